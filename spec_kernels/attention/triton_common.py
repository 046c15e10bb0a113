"""Triton pieces both attention kernels use: the mask-word bits of a draft, NaN for infinite logits,
clamped indptr ranges, fp8 KV values in the interpreter, and the KV-split partial buffers with
their fixed-order merge."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .checks import KV_FP8_DTYPES

LOG2E = 1.4426950408889634


@triton.jit
def draft_bits(i):
    """int64 words with bits 0..i set (all 64 at i >= 63): the part of draft i's mask word that
    counts (itself and earlier drafts; bits of later drafts are ignored)."""
    shift = (tl.minimum(i, 62) + 1).to(tl.int64)
    return tl.where(i >= 63, -1, (tl.full(i.shape, 1, tl.int64) << shift) - 1)


@triton.jit
def finite_or_nan(x):
    """A logit that is +-inf (inf in q or K) becomes NaN, so that -inf never reads as "masked"
    and the row's output and lse come out NaN."""
    return tl.where(tl.abs(x) == float("inf"), float("nan"), x)


@triton.jit
def fp8_bits_to_float(bits, E5M2: tl.constexpr):
    """fp32 values of fp8 bit patterns held as uint8 (e4m3fn, or e5m2 with E5M2): how the kernels
    read an fp8 cache under the interpreter, whose own fp8 conversion turns NaN codes into
    numbers. On a GPU the kernels convert with the hardware instead (exactly the same values).
    The sign is set as a bit: Triton 3.6 compiles a float's unary minus as 0 - x, which makes
    the code 0x80 +0.0 instead of -0.0."""
    b = bits.to(tl.int32)
    if E5M2:
        e = (b >> 2) & 0x1F
        m = (b & 3).to(tl.float32) * 0.25
        v = tl.where(e == 0, m * 6.103515625e-05, (1.0 + m) * tl.math.exp2((e - 15).to(tl.float32)))
        v = tl.where(e == 31, tl.where(m == 0.0, float("inf"), float("nan")), v)
    else:
        e = (b >> 3) & 0xF
        m = (b & 7).to(tl.float32) * 0.125
        v = tl.where(e == 0, m * 0.015625, (1.0 + m) * tl.math.exp2((e - 7).to(tl.float32)))
        v = tl.where((e == 15) & ((b & 7) == 7), float("nan"), v)
    sign = (b & 0x80).to(tl.uint32) << 24
    return (v.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


def fp8_cache_view(cache: torch.Tensor, interpreting: bool) -> torch.Tensor:
    """What a kernel gets for a cache: under the interpreter an fp8 cache's bytes (uint8, decoded
    by fp8_bits_to_float), else the cache itself."""
    return cache.view(torch.uint8) if interpreting and cache.dtype in KV_FP8_DTYPES \
        else cache


@triton.jit
def indptr_range(INDPTR, b, limit):
    """[lo, hi) of entry b of an indptr, cut to [0, limit): invalid (unchecked) values never
    reach outside (spec_kernels._checks)."""
    lo = tl.minimum(tl.maximum(tl.load(INDPTR + b).to(tl.int64), 0), limit)
    hi = tl.minimum(tl.maximum(tl.load(INDPTR + b + 1).to(tl.int64), lo), limit)
    return lo, hi


@triton.jit
def merge_splits_kernel(
    O_PART, LSE_PART, O, LSE,
    num_heads, num_splits,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    stride_ot, stride_oh, stride_lse_t,
    DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """o = sum_s exp2(lse_s - lse) * o_s, lse = log2 sum_s exp2(lse_s); fixed order, no atomics.
    A NaN lse_s (a NaN logit in that split) makes the total, and so the row, NaN."""
    pid = tl.program_id(0)
    token = (pid // num_heads).to(tl.int64)
    head = pid % num_heads
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, DV)
    s_ok = offs_s < num_splits
    lse_s = tl.load(LSE_PART + offs_s * stride_ls + token * stride_lt + head, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse_s - m_safe)  # 0 for empty splits
    total = tl.sum(w, 0)
    o_s = tl.load(O_PART + offs_s[:, None] * stride_ps + token * stride_pt + head * stride_ph + offs_dv[None, :],
                  mask=s_ok[:, None], other=0.0)
    seen = total != 0.0
    o = tl.sum(o_s * w[:, None], 0) / tl.where(seen, total, 1.0)
    tl.store(O + token * stride_ot + head * stride_oh + offs_dv, o.to(O.dtype.element_ty))
    if WRITE_LSE:
        lse = tl.where(seen, m_safe + tl.math.log2(tl.where(seen, total, 1.0)), float("-inf"))
        tl.store(LSE + token * stride_lse_t + head, lse * 0.6931471805599453)


def split_destinations(out: torch.Tensor, lse: Optional[torch.Tensor], workspace):
    """Where the attention kernel writes: with several splits, the SplitWorkspace's fp32 partials
    [S, T, H, Dv] and their log2-sum-exp [S, T, H]; with one, `out` and `lse` themselves (`out`
    stands in for an absent lse: never written, WRITE_LSE is off). Returns (o_dst, lse_dst,
    o strides (token, head, split), lse strides (token, split))."""
    if workspace.splits > 1:
        o_dst, lse_dst = workspace.o_partial, workspace.lse_partial
        return (o_dst, lse_dst, (o_dst.stride(1), o_dst.stride(2), o_dst.stride(0)),
                (lse_dst.stride(1), lse_dst.stride(0)))
    return (out, lse if lse is not None else out, (out.stride(0), out.stride(1), 0),
            (lse.stride(0) if lse is not None else 0, 0))


def merge_splits(o_dst: torch.Tensor, lse_dst: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor]) -> None:
    """Merge the partials of split_destinations into `out` (and `lse`, natural log)."""
    splits, T, H, Dv = o_dst.shape
    merge_splits_kernel[(T * H,)](
        o_dst, lse_dst, out, lse if lse is not None else out,
        H, splits,
        o_dst.stride(0), o_dst.stride(1), o_dst.stride(2), lse_dst.stride(0), lse_dst.stride(1),
        out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0,
        DV=Dv, BLOCK_S=triton.next_power_of_2(splits), WRITE_LSE=lse is not None,
    )
