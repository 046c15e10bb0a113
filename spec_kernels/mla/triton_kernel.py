"""Triton MLA tree-verify attention (and MLA decode, n_b = 1).

One program handles one (request, row block, KV split). The request has ONE latent KV head
shared by all query heads, so its rows are n_b draft tokens x H query heads, packed
(row = draft * H + head), and every KV tile is read once for all of them.

Each cached row (576 = DV latent + DR rope values; 512 + 64 for DeepSeek-V3 / Kimi K2.5) is
loaded once per tile as two blocks, the latent [BLOCK_N, DV] and the rope [BLOCK_N, DR]:
the latent block is both the key (with the rope block) and the value, so V costs no extra read.

  s   = q_latent . latent^T + q_rope . rope^T        (two dots: 576 is not a power of two)
  acc = acc * alpha + p . latent

As in spec_kernels.tree_verify: prefix tiles have no mask work beyond the tile bounds, only
the tail (the n_b draft slots, last split) applies the per-row 64-bit ancestor word, and with
several splits every split writes a normalised partial and its log-sum-exp, merged by the same
fixed-order merge kernel as tree_verify (deterministic). The split count depends on shapes and
the SM count only: no host sync, CUDA-graph capturable. Under TRITON_INTERPRET=1 everything is
computed in fp32 after exact loads (the interpreter's bf16 arithmetic is wrong).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._ops import triton_interpreting
from .._autotune import LazyAutotune
from ..attention.plan import KernelResources, SplitTraffic, SplitWorkspace, expected_rows, mean_prefix, triton_resources
from ..attention.plan import max_rows as plan_max_rows
from ..attention.plan import num_kv_splits as plan_splits
from ..attention.checks import KV_FP8_DTYPES, NO_SCALES, KvScales
from ..attention.triton_common import (LOG2E, draft_bits, finite_or_nan, fp8_bits_to_float, fp8_cache_view,
                                       indptr_range, merge_splits, split_destinations)


@triton.jit
def _dot(a, b, acc, IEEE_DOT: tl.constexpr):
    if IEEE_DOT:  # fp32 inputs: exact fp32 products instead of tf32
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _attend_tile(q_lat, q_rope, m_i, l_i, acc, KV, KV_INDICES, first, offs_n, key_ok, row_bits, qk_scale,
                 stride_kv, num_indices, num_slots, DV: tl.constexpr, DR: tl.constexpr, MASKED: tl.constexpr,
                 COMPUTE_F32: tl.constexpr, IEEE_DOT: tl.constexpr, FP8_KV: tl.constexpr, FP8_BITS: tl.constexpr,
                 E5M2: tl.constexpr):
    """One KV tile (slots kv_indices[first + offs_n]) folded into the online softmax of every row.
    MASKED (tail tiles): key j of the tile is visible to a row iff bit j of its row_bits is set.
    Positions outside kv_indices are skipped; a slot id outside [0, S) (invalid input) reads as
    a zero row, never dereferenced."""
    at = first + offs_n
    key_ok = key_ok & (at >= 0) & (at < num_indices)
    slot = tl.load(KV_INDICES + at, mask=key_ok, other=-1).to(tl.int64)
    slot_ok = key_ok & (slot >= 0) & (slot < num_slots)
    row = KV + slot[:, None] * stride_kv
    lat = tl.load(row + tl.arange(0, DV)[None, :], mask=slot_ok[:, None], other=0.0)  # [BLOCK_N, DV]
    rope = tl.load(row + DV + tl.arange(0, DR)[None, :], mask=slot_ok[:, None], other=0.0)  # [BLOCK_N, DR]
    if FP8_BITS:  # fp8 cache under the interpreter: its bytes
        lat = fp8_bits_to_float(lat, E5M2)
        rope = fp8_bits_to_float(rope, E5M2)
    elif COMPUTE_F32:
        lat = lat.to(tl.float32)
        rope = rope.to(tl.float32)
    elif FP8_KV:  # exact: every fp8 value is a value of q's type
        lat = lat.to(q_lat.dtype)
        rope = rope.to(q_lat.dtype)
    s = _dot(q_rope, tl.trans(rope), None, IEEE_DOT)
    s = _dot(q_lat, tl.trans(lat), s, IEEE_DOT)
    visible = key_ok[None, :]
    if MASKED:
        bit = (row_bits[:, None] >> offs_n.to(tl.int64)[None, :]) & 1
        visible = visible & (bit != 0)
    s = tl.where(visible, finite_or_nan(s * qk_scale), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot(p.to(lat.dtype), lat, acc * alpha[:, None], IEEE_DOT)
    return m_new, l_i, acc


@triton.jit
def _mla_fwd_kernel(
    Q, KV, KV_INDPTR, KV_INDICES, QO_INDPTR, TREE_MASK,
    O, LSE,  # final outputs (one split) or partials [splits, T, H, DV] / [splits, T, H]
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    k_scale, v_scale, K_SCALE, V_SCALE,  # fp8 caches: host scales, or 1-element fp32 tensors (*_SCALE_TENSOR)
    stride_qt, stride_qh, stride_kv,
    stride_ot, stride_oh, stride_os, stride_lt, stride_ls,
    max_rows, num_splits,
    num_tokens, num_indices, num_slots,  # bounds of the index values (invalid input stays in bounds)
    HEADS: tl.constexpr,
    DV: tl.constexpr,
    DR: tl.constexpr,
    IS_DECODE: tl.constexpr,  # no qo_indptr / tree_mask: one query per request sees every slot
    WRITE_LSE: tl.constexpr,
    PARTIAL: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    FP8_KV: tl.constexpr,  # the cache holds fp8 values (value * scale), converted exactly to q's type
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
    # fp8: K's scale folds into the logits' scale, V's into the output (as in tree_verify).
    if K_SCALE_TENSOR:
        qk_scale = qk_scale * tl.load(K_SCALE)
    else:
        qk_scale = qk_scale * k_scale
    if V_SCALE_TENSOR:
        v_scale = tl.load(V_SCALE)
    num_m_blocks = tl.cdiv(max_rows, BLOCK_M)
    m_block = pid % num_m_blocks
    req = pid // num_m_blocks

    # Ranges cut to the tensors (no-ops for valid input): invalid values stay in bounds.
    if IS_DECODE:
        q_start = req
        n_draft = 1
    else:
        q_start, q_end = indptr_range(QO_INDPTR, req, num_tokens)
        n_draft = (q_end - q_start).to(tl.int32)
    kv_start, kv_end = indptr_range(KV_INDPTR, req, num_indices)
    kv_len = (kv_end - kv_start).to(tl.int32)
    if IS_DECODE:
        # The query sees every slot: all of it is prefix, no masked tail. (A one-slot tail loop
        # is flattened and its loads hoisted across the prefix loop: registers spill.)
        prefix_len = kv_len
    else:
        prefix_len = tl.maximum(kv_len - n_draft, 0)
    num_tail = tl.minimum(kv_len - prefix_len, 64)  # draft slots; a mask word covers 64 drafts

    rows = tl.minimum(n_draft * HEADS, max_rows)  # drafts past the launch's bound (invalid input): not computed
    if m_block * BLOCK_M < rows:
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        token = (q_start + offs_m // HEADS).to(tl.int64)  # query token of each row
        row_ok = (offs_m < rows) & (token >= 0) & (token < num_tokens)
        head = offs_m % HEADS
        q_row = Q + token[:, None] * stride_qt + head[:, None] * stride_qh
        q_lat = tl.load(q_row + tl.arange(0, DV)[None, :], mask=row_ok[:, None], other=0.0)
        q_rope = tl.load(q_row + DV + tl.arange(0, DR)[None, :], mask=row_ok[:, None], other=0.0)
        if COMPUTE_F32:
            q_lat = q_lat.to(tl.float32)
            q_rope = q_rope.to(tl.float32)

        if IS_DECODE:
            row_bits = tl.full([BLOCK_M], 1, dtype=tl.int64)  # the query's own slot
        else:
            row_bits = tl.load(TREE_MASK + token, mask=row_ok, other=0) & draft_bits(offs_m // HEADS)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
        offs_n = tl.arange(0, BLOCK_N)

        # ---- prefix: every row sees every key; this split's contiguous share of it
        chunk = tl.cdiv(tl.cdiv(prefix_len, num_splits), BLOCK_N) * BLOCK_N
        chunk = tl.maximum(chunk, MIN_CHUNK)
        lo = split * chunk
        hi = tl.minimum(prefix_len, lo + chunk)
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q_lat, q_rope, m_i, l_i, acc, KV, KV_INDICES, kv_start + start, offs_n,
                                         start + offs_n < hi, row_bits, qk_scale, stride_kv, num_indices,
                                         num_slots, DV, DR, False, COMPUTE_F32, IEEE_DOT, FP8_KV, FP8_BITS, E5M2)

        # ---- tail: the n_draft draft slots under the ancestor bitmask (last split only)
        if not IS_DECODE:
            if split == num_splits - 1:
                for t0 in range(0, num_tail, BLOCK_N):
                    key_ok = t0 + offs_n < num_tail
                    m_i, l_i, acc = _attend_tile(q_lat, q_rope, m_i, l_i, acc, KV, KV_INDICES,
                                                 kv_start + prefix_len + t0, offs_n, key_ok, row_bits >> t0, qk_scale,
                                                 stride_kv, num_indices, num_slots, DV, DR, True, COMPUTE_F32,
                                                 IEEE_DOT, FP8_KV, FP8_BITS, E5M2)

        # ---- epilogue: rows that saw no key get zeros and lse = -inf; a NaN l (a NaN logit) is seen
        seen = l_i != 0.0
        if FP8_KV:
            acc = acc * v_scale
        o = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
        lse2 = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        o_ptrs = O + token[:, None] * stride_ot + head[:, None] * stride_oh + tl.arange(0, DV)[None, :]
        if PARTIAL:
            tl.store(o_ptrs + split * stride_os, o, mask=row_ok[:, None])
            tl.store(LSE + split * stride_ls + token * stride_lt + head, lse2, mask=row_ok)
        else:
            tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None])
            if WRITE_LSE:
                tl.store(LSE + token * stride_lt + head, lse2 * 0.6931471805599453, mask=row_ok)


# --------------------------------------------------------------------------- launch configuration
def default_block_m(max_rows: int) -> int:
    # A [BLOCK_M, 512] fp32 accumulator per program: 32 rows keep it in registers.
    return max(16, min(32, triton.next_power_of_2(max_rows)))


def _autotune_configs():
    return [
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
        # No 1-stage configs: with one stage Triton stages more, not less, shared memory (100-164
        # KB at BLOCK_N 32-64: over sm_120's 99 KB; tools/triton_compile_report.py).
        for bn, w, st in [(16, 4, 2), (32, 4, 2), (32, 8, 2), (16, 8, 3)]
    ]


def _prune_configs(configs, named_args, **kwargs):
    # The KV tiles of all pipeline stages within 96 KB of shared memory (sm_120 allows 99 KB).
    args = {**named_args, **kwargs}
    row_bytes = (args["DV"] + args["DR"]) * args["KV"].element_size()
    kept = [c for c in configs if c.kwargs["BLOCK_N"] * row_bytes * max(c.num_stages, 1) <= 96 * 1024]
    return kept or configs[:1]


# The tiles searched per shape bucket (BLOCK_M comes from the rows per request).
_kernel_for_launch = LazyAutotune(
    _mla_fwd_kernel, _autotune_configs,
    key=["max_rows", "HEADS", "DV", "DR", "IS_DECODE", "PARTIAL", "BLOCK_M"],
    prune=_prune_configs,
)


# The resources the split planner assumes (spec_kernels.attention.plan), from
# `python tools/triton_compile_report.py --ci --kernels mla` (BLOCK_M 32, 8 warps: 177 registers).
TRITON_MLA_REGS = 177


def triton_mla_resources(block_m: int, head_dim: int, elt: int) -> KernelResources:
    """spec_kernels/mla/triton_kernel.py on a GPU: 8 warps, Q tile + one 16-key latent tile."""
    return triton_resources(8, (block_m + 16) * head_dim * elt + 1024, TRITON_MLA_REGS)


def auto_splits(device: torch.device, num_tokens: int, num_requests: int, num_heads: int, head_dim: int,
                kv_dtype: torch.dtype, num_indices: int, decode: bool, max_draft_tokens: int = 0,
                block_m: Optional[int] = None, v_head_dim: Optional[int] = None) -> int:
    """KV splits the Triton launch plans for this batch layout (never from tensor values): for the
    rows that hold work in an even batch (the grid keeps max_rows); v_head_dim (default head_dim)
    sizes the partial outputs."""
    block_m = block_m or default_block_m(plan_max_rows(num_tokens, num_heads, decode, max_draft_tokens))
    rows = expected_rows(num_tokens, num_requests, num_heads, decode, max_draft_tokens)
    elem = torch.empty((), dtype=kv_dtype).element_size()
    return plan_splits(device, num_requests, 1, rows, block_m, triton_mla_resources(block_m, head_dim, elem),
                       mean_prefix(num_indices, num_requests, rows, num_heads),
                       traffic=split_traffic(head_dim, v_head_dim or head_dim, elem))


def split_traffic(head_dim: int, v_head_dim: int, kv_elt: int) -> SplitTraffic:
    """The bytes a split moves: one latent row of head_dim per key (K and V share it) of the
    cache's element size; outputs of v_head_dim as q (16-bit for an fp8 cache)."""
    return SplitTraffic(head_dim * kv_elt, head_dim, v_head_dim, max(kv_elt, 2))


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
    num_kv_splits: int = 0,
    max_draft_tokens: int = 0,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    workspace=None,
    scales: KvScales = NO_SCALES,
) -> None:
    """Launch the Triton kernel(s). Arguments as in spec_kernels.mla.mla_tree_verify_attention
    (already checked; kv_cache is [S, D]); block_m/block_n override the tile (tests); a planned
    SplitWorkspace gives the splits, their minimum share and the partial buffers (without one it
    is planned here, as a plan would); scales: an fp8 cache's (attention.checks.KvScales)."""
    T, H, D = q.shape
    B = kv_indptr.numel() - 1
    if T == 0 or B == 0:
        return
    is_decode = qo_indptr is None
    max_rows = plan_max_rows(T, H, is_decode, max_draft_tokens)
    block_m = block_m or default_block_m(max_rows)
    if workspace is None:
        workspace = SplitWorkspace.plan(
            num_kv_splits, lambda: auto_splits(q.device, T, B, H, D, kv_cache.dtype, kv_indices.numel(), is_decode,
                                               max_draft_tokens, block_m, v_head_dim), T, H, v_head_dim, q.device)
    splits, min_chunk = workspace.splits, workspace.min_chunk
    kernel, fixed = _kernel_for_launch()
    # Placeholders for absent optional pointers (never dereferenced: constexpr branches).
    qo_ptr = qo_indptr if qo_indptr is not None else kv_indptr
    mask_ptr = tree_mask if tree_mask is not None else kv_indptr

    partial = splits > 1
    o_dst, lse_dst, strides_o, strides_l = split_destinations(out, lse, workspace)

    fp8 = kv_cache.dtype in KV_FP8_DTYPES
    args = (q, fp8_cache_view(kv_cache, triton_interpreting()), kv_indptr, kv_indices, qo_ptr, mask_ptr, o_dst,
            lse_dst, sm_scale * LOG2E,
            scales.k, scales.v, scales.k_tensor if scales.k_tensor is not None else kv_indptr,
            scales.v_tensor if scales.v_tensor is not None else kv_indptr,
            q.stride(0), q.stride(1), kv_cache.stride(0), *strides_o, *strides_l, max_rows, splits,
            T, kv_indices.numel(), kv_cache.shape[0])
    meta = dict(
        HEADS=H, DV=v_head_dim, DR=D - v_head_dim, IS_DECODE=is_decode, WRITE_LSE=lse is not None,
        PARTIAL=partial, COMPUTE_F32=triton_interpreting() or q.dtype == torch.float32,
        IEEE_DOT=q.dtype == torch.float32,
        FP8_KV=fp8, FP8_BITS=fp8 and triton_interpreting(), E5M2=kv_cache.dtype == torch.float8_e5m2,
        K_SCALE_TENSOR=scales.k_tensor is not None, V_SCALE_TENSOR=scales.v_tensor is not None,
        # A forced split count divides the prefix evenly; the automatic one keeps splits >= MIN_SPLIT_KEYS.
        MIN_CHUNK=min_chunk,
        BLOCK_M=block_m,
    )
    grid = (B * triton.cdiv(max_rows, block_m), splits)
    if fixed or block_n is not None:
        # 8 warps on a GPU: the [BLOCK_M, 512] fp32 accumulator spills at 4 (report above).
        _mla_fwd_kernel[grid](*args, **meta, BLOCK_N=block_n or 16, num_warps=4 if triton_interpreting() else 8)
    else:
        kernel[grid](*args, **meta)

    if partial:
        merge_splits(o_dst, lse_dst, out, lse)
