"""Lane-level emulation of csrc/tree_verify/tree_verify_attention.cu (tree_verify_kernel and
merge_splits_kernel, as launched by launch_tree_verify_attention), and its checks against
spec_kernels/tree_verify/reference.py.

A hand transliteration: the kernel's index expressions (Q/K/V addresses, swizzle, tile bounds,
masks, warps_m x warps_n layout, epilogue offsets) are copied from the .cu; ldmatrix, mma and
cp.async come from ptx.py (modelled from the PTX ISA). Each CTA runs its 4 warps one after the
other between barriers; ptx.SharedMemory flags any shared-memory access the barriers and
cp.async waits do not order. Update this file together with the kernel (see README.md).
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

from ptx import (LANE, G, T4, GlobalOut, SharedMemory, c_int, ceil_div, in_bounds, mma_m16n8k16,  # noqa: E402
                 nan_data, shfl_xor, swizzled, to_dtype)
from split_merge import merge_splits, split_bounds  # noqa: E402

KERNEL = "csrc/tree_verify/tree_verify_attention.cu"
kWarps, kThreads = 4, 128
kBlockM = 64  # kTreeVerifyBlockM (tree_verify.h)
LN2 = 0.69314718055994531


kMaskBits = 64  # kv_index.cuh


class Params:
    """TreeVerifyParams, with the tensors as float32 numpy arrays / python lists."""


def indptr_range(indptr, b, limit):
    """kv_index.cuh indptr_range: [lo, hi) of entry b cut to [0, limit)."""
    lo = min(max(int(indptr[b]), 0), limit)
    return lo, min(max(int(indptr[b + 1]), lo), limit)


def draft_bits(i):
    """kv_index.cuh draft_bits: bits 0..i of a mask word (all 64 at i >= 63), as a python int."""
    return (1 << 64) - 1 if i >= 63 else (2 << i) - 1


def finite_or_nan(x):
    """kv_index.cuh finite_or_nan: +-inf -> NaN."""
    return np.where(np.isinf(x), np.float32(np.nan), x).astype(np.float32)


def _run_cta(p, bx, split, out, lse, o_part, lse_part):
    D = p.head_dim
    kChunks = D // 8
    kStageKeys = 32 if D >= 256 else 64
    kMaxWarpsN = kStageKeys // 16
    kMaxNTiles = kStageKeys // 8
    kDvTiles = D // 8
    kMergeFloats = kDvTiles * 4 + 4

    smem = SharedMemory(kBlockM * D + 4 * kStageKeys * D)
    s_q, s_k = 0, kBlockM * D
    s_v = s_k + 2 * kStageKeys * D

    # ---- which rows, which request, which KV range
    group = p.num_q_heads // p.num_kv_heads
    m_blocks = ceil_div(p.max_rows, kBlockM)
    m_block = bx % m_blocks
    kv_head = (bx // m_blocks) % p.num_kv_heads
    req = bx // (m_blocks * p.num_kv_heads)

    q_start, q_end = (req, req + 1) if p.qo_indptr is None else indptr_range(p.qo_indptr, req, p.num_tokens)
    n_draft = q_end - q_start
    kv_start, kv_end = indptr_range(p.kv_indptr, req, p.num_indices)
    kv_len = c_int(kv_end - kv_start, "kv_len")
    prefix_len = max(kv_len - n_draft, 0)
    num_tail = min(kv_len - prefix_len, kMaskBits)
    row0 = m_block * kBlockM
    rows_here = min(kBlockM, min(n_draft * group, p.max_rows) - row0)
    if rows_here <= 0:
        return

    warps_m = max(1 if rows_here <= 16 else 2 if rows_here <= 32 else 4, kWarps // kMaxWarpsN)
    warps_n = kWarps // warps_m
    keys_per_warp = kStageKeys // warps_n
    ntiles = keys_per_warp // 8

    lo, hi = split_bounds(prefix_len, p.num_splits, split, kStageKeys, p.min_chunk)
    prefix_tiles = ceil_div(hi - lo, kStageKeys)
    tail_tiles = ceil_div(num_tail, kStageKeys) if split == p.num_splits - 1 else 0
    total_tiles = prefix_tiles + tail_tiles

    # ---- Q block (rows past rows_here are zero-filled); thread i % 128 issues copy i
    for i in range(kBlockM * kChunks):
        r, c = divmod(i, kChunks)
        row = row0 + r
        token = q_start + row // group
        valid = r < rows_here and 0 <= token < p.num_tokens
        src = None
        if valid:
            head = in_bounds(kv_head * group + row % group, p.num_q_heads, "q head")
            src = p.q[token, head, c * 8:c * 8 + 8]
        smem.cp_async_16(s_q + swizzled(kChunks, r, c), src, (i % kThreads) // 32)

    def tile_base(t):
        return lo + t * kStageKeys if t < prefix_tiles else prefix_len + (t - prefix_tiles) * kStageKeys

    def tile_end(t):
        return hi if t < prefix_tiles else prefix_len + num_tail

    def load_tile(t, stage):
        base, end = tile_base(t), tile_end(t)
        for i in range(kStageKeys * kChunks):
            r, c = divmod(i, kChunks)
            at = kv_start + base + r
            in_range = base + r < end and 0 <= at < p.num_indices
            slot = int(p.kv_indices[at]) if in_range else 0
            valid = in_range and 0 <= slot < p.num_slots
            warp = (i % kThreads) // 32
            off = stage * kStageKeys * D + swizzled(kChunks, r, c)
            smem.cp_async_16(s_k + off, p.k[slot, kv_head, c * 8:c * 8 + 8] if valid else None, warp)
            smem.cp_async_16(s_v + off, p.v[slot, kv_head, c * 8:c * 8 + 8] if valid else None, warp)

    # ---- per-warp state; per lane: rows g and g + 8 of the warp's 16 rows
    W = []
    for warp in range(kWarps):
        wm, wn = warp % warps_m, warp // warps_m
        row_mask = []
        for h in range(2):
            r = wm * 16 + G + h * 8
            if p.tree_mask is None:
                row_mask.append([(1 << 64) - 1] * 32)  # decode: the one tail key is the query's own
                continue
            tokens = q_start + (row0 + r) // group
            row_mask.append([int(p.tree_mask[tok]) & ((1 << 64) - 1) & draft_bits((row0 + int(r[l])) // group)
                             if r[l] < rows_here and 0 <= tok < p.num_tokens else 0 for l, tok in enumerate(tokens)])
        W.append(dict(wm=wm, wn=wn, row_mask=row_mask, m=np.full((2, 32), -np.inf, np.float32),
                      l=np.zeros((2, 32), np.float32), acc=np.zeros((kDvTiles, 32, 4), np.float32)))

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

        k_s = s_k + (t & 1) * kStageKeys * D
        v_s = s_v + (t & 1) * kStageKeys * D
        base, end = tile_base(t), tile_end(t)
        is_tail = t >= prefix_tiles
        for warp in range(kWarps):
            w = W[warp]
            wm, wn = w["wm"], w["wn"]
            key0 = wn * keys_per_warp

            # S = Q K^T for 16 rows x keys_per_warp keys, k16 steps over D
            s = np.zeros((kMaxNTiles, 32, 4), np.float32)
            for kk in range(D // 16):
                a = smem.ldmatrix_x4(s_q + swizzled(kChunks, wm * 16 + (LANE // 8 % 2) * 8 + LANE % 8, kk * 2 + LANE // 16),
                                     warp)
                for j in range(0, kMaxNTiles, 2):
                    if j < ntiles:
                        b = smem.ldmatrix_x4(k_s + swizzled(kChunks, key0 + j * 8 + (LANE // 16) * 8 + LANE % 8,
                                                            kk * 2 + LANE // 8 % 2), warp)
                        mma_m16n8k16(s[j], a, b[0], b[1])
                        mma_m16n8k16(s[j + 1], a, b[2], b[3])

            # scale; mask keys past the end and, in the tail, non-ancestors
            full = not is_tail and base + kStageKeys <= end
            for j in range(kMaxNTiles):
                for e in range(4):
                    with np.errstate(invalid="ignore", over="ignore"):
                        x = finite_or_nan(s[j][:, e] * np.float32(p.sm_scale_log2))
                    if not full:
                        pos = base + key0 + j * 8 + T4 * 2 + (e & 1)
                        visible = pos < end
                        if is_tail:
                            rm = w["row_mask"][e >> 1]
                            visible = np.array([bool(visible[l]) and bool((rm[l] >> min(int(pos[l] - prefix_len), 63)) & 1)
                                                for l in range(32)])
                        x = np.where(visible, x, np.float32(-np.inf))
                    s[j][:, e] = x

            # online softmax (base 2); a quad of lanes shares a row
            with np.errstate(invalid="ignore", over="ignore"):
                for h in range(2):
                    mx = w["m"][h].copy()
                    for j in range(ntiles):
                        mx = np.fmax(mx, np.fmax(s[j][:, 2 * h], s[j][:, 2 * h + 1]))
                    mx = np.fmax(mx, shfl_xor(mx, 1))
                    mx = np.fmax(mx, shfl_xor(mx, 2))
                    m_safe = np.where(mx == -np.inf, np.float32(0), mx)
                    alpha = np.exp2(w["m"][h] - m_safe)
                    row_sum = np.zeros(32, np.float32)
                    for j in range(kMaxNTiles):  # exp2f over all tiles, summed over the used ones
                        s[j][:, 2 * h] = np.exp2(s[j][:, 2 * h] - m_safe)
                        s[j][:, 2 * h + 1] = np.exp2(s[j][:, 2 * h + 1] - m_safe)
                        if j < ntiles:
                            row_sum += s[j][:, 2 * h] + s[j][:, 2 * h + 1]
                    w["l"][h] = w["l"][h] * alpha + row_sum
                    w["m"][h] = mx
                    w["acc"][:, :, 2 * h] *= alpha
                    w["acc"][:, :, 2 * h + 1] *= alpha

            # O += P V: the S accumulators of key tiles j, j+1 are the A fragment (pack2 rounds to T)
            for j in range(0, kMaxNTiles, 2):
                if j < ntiles:
                    a = to_dtype(np.stack([s[j][:, 0:2], s[j][:, 2:4], s[j + 1][:, 0:2], s[j + 1][:, 2:4]]), p.dtype)
                    for d in range(0, kDvTiles, 2):
                        b = smem.ldmatrix_x4(v_s + swizzled(kChunks, key0 + j * 8 + (LANE // 8 % 2) * 8 + LANE % 8,
                                                            d + LANE // 16), warp, trans=True)
                        mma_m16n8k16(w["acc"][d], a, b[0], b[1])
                        mma_m16n8k16(w["acc"][d + 1], a, b[2], b[3])
        smem.syncthreads()  # the stage is refilled by the next iteration's prefetch
    smem.wait_group(0)

    for w in W:
        w["l"] = w["l"] + shfl_xor(w["l"], 1)
        w["l"] = w["l"] + shfl_xor(w["l"], 2)

    # ---- merge the warps that shared rows (warps_n > 1) into the wn == 0 warp, through smem
    if warps_n > 1:
        smem.syncthreads()  # Q/K/V tiles are dead; reuse the memory
        kAcc = kDvTiles * 4
        for warp, w in enumerate(W):
            mine = warp * kMergeFloats * 32
            for d in range(kDvTiles):
                for e in range(4):
                    smem.st_f32(mine + (d * 4 + e) * 32 + LANE, w["acc"][d][:, e], warp)
            for h in range(2):
                smem.st_f32(mine + (kAcc + h) * 32 + LANE, w["m"][h], warp)
                smem.st_f32(mine + (kAcc + 2 + h) * 32 + LANE, w["l"][h], warp)
        smem.syncthreads()  # every warp's state published
        for warp, w in enumerate(W):
            if w["wn"] != 0:
                continue
            for other in range(1, warps_n):
                theirs = (other * warps_m + w["wm"]) * kMergeFloats * 32
                sc_mine, sc_theirs = [None, None], [None, None]
                for h in range(2):
                    m_o = smem.ld_f32(theirs + (kAcc + h) * 32 + LANE, warp)
                    mx = np.fmax(w["m"][h], m_o)
                    m_safe = np.where(mx == -np.inf, np.float32(0), mx)
                    sc_mine[h] = np.exp2(w["m"][h] - m_safe)
                    sc_theirs[h] = np.exp2(m_o - m_safe)
                    l_o = smem.ld_f32(theirs + (kAcc + 2 + h) * 32 + LANE, warp)
                    w["l"][h] = w["l"][h] * sc_mine[h] + l_o * sc_theirs[h]
                    w["m"][h] = mx
                for d in range(kDvTiles):
                    for e in range(4):
                        w["acc"][d][:, e] = (w["acc"][d][:, e] * sc_mine[e >> 1]
                                             + smem.ld_f32(theirs + (d * 4 + e) * 32 + LANE, warp) * sc_theirs[e >> 1])

    # ---- epilogue: rows that saw no key get zeros and lse = -inf
    for w in W:
        if warps_n > 1 and w["wn"] != 0:
            continue  # returned after the merge
        for h in range(2):
            for l in range(32):
                r = w["wm"] * 16 + G[l] + h * 8
                if r >= rows_here:
                    continue
                row = row0 + r
                token = q_start + row // group
                if token < 0 or token >= p.num_tokens:
                    continue
                head = kv_head * group + row % group
                L = w["l"][h][l]
                seen = L != 0  # NaN (a NaN logit) counts as seen
                inv_l = np.float32(1) / L if seen else np.float32(0)
                lse2 = w["m"][h][l] + np.log2(L) if seen else -np.inf
                cols = (np.arange(kDvTiles)[:, None] * 8 + T4[l] * 2 + np.arange(2)[None, :]).reshape(-1)
                vals = (w["acc"][:, l, 2 * h:2 * h + 2] * inv_l).reshape(-1) if seen else np.zeros(kDvTiles * 2, np.float32)
                if p.num_splits > 1:
                    o_part.store((split, token, head, cols), vals)
                    if T4[l] == 0:
                        lse_part.store((split, token, head), lse2)
                else:
                    out.store((token, head, cols), to_dtype(vals, p.dtype))
                    if T4[l] == 0:
                        lse.store((token, head), np.float32(lse2) * np.float32(LN2))


def emulate(q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, num_splits, min_chunk,
            max_rows):
    """launch_tree_verify_attention on CPU tensors (q/k/v fp16 or bf16; indices as the op takes
    them). Returns (out, lse) as float32 tensors; NaN where the kernels wrote nothing. Raises
    ptx.HazardError on a shared-memory race, an out-of-bounds access or a double write."""
    p = Params()
    p.dtype = q.dtype
    p.num_tokens, p.num_q_heads, p.head_dim = q.shape
    p.num_kv_heads = k_cache.shape[1]
    p.q, p.k, p.v = (t.float().numpy() for t in (q, k_cache, v_cache))
    p.num_slots = k_cache.shape[0]
    p.kv_indptr = [int(x) for x in kv_indptr.tolist()]
    p.kv_indices = kv_indices.numpy()
    p.num_indices = kv_indices.numel()
    p.qo_indptr = None if qo_indptr is None else [int(x) for x in qo_indptr.tolist()]
    p.tree_mask = None if tree_mask is None else tree_mask.numpy()
    p.sm_scale_log2 = np.float32(sm_scale * 1.4426950408889634)
    p.num_splits, p.min_chunk, p.max_rows = num_splits, min_chunk, max_rows
    p.num_requests = len(p.kv_indptr) - 1
    T, Hq, D = q.shape
    assert D in (64, 128, 256), "launch_for_head_dim: cudaErrorInvalidValue"
    out, lse = GlobalOut((T, Hq, D), "out"), GlobalOut((T, Hq), "lse")
    o_part = GlobalOut((num_splits, T, Hq, D), "o_partial")
    lse_part = GlobalOut((num_splits, T, Hq), "lse_partial")
    if p.num_requests == 0 or p.num_tokens == 0:
        return torch.from_numpy(out.a), torch.from_numpy(lse.a)
    m_blocks = ceil_div(max_rows, kBlockM)
    for split in range(num_splits):  # grid (num_requests * num_kv_heads * m_blocks, num_splits)
        for bx in range(p.num_requests * p.num_kv_heads * m_blocks):
            _run_cta(p, bx, split, out, lse, o_part, lse_part)
    if num_splits > 1:
        merge_splits(out, lse, o_part, lse_part, p.dtype)
    return torch.from_numpy(out.a), torch.from_numpy(lse.a)


# ================================================================================ checks
def make_case(seed, D, Hq, Hkv, drafts, prefixes, dtype, decode=False):
    """Random K/V pool of 2000 slots (a request's slots are a random subset), random trees of
    drafts[b] tokens after prefixes[b] prefix slots; decode: one query per request."""
    g = torch.Generator().manual_seed(seed)
    S = 2000
    k = torch.randn(S, Hkv, D, generator=g).to(dtype)
    v = torch.randn(S, Hkv, D, generator=g).to(dtype)
    n = [1] * len(prefixes) if decode else drafts
    T = sum(n)
    q = (torch.randn(T, Hq, D, generator=g) * 2).to(dtype)
    kv_len = [pr + x for pr, x in zip(prefixes, n)]
    kv_indptr = torch.tensor([0] + list(itertools.accumulate(kv_len)), dtype=torch.int32)
    kv_indices = torch.randperm(S, generator=g)[: int(kv_indptr[-1])].to(torch.int32)
    if decode:
        return q, k, v, kv_indptr, kv_indices, None, None
    from spec_kernels.tree_verify import reference
    qo_indptr = torch.tensor([0] + list(itertools.accumulate(n)), dtype=torch.int32)
    rng = random.Random(seed)
    parents = []
    for x in n:
        parents += [-1] + [rng.randrange(-1, i) for i in range(1, x)] if x else []
    mask = torch.empty(T, dtype=torch.int64)
    reference.tree_mask_from_parents(torch.tensor(parents, dtype=torch.int64), qo_indptr, mask)
    return q, k, v, kv_indptr, kv_indices, qo_indptr, mask


TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3}  # max |out - reference| (P and out round to T)
LSE_TOL = 1e-3


def compare(case, splits, min_chunk, max_draft=0, invalid=False):
    """Emulate with the launch's max_rows (launch_plan.max_rows) and compare with the fp32
    reference: max |out err| within TOL, |lse err| within LSE_TOL, the same -inf rows and the
    same NaN elements. Valid input (invalid=False) must give no NaN at all; NaN inputs and
    invalid index values (invalid=True) must give NaN exactly where the reference does (for
    unwritten rows too: both start from NaN)."""
    from spec_kernels.tree_verify import reference
    from spec_kernels.tree_verify.launch_plan import max_rows
    q, k, v, kvp, kvi, qo, mask = case
    T, Hq, D = q.shape
    scale = 1 / math.sqrt(D)
    ref_o, ref_l = torch.full((T, Hq, D), math.nan), torch.full((T, Hq), math.nan)
    reference.tree_verify_attention(q.float(), k.float(), v.float(), kvp, kvi, qo, mask, scale, ref_o, ref_l,
                                    max_draft)
    rows = max_rows(T, Hq // k.shape[1], qo is None, max_draft)
    o, l = emulate(q, k, v, kvp, kvi, qo, mask, scale, splits, min_chunk, rows)
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


def malformed(which, splits=2):
    """Invalid index values (unchecked on the GPU): the kernel must stay in bounds (the emulator
    raises otherwise) and agree with the reference, which cuts indptr ranges to the tensors,
    reads a bad slot id as a zero row and ignores mask bits of later drafts."""
    if which == "bad_slots":
        q, k, v, kvp, kvi, qo, mask = make_case(13, 128, 4, 2, [4, 3], [20, 6], torch.bfloat16)
        kvi, kvp = kvi.clone(), kvp.clone()
        kvi[3], kvi[30] = 10**6, -5  # slot ids out of range
        kvp[-1] += 50  # indptr past the end of kv_indices
        return compare((q, k, v, kvp, kvi, qo, mask), splits, 0, invalid=True)
    if which == "negative_indptr":
        q, k, v, kvp, kvi, qo, mask = make_case(14, 64, 4, 2, [4, 3], [20, 6], torch.bfloat16)
        qo, kvp = qo.clone(), kvp.clone()
        qo[1], kvp[1] = -2, -10  # request 1 starts at token -2, at index -10
        return compare((q, k, v, kvp, kvi, qo, mask), splits, 0, invalid=True)
    if which == "decreasing_indptr":  # request 1's ranges run backwards: it attends to nothing
        q, k, v, kvp, kvi, qo, mask = make_case(16, 64, 4, 2, [4, 3, 2], [20, 6, 9], torch.bfloat16)
        qo, kvp = qo.clone(), kvp.clone()
        kvp[2] = 3  # request 1: [24, 3) -> empty; request 2: [3, 44)
        return compare((q, k, v, kvp, kvi, qo, mask), splits, 0, invalid=True)
    if which == "n_b_70":  # more than 64 drafts: drafts past 64 unwritten, the mask shift stays < 64
        q, k, v, kvp, kvi, qo, mask = make_case(15, 64, 1, 1, [70], [5], torch.bfloat16)
        return compare((q, k, v, kvp, kvi, qo, mask), 1, 0, invalid=True)
    if which == "later_draft_bits":  # random words: bits of later drafts and past n_b are ignored
        q, k, v, kvp, kvi, qo, _ = make_case(17, 64, 4, 2, [5, 20], [0, 3], torch.bfloat16)
        g = torch.Generator().manual_seed(17)
        mask = torch.randint(-2**62, 2**62, (q.shape[0],), dtype=torch.int64, generator=g)
        mask[0] = -2**63 | 2  # draft 0 of an empty prefix: sees nothing
        return compare((q, k, v, kvp, kvi, qo, mask), splits, 0)
    raise ValueError(which)


def nonfinite(D, splits):
    """NaN / inf inputs: a row with a NaN or inf logit (q, or the K row of a slot it sees) is NaN
    in output and lse; NaN in a prefix V row makes that column NaN for every row of the request;
    rows that see nothing stay zeros with lse -inf even with a NaN query."""
    q, k, v, kvp, kvi, qo, mask = make_case(18, D, 4, 2, [5, 3, 2], [40, 6, 0], torch.bfloat16)
    q, k, v, mask = q.clone(), k.clone(), v.clone(), mask.clone()
    nan, inf = float("nan"), float("inf")
    q[1, 2, 5] = nan  # request 0, draft 1, head 2
    k[int(kvi[10]), 0, 3] = inf  # request 0's prefix, KV head 0: heads 0-1 of every draft
    k[int(kvi[45 + 6 + 1]), 1, 0] = -inf  # request 1's draft 1, KV head 1: heads 2-3 of the drafts that see it
    v[int(kvi[45 + 2]), 0, 7] = nan  # request 1's prefix, KV head 0: column 7 of heads 0-1
    mask[8] = 0  # request 2 (empty prefix), draft 0: sees nothing ...
    q[8] = nan  # ... so its NaN query does not matter
    with nan_data():  # NaN in mma operands is data here, not unwritten memory
        return compare((q, k, v, kvp, kvi, qo, mask), splits, 0, invalid=True)


def _unseen_rows(seed, D):
    """Empty prefixes and two mask words zeroed: those rows see nothing (zeros, lse -inf)."""
    q, k, v, kvp, kvi, qo, mask = make_case(seed, D, 4, 4, [5, 3], [0, 0], torch.bfloat16)
    mask = mask.clone()
    mask[1] = mask[6] = 0
    return q, k, v, kvp, kvi, qo, mask


def _empty_decode(seed, D):
    """Decode where request 0 has no KV slots at all (kv_len 0: no tile, output zeros)."""
    q, k, v, _, kvi, qo, mask = make_case(seed, D, 8, 2, None, [0, 100], torch.bfloat16, decode=True)
    return q, k, v, torch.tensor([0, 0, 101], dtype=torch.int32), kvi[:101], qo, mask


def cases(quick):
    """(name, thunk) pairs; the thunk returns a result dict. The reviewers' configurations:
    head dims 64/128/256, fp16 and bf16, GQA groups 1/2/3/4/16, tree and decode, warps_m 1/2/4,
    several m-blocks, n_b 0 and 64, 1-5 splits, min_chunk 256, unseen rows, empty requests."""
    out = []
    Q = {  # the --quick subset: every code path at least once
        ("tree", 64, "bf16", 3), ("tree", 128, "fp16", 1), ("n40", 128, "fp16", 2), ("n40", 256, "bf16", 1),
        ("decode", 256, "bf16", 4), ("decode_g1", 64, "fp16", 2),
        ("n0_n64", 64, 3), ("unseen", 256, 2), ("empty_decode", 64, 5), ("bad_slots",), ("negative_indptr",),
        ("decreasing_indptr",), ("later_draft_bits",), ("nonfinite", 64, 2)}
    for dt, dname in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        for D in (64, 128, 256):
            def add(tag, make, splits_list):
                for splits in splits_list:
                    if quick and (tag, D, dname, splits) not in Q:
                        continue
                    out.append((f"{tag} D={D} {dname} splits={splits}",
                                lambda make=make, splits=splits: compare(make(), splits, 0)))
            # tree, GQA group 4: rows 4..36 (warps_m 1/2/4 across the requests)
            add("tree", lambda D=D, dt=dt: make_case(1, D, 8, 2, [3, 9, 1], [70, 5, 130], dt), (1, 3))
            # 40 drafts x group 2 = 80 rows: two m-blocks, one of them ragged
            add("n40", lambda D=D, dt=dt: make_case(2, D, 4, 2, [40, 17], [0, 200], dt), (1, 2))
            # decode, group 16: rows = group
            add("decode", lambda D=D, dt=dt: make_case(3, D, 16, 1, None, [0, 65, 300], dt, decode=True), (1, 4))
            if D != 256:  # decode, group 1 (one row per CTA; warps_n 4)
                add("decode_g1", lambda D=D, dt=dt: make_case(4, D, 2, 2, None, [33, 0, 1], dt, decode=True), (2,))
    for D in (64, 256):
        edge = [  # (tag, case, splits, min_chunk)
            ("n0_n64", lambda D=D: make_case(5, D, 3, 1, [0, 64, 2], [10, 40, 0], torch.bfloat16), 1, 0),
            ("n0_n64", lambda D=D: make_case(5, D, 3, 1, [0, 64, 2], [10, 40, 0], torch.bfloat16), 3, 256),
            ("unseen", lambda D=D: _unseen_rows(6, D), 1, 0),
            ("unseen", lambda D=D: _unseen_rows(6, D), 2, 0),
            ("empty_decode", lambda D=D: _empty_decode(7, D), 1, 0),
            ("empty_decode", lambda D=D: _empty_decode(7, D), 5, 0),
        ]
        for tag, make, splits, min_chunk in edge:
            if quick and (tag, D, splits) not in Q:
                continue
            name = f"{tag} D={D} bf16 splits={splits}" + (f" min_chunk={min_chunk}" if min_chunk else "")
            out.append((name, lambda make=make, s=splits, mc=min_chunk: compare(make(), s, mc)))
    for which in ("bad_slots", "negative_indptr", "decreasing_indptr", "n_b_70", "later_draft_bits"):
        if not quick or (which,) in Q:
            out.append((f"malformed {which}", lambda which=which: malformed(which)))
    for D in (64, 128):
        for splits in (1, 2):
            if not quick or ("nonfinite", D, splits) in Q:
                out.append((f"nonfinite D={D} bf16 splits={splits}", lambda D=D, s=splits: nonfinite(D, s)))
    return out
