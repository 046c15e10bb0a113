"""Readable PyTorch references of the tree-verify ops: the oracle every kernel is tested against.

They loop over requests on the host (reading the indptr values), so they sync with the GPU and
cannot be captured in a CUDA graph; everything else about them favours clarity over speed.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

MAX_DRAFT_TOKENS = 64  # one 64-bit mask word per draft token


def tree_mask_from_parents(parents: torch.Tensor, qo_indptr: torch.Tensor, tree_mask: torch.Tensor) -> None:
    """tree_mask[t] = bit of draft t and of each of its ancestors (indices within its request).

    Walks every draft's parent chain at once, one level per step; parents precede children, so
    64 steps reach every root. A link that does not point backwards ends the walk."""
    T = parents.numel()
    starts = torch.repeat_interleave(qo_indptr[:-1].long(), torch.diff(qo_indptr).long(), output_size=T)
    local = torch.arange(T, device=parents.device) - starts  # index of each draft within its request
    bits = torch.zeros(T, dtype=torch.int64, device=parents.device)
    cur = local.clone()  # the ancestor each draft's walk has reached (-1 once past the root)
    for _ in range(MAX_DRAFT_TOKENS):
        alive = (cur >= 0) & (cur < MAX_DRAFT_TOKENS)
        bits |= torch.where(alive, torch.ones_like(bits) << cur.clamp(0, 63), torch.zeros_like(bits))
        parent = parents[(starts + cur).clamp(0, max(T - 1, 0))].long() if T else cur
        cur = torch.where(alive & (parent < cur), parent, torch.full_like(cur, -1))
    tree_mask.copy_(bits)


def tree_verify_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    qo_indptr: Optional[torch.Tensor],
    tree_mask: Optional[torch.Tensor],
    sm_scale: float,
    out: torch.Tensor,
    lse: Optional[torch.Tensor],
) -> None:
    """Tree-verify attention, one request at a time, in fp32.

    Request b has n_b queries and L_b = kv_indptr[b+1] - kv_indptr[b] KV slots: P_b = L_b - n_b
    prefix slots every query sees, then its n_b draft slots, of which query i sees draft j iff
    bit j of tree_mask[query i] is set. qo_indptr=None means plain decode (n_b = 1, the one
    query sees all L_b slots). A query that sees no slot gets zeros and lse = -inf.
    """
    B = kv_indptr.numel() - 1
    Hq, Hkv = q.shape[1], k_cache.shape[1]
    group = Hq // Hkv
    kv_ptr = kv_indptr.tolist()
    qo_ptr = list(range(B + 1)) if qo_indptr is None else qo_indptr.tolist()
    for b in range(B):
        q0, q1 = qo_ptr[b], qo_ptr[b + 1]
        n = q1 - q0
        if n == 0:
            continue
        slots = kv_indices[kv_ptr[b]:kv_ptr[b + 1]].long()
        prefix_len = slots.numel() - n
        # KV heads repeated so that query head h reads KV head h // group.
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)  # [L, Hq, Dv]
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * sm_scale  # [Hq, n, L]

        if qo_indptr is None:  # decode: the one query sees every slot, its own included
            visible = torch.ones(n, slots.numel(), dtype=torch.bool, device=q.device)
        else:
            draft_bits = tree_mask[q0:q1, None] >> torch.arange(n, device=q.device)
            draft_visible = (draft_bits & 1).bool()  # [n, n]
            prefix_visible = torch.ones(n, prefix_len, dtype=torch.bool, device=q.device)
            visible = torch.cat([prefix_visible, draft_visible], dim=1)  # [n, L]
        scores = scores.masked_fill(~visible, -math.inf)

        row_lse = torch.logsumexp(scores, dim=-1)  # [Hq, n]; -inf where nothing is visible
        seen = torch.isfinite(row_lse)[..., None]
        probs = torch.where(seen, torch.exp(scores - row_lse[..., None]), torch.zeros_like(scores))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
        if lse is not None:
            lse[q0:q1] = row_lse.transpose(0, 1)
