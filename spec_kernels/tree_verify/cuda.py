"""CUDA binding of tree-verify attention: sizes the launch, allocates the split buffers and calls
torch.ops.spec_kernels_cuda.tree_verify_attention (csrc/tree_verify/tree_verify_attention.cu,
host checks in csrc/ops.cpp)."""
from __future__ import annotations

from typing import Optional

import torch

from .._ops import cuda_ops
from .launch_plan import MIN_SPLIT_KEYS, cuda_tree_verify_block_m, cuda_tree_verify_kernel, expected_rows, max_rows
from .launch_plan import mean_prefix
from .launch_plan import num_kv_splits as plan_splits


def supports(q, k_cache, v_cache, *_) -> Optional[str]:
    """None when the CUDA kernel handles these inputs, else why not (then Triton runs)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"the CUDA kernel takes float16/bfloat16 (tensor cores), got {q.dtype}"
    if v_cache.shape[2] != q.shape[2]:
        return f"the CUDA kernel needs the V head dim ({v_cache.shape[2]}) equal to Q's ({q.shape[2]})"
    if q.device.type == "cuda" and any(t.data_ptr() % 16 for t in (q, k_cache, v_cache)):
        return "the CUDA kernel copies 16-byte chunks: q, k_cache and v_cache must be 16-byte aligned"
    return None


def tree_verify_attention(q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale,
                          out, lse, num_kv_splits=0, max_draft_tokens=0) -> None:
    T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    B = kv_indptr.numel() - 1
    if T == 0 or B == 0:  # nothing to compute (every n_b = 0, or no request); a 0-row grid is no launch
        return
    group, decode = Hq // Hkv, qo_indptr is None
    rows = max_rows(T, group, decode, max_draft_tokens)  # sizes the grid: every valid n_b fits
    splits = num_kv_splits
    if not splits:  # planned for the rows that hold work in an even batch
        work = expected_rows(T, B, group, decode, max_draft_tokens)
        block_m = cuda_tree_verify_block_m(D, rows)  # rows per CTA: 32 (decode) counts as 64
        splits = plan_splits(q.device, B, Hkv, work, block_m, cuda_tree_verify_kernel(D, rows),
                             mean_prefix(kv_indices.numel(), B, work, group))
    o_partial = lse_partial = None
    if splits > 1:
        o_partial = torch.empty((splits, T, Hq, D), dtype=torch.float32, device=q.device)
        lse_partial = torch.empty((splits, T, Hq), dtype=torch.float32, device=q.device)
    # A forced split count divides the prefix evenly; automatic splits keep >= 256 keys each.
    min_chunk = 0 if num_kv_splits else MIN_SPLIT_KEYS
    cuda_ops().tree_verify_attention(q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask,
                                     out, lse, o_partial, lse_partial, sm_scale, splits, min_chunk, rows)
