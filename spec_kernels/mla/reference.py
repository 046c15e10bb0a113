"""Readable PyTorch reference of MLA tree-verify attention: the oracle the kernels are tested against.

With the query projections absorbed (DeepSeek-V2/V3, Kimi K2.5), multi-head latent attention
is multi-query attention over ONE cached KV head:

* key of token j   = kv_cache[j]                 (576 = 512 compressed latent + 64 rope dims)
* value of token j = kv_cache[j, :v_head_dim]    (the latent part of the same row)
* every query head h attends to that one head: score = q[t, h] . kv_cache[j] * sm_scale.

So the tree-verify reference (prefix fully visible, drafts under the ancestor mask) is exactly
the one of spec_kernels.tree_verify with Hkv = 1, K = the cached rows and V = their first
v_head_dim values: it is reused here on views, nothing is copied.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..attention import reference as attention_reference


def mla_tree_verify_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    qo_indptr: Optional[torch.Tensor],
    tree_mask: Optional[torch.Tensor],
    sm_scale: float,
    v_head_dim: int,
    out: torch.Tensor,
    lse: Optional[torch.Tensor],
    max_draft_tokens: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """q [T, H, D], kv_cache [S, D] -> out [T, H, v_head_dim] (and lse [T, H]), in fp32.
    qo_indptr=None is plain decode (one query per request sees all its slots). An fp8 cache is
    dequantised: K = kv_cache * k_scale, V = its first v_head_dim values * v_scale. Non-finite
    values and invalid (unchecked) indices as in spec_kernels.attention.reference."""
    kv = kv_cache.unsqueeze(1)  # [S, 1, D]: the one KV head every query head reads
    attention_reference.tree_verify_attention(q, kv, kv[..., :v_head_dim], kv_indptr, kv_indices, qo_indptr,
                                              tree_mask, sm_scale, out, lse, max_draft_tokens, k_scale, v_scale)
