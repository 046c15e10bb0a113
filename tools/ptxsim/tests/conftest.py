"""ptxsim's own tests: instruction semantics on small nvcc-compiled kernels (skipped, with the
reason, without nvcc) and the mma.sync numerics against golden files (NumPy only)."""
import os

import pytest

from ptxsim.nvcc import compile_ptx, find_nvcc

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def nvcc_ptx():
    """compile_ptx(text, name=...) when nvcc is there, else the test is skipped with the reason."""
    if find_nvcc() is None:
        pytest.skip("nvcc not found: these tests compile CUDA snippets (set CUDA_HOME)")
    return compile_ptx
