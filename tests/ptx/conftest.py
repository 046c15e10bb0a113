"""tests/ptx: the PTX interpreter (tools/ptxsim) and the census of the PTX the kernels compile to.

Puts the repository root on sys.path (the tests import tools.ptxsim) and marks every test here
with the `ptx` marker, so `pytest -m ptx` runs exactly this directory and `-m "not ptx"` skips it.
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if os.path.abspath(str(item.fspath)).startswith(HERE + os.sep):
            item.add_marker(pytest.mark.ptx)


def pytest_runtest_setup(item):
    """Every test here compiles kernels with nvcc: without it, skip with the reason (never pass)."""
    if os.path.abspath(str(item.fspath)).startswith(HERE + os.sep) and not _nvcc():
        pytest.skip("nvcc not found: the PTX tests compile the kernels (set CUDA_HOME)")


def _nvcc():
    from tools.ptxsim.build import find_nvcc
    return find_nvcc()
