"""The readable PyTorch reference of tree-verify attention over a token-slot KV pool, shared by the
tree-verify and MLA families (MLA is the same attention with K = the latent cache and V its first
columns): the oracle every attention kernel is tested against.

It loops over requests on the host (reading the indptr values), so it syncs with the GPU and
cannot be captured in a CUDA graph; everything else about it favours clarity over speed.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .._limits import MAX_DRAFT_TOKENS  # one 64-bit mask word per draft token


def _clamp(x: int, lo: int, hi: int) -> int:
    return min(max(x, lo), hi)


def _range(indptr: list[int], b: int, limit: int) -> tuple[int, int]:
    """[lo, hi) of entry b of an indptr, cut to [0, limit): what every kernel reads for invalid
    (unchecked) values; the identity for valid ones (spec_kernels._checks)."""
    lo = _clamp(indptr[b], 0, limit)
    return lo, _clamp(indptr[b + 1], lo, limit)


def draft_bits(i: torch.Tensor) -> torch.Tensor:
    """int64 words with bits 0..i set (all 64 at i >= 63): what draft i may see of the mask."""
    return torch.where(i >= 63, torch.full_like(i, -1), (1 << (i.clamp(0, 62) + 1)) - 1)


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
    max_draft_tokens: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Tree-verify attention, one request at a time, in fp32.

    K and V are the caches' values times k_scale / v_scale (fp8 caches: dequantised in fp32;
    other caches have scale 1).

    Request b has n_b queries and L_b = kv_indptr[b+1] - kv_indptr[b] KV slots: P_b = L_b - n_b
    prefix slots every query sees, then its n_b draft slots, of which query i sees draft j iff
    j <= i and bit j of tree_mask[query i] is set. qo_indptr=None means plain decode (n_b = 1,
    the one query sees all L_b slots).

    Non-finite values: a row with a NaN or +-inf logit among the keys it sees (NaN/inf in its
    query or in such a key's K row) gets NaN output and lse. V enters as sum(weight * V) over
    the request's slots, as in the kernels: a NaN/inf in a V row makes those output columns
    NaN/inf, also for a row that does not see that draft slot (weight 0 times NaN is NaN). A
    query that sees no slot gets zeros and lse = -inf.

    Invalid index values (what the API checks on CPU) are handled like the kernels do (rules in
    spec_kernels._checks): indptr ranges cut to [0, len), slot ids outside [0, S) read as zero
    rows, only the first min(n_b, max_draft_tokens or 64) drafts of a request computed.
    """
    B = kv_indptr.numel() - 1
    T, Hq = q.shape[:2]
    S, Hkv = k_cache.shape[:2]
    N = kv_indices.numel()
    group = Hq // Hkv
    kv_ptr = kv_indptr.tolist()
    qo_ptr = list(range(B + 1)) if qo_indptr is None else qo_indptr.tolist()
    bound = 1 if qo_indptr is None else (max_draft_tokens or MAX_DRAFT_TOKENS)
    dev = q.device
    for b in range(B):
        q0, q1 = _range(qo_ptr, b, T)
        n = q1 - q0
        rows = min(n, bound)  # drafts computed (= n for valid input)
        if rows == 0:
            continue
        k0, k1 = _range(kv_ptr, b, N)
        slots = kv_indices[k0:k1].long()
        L = slots.numel()
        prefix_len = max(L - n, 0)
        ok = (slots >= 0) & (slots < S)  # else a zero K / V row
        safe = torch.where(ok, slots, torch.zeros_like(slots))
        # KV heads repeated so that query head h reads KV head h // group.
        k = torch.where(ok[:, None, None], k_cache[safe].float() * k_scale, 0.0).repeat_interleave(group, dim=1)
        v = torch.where(ok[:, None, None], v_cache[safe].float() * v_scale, 0.0).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q0 + rows].float(), k) * sm_scale  # [Hq, rows, L]

        if qo_indptr is None:  # decode: the one query sees every slot, its own included
            visible = torch.ones(rows, L, dtype=torch.bool, device=dev)
        else:
            i = torch.arange(rows, device=dev)[:, None]
            j = torch.arange(L, device=dev)[None, :] - prefix_len  # draft index of each slot (< 0: prefix)
            words = tree_mask[q0:q0 + rows, None] & draft_bits(i)  # bits of later drafts ignored
            bit = (words >> j.clamp(0, 63)) & 1
            visible = (j < 0) | ((j < MAX_DRAFT_TOKENS) & (bit != 0))  # [rows, L]
        visible = visible.expand_as(scores)
        nonfinite = (visible & ~torch.isfinite(scores)).any(-1)  # [Hq, rows]: NaN/inf logit seen
        seen = visible.any(-1)  # [Hq, rows]
        scores = torch.where(visible & torch.isfinite(scores), scores, -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is visible
        probs = torch.where(seen[..., None], torch.exp(scores - row_lse[..., None]), 0.0)
        o = torch.einsum("hqk,khd->hqd", probs, v)  # zero weights included: 0 * NaN is NaN, as in the kernels
        o = torch.where(nonfinite[..., None], math.nan, o)
        o = torch.where(seen[..., None], o, 0.0)
        row_lse = torch.where(nonfinite, math.nan, row_lse)
        out[q0:q0 + rows] = o.transpose(0, 1).to(out.dtype)
        if lse is not None:
            lse[q0:q0 + rows] = row_lse.transpose(0, 1)
