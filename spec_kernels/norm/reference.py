"""Readable PyTorch reference of fused residual add + RMSNorm: the oracle the kernels are tested
against. Works on any device torch supports; favours clarity over speed."""
from __future__ import annotations

from typing import Optional

import torch

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value; fp8 outputs saturate to it


def fp32_reciprocal(scale: float) -> float:
    """1 / scale rounded to fp32: the factor every implementation multiplies fp8 outputs by."""
    return torch.tensor(1.0 / scale, dtype=torch.float32).item()


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    out_scale: Optional[float] = None,
) -> None:
    """residual_out = x + residual; out = residual_out * rsqrt(mean(residual_out^2) + eps) * weight.

    All arithmetic in fp32. residual_out is stored in x's dtype; the norm uses the fp32 sum, not
    its rounded copy. With out_scale, out is float8_e4m3fn holding out * (1 / out_scale) (the
    reciprocal rounded to fp32, as the kernels use it), saturated to +-448.
    """
    h = x.float() + residual.float()
    normed = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    if out_scale is not None:
        normed = (normed * fp32_reciprocal(out_scale)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    # Write residual_out last: out or residual_out may alias x or residual (in-place use).
    out.copy_(normed)
    residual_out.copy_(h)
