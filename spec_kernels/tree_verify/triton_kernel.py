"""Triton tree-verify attention (and plain decode, n_b = 1).

One program handles one (request, KV head, row block, KV split):

* rows = the request's n_b draft queries x the GQA group of the KV head, packed row-major
  (row = draft * group + head_in_group), so every KV tile is read once for all of them;
* the prefix part of the KV split is streamed with no mask work beyond the tile's bounds;
* only the tail (the n_b draft slots, handled by the last split) applies the per-row 64-bit
  ancestor mask;
* with more than one split, every split writes a normalised partial output and its log-sum-exp,
  and a second small kernel merges them (a deterministic fixed-order reduction).

The split count depends only on shapes and the SM count (never on kv_indptr values), so a call
never syncs with the host and is CUDA-graph capturable. Under TRITON_INTERPRET=1 (CPU tensors)
all arithmetic is done in fp32: the interpreter's bf16 arithmetic is wrong.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .._ops import triton_interpreting
from .._autotune import LazyAutotune
from ..attention.plan import KernelResources, SplitTraffic, SplitWorkspace, expected_rows, mean_prefix, triton_resources
from ..attention.plan import max_rows as plan_max_rows
from ..attention.plan import num_kv_splits as plan_splits
from ..attention.checks import KV_FP8_DTYPES, NO_SCALES, KvScales
from ..attention.triton_common import (LOG2E, draft_bits, finite_or_nan, fp8_bits_to_float, fp8_cache_view,
                                       indptr_range, merge_splits, split_destinations)

@triton.jit
def _tree_verify_fwd_kernel(
    Q, K, V, KV_INDPTR, KV_INDICES, QO_INDPTR, TREE_MASK,
    O, LSE,  # final outputs (one split) or partial outputs [splits, T, Hq, DV] / [splits, T, Hq]
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    k_scale, v_scale, K_SCALE, V_SCALE,  # fp8 caches: host scales, or 1-element fp32 tensors (*_SCALE_TENSOR)
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_os, stride_lt, stride_ls,
    num_kv_heads, max_rows, num_splits,
    num_tokens, num_slots, num_indices,  # bounds: malformed indices never read or write outside
    GROUP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    IS_DECODE: tl.constexpr,  # no qo_indptr / tree_mask: one query per request sees every slot
    WRITE_LSE: tl.constexpr,
    PARTIAL: tl.constexpr,  # write normalised partials + base-2 lse for the combine kernel
    COMPUTE_F32: tl.constexpr,  # upcast loads (interpreter, fp32 inputs)
    IEEE_DOT: tl.constexpr,  # fp32 inputs: exact fp32 dot instead of tf32
    FP8_KV: tl.constexpr,  # K / V hold fp8 values (value * scale); converted exactly to q's type
    FP8_BITS: tl.constexpr,  # ... passed as their bytes (interpreter: fp8_bits_to_float)
    E5M2: tl.constexpr,  # ... e5m2 rather than e4m3fn
    K_SCALE_TENSOR: tl.constexpr,  # k_scale is read from K_SCALE
    V_SCALE_TENSOR: tl.constexpr,  # v_scale is read from V_SCALE
    MIN_CHUNK: tl.constexpr,  # smallest prefix share of a split (0: none); the chunk stays whole BLOCK_N tiles
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    # fp8: K's scale folds into the logits' scale, V's into the output (both exact in fp32 apart
    # from that one product), so the converted fp8 values feed the dots unchanged.
    if K_SCALE_TENSOR:
        qk_scale = qk_scale * tl.load(K_SCALE)
    else:
        qk_scale = qk_scale * k_scale
    if V_SCALE_TENSOR:
        v_scale = tl.load(V_SCALE)
    num_m_blocks = tl.cdiv(max_rows, BLOCK_M)
    m_block = pid % num_m_blocks
    kv_head = (pid // num_m_blocks) % num_kv_heads
    req = pid // (num_m_blocks * num_kv_heads)

    # Ranges cut to the tensors (no-ops for valid input): invalid values stay in bounds.
    if IS_DECODE:
        q_start = req
        n_draft = 1
    else:
        q_start, q_end = indptr_range(QO_INDPTR, req, num_tokens)
        n_draft = (q_end - q_start).to(tl.int32)
    kv_start, kv_end = indptr_range(KV_INDPTR, req, num_indices)
    kv_len = (kv_end - kv_start).to(tl.int32)
    prefix_len = tl.maximum(kv_len - n_draft, 0)
    num_tail = tl.minimum(kv_len - prefix_len, 64)  # draft slots; a mask word covers 64 drafts

    rows = tl.minimum(n_draft * GROUP, max_rows)  # drafts past the launch's bound (invalid input): not computed
    if m_block * BLOCK_M < rows:
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        token = (q_start + offs_m // GROUP).to(tl.int64)  # query token of each row
        row_ok = (offs_m < rows) & (token >= 0) & (token < num_tokens)
        head = kv_head * GROUP + offs_m % GROUP  # query head of each row
        offs_d = tl.arange(0, D)
        offs_dv = tl.arange(0, DV)

        q = tl.load(Q + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        if COMPUTE_F32:
            q = q.to(tl.float32)
        k_base = K + kv_head * stride_kh
        v_base = V + kv_head * stride_vh

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)

        # ---- prefix: every row sees every key; this split's contiguous share of it
        chunk = tl.cdiv(tl.cdiv(prefix_len, num_splits), BLOCK_N) * BLOCK_N
        chunk = tl.maximum(chunk, MIN_CHUNK)
        lo = split * chunk
        hi = tl.minimum(prefix_len, lo + chunk)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            key_ok = (offs_n < hi) & (kv_start + offs_n < num_indices)
            slot = tl.load(KV_INDICES + kv_start + offs_n, mask=key_ok, other=0).to(tl.int64)
            slot_ok = key_ok & (slot >= 0) & (slot < num_slots)  # a bad slot id reads as a zero row
            k = tl.load(k_base + slot[None, :] * stride_ks + offs_d[:, None], mask=slot_ok[None, :], other=0.0)
            v = tl.load(v_base + slot[:, None] * stride_vs + offs_dv[None, :], mask=slot_ok[:, None], other=0.0)
            if FP8_BITS:
                k = fp8_bits_to_float(k, E5M2)
                v = fp8_bits_to_float(v, E5M2)
            elif COMPUTE_F32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            elif FP8_KV:
                k = k.to(Q.dtype.element_ty)
                v = v.to(Q.dtype.element_ty)
            if IEEE_DOT:
                s = tl.dot(q, k, input_precision="ieee")
            else:
                s = tl.dot(q, k)
            s = tl.where(key_ok[None, :], finite_or_nan(s * qk_scale), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_safe)
            p = tl.math.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE_DOT:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        # ---- tail: the n_draft draft slots under the ancestor bitmask (last split only)
        if split == num_splits - 1:
            if IS_DECODE:
                row_bits = tl.full([BLOCK_M], 1, dtype=tl.int64)
            else:
                row_bits = tl.load(TREE_MASK + token, mask=row_ok, other=0) & draft_bits(offs_m // GROUP)
            for t0 in range(0, num_tail, BLOCK_N):
                offs_j = t0 + tl.arange(0, BLOCK_N)
                at = kv_start + prefix_len + offs_j
                key_ok = (offs_j < num_tail) & (at < num_indices)
                slot = tl.load(KV_INDICES + at, mask=key_ok, other=0).to(tl.int64)
                slot_ok = key_ok & (slot >= 0) & (slot < num_slots)  # a bad slot id reads as a zero row
                k = tl.load(k_base + slot[None, :] * stride_ks + offs_d[:, None], mask=slot_ok[None, :], other=0.0)
                v = tl.load(v_base + slot[:, None] * stride_vs + offs_dv[None, :], mask=slot_ok[:, None], other=0.0)
                if FP8_BITS:
                    k = fp8_bits_to_float(k, E5M2)
                    v = fp8_bits_to_float(v, E5M2)
                elif COMPUTE_F32:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                elif FP8_KV:
                    k = k.to(Q.dtype.element_ty)
                    v = v.to(Q.dtype.element_ty)
                if IEEE_DOT:
                    s = tl.dot(q, k, input_precision="ieee")
                else:
                    s = tl.dot(q, k)
                bit = (row_bits[:, None] >> tl.minimum(offs_j, 63).to(tl.int64)[None, :]) & 1
                visible = (bit != 0) & key_ok[None, :]
                s = tl.where(visible, finite_or_nan(s * qk_scale), float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.math.exp2(m_i - m_safe)
                p = tl.math.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                if IEEE_DOT:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new

        # ---- epilogue: rows that saw no key get zeros and lse = -inf; a NaN l (a NaN logit) is seen
        seen = l_i != 0.0
        if FP8_KV:
            acc = acc * v_scale
        o = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
        lse2 = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        o_ptrs = O + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
        if PARTIAL:
            tl.store(o_ptrs + split * stride_os, o, mask=row_ok[:, None])
            tl.store(LSE + split * stride_ls + token * stride_lt + head, lse2, mask=row_ok)
        else:
            tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None])
            if WRITE_LSE:
                tl.store(LSE + token * stride_lt + head, lse2 * 0.6931471805599453, mask=row_ok)


# --------------------------------------------------------------------------- launch configuration
# The resources the split planner assumes (spec_kernels.attention.plan), from `python tools/triton_compile_report.py --ci --kernels tree_verify,mla`
# (its "smem" and "regs" columns; the larger of sm_90 and sm_120). Tree verify, bf16, D = 128,
# BLOCK_M 32, 4 warps: 188 registers, 44.5 KB; MLA, BLOCK_M 32, 8 warps: 177 registers, 55.1 KB.
# Both shared memory figures are the Q tile plus ONE K and V tile plus a few KB of scratch (the
# compiler keeps the other pipeline stage in registers), which triton_tree_verify_smem models.
# 8-warp tree-verify tiles (BLOCK_M >= 64, head dim 256) are taken at the 255-register ceiling.
# The autotuner may pick another tile than the one planned for; this sizes the common case.
TRITON_TREE_VERIFY_REGS = {4: 188, 8: 255}  # num_warps -> registers
TRITON_SCRATCH_SMEM = 4608  # bytes beyond the tiles (44.5 KB - 8 KB Q - 32 KB K and V)


def triton_tree_verify_resources(block_m: int, block_n: int, num_warps: int, head_dim: int, v_head_dim: int,
                                 elt: int) -> KernelResources:
    smem = (block_m * head_dim + block_n * (head_dim + v_head_dim)) * elt + TRITON_SCRATCH_SMEM
    return triton_resources(num_warps, smem, TRITON_TREE_VERIFY_REGS.get(num_warps, 255))


def default_block_m(max_rows: int, head_dim: int) -> int:
    cap = 64 if head_dim >= 256 else 128
    return max(16, min(cap, triton.next_power_of_2(max_rows)))


def _autotune_configs():
    # BLOCK_M is chosen from the rows per request (below); the search is over the KV tile and
    # the pipeline. Few configs: each is a compile on first use of a shape bucket.
    return [
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bn, w, st in [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 2), (128, 4, 2)]
    ]


def _prune_configs(configs, named_args, **kwargs):
    # Keep the K and V tiles of all pipeline stages within 96 KB of shared memory (sm_120: 99 KB).
    # The estimate leaves out Q and the compiler's scratch: a config that still does not fit fails
    # its launch with OutOfResources, which the autotuner skips. When none is kept (fp32 at head
    # dim 256), the smallest tile (tools/triton_compile_report.py: fits sm_120).
    args = {**named_args, **kwargs}
    elt = args["K"].element_size()
    budget = 96 * 1024
    kept = [c for c in configs if c.kwargs["BLOCK_N"] * (args["D"] + args["DV"]) * elt * c.num_stages <= budget]
    return kept or [triton.Config({"BLOCK_N": 16}, num_warps=8, num_stages=2)]


# The fixed tile (autotune off): (BLOCK_N, num_stages) candidates, tried in this order; the first
# whose shared memory fits the device is kept per shape (a launch that needs more than the device
# has, e.g. sm_120's 99 KB per block, raises OutOfResources before anything is queued). Chosen
# from tools/triton_compile_report.py's sm_90 / sm_120 compiles: head dim 256 and fp32 (exact fp32
# dot) need narrower KV tiles, and 8 warps avoid register spills there and at BLOCK_M >= 64.
_FIXED_TILES = ((64, 3), (64, 2), (32, 2), (16, 2), (16, 1))
_fixed_tile_for: dict = {}


def _fixed_tiles(head_dim: int, ieee_dot: bool) -> tuple:
    first = (16, 2) if ieee_dot else (32, 2) if head_dim >= 256 else (64, 3)
    return _FIXED_TILES[_FIXED_TILES.index(first):]


def _fixed_warps(block_m: int, head_dim: int, ieee_dot: bool) -> int:
    return 8 if block_m >= 64 or head_dim >= 256 or ieee_dot else 4


def planned_resources(block_m: int, D: int, Dv: int, elt: int, ieee_dot: bool):
    """The split planner's picture of one program (attention.plan.resident_ctas_per_sm): the fixed
    tile's warps, registers and shared memory (triton_tree_verify_resources)."""
    bn = _fixed_tiles(max(D, Dv), ieee_dot)[0][0]
    return triton_tree_verify_resources(block_m, bn, _fixed_warps(block_m, max(D, Dv), ieee_dot), D, Dv, elt)


# The tiles searched per shape bucket (BLOCK_M comes from the rows per request).
_kernel_for_launch = LazyAutotune(
    _tree_verify_fwd_kernel, _autotune_configs,
    key=["max_rows", "GROUP", "D", "DV", "IS_DECODE", "PARTIAL", "BLOCK_M"],
    prune=_prune_configs,
)


def auto_splits(device: torch.device, num_tokens: int, num_requests: int, num_q_heads: int, num_kv_heads: int,
                head_dim: int, v_head_dim: int, kv_dtype: torch.dtype, num_indices: int, decode: bool,
                max_draft_tokens: int = 0, block_m: Optional[int] = None) -> int:
    """KV splits the Triton launch plans for this batch layout (never from tensor values):
    planned for the rows that hold work in an even batch (the grid keeps the max_rows bound)."""
    group = num_q_heads // num_kv_heads
    block_m = block_m or default_block_m(plan_max_rows(num_tokens, group, decode, max_draft_tokens), max(head_dim, v_head_dim))
    rows = expected_rows(num_tokens, num_requests, group, decode, max_draft_tokens)
    ieee = kv_dtype == torch.float32
    elt = torch.empty((), dtype=kv_dtype).element_size()
    return plan_splits(device, num_requests, num_kv_heads, rows, block_m,
                       planned_resources(block_m, head_dim, v_head_dim, elt, ieee),
                       mean_prefix(num_indices, num_requests, rows, group),
                       traffic=split_traffic(head_dim, v_head_dim, elt))


def split_traffic(head_dim: int, v_head_dim: int, kv_elt: int) -> SplitTraffic:
    """The bytes a split moves: a K row of head_dim and a V row of v_head_dim per key, of the
    cache's element size; outputs as q (16-bit for an fp8 cache, else the cache's size)."""
    return SplitTraffic((head_dim + v_head_dim) * kv_elt, head_dim, v_head_dim, max(kv_elt, 2))


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
    num_kv_splits: int = 0,
    max_draft_tokens: int = 0,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    workspace=None,
    scales: KvScales = NO_SCALES,
) -> None:
    """Launch the Triton kernel(s). Arguments as in spec_kernels.tree_verify_attention (already
    checked); num_kv_splits=0 picks from the device, max_draft_tokens=0 assumes up to 64 drafts;
    block_m/block_n override the tile (tests); a planned SplitWorkspace gives the splits, their
    minimum share and the partial buffers (without one it is planned here, as a plan would);
    scales: an fp8 cache's (attention.checks.KvScales)."""
    T, Hq, D = q.shape
    Hkv, Dv = k_cache.shape[1], v_cache.shape[2]
    B = kv_indptr.numel() - 1
    if T == 0 or B == 0:
        return
    group = Hq // Hkv
    is_decode = qo_indptr is None
    max_rows = plan_max_rows(T, group, is_decode, max_draft_tokens)
    block_m = block_m or default_block_m(max_rows, max(D, Dv))
    ieee = q.dtype == torch.float32
    if workspace is None:
        workspace = SplitWorkspace.plan(
            num_kv_splits, lambda: auto_splits(q.device, T, B, Hq, Hkv, D, Dv, k_cache.dtype, kv_indices.numel(),
                                               is_decode, max_draft_tokens, block_m), T, Hq, Dv, q.device)
    splits, min_chunk = workspace.splits, workspace.min_chunk
    kernel, fixed = _kernel_for_launch()
    compute_f32 = triton_interpreting() or q.dtype == torch.float32
    fp8 = k_cache.dtype in KV_FP8_DTYPES
    k_arg, v_arg = fp8_cache_view(k_cache, triton_interpreting()), fp8_cache_view(v_cache, triton_interpreting())
    # A placeholder for absent optional pointers (never dereferenced: constexpr branches).
    qo_ptr = qo_indptr if qo_indptr is not None else kv_indptr
    mask_ptr = tree_mask if tree_mask is not None else kv_indptr

    partial = splits > 1
    o_dst, lse_dst, strides_o, strides_l = split_destinations(out, lse, workspace)

    args = (
        q, k_arg, v_arg, kv_indptr, kv_indices, qo_ptr, mask_ptr, o_dst, lse_dst,
        sm_scale * LOG2E,
        scales.k, scales.v, scales.k_tensor if scales.k_tensor is not None else kv_indptr,
        scales.v_tensor if scales.v_tensor is not None else kv_indptr,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        *strides_o, *strides_l,
        Hkv, max_rows, splits,
        T, k_cache.shape[0], kv_indices.numel(),
    )
    meta = dict(
        GROUP=group, D=D, DV=Dv, IS_DECODE=is_decode, WRITE_LSE=lse is not None, PARTIAL=partial,
        COMPUTE_F32=compute_f32, IEEE_DOT=ieee,
        FP8_KV=fp8, FP8_BITS=fp8 and triton_interpreting(), E5M2=k_cache.dtype == torch.float8_e5m2,
        K_SCALE_TENSOR=scales.k_tensor is not None, V_SCALE_TENSOR=scales.v_tensor is not None,
        MIN_CHUNK=min_chunk,
        BLOCK_M=block_m,
    )

    def grid(META):
        return (B * Hkv * triton.cdiv(max_rows, META["BLOCK_M"]), splits)

    if block_n is not None or triton_interpreting():
        _tree_verify_fwd_kernel[grid](*args, **meta, BLOCK_N=block_n or 32, num_warps=4)
    elif fixed:
        key = (q.device, q.dtype, k_cache.dtype, D, Dv, group, is_decode, partial, block_m)
        tiles = _fixed_tiles(max(D, Dv), ieee)
        if key in _fixed_tile_for:
            tiles = tiles[tiles.index(_fixed_tile_for[key]):]
        warps = _fixed_warps(block_m, max(D, Dv), ieee)
        for i, (bn, stages) in enumerate(tiles):
            try:
                _tree_verify_fwd_kernel[grid](*args, **meta, BLOCK_N=bn, num_warps=warps, num_stages=stages)
            except OutOfResources:
                if i == len(tiles) - 1:
                    raise
                continue
            _fixed_tile_for[key] = (bn, stages)
            break
    else:
        kernel[grid](*args, **meta)

    if partial:
        merge_splits(o_dst, lse_dst, out, lse)
