"""CUDA binding of tree-verify attention: sizes the launch, allocates the split buffers and calls
torch.ops.spec_kernels_cuda.tree_verify_attention (csrc/tree_verify/tree_verify_attention.cu,
host checks in csrc/tree_verify/tree_verify_binding.cpp)."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .._ops import LaunchShape, cuda_ops, kernel_config, kernel_configs, tree_verify_launch_config
from ..attention.checks import KV_FP8_DTYPES, NO_SCALES, KvScales, cuda_cache_dtype_refusal, cuda_row_chunk_refusal
from ..attention.plan import (DeviceLimits, KernelResources, SplitTraffic, SplitWorkspace, expected_rows, max_rows,
                               mean_prefix)
from ..attention.plan import num_kv_splits as plan_splits

KERNEL = "tree_verify_kernel"


def cuda_tree_verify_launch(head_dim: int, rows: int, limits: Optional[DeviceLimits] = None,
                            kv_fp8: bool = False) -> LaunchShape:
    """The configuration a CUDA launch of `rows` (max_rows) takes on a device with `limits` (the
    launch's own choice, tree_verify_launch_shape in the C++, read from the extension): at D = 128,
    128 rows per CTA for more than 64 rows (two m tiles per warp where that configuration's shared
    memory fits, sm_90); where two 64-row CTAs do not fit on an SM (sm_120) 32 rows for at most 16
    and 128 (8 warps) for 17-64; else 64. Without `limits` the one every device can run, 64 rows
    for at most 64 (for counting CTAs they agree: <= 64 rows are one CTA either way). block_m 0
    for a head dim without a configuration (supports() sends such calls to Triton)."""
    per_sm, reserved = (limits.smem_per_sm, limits.smem_reserved_per_cta) if limits is not None else (0, 0)
    return tree_verify_launch_config(head_dim, max(rows, 1), per_sm, reserved, kv_fp8)


def cuda_tree_verify_block_m(head_dim: int, rows: int, limits: Optional[DeviceLimits] = None,
                             kv_fp8: bool = False) -> int:
    """Rows per CTA of cuda_tree_verify_launch(head_dim, rows, limits, kv_fp8)."""
    return cuda_tree_verify_launch(head_dim, rows, limits, kv_fp8).block_m


def cuda_tree_verify_resources(head_dim: int, block_m: int = 64, kv_fp8: bool = False,
                               limits: Optional[DeviceLimits] = None) -> KernelResources:
    """Threads, registers and dynamic shared memory of the configuration with block_m rows per CTA
    (kv_fp8: its fp8-cache instance) that a launch takes on a device with `limits` (None: the one
    every device can run), as the extension reports them (TileConfig and the list of
    configurations in csrc/include/spec_kernels/tree_verify_config.h). ValueError when there is
    no such configuration, RuntimeError without the extension."""
    c = cuda_tree_verify_launch(head_dim, block_m, limits, kv_fp8)
    if c.block_m != block_m:
        c = kernel_config(KERNEL, head_dim, block_m, kv_fp8)  # raises: no configuration of block_m rows
    # launch() starts the split merge as a programmatic dependent (programmatic_launch.cuh)
    return KernelResources(c.threads, c.regs, c.smem_bytes, dependent_merge=True)


def cuda_tree_verify_kernel(head_dim: int, rows: int, kv_fp8: bool = False) -> Callable[[DeviceLimits], KernelResources]:
    """The resources of the configuration a launch of `rows` (max_rows) takes on a device."""
    return lambda limits: cuda_tree_verify_resources(
        head_dim, cuda_tree_verify_block_m(head_dim, rows, limits, kv_fp8), kv_fp8, limits)


def split_traffic(head_dim: int, kv_fp8: bool = False) -> SplitTraffic:
    """The bytes a split moves: K and V rows of head_dim (16-bit, or 8-bit in an fp8 cache) per
    key; 16-bit outputs of head_dim (the kernel takes Dv = D)."""
    return SplitTraffic(2 * head_dim * (1 if kv_fp8 else 2), head_dim, head_dim)


def supports(q, k_cache, v_cache, *_) -> Optional[str]:
    """None when the CUDA kernel handles these inputs, else why not (then Triton runs)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"the CUDA kernel takes float16/bfloat16 (tensor cores), got {q.dtype}"
    if (refusal := cuda_cache_dtype_refusal(q.dtype, k_cache.dtype)) is not None:
        return refusal
    if not any(c.kernel == KERNEL and c.head_dim == q.shape[2] for c in kernel_configs()):
        return f"the CUDA kernel has no configuration for head dim {q.shape[2]}"
    if v_cache.shape[2] != q.shape[2]:
        return f"the CUDA kernel needs the V head dim ({v_cache.shape[2]}) equal to Q's ({q.shape[2]})"
    if q.device.type == "cuda" and any(t.data_ptr() % 16 for t in (q, k_cache, v_cache)):
        return "the CUDA kernel copies 16-byte chunks: q, k_cache and v_cache must be 16-byte aligned"
    return cuda_row_chunk_refusal(q=q, k_cache=k_cache, v_cache=v_cache)


def auto_splits(device: torch.device, num_tokens: int, num_requests: int, num_q_heads: int, num_kv_heads: int,
                head_dim: int, num_indices: int, decode: bool, max_draft_tokens: int = 0, kv_fp8: bool = False) -> int:
    """KV splits the CUDA launch plans for this batch layout (never from tensor values): for the
    rows that hold work in an even batch, on the configuration the launch takes."""
    group = num_q_heads // num_kv_heads
    rows = max_rows(num_tokens, group, decode, max_draft_tokens)
    work = expected_rows(num_tokens, num_requests, group, decode, max_draft_tokens)
    block_m = cuda_tree_verify_block_m(head_dim, rows, kv_fp8=kv_fp8)  # rows per CTA: 32 (decode) counts as 64
    return plan_splits(device, num_requests, num_kv_heads, work, block_m, cuda_tree_verify_kernel(head_dim, rows, kv_fp8),
                       mean_prefix(num_indices, num_requests, work, group), traffic=split_traffic(head_dim, kv_fp8))


def tree_verify_attention(q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale,
                          out, lse, num_kv_splits=0, max_draft_tokens=0, workspace=None,
                          scales: KvScales = NO_SCALES) -> None:
    T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    B = kv_indptr.numel() - 1
    if T == 0 or B == 0:  # nothing to compute (every n_b = 0, or no request); a 0-row grid is no launch
        return
    decode = qo_indptr is None
    rows = max_rows(T, Hq // Hkv, decode, max_draft_tokens)  # sizes the grid: every valid n_b fits
    if workspace is None:  # the one-call path: planned here as TreeVerifyPlan plans it
        workspace = SplitWorkspace.plan(
            num_kv_splits, lambda: auto_splits(q.device, T, B, Hq, Hkv, D, kv_indices.numel(), decode,
                                               max_draft_tokens, k_cache.dtype in KV_FP8_DTYPES), T, Hq, D, q.device)
    cuda_ops().tree_verify_attention(q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask,
                                     out, lse, workspace.o_partial, workspace.lse_partial, sm_scale,
                                     workspace.splits, workspace.min_chunk, rows, scales.k, scales.v,
                                     scales.k_tensor, scales.v_tensor)
