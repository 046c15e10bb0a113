"""Plan once per batch, run per layer: tree-verify and decode attention over one batch layout.

A model step calls attention once per layer over the same batch layout (kv_indptr, kv_indices,
qo_indptr, tree_mask). `TreeVerifyPlan` checks that layout once, picks the implementation, plans
the KV splits and allocates the split buffers; `plan.run(q, k_cache, v_cache)` per layer only
checks the layer's tensors against the plan and launches. The one-call functions
(spec_kernels.tree_verify_attention / decode_attention) plan and run in one call through the same
code: the split comes from SplitWorkspace.plan with the same planner, the launch is the same
kernel launcher, so the results are the same.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .._checks import FLOAT_DTYPES, check_shape, check_tensor
from ..attention.batch import BatchLayout
from ..attention.checks import KV_FP8_DTYPES, check_kv_scales, check_num_kv_splits, check_out, kv_cache_dtypes, softmax_scale
from ..attention.plan import SplitWorkspace
from . import cuda as cuda_binding
from . import triton_kernel
from .api import HEAD_DIMS, TREE_VERIFY, decode_attention, tree_verify_attention


class TreeVerifyPlan:
    """The checked batch layout, the implementation, the split plan and the split buffers of one
    batch, for every layer of a step (FlashInfer's plan/run).

    Args:
        kv_indptr, kv_indices, qo_indptr, tree_mask: the batch layout, as in
            spec_kernels.tree_verify_attention; qo_indptr = tree_mask = None plans decode (one
            query per request, spec_kernels.decode_attention).
        num_q_heads, num_kv_heads, head_dim, v_head_dim (default head_dim), dtype: what every
            layer's q / k_cache / v_cache will be; kv_dtype: the caches' dtype if not q's (an fp8
            cache; run() then takes the layer's k_scale / v_scale).
        sm_scale, max_draft_tokens, num_kv_splits, impl: as in the one-call functions.

    Guarantees: the layout is checked here as the one-call functions check it (ValueError or
    TypeError naming the argument; index values on CPU tensors and in debug mode, against the
    first run's k_cache size); run() checks the layer's tensors against the plan. The layout
    tensors must keep their values (and stay the same tensors) between plan and run: the plan
    keeps references, as the kernels read them at run time. Layer tensors the planned CUDA kernel
    cannot take (not 16-byte aligned) run through the one-call function instead. The split buffers are reused by
    every run, so runs of one plan must not overlap on different streams. No host
    synchronisation in run() on CUDA tensors: it can be captured in a CUDA graph, together with
    the plan's buffers."""

    def __init__(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, qo_indptr: Optional[torch.Tensor] = None,
                 tree_mask: Optional[torch.Tensor] = None, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 v_head_dim: Optional[int] = None, dtype: torch.dtype = torch.float16,
                 sm_scale: Optional[float] = None, max_draft_tokens: Optional[int] = None,
                 num_kv_splits: Optional[int] = None, impl: Optional[str] = None,
                 kv_dtype: Optional[torch.dtype] = None):
        self.layout = layout = BatchLayout.check(kv_indptr, kv_indices, qo_indptr, tree_mask, max_draft_tokens)
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if kv_dtype not in kv_cache_dtypes(dtype):
            raise TypeError(f"kv_dtype must be one of {kv_cache_dtypes(dtype)} for dtype {dtype}, got {kv_dtype}")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
        if v_head_dim not in HEAD_DIMS:
            raise ValueError(f"v_head_dim must be one of {HEAD_DIMS}, got {v_head_dim}")
        if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads "
                             f"({num_kv_heads})")
        check_num_kv_splits(num_kv_splits)
        T, B, dev = layout.num_tokens, layout.num_requests, layout.device
        self.device, self.dtype, self.kv_dtype = dev, dtype, kv_dtype
        self.num_q_heads, self.num_kv_heads, self.head_dim, self.v_head_dim = num_q_heads, num_kv_heads, head_dim, v_head_dim
        self.sm_scale = softmax_scale(sm_scale, head_dim)
        # The implementation, for tensors of the planned dtype and shapes (alignment: at run()).
        meta = [torch.empty(shape, dtype=dt, device="meta")
                for shape, dt in (((T, num_q_heads, head_dim), dtype), ((1, num_kv_heads, head_dim), kv_dtype),
                                  ((1, num_kv_heads, v_head_dim), kv_dtype))]
        self.impl, _ = TREE_VERIFY.select(dev, impl or None, args=tuple(meta))
        planners = {  # each implementation's split planner, as its one-call launch uses it
            "cuda": lambda: cuda_binding.auto_splits(dev, T, B, num_q_heads, num_kv_heads, head_dim,
                                                     kv_indices.numel(), layout.decode, layout.max_draft_tokens,
                                                     kv_dtype in KV_FP8_DTYPES),
            "triton": lambda: triton_kernel.auto_splits(dev, T, B, num_q_heads, num_kv_heads, head_dim, v_head_dim,
                                                        kv_dtype, kv_indices.numel(), layout.decode,
                                                        layout.max_draft_tokens),
        }
        # The reference has no splits; an empty batch launches nothing.
        auto = planners[self.impl] if self.impl in planners and T and B else (lambda: 1)
        self.workspace = SplitWorkspace.plan(num_kv_splits, auto, T, num_q_heads, v_head_dim, dev)
        self._values_checked_for: Optional[int] = None

    @property
    def num_kv_splits(self) -> int:
        return self.workspace.splits

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: Optional[torch.Tensor] = None,
            return_lse: bool = False, k_scale=None, v_scale=None) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One layer's attention over the planned batch: q [T, Hq, D], k_cache [S, Hkv, D],
        v_cache [S, Hkv, Dv] of the planned dtypes (and an fp8 cache's k_scale / v_scale); returns
        o [T, Hq, Dv] (written into `out` when given), or (o, lse). Results as
        spec_kernels.tree_verify_attention / decode_attention."""
        lay = self.layout
        T, Hq, Hkv = lay.num_tokens, self.num_q_heads, self.num_kv_heads
        check_tensor(q, "q", dim=3, dtypes=(self.dtype,), device=self.device)
        check_shape(q, "q", (T, Hq, self.head_dim), "[T, Hq, D] of the plan")
        check_tensor(k_cache, "k_cache", dim=3, dtypes=(self.kv_dtype,), device=self.device)
        S = k_cache.shape[0]
        check_shape(k_cache, "k_cache", (S, Hkv, self.head_dim), "[S, Hkv, D] of the plan")
        check_tensor(v_cache, "v_cache", dim=3, dtypes=(self.kv_dtype,), device=self.device)
        check_shape(v_cache, "v_cache", (S, Hkv, self.v_head_dim), "[S, Hkv, Dv] of the plan, k_cache's S")
        scales = check_kv_scales(q, k_cache, v_cache, k_scale, v_scale)
        if self._values_checked_for != S:
            lay.check_values(S)
            self._values_checked_for = S
        if self.impl == "cuda" and cuda_binding.supports(q, k_cache, v_cache) is not None:
            # Tensors the CUDA kernel cannot take (e.g. not 16-byte aligned): the one-call
            # function's dispatch runs them (Triton), planned for this call.
            return self._unplanned(q, k_cache, v_cache, out, return_lse, k_scale, v_scale)
        out = check_out(out, q, self.v_head_dim)
        lse = q.new_empty((T, Hq), dtype=torch.float32) if return_lse else None
        ws = self.workspace
        torch.ops.spec_kernels.tree_verify_attention_run(
            q, k_cache, v_cache, lay.kv_indptr, lay.kv_indices, lay.qo_indptr, lay.tree_mask, self.sm_scale,
            out, lse, ws.o_partial, ws.lse_partial, self.impl, ws.splits, ws.min_chunk, lay.max_draft_tokens,
            scales.k, scales.v, scales.k_tensor, scales.v_tensor)
        return (out, lse) if return_lse else out

    def _unplanned(self, q, k_cache, v_cache, out, return_lse, k_scale=None, v_scale=None):
        lay, ws = self.layout, self.workspace
        splits = ws.splits if ws.min_chunk == 0 else None  # a forced count stays forced
        if lay.decode:
            return decode_attention(q, k_cache, v_cache, lay.kv_indptr, lay.kv_indices, self.sm_scale, return_lse,
                                    out, num_kv_splits=splits, k_scale=k_scale, v_scale=v_scale)
        return tree_verify_attention(q, k_cache, v_cache, lay.kv_indptr, lay.kv_indices, lay.qo_indptr, lay.tree_mask,
                                     self.sm_scale, return_lse, out, num_kv_splits=splits,
                                     max_draft_tokens=lay.max_draft_tokens or None, k_scale=k_scale, v_scale=v_scale)

