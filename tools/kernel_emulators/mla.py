"""Lane-level emulation of csrc/mla/mla_tree_verify_attention.cu (mla_tree_verify_kernel and
mla_merge_splits_kernel, as launched by launch_mla_tree_verify_attention), and its checks
against spec_kernels/mla/reference.py.

A hand transliteration: index expressions are copied from the .cu; ldmatrix, mma and cp.async
come from ptx.py (modelled from the PTX ISA). Each CTA runs its 4 warps one after the other
between barriers; ptx.SharedMemory flags accesses the barriers and cp.async waits do not order
(K/V stages, the Q tile and the S partials that the warps exchange every tile).
Update this file together with the kernel (see README.md).
"""
from __future__ import annotations

import itertools
import math
import random
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ptx import (LANE, G, T4, GlobalOut, SharedMemory, ceil_div, mma_m16n8k16, nan_data, shfl_xor,  # noqa: E402
                 swizzled, to_dtype)
from split_merge import merge_splits, split_bounds  # noqa: E402
from tree_verify import draft_bits, finite_or_nan, indptr_range, kMaskBits  # noqa: E402  (kv_index.cuh)

KERNEL = "csrc/mla/mla_tree_verify_attention.cu"
kWarps, kThreads = 4, 128
kD, kDv = 576, 512  # kMlaHeadDim, kMlaVHeadDim (mla.h)
kChunks = kD // 8  # 72 16-byte chunks per row
kBlockN = 16  # keys per tile
kKStepsPerWarp = kD // 16 // kWarps  # S = Q K^T: 9 of the 36 k16 steps per warp
kDvTiles = kDv // kWarps // 8  # O += P V: 128 columns = 16 n8 tiles per warp
LN2 = 0.69314718055994531


class Params:
    """MlaParams, with the tensors as float32 numpy arrays / python lists."""


def mla_block_m(max_rows):
    return 16 if max_rows <= 16 else 32


def _run_cta(p, kMTiles, bx, split, out, lse, o_part, lse_part):
    kBlockM = 16 * kMTiles
    kStageElems = kBlockN * kD
    kPartialFloats = kMTiles * 2 * 4 * 32  # one warp's S: [m tile][n8 tile][4][lane]
    smem = SharedMemory(kBlockM * kD + 2 * kStageElems + 2 * kWarps * kPartialFloats)
    s_q, s_kv = 0, kBlockM * kD
    s_part = (s_kv + 2 * kStageElems) // 2  # float index

    # ---- which rows, which request, which KV range
    H = p.num_heads
    m_blocks = ceil_div(p.max_rows, kBlockM)
    m_block, req = bx % m_blocks, bx // m_blocks
    q_start, q_end = (req, req + 1) if p.qo_indptr is None else indptr_range(p.qo_indptr, req, p.num_tokens)
    n_draft = q_end - q_start
    kv_start, kv_end = indptr_range(p.kv_indptr, req, p.num_indices)
    kv_len = kv_end - kv_start
    prefix_len = max(kv_len - n_draft, 0)
    num_tail = min(kv_len - prefix_len, kMaskBits)
    row0 = m_block * kBlockM
    rows_here = min(kBlockM, min(n_draft * H, p.max_rows) - row0)
    if rows_here <= 0:
        return

    lo, hi = split_bounds(prefix_len, p.num_splits, split, kBlockN, p.min_chunk)
    prefix_tiles = ceil_div(hi - lo, kBlockN)
    tail_tiles = ceil_div(num_tail, kBlockN) if split == p.num_splits - 1 else 0
    total_tiles = prefix_tiles + tail_tiles

    def row_token(r):  # query token of block row r, or -1 past the rows / for invalid qo_indptr
        token = q_start + (row0 + r) // H
        return token if r < rows_here and 0 <= token < p.num_tokens else -1

    # ---- Q block (rows past rows_here are zero-filled); thread i % 128 issues copy i
    for i in range(kBlockM * kChunks):
        r, c = divmod(i, kChunks)
        token = row_token(r)
        src = p.q[token, (row0 + r) % H, c * 8:c * 8 + 8] if token >= 0 else None
        smem.cp_async_16(s_q + swizzled(kChunks, r, c), src, (i % kThreads) // 32)

    def tile_base(t):
        return lo + t * kBlockN if t < prefix_tiles else prefix_len + (t - prefix_tiles) * kBlockN

    def tile_end(t):
        return hi if t < prefix_tiles else prefix_len + num_tail

    def load_tile(t, stage):
        base, end = tile_base(t), tile_end(t)
        for i in range(kBlockN * kChunks):
            r, c = divmod(i, kChunks)
            at = kv_start + base + r
            slot = int(p.kv_indices[at]) if base + r < end and 0 <= at < p.num_indices else -1
            valid = 0 <= slot < p.num_slots  # else a zero row
            smem.cp_async_16(s_kv + stage * kStageElems + swizzled(kChunks, r, c),
                             p.kv[slot, c * 8:c * 8 + 8] if valid else None, (i % kThreads) // 32)

    # ---- per-thread state, [warp][m tile][h][lane]: rows mt * 16 + g (h = 0) and + 8 (h = 1)
    row_mask = [[[0] * 32 for _ in range(2)] for _ in range(kMTiles)]  # the same in every warp
    for mt in range(kMTiles):
        for h in range(2):
            for ln in range(32):
                r = mt * 16 + ln // 4 + h * 8
                token = row_token(r)
                row_mask[mt][h][ln] = (1 << 64) - 1  # decode: the one tail key is the query's own
                if p.tree_mask is not None:  # only the bits of the draft itself and earlier drafts
                    row_mask[mt][h][ln] = (int(p.tree_mask[token]) & ((1 << 64) - 1) & draft_bits((row0 + r) // H)
                                           if token >= 0 else 0)
    m_i = np.full((kWarps, kMTiles, 2, 32), -np.inf, np.float32)
    l_i = np.zeros((kWarps, kMTiles, 2, 32), np.float32)
    acc = np.zeros((kWarps, kMTiles, kDvTiles, 32, 4), np.float32)

    if total_tiles > 0:
        load_tile(0, 0)
    smem.commit_group()  # group 0: Q and tile 0

    for t in range(total_tiles):
        if t + 1 < total_tiles:
            load_tile(t + 1, (t + 1) & 1)
            smem.commit_group()
            smem.wait_group(1)
        else:
            smem.wait_group(0)
        smem.syncthreads()  # the tile (and Q) visible to every warp
        kv_s = s_kv + (t & 1) * kStageElems

        # S partial: all rows x 16 keys over the warp's 9 k16 steps of the 576 dims
        s = np.zeros((kWarps, kMTiles, 2, 32, 4), np.float32)
        for warp in range(kWarps):
            for ks in range(kKStepsPerWarp):
                kk = warp * kKStepsPerWarp + ks
                b = smem.ldmatrix_x4(kv_s + swizzled(kChunks, (LANE // 16) * 8 + LANE % 8, kk * 2 + LANE // 8 % 2), warp)
                for mt in range(kMTiles):
                    a = smem.ldmatrix_x4(
                        s_q + swizzled(kChunks, mt * 16 + (LANE // 8 % 2) * 8 + LANE % 8, kk * 2 + LANE // 16), warp)
                    mma_m16n8k16(s[warp, mt, 0], a, b[0], b[1])
                    mma_m16n8k16(s[warp, mt, 1], a, b[2], b[3])

        # publish the partials, then every warp sums all four in the same order
        for warp in range(kWarps):
            for mt in range(kMTiles):
                for j in range(2):
                    for e in range(4):
                        smem.st_f32(s_part + warp * kPartialFloats + ((mt * 2 + j) * 4 + e) * 32 + LANE,
                                    s[warp, mt, j, :, e], warp)
        smem.syncthreads()  # the S partials published
        for warp in range(kWarps):
            for mt in range(kMTiles):
                for j in range(2):
                    for e in range(4):
                        x = np.zeros(32, np.float32)
                        for w in range(kWarps):
                            x += smem.ld_f32(s_part + w * kPartialFloats + ((mt * 2 + j) * 4 + e) * 32 + LANE, warp)
                        s[warp, mt, j, :, e] = x

        # scale; mask keys past the end and, in the tail, non-ancestors
        base, end = tile_base(t), tile_end(t)
        is_tail = t >= prefix_tiles
        full = not is_tail and base + kBlockN <= end
        for mt in range(kMTiles):
            for j in range(2):
                for e in range(4):
                    with np.errstate(invalid="ignore", over="ignore"):
                        x = finite_or_nan(s[:, mt, j, :, e] * np.float32(p.sm_scale_log2))
                    if not full:
                        pos = base + j * 8 + T4 * 2 + (e & 1)
                        visible = pos < end
                        if is_tail:
                            for ln in range(32):
                                if visible[ln]:
                                    visible[ln] = (row_mask[mt][e >> 1][ln] >> min(int(pos[ln] - prefix_len), 63)) & 1
                        x = np.where(visible, x, np.float32(-np.inf))
                    s[:, mt, j, :, e] = x

        # online softmax (base 2); every warp holds the same S, so the same m_i and l_i
        with np.errstate(invalid="ignore", over="ignore"):
            for mt in range(kMTiles):
                for h in range(2):
                    mx = np.fmax(m_i[:, mt, h], np.fmax(np.fmax(s[:, mt, 0, :, 2 * h], s[:, mt, 0, :, 2 * h + 1]),
                                                        np.fmax(s[:, mt, 1, :, 2 * h], s[:, mt, 1, :, 2 * h + 1])))
                    mx = np.fmax(mx, shfl_xor(mx, 1))
                    mx = np.fmax(mx, shfl_xor(mx, 2))
                    m_safe = np.where(mx == -np.inf, np.float32(0), mx)
                    alpha = np.exp2(m_i[:, mt, h] - m_safe)
                    row_sum = np.zeros((kWarps, 32), np.float32)
                    for j in range(2):
                        s[:, mt, j, :, 2 * h] = np.exp2(s[:, mt, j, :, 2 * h] - m_safe)
                        s[:, mt, j, :, 2 * h + 1] = np.exp2(s[:, mt, j, :, 2 * h + 1] - m_safe)
                        row_sum += s[:, mt, j, :, 2 * h] + s[:, mt, j, :, 2 * h + 1]
                    l_i[:, mt, h] = l_i[:, mt, h] * alpha + row_sum
                    m_i[:, mt, h] = mx
                    acc[:, mt, :, :, 2 * h] *= alpha[:, None, :]
                    acc[:, mt, :, :, 2 * h + 1] *= alpha[:, None, :]

        # O[:, the warp's 128 columns] += P V: the S accumulators are the A fragment (pack2 rounds
        # to T); V is the latent part of the same smem rows as K, loaded with .trans
        for warp in range(kWarps):
            a_p = [to_dtype(np.stack([s[warp, mt, 0][:, 0:2], s[warp, mt, 0][:, 2:4],
                                      s[warp, mt, 1][:, 0:2], s[warp, mt, 1][:, 2:4]]), p.dtype) for mt in range(kMTiles)]
            for d in range(0, kDvTiles, 2):
                b = smem.ldmatrix_x4(
                    kv_s + swizzled(kChunks, (LANE // 8 % 2) * 8 + LANE % 8, warp * kDvTiles + d + LANE // 16),
                    warp, trans=True)
                for mt in range(kMTiles):
                    mma_m16n8k16(acc[warp, mt, d], a_p[mt], b[0], b[1])
                    mma_m16n8k16(acc[warp, mt, d + 1], a_p[mt], b[2], b[3])
        smem.syncthreads()  # the stage and the partials are rewritten by the next iteration
    smem.wait_group(0)

    # ---- epilogue: every warp writes its 128 columns; rows that saw no key get zeros, lse = -inf
    for warp in range(kWarps):
        col0 = warp * kDvTiles * 8
        for mt in range(kMTiles):
            for h in range(2):
                l = l_i[warp, mt, h]
                l = l + shfl_xor(l, 1)
                l = l + shfl_xor(l, 2)
                for ln in range(32):
                    r = mt * 16 + G[ln] + h * 8
                    token = row_token(r)
                    if token < 0:
                        continue
                    head = (row0 + r) % H
                    seen = l[ln] != 0  # NaN (a NaN logit) counts as seen
                    inv_l = np.float32(1) / l[ln] if seen else np.float32(0)
                    lse2 = m_i[warp, mt, h, ln] + np.log2(l[ln]) if seen else -np.inf
                    cols = col0 + (np.arange(kDvTiles)[:, None] * 8 + T4[ln] * 2 + np.arange(2)[None, :]).reshape(-1)
                    vals = ((acc[warp, mt, :, ln, 2 * h:2 * h + 2] * inv_l).reshape(-1) if seen
                            else np.zeros(kDvTiles * 2, np.float32))
                    if p.num_splits > 1:
                        o_part.store((split, token, head, cols), vals)
                        if warp == 0 and T4[ln] == 0:
                            lse_part.store((split, token, head), lse2)
                    else:
                        out.store((token, head, cols), to_dtype(vals, p.dtype))
                        if p.want_lse and warp == 0 and T4[ln] == 0:
                            lse.store((token, head), np.float32(lse2) * np.float32(LN2))


def emulate(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, num_splits, min_chunk, max_rows,
            want_lse=True):
    """launch_mla_tree_verify_attention on CPU tensors (q [T, H, 576], kv_cache [S, 576], fp16 or
    bf16). Returns (out [T, H, 512], lse [T, H]) as float32 tensors; NaN where nothing was
    written. Raises ptx.HazardError on a race, an out-of-bounds access or a double write."""
    p = Params()
    p.dtype = q.dtype
    p.num_tokens, p.num_heads, D = q.shape
    assert D == kD and kv_cache.shape[1] == kD
    p.q, p.kv = q.float().numpy(), kv_cache.float().numpy()
    p.num_slots = kv_cache.shape[0]
    p.kv_indptr = [int(x) for x in kv_indptr.tolist()]
    p.kv_indices = kv_indices.numpy()
    p.num_indices = kv_indices.numel()
    p.qo_indptr = None if qo_indptr is None else [int(x) for x in qo_indptr.tolist()]
    p.tree_mask = None if tree_mask is None else tree_mask.numpy()
    p.sm_scale_log2 = np.float32(sm_scale * 1.4426950408889634)
    p.num_splits, p.min_chunk, p.max_rows, p.want_lse = num_splits, min_chunk, max_rows, want_lse
    p.num_requests = len(p.kv_indptr) - 1
    T, H = p.num_tokens, p.num_heads
    out, lse = GlobalOut((T, H, kDv), "out"), GlobalOut((T, H), "lse")
    o_part = GlobalOut((num_splits, T, H, kDv), "o_partial")
    lse_part = GlobalOut((num_splits, T, H), "lse_partial")
    if p.num_requests == 0 or p.num_tokens == 0:
        return torch.from_numpy(out.a), torch.from_numpy(lse.a)
    kMTiles = 1 if mla_block_m(max_rows) == 16 else 2
    m_blocks = ceil_div(max_rows, 16 * kMTiles)
    for split in range(num_splits):  # grid (num_requests * m_blocks, num_splits)
        for bx in range(p.num_requests * m_blocks):
            _run_cta(p, kMTiles, bx, split, out, lse, o_part, lse_part)
    if num_splits > 1:
        merge_splits(out, lse, o_part, lse_part, p.dtype, p.want_lse)
    return torch.from_numpy(out.a), torch.from_numpy(lse.a)


# ================================================================================ checks
def make_case(ns, prefixes, heads, seed=0, dtype=torch.float16, decode=False):
    """Request b: ns[b] drafts (a random tree) after prefixes[b] prefix slots; the slots are a
    random subset of a larger pool, so an emulation that ignored kv_indices could not pass."""
    from spec_kernels.tree_verify.reference import tree_mask_from_parents
    g = torch.Generator().manual_seed(seed)
    kv_lens = [pr + n for pr, n in zip(prefixes, ns)]
    num_slots = sum(kv_lens) + 7
    T = sum(ns)
    q = torch.randn(T, heads, kD, generator=g).to(dtype)
    kv = torch.randn(num_slots, kD, generator=g).to(dtype)
    kv_indptr = torch.tensor([0] + list(itertools.accumulate(kv_lens)), dtype=torch.int32)
    kv_indices = torch.randperm(num_slots, generator=g)[: sum(kv_lens)].to(torch.int32)
    if decode:
        assert all(n == 1 for n in ns)
        return q, kv, kv_indptr, kv_indices, None, None
    qo_indptr = torch.tensor([0] + list(itertools.accumulate(ns)), dtype=torch.int32)
    rng = random.Random(seed)
    parents = [x for n in ns for x in ([-1] + [rng.randrange(-1, i) for i in range(1, n)] if n else [])]
    mask = torch.empty(T, dtype=torch.int64)
    tree_mask_from_parents(torch.tensor(parents, dtype=torch.int64), qo_indptr, mask)
    return q, kv, kv_indptr, kv_indices, qo_indptr, mask


def garbage_mask_case(seed=0, dtype=torch.float16):
    """Random 64-bit mask words (sign bit, bits past n_b set): only bits 0..i of draft i count
    (itself and earlier drafts); a row whose word is 0 sees nothing (empty prefixes) and gets
    zeros with lse = -inf."""
    q, kv, kvp, kvi, qo, _ = make_case([4, 20], [0, 0], 3, seed, dtype)
    g = torch.Generator().manual_seed(seed)
    mask = torch.randint(-2**62, 2**62, (q.shape[0],), dtype=torch.int64, generator=g)
    mask[0] = 0
    mask[1] = -2**63 | (1 << 1)
    mask[5] = 0
    mask[6] = (1 << 17) | (1 << 60)
    return q, kv, kvp, kvi, qo, mask


TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3}  # max |out - reference| (P and out round to T)
LSE_TOL = 1e-3


def compare(case, splits=1, min_chunk=0, max_draft=0, invalid=False):
    """Emulate with the launch's max_rows (launch_plan.max_rows, as spec_kernels/mla/cuda.py)
    and compare with the fp32 reference: errors within TOL / LSE_TOL, the same -inf rows and the
    same NaN elements (both start from NaN, so unwritten rows must match too); valid input
    (invalid=False) must give no NaN at all."""
    from spec_kernels.mla import reference
    from spec_kernels.tree_verify.launch_plan import max_rows
    q, kv, kvp, kvi, qo, mask = case
    T, H, _ = q.shape
    scale = 1 / math.sqrt(kD)
    ref_o, ref_l = torch.full((T, H, kDv), math.nan), torch.full((T, H), math.nan)
    reference.mla_tree_verify_attention(q.float(), kv.float(), kvp, kvi.long(), qo, mask, scale, kDv, ref_o, ref_l,
                                        max_draft)
    rows = max_rows(T, H, qo is None, max_draft)
    o, l = emulate(q, kv, kvp, kvi, qo, mask, scale, splits, min_chunk, rows)
    nan = bool(torch.isnan(o).any() or torch.isnan(l).any())
    same_nan = torch.equal(torch.isnan(o), torch.isnan(ref_o)) and torch.equal(torch.isnan(l), torch.isnan(ref_l))
    err = torch.where(torch.isnan(o) | torch.isnan(ref_o), 0, o - ref_o).abs().max().item() if T else 0.0
    same_inf = torch.equal(torch.isinf(ref_l), torch.isinf(l))
    lerr = torch.where(torch.isinf(ref_l) | torch.isnan(ref_l) | torch.isnan(l), 0, l - ref_l).abs().max().item() \
        if T else 0.0
    ok = (invalid or not nan) and same_nan and same_inf and err <= TOL[q.dtype] and lerr <= LSE_TOL
    note = "" if ok else (f"max|out err| {err:.1e} (tol {TOL[q.dtype]:.0e}), max|lse err| {lerr:.1e} (tol {LSE_TOL:.0e}), "
                          f"NaN: {nan}, same NaN elements: {same_nan}, same -inf rows: {same_inf}")
    return dict(ok=ok, err=err, lse_err=lerr, dtype=q.dtype, note=note)


def invalid_indices_case(seed=0, dtype=torch.float16):
    """Unchecked invalid index values: a negative qo_indptr / kv_indptr entry, a decreasing
    kv_indptr pair, an indptr past the end, slot ids outside [0, S). The reference cuts the
    ranges to the tensors and reads bad slots as zero rows; the kernel must do the same."""
    q, kv, kvp, kvi, qo, mask = make_case([3, 2, 4, 1], [10, 0, 20, 5], 2, seed, dtype)
    qo, kvp, kvi = qo.clone(), kvp.clone(), kvi.clone()
    qo[1] = -1  # request 0: rows [0, 0); request 1: rows [0, 5)
    kvp[1] = -4  # request 0: KV [0, 0); request 1: KV [0, 15)
    kvp[3] = 2  # request 2: KV [15, 2) -> empty; request 3: KV [2, 45)
    kvp[4] = 10**6  # past the end of kv_indices: cut to its length
    kvi[5], kvi[20] = -3, 10**7  # bad slot ids: zero rows
    return q, kv, kvp, kvi, qo, mask


def nonfinite_case(seed=0, dtype=torch.float16):
    """NaN / inf inputs: a NaN query element, an inf / -inf in the K part of a prefix / draft row
    (rows that see it: NaN output and lse), a NaN in the latent (V) part of a prefix row (the
    output column is NaN, for every row of the request), a NaN query of a row that sees nothing."""
    q, kv, kvp, kvi, qo, mask = make_case([4, 3, 2], [12, 5, 0], 3, seed, dtype)
    q, kv, mask = q.clone(), kv.clone(), mask.clone()
    nan, inf = float("nan"), float("inf")
    q[1, 2, 100] = nan  # request 0, draft 1, head 2
    kv[int(kvi[3]), kDv + 5] = inf  # request 0's prefix, rope part: every row of request 0
    kv[int(kvi[16 + 5 + 1]), 7] = -inf  # request 1's draft 1 (latent = K and V): the rows that see it
    kv[int(kvi[16 + 2]), 300] = nan  # request 1's prefix, latent column 300: K and V
    kv[int(kvi[16 + 3]), kDv + 1] = nan  # request 1's prefix, rope part: K only
    mask[7] = 0  # request 2 (empty prefix), draft 0 sees nothing ...
    q[7] = nan  # ... so its NaN query does not matter
    return q, kv, kvp, kvi, qo, mask


def cases(quick):
    """(name, thunk) pairs: the reviewers' 17 configurations (fp16) plus 3 in bf16. H 1..128,
    kMTiles 1 and 2, several m-blocks, n_b 0/1/17/64 (bit 63), empty prefixes, decode, splits
    2..5 with the merge, min_chunk 256 with empty splits, unseen rows, garbage mask bits; then
    unchecked invalid indptr / slot values, n_b 70, and NaN / inf inputs (against the reference)."""
    fp16, bf16 = torch.float16, torch.bfloat16
    spec = [  # (name, ns, prefixes, heads, dict(splits, min_chunk, max_draft, decode, dtype), quick)
        ("one tile, tail in range", [3], [5], 2, {}, False),
        ("n_b 0, empty prefix", [5, 0, 2], [20, 7, 0], 3, {}, True),
        ("only the draft", [1], [0], 1, {}, False),
        ("tail over 2 tiles, kMTiles 2", [17], [3], 1, dict(max_draft=17), False),
        ("rows 32", [2], [40], 16, {}, False),
        ("splits 3 + merge", [2, 3], [40, 33], 5, dict(splits=3), False),
        ("decode H=16", [1, 1], [37, 0], 16, dict(decode=True), False),
        ("decode H=20, 2 m-blocks, splits 2", [1, 1, 1], [70, 3, 16], 20, dict(decode=True, splits=2), False),
        ("n_b 64 (bit 63)", [64], [10], 1, {}, True),
        ("n_b 64, splits 4", [64, 7], [300, 1], 1, dict(splits=4), False),
        ("min_chunk 256, empty splits", [2, 5], [600, 513], 3, dict(splits=4, min_chunk=256), True),
        ("H=128, 12 m-blocks", [3, 1], [17, 16], 128, dict(max_draft=3), True),
        ("decode H=128", [1], [33], 128, dict(decode=True), True),
        ("decode H=7, more splits than tiles", [1], [33], 7, dict(decode=True, splits=5), False),
        ("empty prefixes", [9, 16], [0, 0], 2, {}, False),
        ("n_b 0, empty prefix", [5, 0, 2], [20, 7, 0], 3, dict(dtype=bf16), False),
        ("splits 3 + merge", [2, 3], [40, 33], 5, dict(splits=3, dtype=bf16), True),
        ("decode H=128", [1], [33], 128, dict(decode=True, dtype=bf16), False),
    ]
    out = []
    for name, ns, prefixes, heads, kw, q in spec:
        if quick and not q:
            continue
        dt = kw.get("dtype", fp16)
        label = f"{name}: ns={ns} prefixes={prefixes} H={heads} {'bf16' if dt == bf16 else 'fp16'}"
        out.append((label, lambda ns=ns, pr=prefixes, h=heads, kw=kw, dt=dt: compare(
            make_case(ns, pr, h, dtype=dt, decode=kw.get("decode", False)), kw.get("splits", 1),
            kw.get("min_chunk", 0), kw.get("max_draft", 0))))
    for splits in (1, 2):
        if quick and splits == 1:
            continue
        out.append((f"garbage mask bits, unseen rows: ns=[4, 20] H=3 fp16 splits={splits}",
                    lambda splits=splits: compare(garbage_mask_case(), splits)))
    for splits in (1, 3):
        if quick and splits == 1:
            continue
        out.append((f"invalid indptr / slot values: H=2 fp16 splits={splits}",
                    lambda splits=splits: compare(invalid_indices_case(), splits, invalid=True)))
    out.append(("more than 64 drafts (n_b 70): drafts past the bound unwritten, H=1 fp16",
                lambda: compare(make_case([70], [5], 1), 1, invalid=True)))

    def nonfinite(splits, dtype):
        with nan_data():  # NaN in mma operands is data here, not unwritten memory
            return compare(nonfinite_case(dtype=dtype), splits, invalid=True)
    for splits, dt in ((1, fp16), (2, bf16)):
        out.append((f"NaN / inf inputs: H=3 {'bf16' if dt == bf16 else 'fp16'} splits={splits}",
                    lambda splits=splits, dt=dt: nonfinite(splits, dt)))
    return out
