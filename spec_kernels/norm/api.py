"""Fused residual add + RMSNorm: the public function, its checks, and the custom op behind it.

    torch.ops.spec_kernels.fused_add_rmsnorm

The custom op mutates preallocated outputs and returns nothing, has a fake implementation
(FakeTensorMode, torch.compile(fullgraph=True)), and picks its implementation with the dispatch
rule of spec_kernels._ops (cuda -> triton -> reference, or the one forced with impl=).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .._checks import FLOAT_DTYPES, _is_fake, check_shape, check_tensor, common_device
from .._ops import cuda_ops, op_impls
from . import reference, triton_kernel

MAX_HIDDEN = 16384  # a row is one block / one program in every kernel
FP8_DTYPE = torch.float8_e4m3fn

FUSED_ADD_RMSNORM = op_impls("fused_add_rmsnorm")
FUSED_ADD_RMSNORM.register("triton")(triton_kernel.fused_add_rmsnorm)
FUSED_ADD_RMSNORM.register("reference")(reference.fused_add_rmsnorm)


@FUSED_ADD_RMSNORM.register("cuda")
def _fused_add_rmsnorm_cuda(x, residual, weight, eps, out, residual_out, out_scale=None):
    cuda_ops().fused_add_rmsnorm(x, residual, weight, out, residual_out, eps, out_scale)


@torch.library.custom_op("spec_kernels::fused_add_rmsnorm", mutates_args=("out", "residual_out"))
def _fused_add_rmsnorm_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    out_scale: Optional[float],
    impl: str,
) -> None:
    _, fn = FUSED_ADD_RMSNORM.select(x.device, impl or None)
    fn(x, residual, weight, eps, out, residual_out, out_scale)


@_fused_add_rmsnorm_op.register_fake
def _(x, residual, weight, eps, out, residual_out, out_scale, impl):
    return None


# --------------------------------------------------------------------------- checks
def _check_no_partial_overlap(dst: torch.Tensor, dst_name: str, srcs: dict, may_equal: bool) -> None:
    """dst must not overlap any of srcs; with may_equal it may be exactly one of them (in place).
    Reads only addresses (no sync); skipped while compiling and for fake tensors."""
    if torch.compiler.is_compiling() or _is_fake(dst):
        return
    lo = dst.data_ptr()
    hi = lo + dst.numel() * dst.element_size()
    for name, src in srcs.items():
        s_lo = src.data_ptr()
        s_hi = s_lo + src.numel() * src.element_size()
        same = s_lo == lo and s_hi == hi and src.dtype == dst.dtype
        if lo < s_hi and s_lo < hi and not (may_equal and same):
            what = "must not overlap" if not may_equal else "partly overlaps"
            raise ValueError(f"{dst_name} {what} {name}: an output must be a separate buffer"
                             + (" or exactly that input (in place)" if may_equal else ""))


def check_norm_args(x, residual, weight, eps, out_scale) -> None:
    """Checks shared with the communicator (spec_kernels.comm)."""
    dev, like = common_device([("x", x), ("residual", residual), ("weight", weight)])
    check_tensor(x, "x", dim=2, dtypes=FLOAT_DTYPES, device=dev, like=like)
    check_tensor(residual, "residual", dim=2, dtypes=(x.dtype,), device=dev, like=like)
    check_shape(residual, "residual", tuple(x.shape), "like x")
    hidden = x.shape[1]
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"x must have 1 <= hidden <= {MAX_HIDDEN} columns, got shape {tuple(x.shape)}")
    check_tensor(weight, "weight", dim=1, dtypes=(x.dtype,), device=dev, like=like)
    check_shape(weight, "weight", (hidden,), "[hidden]")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if out_scale is not None and not (isinstance(out_scale, (int, float)) and math.isfinite(out_scale)
                                      and out_scale > 0):
        raise ValueError(f"out_scale must be a finite number > 0 (or None for no fp8 output), got {out_scale!r}")


def _output(t: Optional[torch.Tensor], name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t is None:
        return torch.empty(like.shape, dtype=dtype, device=like.device)
    check_tensor(t, name, dim=2, dtypes=(dtype,), device=like.device)
    check_shape(t, name, tuple(like.shape), "like x")
    return t


# --------------------------------------------------------------------------- public API
def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    impl: Optional[str] = None,
    *,
    out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
    out_scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add followed by RMSNorm, in one pass over the rows.

    ``residual_out = x + residual`` and
    ``out = residual_out * rsqrt(mean(residual_out ** 2, -1) + eps) * weight``.

    Args:
        x, residual: [tokens, hidden] fp16/bf16/fp32, same dtype, 1 <= hidden <= 16384.
        weight: [hidden], x's dtype.
        eps: added to the mean square, finite and >= 0.
        impl: "cuda", "triton" or "reference" to force one; default the fastest available.
        out, residual_out: optional preallocated outputs; ``out=x`` and ``residual_out=residual``
            (in place) are allowed, partly overlapping buffers are not.
        out_scale: if given, ``out`` is float8_e4m3fn holding ``normed * (1 / out_scale)``
            saturated to +-448 (a static per-tensor quantisation scale).

    Returns:
        (out, residual_out). All arithmetic is fp32; residual_out is stored in x's dtype and the
        norm is taken of the fp32 sum (not of its rounded copy); out is stored in x's dtype
        (or fp8 with out_scale).

    Guarantees: every argument's type, dtype, device, rank, shape and contiguity is checked
    (ValueError/TypeError naming it). GPU paths launch without host synchronisation (CUDA-graph
    capturable). Results are deterministic; every row is reduced in a fixed order.

    Example:
        >>> out, residual = spec_kernels.fused_add_rmsnorm(attn_out, residual, norm.weight, 1e-6)
    """
    check_norm_args(x, residual, weight, eps, out_scale)
    given = out is not None or residual_out is not None
    out = _output(out, "out", x, FP8_DTYPE if out_scale is not None else x.dtype)
    residual_out = _output(residual_out, "residual_out", x, x.dtype)
    if given:
        inputs = {"x": x, "residual": residual}
        _check_no_partial_overlap(out, "out", inputs, may_equal=True)
        _check_no_partial_overlap(residual_out, "residual_out", inputs, may_equal=True)
        _check_no_partial_overlap(residual_out, "residual_out", {"out": out, "weight": weight}, may_equal=False)
        _check_no_partial_overlap(out, "out", {"weight": weight}, may_equal=False)
    torch.ops.spec_kernels.fused_add_rmsnorm(x, residual, weight, float(eps), out, residual_out,
                                             None if out_scale is None else float(out_scale), impl or "")
    return out, residual_out
