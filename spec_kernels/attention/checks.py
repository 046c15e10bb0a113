"""Argument checks both attention families run (tree verify and MLA): the output buffer, the
value checks of kv_indptr / kv_indices / qo_indptr / tree_mask, the softmax scale and the fp8 KV
cache scales."""
from __future__ import annotations

import math
from typing import Optional

import torch

from dataclasses import dataclass

from .._checks import (
    check_index_range,
    check_indptr_values,
    check_offset_indptr_values,
    check_shape,
    check_tensor,
    check_tree_mask_values,
    values_checkable,
)
from .._limits import MAX_DRAFT_TOKENS
from .plan import MAX_KV_SPLITS


def check_out(out: Optional[torch.Tensor], q: torch.Tensor, dv: int) -> torch.Tensor:
    """`out`, checked to be [T, Hq, dv] of q's dtype and device; a new tensor when None."""
    shape = (q.shape[0], q.shape[1], dv)
    if out is None:
        return q.new_empty(shape)
    check_tensor(out, "out", dim=3, dtypes=(q.dtype,), device=q.device)
    check_shape(out, "out", shape, "[T, Hq, Dv]: the rows and heads of q")
    return out


def check_kv_values(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, num_slots: int,
                    draft_counts: list[int], cache_name: str = "k_cache") -> None:
    """kv_indptr: >= 0, non-decreasing, within kv_indices, >= n_b slots per request; the slots
    used in [0, num_slots)."""
    kv_ptr = check_offset_indptr_values(kv_indptr, "kv_indptr", kv_indices.numel(), "kv_indices")
    for b, n in enumerate(draft_counts):
        kv_len = kv_ptr[b + 1] - kv_ptr[b]
        if kv_len < n:
            raise ValueError(f"kv_indptr is inconsistent with qo_indptr: request {b} has {n} draft "
                             f"tokens but only {kv_len} KV slots (its drafts' slots must be the last n)")
    check_index_range(kv_indices[kv_ptr[0]:kv_ptr[-1]], "kv_indices", num_slots, f"{cache_name}.shape[0]",
                      f" in the window kv_indptr[0]:kv_indptr[-1] = {kv_ptr[0]}:{kv_ptr[-1]}")


def check_draft_values(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                       tree_mask: torch.Tensor, num_tokens: int, num_slots: int,
                       max_draft_tokens: Optional[int], cache_name: str = "k_cache") -> None:
    """The value checks of a tree-verify call (CPU tensors, or CUDA in debug mode): qo_indptr
    partitions the T rows, every n_b <= the draft bound, kv_indptr as in check_kv_values, and
    every mask word sets only bits of the draft itself and earlier drafts."""
    qo = check_indptr_values(qo_indptr, "qo_indptr", num_tokens, "q.shape[0]")
    counts = [qo[b + 1] - qo[b] for b in range(len(qo) - 1)]
    bound = max_draft_tokens or MAX_DRAFT_TOKENS
    if counts and max(counts) > bound:
        b = max(range(len(counts)), key=counts.__getitem__)
        what = "max_draft_tokens" if max_draft_tokens else "are supported"
        raise ValueError(f"qo_indptr: request {b} has {counts[b]} draft tokens, at most {bound} {what}")
    check_kv_values(kv_indptr, kv_indices, num_slots, counts, cache_name)
    check_tree_mask_values(tree_mask, qo)


def check_max_draft_tokens(max_draft_tokens: Optional[int]) -> None:
    if max_draft_tokens is not None and not (1 <= int(max_draft_tokens) <= MAX_DRAFT_TOKENS):
        raise ValueError(f"max_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {max_draft_tokens}")


def check_num_kv_splits(num_kv_splits: Optional[int]) -> None:
    if num_kv_splits is not None and not (1 <= int(num_kv_splits) <= MAX_KV_SPLITS):
        raise ValueError(f"num_kv_splits must be in [1, {MAX_KV_SPLITS}], got {num_kv_splits}")


def softmax_scale(sm_scale: Optional[float], head_dim: int) -> float:
    """sm_scale as a float, 1/sqrt(head_dim) when None; a non-finite one is refused."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    sm_scale = float(sm_scale)
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be finite, got {sm_scale}")
    return sm_scale


# KV cache dtypes stored as 8-bit floats with a per-layer scale (the value is fp8 * scale).
KV_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Query / output dtypes an fp8 cache is read with (the fp8 values convert exactly to either).
FP8_QUERY_DTYPES = (torch.float16, torch.bfloat16)


def cuda_cache_dtype_refusal(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> Optional[str]:
    """Why a CUDA attention kernel (compiled for caches of the query dtype and fp8 caches, for
    fp16 / bf16 queries) declines this cache, or None when it has an instance for it."""
    if cache_dtype == q_dtype or (cache_dtype in KV_FP8_DTYPES and q_dtype in FP8_QUERY_DTYPES):
        return None
    return f"the CUDA kernel has no instance for a {cache_dtype} KV cache with {q_dtype} queries"


def cuda_row_chunk_refusal(**tensors: torch.Tensor) -> Optional[str]:
    """Why a CUDA attention kernel, which copies 16-byte chunks of rows, declines these tensors
    (by name): each needs a unit last stride and its other strides multiples of 16 bytes."""
    for name, t in tensors.items():
        chunk = 16 // t.element_size()
        if t.stride(-1) != 1 or any(s % chunk for s in t.stride()[:-1]):
            return (f"the CUDA kernel copies 16-byte chunks of rows: {name}'s strides {tuple(t.stride())} are not"
                    " a unit last stride and multiples of 16 bytes")
    return None


@dataclass(frozen=True)
class KvScales:
    """The dequantisation scales of a call: K and V values are cache value * scale. A scale is a
    host float (``k`` / ``v``), or a 1-element fp32 tensor on the cache's device (``k_tensor`` /
    ``v_tensor``, then ``k`` / ``v`` are 1.0 and unused) that the kernels read on the device, so
    a CUDA graph replay uses its current value. A bf16/fp16/fp32 cache has no scales (1.0)."""

    k: float = 1.0
    v: float = 1.0
    k_tensor: Optional[torch.Tensor] = None
    v_tensor: Optional[torch.Tensor] = None

    def values(self) -> tuple[float, float]:
        """Both scales as floats (reads tensors: a host sync on CUDA; the reference uses it)."""
        k = float(self.k_tensor.reshape(()).item()) if self.k_tensor is not None else self.k
        v = float(self.v_tensor.reshape(()).item()) if self.v_tensor is not None else self.v
        return k, v


NO_SCALES = KvScales()


def scales_kwargs(k_scale: float, v_scale: float, k_scale_tensor: Optional[torch.Tensor],
                  v_scale_tensor: Optional[torch.Tensor]) -> dict:
    """The implementations' `scales` argument from a custom op's four scale arguments (none for a
    cache without scales, so that every implementation keeps its plain signature there)."""
    if k_scale_tensor is None and v_scale_tensor is None and k_scale == 1.0 and v_scale == 1.0:
        return {}
    return {"scales": KvScales(k_scale, v_scale, k_scale_tensor, v_scale_tensor)}


def _check_scale(scale, name: str, cache_name: str, device: torch.device):
    """A host scale as a float, or a scale tensor as it is; refused with a message naming it."""
    if isinstance(scale, torch.Tensor):
        check_tensor(scale, name, dtypes=(torch.float32,), device=device, contiguous=False)
        if scale.numel() != 1:
            raise ValueError(f"{name} must hold one value (a per-layer scale), got shape {tuple(scale.shape)}")
        if values_checkable(scale):
            _check_scale(float(scale.reshape(()).item()), name, cache_name, device)
        return scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a float or a 1-element float32 tensor, got {type(scale).__name__}")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name} must be finite and > 0 (the {cache_name} values are multiplied by it), got {scale}")
    return scale


def check_kv_scales(q: torch.Tensor, k_cache: torch.Tensor, v_cache: Optional[torch.Tensor], k_scale, v_scale,
                    cache_names: tuple[str, str] = ("k_cache", "v_cache")) -> KvScales:
    """The scales of a call whose cache dtypes passed check_kv_dtypes: required (and checked)
    for an fp8 cache, refused for any other. v_cache None: one cache holds K and V (MLA's
    latent cache), v_scale is its V columns' scale."""
    k_name, v_name = cache_names
    fp8 = k_cache.dtype in KV_FP8_DTYPES
    for scale, name in ((k_scale, "k_scale"), (v_scale, "v_scale")):
        if fp8 and scale is None:
            raise ValueError(f"{name} is required: {k_name} is {str(k_cache.dtype).replace('torch.', '')} "
                             f"(an fp8 KV cache holds value / scale)")
        if not fp8 and scale is not None:
            raise ValueError(f"{name} is given but {k_name} is {str(k_cache.dtype).replace('torch.', '')}: scales "
                             f"only apply to fp8 KV caches ({', '.join(str(d).replace('torch.', '') for d in KV_FP8_DTYPES)})")
    if not fp8:
        return NO_SCALES
    k = _check_scale(k_scale, "k_scale", k_name, k_cache.device)
    v = _check_scale(v_scale, "v_scale", v_name if v_cache is not None else k_name, k_cache.device)
    return KvScales(k=1.0 if isinstance(k, torch.Tensor) else k, v=1.0 if isinstance(v, torch.Tensor) else v,
                    k_tensor=k if isinstance(k, torch.Tensor) else None,
                    v_tensor=v if isinstance(v, torch.Tensor) else None)


def kv_cache_dtypes(q_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The cache dtypes q can be read with: its own, and fp8 for fp16 / bf16 queries."""
    return (q_dtype, *KV_FP8_DTYPES) if q_dtype in FP8_QUERY_DTYPES else (q_dtype,)


def check_kv_dtypes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: Optional[torch.Tensor],
                    cache_names: tuple[str, str] = ("k_cache", "v_cache")) -> None:
    """k_cache is q's dtype, or fp8 (fp16 / bf16 q only); v_cache has k_cache's dtype."""
    k_name, v_name = cache_names
    if k_cache.dtype in KV_FP8_DTYPES and q.dtype not in FP8_QUERY_DTYPES:
        raise ValueError(f"q must be float16 or bfloat16 to read an fp8 {k_name} "
                        f"({str(k_cache.dtype).replace('torch.', '')}), got {str(q.dtype).replace('torch.', '')}")
    if k_cache.dtype not in kv_cache_dtypes(q.dtype):
        names = ", ".join(str(d).replace("torch.", "") for d in kv_cache_dtypes(q.dtype))
        raise ValueError(f"{k_name} must have dtype {names} (q is {str(q.dtype).replace('torch.', '')}), "
                        f"got {str(k_cache.dtype).replace('torch.', '')}")
    if v_cache is not None and v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{v_name} must have dtype {str(k_cache.dtype).replace('torch.', '')} ({k_name}'s), got "
                         f"{str(v_cache.dtype).replace('torch.', '')}")
