"""CUDA binding of MLA tree-verify attention: sizes the launch, allocates the split buffers and calls
torch.ops.spec_kernels_cuda.mla_tree_verify_attention (csrc/mla/mla_tree_verify_attention.cu,
host checks in csrc/ops.cpp)."""
from __future__ import annotations

from typing import Optional

import torch

from .._ops import cuda_ops
from ..tree_verify.launch_plan import MIN_SPLIT_KEYS, cuda_mla_resources, expected_rows, max_rows, mean_prefix
from ..tree_verify.launch_plan import num_kv_splits as plan_splits

HEAD_DIM, V_HEAD_DIM = 576, 512  # kMlaHeadDim / kMlaVHeadDim in csrc/include/spec_kernels/mla.h


def block_m(rows: int) -> int:
    """Rows per CTA: mla_block_m() in csrc/include/spec_kernels/mla.h."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def supports(q, kv_cache, v_head_dim, *_) -> Optional[str]:
    """None when the CUDA kernel handles these inputs, else why not (then Triton runs)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"the CUDA kernel takes float16/bfloat16 (tensor cores), got {q.dtype}"
    if (q.shape[2], v_head_dim) != (HEAD_DIM, V_HEAD_DIM):
        return (f"the CUDA kernel is built for head dim {HEAD_DIM} with v_head_dim {V_HEAD_DIM} "
                f"(DeepSeek-V3 / Kimi K2.5), got {q.shape[2]} / {v_head_dim}")
    if q.data_ptr() % 16 or kv_cache.data_ptr() % 16:
        return "the CUDA kernel copies 16-byte chunks: q and kv_cache must start 16-byte aligned"
    return None


def mla_tree_verify_attention(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, v_head_dim,
                              out, lse, num_kv_splits=0, max_draft_tokens=0) -> None:
    T, H, _ = q.shape
    B = kv_indptr.numel() - 1
    if T == 0 or B == 0:  # nothing to compute (every n_b = 0, or no request); a 0-row grid is no launch
        return
    decode = qo_indptr is None
    rows = max_rows(T, H, decode, max_draft_tokens)  # sizes the grid (and the tile): every valid n_b fits
    splits = num_kv_splits
    if not splits:  # planned for the rows that hold work in an even batch
        work = expected_rows(T, B, H, decode, max_draft_tokens)
        splits = plan_splits(q.device, B, 1, work, block_m(rows), cuda_mla_resources(block_m(rows)),
                             mean_prefix(kv_indices.numel(), B, work, H))
    o_partial = lse_partial = None
    if splits > 1:
        o_partial = torch.empty((splits, T, H, v_head_dim), dtype=torch.float32, device=q.device)
        lse_partial = torch.empty((splits, T, H), dtype=torch.float32, device=q.device)
    # A forced split count divides the prefix evenly; automatic splits keep >= 256 keys each.
    min_chunk = 0 if num_kv_splits else MIN_SPLIT_KEYS
    cuda_ops().mla_tree_verify_attention(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, out, lse,
                                         o_partial, lse_partial, sm_scale, splits, min_chunk, rows)
