"""CUDA binding of MLA tree-verify attention: sizes the launch, allocates the split buffers and calls
torch.ops.spec_kernels_cuda.mla_tree_verify_attention (csrc/mla/mla_tree_verify_attention.cu,
host checks in csrc/mla/mla_binding.cpp)."""
from __future__ import annotations

from typing import Optional

import torch

from .._ops import LaunchShape, cuda_ops, kernel_config, mla_launch_config
from ..attention.checks import KV_FP8_DTYPES, NO_SCALES, KvScales, cuda_cache_dtype_refusal, cuda_row_chunk_refusal
from ..attention.plan import (DeviceLimits, KernelResources, SplitTraffic, SplitWorkspace, expected_rows, max_rows,
                              mean_prefix)
from ..attention.plan import num_kv_splits as plan_splits

HEAD_DIM, V_HEAD_DIM = 576, 512  # kMlaHeadDim / kMlaVHeadDim in csrc/include/spec_kernels/mla.h
KERNEL = "mla_tree_verify_kernel"


def block_m(rows: int) -> int:
    """Rows per CTA of the configuration a launch of `rows` (max_rows) takes (mla_block_m in
    csrc/include/spec_kernels/mla.h, read from the extension)."""
    return mla_launch_config(max(rows, 1)).block_m


def supports(q, kv_cache, v_head_dim, *_) -> Optional[str]:
    """None when the CUDA kernel handles these inputs, else why not (then Triton runs)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"the CUDA kernel takes float16/bfloat16 (tensor cores), got {q.dtype}"
    if (refusal := cuda_cache_dtype_refusal(q.dtype, kv_cache.dtype)) is not None:
        return refusal
    if (q.shape[2], v_head_dim) != (HEAD_DIM, V_HEAD_DIM):
        return (f"the CUDA kernel is built for head dim {HEAD_DIM} with v_head_dim {V_HEAD_DIM} "
                f"(DeepSeek-V3 / Kimi K2.5), got {q.shape[2]} / {v_head_dim}")
    if q.data_ptr() % 16 or kv_cache.data_ptr() % 16:
        return "the CUDA kernel copies 16-byte chunks: q and kv_cache must start 16-byte aligned"
    return cuda_row_chunk_refusal(kv_cache=kv_cache)


def auto_splits(device: torch.device, num_tokens: int, num_requests: int, num_heads: int, num_indices: int,
                decode: bool, max_draft_tokens: int = 0, kv_fp8: bool = False) -> int:
    """KV splits the CUDA launch plans for this batch layout (never from tensor values): for the
    rows that hold work in an even batch, on the configuration the launch takes."""
    rows = max_rows(num_tokens, num_heads, decode, max_draft_tokens)
    work = expected_rows(num_tokens, num_requests, num_heads, decode, max_draft_tokens)
    return plan_splits(device, num_requests, 1, work, block_m(rows),
                       lambda limits: cuda_mla_resources(block_m(rows), kv_fp8, limits),
                       mean_prefix(num_indices, num_requests, work, num_heads), traffic=split_traffic(kv_fp8))


def split_traffic(kv_fp8: bool = False) -> SplitTraffic:
    """The bytes a split moves: one latent row of HEAD_DIM per key (K and V share it), 16-bit
    or fp8; 16-bit outputs of V_HEAD_DIM."""
    return SplitTraffic(HEAD_DIM * (1 if kv_fp8 else 2), HEAD_DIM, V_HEAD_DIM)


def mla_tree_verify_attention(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, v_head_dim,
                              out, lse, num_kv_splits=0, max_draft_tokens=0, workspace=None,
                              scales: KvScales = NO_SCALES) -> None:
    T, H, _ = q.shape
    B = kv_indptr.numel() - 1
    if T == 0 or B == 0:  # nothing to compute (every n_b = 0, or no request); a 0-row grid is no launch
        return
    decode = qo_indptr is None
    rows = max_rows(T, H, decode, max_draft_tokens)  # sizes the grid (and the tile): every valid n_b fits
    if workspace is None:  # the one-call path: planned here as MlaPlan plans it
        workspace = SplitWorkspace.plan(
            num_kv_splits, lambda: auto_splits(q.device, T, B, H, kv_indices.numel(), decode, max_draft_tokens,
                                               kv_cache.dtype in KV_FP8_DTYPES),
            T, H, v_head_dim, q.device)
    cuda_ops().mla_tree_verify_attention(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, out, lse,
                                         workspace.o_partial, workspace.lse_partial, sm_scale, workspace.splits,
                                         workspace.min_chunk, rows, scales.k, scales.v, scales.k_tensor,
                                         scales.v_tensor)


def launch_config(rows: int, limits: Optional[DeviceLimits] = None, kv_fp8: bool = False) -> LaunchShape:
    """The configuration a launch of `rows` (max_rows) takes on a device with `limits` (None: not
    known, the configuration that fits every device), read from the extension
    (mla_launch_shape in csrc/include/spec_kernels/mla_config.h)."""
    per_sm, reserved = (limits.smem_per_sm, limits.smem_reserved_per_cta) if limits is not None else (0, 0)
    return mla_launch_config(max(rows, 1), per_sm, reserved, kv_fp8)


def cuda_mla_resources(block_m: int, kv_fp8: bool = False, limits: Optional[DeviceLimits] = None) -> KernelResources:
    """Threads, registers and dynamic shared memory of the configuration with block_m rows per CTA
    (kv_fp8: its fp8-cache instance) that a launch takes on a device with `limits` (None: the one
    every device can run), as the extension reports them (MlaTile and the list of configurations
    in csrc/include/spec_kernels/mla_config.h). ValueError when there is none."""
    c = launch_config(block_m, limits, kv_fp8)
    if c.block_m != block_m:
        c = kernel_config(KERNEL, HEAD_DIM, block_m, kv_fp8)  # raises: no configuration of block_m rows
    # launch() starts the split merge as a programmatic dependent (programmatic_launch.cuh)
    return KernelResources(c.threads, c.regs, c.smem_bytes, dependent_merge=True)
