"""Launch sizing shared by the Triton and CUDA kernels: rows per request and KV splits.

Both depend only on tensor shapes and the GPU's SM count, never on index values, so no call
syncs with the host and every launch can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from .._ops import sm_count
from .reference import MAX_DRAFT_TOKENS

MAX_KV_SPLITS = 64
MIN_SPLIT_KEYS = 256  # automatic splits stream at least this many prefix keys each


def max_rows(num_tokens: int, group: int, decode: bool, max_draft_tokens: int = 0) -> int:
    """Upper bound of a request's query rows (n_b x GQA group): sizes the grid. Without the
    caller's bound on n_b (max_draft_tokens = 0) it is min(T, 64): a grid for 64 drafts."""
    if decode:
        return group
    return min(num_tokens, max_draft_tokens or MAX_DRAFT_TOKENS) * group


def num_kv_splits(device: torch.device, num_requests: int, num_kv_heads: int, rows: int, block_m: int) -> int:
    """KV splits per request so that the grid fills the GPU about twice; 1 on CPU."""
    if device.type != "cuda" or num_requests == 0:
        return 1
    ctas = num_requests * num_kv_heads * -(-rows // block_m)
    sms = sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if ctas >= sms:
        return 1
    return max(1, min(MAX_KV_SPLITS, -(-2 * sms // ctas)))
