"""Triton fused residual add + RMSNorm: one program per row.

A whole row (hidden <= 16384) is one block: it is loaded once, reduced, and written once, so
out / residual_out may alias x / residual. All arithmetic is fp32: loads are upcast at once,
which also keeps the CPU interpreter away from its broken bf16 arithmetic.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._ops import triton_interpreting
from .reference import FP8_E4M3_MAX, fp32_reciprocal

# The CPU interpreter rounds fp32 -> bf16 toward zero and fp32 -> fp8 wrongly (lost carries), so
# under it these outputs are stored as fp32 and rounded by torch. GPU casts are exact RNE.
_INTERPRETER_BAD_CASTS = (torch.bfloat16, torch.float8_e4m3fn)


@triton.jit
def _fused_add_rmsnorm_kernel(
    X, RES, W, OUT, RES_OUT,
    hidden, eps, inv_scale,
    BLOCK: tl.constexpr,
    FP8_OUT: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    row_start = tl.program_id(0).to(tl.int64) * hidden
    offs = tl.arange(0, BLOCK)
    ok = offs < hidden
    h = tl.load(X + row_start + offs, mask=ok, other=0.0).to(tl.float32)
    h += tl.load(RES + row_start + offs, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    y = h * rstd * tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
    if FP8_OUT:
        y = tl.minimum(tl.maximum(y * inv_scale, -FP8_MAX), FP8_MAX)
    tl.store(OUT + row_start + offs, y.to(OUT.dtype.element_ty), mask=ok)
    tl.store(RES_OUT + row_start + offs, h.to(RES_OUT.dtype.element_ty), mask=ok)


def _num_warps(block: int) -> int:
    # ~16 fp32 values of each of h, w, y per thread; 1..16 warps.
    return max(1, min(16, block // 512))


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    out_scale: Optional[float] = None,
) -> None:
    """Launch the kernel. Arguments as in spec_kernels.fused_add_rmsnorm (already checked)."""
    rows, hidden = x.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(hidden)
    staged = triton_interpreting() and (out.dtype in _INTERPRETER_BAD_CASTS or
                                        residual_out.dtype in _INTERPRETER_BAD_CASTS)
    dst, res_dst = (out, residual_out) if not staged else (
        torch.empty(out.shape, dtype=torch.float32), torch.empty(out.shape, dtype=torch.float32))
    _fused_add_rmsnorm_kernel[(rows,)](
        x, residual, weight, dst, res_dst,
        hidden, float(eps), fp32_reciprocal(out_scale) if out_scale is not None else 1.0,
        BLOCK=block, FP8_OUT=out_scale is not None, FP8_MAX=FP8_E4M3_MAX,
        num_warps=_num_warps(block),
    )
    if staged:
        out.copy_(dst)
        residual_out.copy_(res_dst)
