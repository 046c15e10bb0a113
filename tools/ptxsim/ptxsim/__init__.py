"""ptxsim: a PTX interpreter on NumPy (see README.md).

    from ptxsim.nvcc import compile_ptx
    from ptxsim.executor import Machine
    from ptxsim.launch import run
"""
