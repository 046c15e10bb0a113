"""The batch layout both attention families take, checked once: which queries and which KV slots
each request owns, and the draft tree of each request (absent for decode)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .._checks import INDEX_DTYPES, check_shape, check_tensor, common_device, values_checkable
from .checks import check_draft_values, check_kv_values, check_max_draft_tokens


@dataclass
class BatchLayout:
    """kv_indptr (int32 [B+1]), kv_indices (int32/int64 slot ids), and for tree verify qo_indptr
    (int32 [B+1]) and tree_mask (int64 [T]); decode has neither (one query per request, T = B).
    Made by `BatchLayout.check`, which checks the metadata (dtype, device, rank, shape) as the
    one-call functions do; `check_values` checks the index values against a cache of num_slots
    rows when that needs no host sync (CPU tensors, or debug mode)."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    qo_indptr: Optional[torch.Tensor]
    tree_mask: Optional[torch.Tensor]
    num_tokens: int
    num_requests: int
    max_draft_tokens: int  # 0: unknown (the kernels assume up to 64); decode: 1
    device: torch.device

    @property
    def decode(self) -> bool:
        return self.qo_indptr is None

    @staticmethod
    def check(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, qo_indptr: Optional[torch.Tensor] = None,
              tree_mask: Optional[torch.Tensor] = None, max_draft_tokens: Optional[int] = None) -> "BatchLayout":
        if (qo_indptr is None) != (tree_mask is None):
            raise ValueError("qo_indptr and tree_mask go together: both (tree verify) or neither (decode)")
        named = [("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("qo_indptr", qo_indptr),
                 ("tree_mask", tree_mask)]
        dev, like = common_device(named)
        check_tensor(kv_indptr, "kv_indptr", dim=1, dtypes=(torch.int32,), device=dev, like=like)
        check_tensor(kv_indices, "kv_indices", dim=1, dtypes=INDEX_DTYPES, device=dev, like=like)
        if kv_indptr.numel() < 1:
            raise ValueError("kv_indptr must have B+1 >= 1 entries")
        B = kv_indptr.numel() - 1
        if qo_indptr is None:
            return BatchLayout(kv_indptr, kv_indices, None, None, B, B, 1, dev)
        check_tensor(qo_indptr, "qo_indptr", dim=1, dtypes=(torch.int32,), device=dev, like=like)
        check_shape(qo_indptr, "qo_indptr", (B + 1,), "B+1, like kv_indptr")
        check_tensor(tree_mask, "tree_mask", dim=1, dtypes=(torch.int64,), device=dev, like=like)
        check_max_draft_tokens(max_draft_tokens)
        return BatchLayout(kv_indptr, kv_indices, qo_indptr, tree_mask, tree_mask.shape[0], B,
                           int(max_draft_tokens or 0), dev)

    def check_values(self, num_slots: int, cache_name: str = "k_cache") -> None:
        """The index-value checks of the one-call functions, against a cache of num_slots rows
        (skipped where they would need a host sync)."""
        if not values_checkable(self.kv_indptr, self.kv_indices):
            return
        if self.decode:
            check_kv_values(self.kv_indptr, self.kv_indices, num_slots, [0] * self.num_requests, cache_name)
        else:
            check_draft_values(self.qo_indptr, self.kv_indptr, self.kv_indices, self.tree_mask, self.num_tokens,
                               num_slots, self.max_draft_tokens or None, cache_name)
