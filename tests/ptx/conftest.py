"""tests/ptx: the kernels' compiled PTX run in the PTX interpreter (the `ptxsim` package,
tools/ptxsim), through the project's harness (tools/ptx_harness), and the census of that PTX.

Puts the repository root on sys.path (the tests import tools.ptx_harness) and marks every test
here and in ptxsim's own tests (tools/ptxsim/tests) with the `ptx` marker, so `pytest -m ptx`
runs exactly those and `-m "not ptx"` skips them.
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PTXSIM_TESTS = os.path.join(ROOT, "tools", "ptxsim", "tests")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if os.path.abspath(str(item.fspath)).startswith((HERE + os.sep, PTXSIM_TESTS + os.sep)):
            item.add_marker(pytest.mark.ptx)


def pytest_runtest_setup(item):
    """Every test here compiles kernels with nvcc: without it, skip with the reason (never pass)."""
    if os.path.abspath(str(item.fspath)).startswith(HERE + os.sep) and not _nvcc():
        pytest.skip("nvcc not found: the PTX tests compile the kernels (set CUDA_HOME)")


def _nvcc():
    from ptxsim.nvcc import find_nvcc
    return find_nvcc()
