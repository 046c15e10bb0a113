"""Argument checks both attention families run (tree verify and MLA): the output buffer, the
value checks of kv_indptr / kv_indices / qo_indptr / tree_mask, and the softmax scale."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .._checks import (
    check_index_range,
    check_indptr_values,
    check_offset_indptr_values,
    check_shape,
    check_tensor,
    check_tree_mask_values,
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
