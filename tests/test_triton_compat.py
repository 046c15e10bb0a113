"""The Triton interpreter path must not rest on NumPy conversions that NumPy 2.5 removed.

Triton 3.6 (the GPU machine's version) converts a scalar tensor used as an index with
`int(array of ndim 1)`: a DeprecationWarning up to NumPy 2.4, an error from 2.5 on, which broke
every interpreted kernel there. `spec_kernels._triton_compat` fixes the conversion; here the
warning is turned into an error, so the check fails on any NumPy when the fix is missing.
"""
import warnings

import pytest
import torch

import spec_kernels  # noqa: F401  (installs the interpreter fix, as any use of the package does)
from spec_kernels._ops import triton_interpreting

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

pytestmark = pytest.mark.skipif(not triton_interpreting(), reason="checks the Triton interpreter (CPU runs)")


@triton.jit
def _sum_first_n(x_ptr, n_ptr, out_ptr):
    n = tl.load(n_ptr)  # a scalar loaded from memory, used as a range bound as in every kernel here
    acc = tl.load(x_ptr) * 0.0
    for i in range(n):
        acc += tl.load(x_ptr + i)
    tl.store(out_ptr, acc)


def test_loaded_scalar_as_range_bound_needs_no_removed_numpy_conversion():
    x = torch.arange(10, dtype=torch.float32)
    out = torch.zeros(1)
    for n in (0, 1, 7):
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            _sum_first_n[(1,)](x, torch.tensor([n], dtype=torch.int32), out)
        assert out.item() == sum(range(n))
