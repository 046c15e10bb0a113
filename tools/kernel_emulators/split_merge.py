"""csrc/include/spec_kernels/split_merge.cuh, shared by both attention kernels: split_bounds (the
prefix keys a split reads) and merge_split_row (the combine merge_splits_kernel and
mla_merge_splits_kernel launch when num_splits > 1)."""
from __future__ import annotations

import numpy as np

from ptx import c_int, to_dtype

LN2 = 0.69314718055994531


def split_bounds(prefix_len, num_splits, split, tile, min_chunk):
    """(lo, hi): the kernels' int arithmetic (c_int flags a value that would overflow int)."""
    per_split = (prefix_len + num_splits - 1) // num_splits
    chunk = max(c_int((per_split + tile - 1) // tile * tile, "chunk"), min_chunk)
    lo = prefix_len if split > 0 and chunk > prefix_len // split else c_int(split * chunk, "split * chunk")
    return lo, lo + min(chunk, prefix_len - lo)


def merge_splits(out, lse, o_part, lse_part, dtype, want_lse=True):
    """One block per (token, head) row: out = sum_s 2^(lse_s - lse) o_s in split order,
    lse = log2 sum_s 2^lse_s (stored in natural log); rows no split saw get zeros and -inf.
    out / lse / o_part / lse_part are ptx.GlobalOut buffers ([S, T, H, dim] and [S, T, H] partials)."""
    num_splits, num_tokens, num_heads, dim = o_part.a.shape
    for token in range(num_tokens):
        for head in range(num_heads):
            ls = lse_part.a[:, token, head]
            mx = np.float32(-np.inf)
            for s_ in range(num_splits):
                mx = np.fmax(mx, ls[s_])
            m_safe = np.float32(0) if mx == -np.inf else mx
            total = np.float32(0)
            for s_ in range(num_splits):
                total += np.exp2(ls[s_] - m_safe)
            seen = total != 0  # NaN (a NaN lse_s) counts as seen
            inv_total = np.float32(1) / total if seen else np.float32(0)
            o = np.zeros(dim, np.float32)
            for s_ in range(num_splits):
                o += np.exp2(ls[s_] - m_safe) * o_part.a[s_, token, head]
            out.store((token, head, np.arange(dim)), to_dtype(o * inv_total, dtype))
            if want_lse:
                lse.store((token, head), (m_safe + np.log2(total)) * np.float32(LN2) if seen else -np.inf)
