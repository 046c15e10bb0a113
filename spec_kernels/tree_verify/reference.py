"""Readable PyTorch references of the tree-verify ops: the oracle every kernel is tested against.

They loop over requests on the host (reading the indptr values), so they sync with the GPU and
cannot be captured in a CUDA graph; everything else about them favours clarity over speed. The
attention itself lives in spec_kernels.attention.reference (MLA shares it).
"""
from __future__ import annotations

import torch

from .._limits import MAX_DRAFT_TOKENS  # one 64-bit mask word per draft token
from ..attention.reference import _range, tree_verify_attention  # noqa: F401 (tree_verify_attention: re-exported)


def tree_mask_from_parents(parents: torch.Tensor, qo_indptr: torch.Tensor, tree_mask: torch.Tensor) -> None:
    """tree_mask[t] = bit of draft t and of each of its ancestors (indices within its request).

    Walks every draft's parent chain at once, one level per step; parents precede children, so
    64 steps reach every root. A link that does not point backwards ends the walk; drafts past
    the 64th get an empty word. Invalid (unchecked) qo_indptr values are cut to [0, T) like in
    the kernels, and rows no request claims are left unwritten."""
    T = parents.numel()
    qo = qo_indptr.tolist()
    ranges = [_range(qo, b, T) for b in range(len(qo) - 1)]
    dev = parents.device
    starts_b = torch.tensor([lo for lo, _ in ranges], dtype=torch.int64, device=dev)
    counts_b = torch.tensor([hi - lo for lo, hi in ranges], dtype=torch.int64, device=dev)
    R = sum(hi - lo for lo, hi in ranges)  # rows claimed (= T for valid input)
    starts = torch.repeat_interleave(starts_b, counts_b, output_size=R)
    rows = torch.cat([torch.arange(lo, hi, device=dev) for lo, hi in ranges]) if R else starts
    local = rows - starts  # index of each draft within its request
    bits = torch.zeros(R, dtype=torch.int64, device=dev)
    cur = local.clone()  # the ancestor each draft's walk has reached (-1 once past the root)
    for _ in range(MAX_DRAFT_TOKENS):
        alive = (cur >= 0) & (cur < MAX_DRAFT_TOKENS)
        bits |= torch.where(alive, torch.ones_like(bits) << cur.clamp(0, 63), torch.zeros_like(bits))
        parent = parents[(starts + cur).clamp(0, max(T - 1, 0))].long() if R else cur
        cur = torch.where(alive & (parent < cur), parent, torch.full_like(cur, -1))
    tree_mask[rows] = bits
