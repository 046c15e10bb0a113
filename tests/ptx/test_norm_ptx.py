"""The compiled sm_120a PTX of the fused residual add + RMSNorm kernel (csrc/norm/fused_add_rmsnorm.cu)
run through tools/ptxsim, against the PyTorch reference.

The op's CUDA binding (spec_kernels.norm.api) runs with its cuda_ops patched to
tests/ptx/cuda_glue.PtxCudaOps, which picks the kernel instance (16-byte vectors or scalar, vectors
per thread) and the block size like launch_typed() / launch_vec() / norm::row_launch(). Covered:
fp16, bf16, fp32; the vector path and the scalar path (hidden not a multiple of the vector, or a
pointer that is not 16-byte aligned); one and two vectors per thread; fp8 e4m3 output with
saturation; in-place use; NaN rows.
"""
from __future__ import annotations

import pytest
import torch

from tools.ptx_harness import build

import spec_kernels.norm.api as norm_api
from spec_kernels.norm import reference

pytestmark = pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not found (set CUDA_HOME): the kernel's "
                                "PTX cannot be produced")

FP8 = torch.float8_e4m3fn
# One ulp of the stored output, relative (significant bits: bf16 8, fp16 11, fp8 e4m3 4). The kernel
# and the reference do the same fp32 operations in the same order except the sum of squares (a
# block reduction vs torch's mean: a few fp32 ulps apart), so rstd differs by ~1e-6 relative and the
# two fp32 results can round to neighbouring values of the output dtype: at most one ulp apart.
# fp32 output keeps that ~1e-6 difference: 1e-5 covers the summation order over <= 4100 terms.
RTOL = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 1e-5, FP8: 2.0 ** -3}
# Near zero the ulp is the subnormal spacing (fp8 e4m3: 2^-9; fp16: 2^-24; bf16/fp32 have no
# reachable subnormals here): one spacing absolute.
ATOL = {torch.bfloat16: 0.0, torch.float16: 2.0 ** -24, torch.float32: 0.0, FP8: 2.0 ** -9}


@pytest.fixture
def ops(monkeypatch):
    from tools.ptx_harness.cuda_glue import PtxCudaOps

    o = PtxCudaOps()
    monkeypatch.setattr(norm_api, "cuda_ops", lambda: o)
    return o


def inputs(rows, hidden, dtype, seed, offset=0):
    """x, residual, weight; offset > 0 makes x start `offset` elements into its storage (not
    16-byte aligned: the scalar kernel must run)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows * hidden + offset, generator=gen).to(dtype)[offset:].view(rows, hidden)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype)
    return x, residual, weight


def run_both(ops, x, residual, weight, eps=1e-6, out_scale=None, in_place=False):
    """(kernel out, kernel residual_out, reference out, reference residual_out), kernel through the
    binding. Kernel outputs start as NaN (fp8: 0x7f) so that an element it does not write cannot
    pass; in_place: out=x and residual_out=residual, as the op allows."""
    out_dtype = FP8 if out_scale is not None else x.dtype
    ref_out = torch.empty(x.shape, dtype=out_dtype)
    ref_res = torch.empty_like(x)
    reference.fused_add_rmsnorm(x, residual, weight, eps, ref_out, ref_res, out_scale)
    if in_place:
        x, residual = x.clone(), residual.clone()
        out, res = x, residual
    else:
        out = torch.full(x.shape, float("nan"), dtype=x.dtype) if out_scale is None else \
            torch.full(x.shape, 0x7F, dtype=torch.uint8).view(FP8)
        res = torch.full_like(x, float("nan"))
    norm_api._fused_add_rmsnorm_cuda(x, residual, weight, eps, out, res, out_scale)
    return out, res, ref_out, ref_res


def assert_matches(out, res, ref_out, ref_res):
    # residual_out: fp32 x + residual rounded once to x's dtype on both sides: bit-identical.
    assert torch.equal(res.isnan(), ref_res.isnan())
    torch.testing.assert_close(res, ref_res, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=ATOL[out.dtype], rtol=RTOL[out.dtype],
                               equal_nan=True)


def kernel_name(ops):
    (name, grid, block, smem, _), = ops.launches
    return name.split("fused_add_rmsnorm_kernel")[1].split("EEEv")[0], grid, block


@pytest.mark.parametrize(
    "dtype,hidden,offset,expect",
    [
        # 16-byte vectors, 5 per row: one 32-thread block
        pytest.param(torch.bfloat16, 40, 0, ("13__nv_bfloat16S2_Li8ELi1E", 32), id="bf16-vec"),
        pytest.param(torch.float16, 40, 0, ("6__halfS2_Li8ELi1E", 32), id="f16-vec"),
        pytest.param(torch.float32, 36, 0, ("IffLi4ELi1E", 32), id="f32-vec"),
        # hidden not a multiple of the vector: the scalar kernel, a partly idle last warp
        pytest.param(torch.bfloat16, 37, 0, ("13__nv_bfloat16S2_Li1ELi1E", 64), id="bf16-scalar-odd"),
        pytest.param(torch.float32, 99, 0, ("IffLi1ELi1E", 128), id="f32-scalar-odd"),
        # a multiple of the vector but x not 16-byte aligned: the scalar kernel
        pytest.param(torch.float16, 48, 1, ("6__halfS2_Li1ELi1E", 64), id="f16-scalar-misaligned"),
        # more than 1024 vectors: two per thread (scalar: 1030 elements, vector: 1025 x 4 floats)
        pytest.param(torch.float16, 1030, 0, ("6__halfS2_Li1ELi2E", 544), id="f16-scalar-2-per-thread"),
        pytest.param(torch.float32, 4100, 0, ("IffLi4ELi2E", 544), id="f32-vec-2-per-thread"),
    ],
)
def test_matches_reference(ops, dtype, hidden, offset, expect):
    x, residual, weight = inputs(3, hidden, dtype, seed=hidden, offset=offset)
    out, res, ref_out, ref_res = run_both(ops, x, residual, weight)
    assert_matches(out, res, ref_out, ref_res)
    name, grid, block = kernel_name(ops)
    assert name.endswith(expect[0]) and grid == (3,) and block == (expect[1],)


@pytest.mark.parametrize(
    "dtype,hidden,expect",
    [
        # the largest rows (hidden <= 16384): 1024 threads with 4 float4 vectors / 16 scalars each
        pytest.param(torch.float32, 16384, "IffLi4ELi4E", id="f32-vec-4-per-thread"),
        pytest.param(torch.float16, 16383, "6__halfS2_Li1ELi16E", id="f16-scalar-16-per-thread"),
    ],
)
def test_largest_rows(ops, dtype, hidden, expect):
    x, residual, weight = inputs(1, hidden, dtype, seed=11)
    out, res, ref_out, ref_res = run_both(ops, x, residual, weight)
    assert_matches(out, res, ref_out, ref_res)
    name, grid, block = kernel_name(ops)
    assert name.endswith(expect) and grid == (1,) and block == (1024,)


@pytest.mark.parametrize(
    "dtype,hidden,expect",
    [
        pytest.param(torch.bfloat16, 40, "13__nv_bfloat1613__nv_fp8_e4m3Li8ELi1E", id="bf16-vec"),
        pytest.param(torch.float16, 21, "6__half13__nv_fp8_e4m3Li1ELi1E", id="f16-scalar"),
        pytest.param(torch.float32, 64, "If13__nv_fp8_e4m3Li4ELi1E", id="f32-vec"),
    ],
)
def test_fp8_output_matches_reference(ops, dtype, hidden, expect):
    """out_scale 1/16: outputs mostly within +-448 (normalised values times weight ~1 times 16), and
    weights x100 in three columns so that those saturate to +-448 (the kernel's __nv_fp8_e4m3
    conversion saturates; the reference clamps)."""
    x, residual, weight = inputs(3, hidden, dtype, seed=hidden + 1)
    weight[:3] *= 100
    out, res, ref_out, ref_res = run_both(ops, x, residual, weight, out_scale=1 / 16)
    assert out.dtype == FP8
    assert_matches(out, res, ref_out, ref_res)
    assert (out.float().abs() == 448).any() and out.float().abs().max() == 448
    assert kernel_name(ops)[0].endswith(expect)


@pytest.mark.parametrize("dtype,hidden", [(torch.bfloat16, 48), (torch.float16, 45)])
def test_in_place(ops, dtype, hidden):
    """out=x and residual_out=residual (documented in-place use): every load precedes the stores."""
    x, residual, weight = inputs(2, hidden, dtype, seed=5)
    out, res, ref_out, ref_res = run_both(ops, x, residual, weight, in_place=True)
    assert_matches(out, res, ref_out, ref_res)


# NaN inputs: the interpreter's numpy arithmetic warns about the NaN it computes, as it should.
@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("out_scale", [None, 0.5], ids=["bf16-out", "fp8-out"])
def test_nan_rows_follow_the_reference(ops, out_scale):
    """A NaN input element makes its row's out NaN (the row's mean square is NaN; fp8: the NaN
    encoding, not a saturated 448) and only that element of residual_out; an all-zero row with
    eps=0 is 0 * rsqrt(0) = NaN."""
    x, residual, weight = inputs(3, 40, torch.bfloat16, seed=9)
    x[0, 7] = float("nan")
    x[2] = 0
    residual[2] = 0
    out, res, ref_out, ref_res = run_both(ops, x, residual, weight, eps=0.0, out_scale=out_scale)
    nan = out.float().isnan()
    assert nan[0].all() and nan[2].all() and not nan[1].any()
    assert torch.isnan(res).nonzero().tolist() == [[0, 7]]
    assert_matches(out, res, ref_out, ref_res)
