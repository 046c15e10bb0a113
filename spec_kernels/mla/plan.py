"""Plan once per batch, run per layer: MLA tree-verify and decode attention over one batch layout
(as spec_kernels.tree_verify.plan, for the latent KV cache)."""
from __future__ import annotations

from typing import Optional, Union

import torch

from .._checks import FLOAT_DTYPES, check_shape, check_tensor
from ..attention.batch import BatchLayout
from ..attention.checks import (KV_FP8_DTYPES, check_kv_scales, check_num_kv_splits, check_out, kv_cache_dtypes,
                                softmax_scale)
from ..attention.plan import SplitWorkspace
from . import cuda as cuda_binding
from . import triton_kernel
from .api import LATENT_DIMS, MAX_HEADS, MLA, ROPE_DIMS, mla_decode_attention, mla_tree_verify_attention


class MlaPlan:
    """The checked batch layout, the implementation, the split plan and the split buffers of one
    batch, for every MLA layer of a step.

    Args:
        kv_indptr, kv_indices, qo_indptr, tree_mask: the batch layout, as in
            spec_kernels.mla_tree_verify_attention; qo_indptr = tree_mask = None plans decode.
        num_heads, head_dim (576), v_head_dim (512), dtype: what every layer's q / kv_cache will be.
        sm_scale, max_draft_tokens, num_kv_splits, impl: as in the one-call functions.

    Guarantees as spec_kernels.TreeVerifyPlan: the layout is checked once (index values against
    the first run's kv_cache), run() checks the layer's tensors against the plan, the layout
    tensors and split buffers are kept and reused, no host synchronisation in run(); layer tensors
    the planned CUDA kernel cannot take run through the one-call function."""

    def __init__(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, qo_indptr: Optional[torch.Tensor] = None,
                 tree_mask: Optional[torch.Tensor] = None, *, num_heads: int, head_dim: int = 576,
                 v_head_dim: int = 512, dtype: torch.dtype = torch.bfloat16, sm_scale: Optional[float] = None,
                 max_draft_tokens: Optional[int] = None, num_kv_splits: Optional[int] = None,
                 impl: Optional[str] = None, kv_dtype: Optional[torch.dtype] = None):
        self.layout = layout = BatchLayout.check(kv_indptr, kv_indices, qo_indptr, tree_mask, max_draft_tokens)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if kv_dtype not in kv_cache_dtypes(dtype):
            raise TypeError(f"kv_dtype must be one of {kv_cache_dtypes(dtype)} for dtype {dtype}, got {kv_dtype}")
        if not 1 <= num_heads <= MAX_HEADS:
            raise ValueError(f"num_heads must be in 1..{MAX_HEADS}, got {num_heads}")
        if v_head_dim not in LATENT_DIMS or head_dim - v_head_dim not in ROPE_DIMS:
            raise ValueError(f"head_dim {head_dim} with v_head_dim {v_head_dim} is not supported: v_head_dim must "
                             f"be one of {LATENT_DIMS} and the rest one of {ROPE_DIMS}")
        check_num_kv_splits(num_kv_splits)
        T, B, dev = layout.num_tokens, layout.num_requests, layout.device
        self.device, self.dtype, self.kv_dtype = dev, dtype, kv_dtype
        self.num_heads, self.head_dim, self.v_head_dim = num_heads, head_dim, v_head_dim
        self.sm_scale = softmax_scale(sm_scale, head_dim)
        meta = (torch.empty((T, num_heads, head_dim), dtype=dtype, device="meta"),
                torch.empty((1, head_dim), dtype=kv_dtype, device="meta"), v_head_dim)
        self.impl, _ = MLA.select(dev, impl or None, args=meta)
        planners = {  # each implementation's split planner, as its one-call launch uses it
            "cuda": lambda: cuda_binding.auto_splits(dev, T, B, num_heads, kv_indices.numel(), layout.decode,
                                                     layout.max_draft_tokens, kv_dtype in KV_FP8_DTYPES),
            "triton": lambda: triton_kernel.auto_splits(dev, T, B, num_heads, head_dim, kv_dtype, kv_indices.numel(),
                                                        layout.decode, layout.max_draft_tokens,
                                                        v_head_dim=v_head_dim),
        }
        # The reference has no splits; an empty batch launches nothing.
        auto = planners[self.impl] if self.impl in planners and T and B else (lambda: 1)
        self.workspace = SplitWorkspace.plan(num_kv_splits, auto, T, num_heads, v_head_dim, dev)
        self._values_checked_for: Optional[int] = None

    @property
    def num_kv_splits(self) -> int:
        return self.workspace.splits

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, out: Optional[torch.Tensor] = None,
            return_lse: bool = False, k_scale=None, v_scale=None) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One layer's MLA attention over the planned batch: q [T, H, D], kv_cache [S, D] or
        [S, 1, D] of the planned kv_dtype (an fp8 cache: with its k_scale / v_scale); returns o [T, H, v_head_dim] (written into `out` when
        given), or (o, lse). Results as spec_kernels.mla_tree_verify_attention / mla_decode_attention."""
        lay = self.layout
        T, H, D = lay.num_tokens, self.num_heads, self.head_dim
        check_tensor(q, "q", dim=3, dtypes=(self.dtype,), device=self.device)
        check_shape(q, "q", (T, H, D), "[T, H, D] of the plan")
        check_tensor(kv_cache, "kv_cache", dtypes=(self.kv_dtype,), device=self.device)
        if not (kv_cache.dim() == 2 or (kv_cache.dim() == 3 and kv_cache.shape[1] == 1)) or kv_cache.shape[-1] != D:
            raise ValueError(f"kv_cache must be [S, {D}] or [S, 1, {D}], got shape {tuple(kv_cache.shape)}")
        kv2d = kv_cache.view(kv_cache.shape[0], D)
        scales = check_kv_scales(q, kv2d, None, k_scale, v_scale, ("kv_cache", "kv_cache"))
        S = kv2d.shape[0]
        if self._values_checked_for != S:
            lay.check_values(S, "kv_cache")
            self._values_checked_for = S
        if self.impl == "cuda" and cuda_binding.supports(q, kv2d, self.v_head_dim) is not None:
            # Tensors the CUDA kernel cannot take (not 16-byte aligned): the one-call function's
            # dispatch runs them (Triton), planned for this call.
            ws = self.workspace
            splits = ws.splits if ws.min_chunk == 0 else None
            if lay.decode:
                return mla_decode_attention(q, kv_cache, lay.kv_indptr, lay.kv_indices, self.sm_scale, self.v_head_dim,
                                            return_lse, out, num_kv_splits=splits, k_scale=k_scale, v_scale=v_scale)
            return mla_tree_verify_attention(q, kv_cache, lay.kv_indptr, lay.kv_indices, lay.qo_indptr, lay.tree_mask,
                                             self.sm_scale, self.v_head_dim, return_lse, out, num_kv_splits=splits,
                                             max_draft_tokens=lay.max_draft_tokens or None, k_scale=k_scale,
                                             v_scale=v_scale)
        out = check_out(out, q, self.v_head_dim)
        lse = q.new_empty((T, H), dtype=torch.float32) if return_lse else None
        ws = self.workspace
        torch.ops.spec_kernels.mla_tree_verify_attention_run(
            q, kv2d, lay.kv_indptr, lay.kv_indices, lay.qo_indptr, lay.tree_mask, self.sm_scale, self.v_head_dim,
            out, lse, ws.o_partial, ws.lse_partial, self.impl, ws.splits, ws.min_chunk, lay.max_draft_tokens,
            scales.k, scales.v, scales.k_tensor, scales.v_tensor)
        return (out, lse) if return_lse else out
