"""MLA tree-verify attention: public functions, their checks, and the torch custom op behind them.

    torch.ops.spec_kernels.mla_tree_verify_attention   (MLA decode is the same op with qo_indptr=None)

Like spec_kernels.tree_verify: the custom op mutates a preallocated output and returns nothing,
has a fake implementation (FakeTensorMode, torch.compile(fullgraph=True)), and picks its
implementation with the dispatch rule of spec_kernels._ops (cuda -> triton -> reference).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_shape,
    check_tensor,
    common_device,
    values_checkable,
)
from .._ops import op_impls
from ..attention.plan import SplitWorkspace
from ..attention.checks import (
    NO_SCALES,
    KvScales,
    check_draft_values,
    check_kv_dtypes,
    check_kv_scales,
    check_kv_values,
    check_max_draft_tokens,
    check_num_kv_splits,
    check_out,
    scales_kwargs,
    softmax_scale,
)
from . import cuda as cuda_binding
from . import reference, triton_kernel

MAX_HEADS = 128  # query heads per rank (Kimi K2.5 at TP8: 8, DeepSeek-V3 at TP8: 16, TP1: 128)
LATENT_DIMS = (128, 256, 512)  # v_head_dim = kv_lora_rank
ROPE_DIMS = (32, 64)  # head dim - v_head_dim = qk_rope_head_dim

MLA = op_impls("mla_tree_verify_attention")
MLA.register("cuda", supports=cuda_binding.supports)(cuda_binding.mla_tree_verify_attention)
MLA.register("triton")(triton_kernel.mla_tree_verify_attention)


@MLA.register("reference")
def _mla_reference(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, v_head_dim, out, lse,
                   num_kv_splits=0, max_draft_tokens=0, scales=NO_SCALES):
    # The reference is exact and loops over requests: no splits, no launch sizing.
    k_scale, v_scale = scales.values()
    reference.mla_tree_verify_attention(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale,
                                        v_head_dim, out, lse, max_draft_tokens, k_scale, v_scale)


@torch.library.custom_op("spec_kernels::mla_tree_verify_attention", mutates_args=("out", "lse"))
def _mla_op(
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
    impl: str,
    num_kv_splits: int,
    max_draft_tokens: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    k_scale_tensor: Optional[torch.Tensor] = None,
    v_scale_tensor: Optional[torch.Tensor] = None,
) -> None:
    _, fn = MLA.select(q.device, impl or None, args=(q, kv_cache, v_head_dim))
    fn(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, v_head_dim, out, lse, num_kv_splits,
       max_draft_tokens, **scales_kwargs(k_scale, v_scale, k_scale_tensor, v_scale_tensor))


@_mla_op.register_fake
def _(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, v_head_dim, out, lse, impl, num_kv_splits,
      max_draft_tokens, k_scale=1.0, v_scale=1.0, k_scale_tensor=None, v_scale_tensor=None):
    return None


@torch.library.custom_op("spec_kernels::mla_tree_verify_attention_run",
                         mutates_args=("out", "lse", "o_partial", "lse_partial"))
def _mla_run_op(
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
    o_partial: Optional[torch.Tensor],
    lse_partial: Optional[torch.Tensor],
    impl: str,
    num_kv_splits: int,
    min_chunk: int,
    max_draft_tokens: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    k_scale_tensor: Optional[torch.Tensor] = None,
    v_scale_tensor: Optional[torch.Tensor] = None,
) -> None:
    """The planned launch (spec_kernels.mla.plan.MlaPlan.run): implementation, splits, their
    minimum share and the split buffers come from the plan."""
    fn = MLA.impls[impl]
    args = (q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, v_head_dim, out, lse, num_kv_splits,
            max_draft_tokens)
    scales = scales_kwargs(k_scale, v_scale, k_scale_tensor, v_scale_tensor)
    if impl == "reference":
        fn(*args, **scales)
    else:
        fn(*args, workspace=SplitWorkspace(num_kv_splits, min_chunk, o_partial, lse_partial), **scales)


@_mla_run_op.register_fake
def _(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, v_head_dim, out, lse, o_partial,
      lse_partial, impl, num_kv_splits, min_chunk, max_draft_tokens, k_scale=1.0, v_scale=1.0, k_scale_tensor=None,
      v_scale_tensor=None):
    return None


# --------------------------------------------------------------------------- checks
def _check_inputs(q, kv_cache, kv_indptr, kv_indices, v_head_dim, others=()) -> tuple[torch.Tensor, str]:
    """Metadata checks shared by verify and decode; returns kv_cache as [S, D] and how device
    errors name the device all tensors (others included, for the vote) must be on."""
    dev, like = common_device([("q", q), ("kv_cache", kv_cache), ("kv_indptr", kv_indptr),
                               ("kv_indices", kv_indices), *others])
    check_tensor(q, "q", dim=3, dtypes=FLOAT_DTYPES, device=dev, like=like)
    check_tensor(kv_cache, "kv_cache", device=dev, like=like)
    check_kv_dtypes(q, kv_cache, None, ("kv_cache", "kv_cache"))
    check_tensor(kv_indptr, "kv_indptr", dim=1, dtypes=(torch.int32,), device=dev, like=like)
    check_tensor(kv_indices, "kv_indices", dim=1, dtypes=INDEX_DTYPES, device=dev, like=like)
    _, H, D = q.shape
    if not (kv_cache.dim() == 2 or (kv_cache.dim() == 3 and kv_cache.shape[1] == 1)):
        raise ValueError(f"kv_cache must be [S, D] or [S, 1, D] (one latent KV head), "
                         f"got shape {tuple(kv_cache.shape)}")
    if kv_cache.shape[-1] != D:
        raise ValueError(f"kv_cache head dim must equal q's ({D}), got kv_cache shape {tuple(kv_cache.shape)}")
    if not 1 <= H <= MAX_HEADS:
        raise ValueError(f"q must have 1..{MAX_HEADS} heads, got {H}")
    if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, int):
        raise TypeError(f"v_head_dim must be an int, got {type(v_head_dim).__name__}")
    if v_head_dim not in LATENT_DIMS or D - v_head_dim not in ROPE_DIMS:
        raise ValueError(
            f"q head dim {D} with v_head_dim {v_head_dim} is not supported: v_head_dim (the latent part) must be "
            f"one of {LATENT_DIMS} and the rest (the rope part) one of {ROPE_DIMS}, e.g. 576 = 512 + 64 "
            "(DeepSeek-V3, Kimi K2.5)")
    if kv_indptr.numel() < 1:
        raise ValueError("kv_indptr must have B+1 >= 1 entries")
    return kv_cache.view(kv_cache.shape[0], D), like


# --------------------------------------------------------------------------- public API
def mla_tree_verify_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    qo_indptr: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: Optional[float] = None,
    v_head_dim: int = 512,
    return_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    impl: Optional[str] = None,
    num_kv_splits: Optional[int] = None,
    max_draft_tokens: Optional[int] = None,
    k_scale: Optional[Union[float, torch.Tensor]] = None,
    v_scale: Optional[Union[float, torch.Tensor]] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Multi-head latent attention (MLA, absorbed form) of a batch of draft-token trees over a
    paged (token-slot) latent KV cache: DeepSeek-V3 / Kimi K2.5 verify attention.

    The cache holds ONE latent KV head per token: row s of ``kv_cache`` is the key (576 = 512
    compressed latent + 64 rope values) and its first ``v_head_dim`` values are the value. All H
    query heads read that head, so request b has n_b x H query rows over the same KV, and the
    kernels read each KV row once for all of them. Score of query head h of token t with slot s:
    ``q[t, h] . kv_cache[s] * sm_scale``; output ``sum_s softmax(score)_s * kv_cache[s, :v_head_dim]``.

    Batch layout exactly as in :func:`spec_kernels.tree_verify_attention`: request b owns queries
    ``q[qo_indptr[b]:qo_indptr[b+1]]`` (its n_b draft tokens, 0 <= n_b <= 64) and KV slots
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, first its prefix (visible to every draft), then
    its n_b draft slots; draft i sees draft j iff bit j of ``tree_mask[qo_indptr[b] + i]`` is set
    (bits 0..i only: the draft itself and earlier drafts). The indptr and mask rules, the
    handling of unchecked invalid values and of NaN / inf inputs are those of
    :func:`spec_kernels.tree_verify_attention`; the cached row is K (all D values) and V (its
    first v_head_dim values), so NaN / inf in the latent part of a row a query sees makes that
    query's whole output and lse NaN, in the rope part as well.

    Args:
        q: [T, H, D] fp16/bf16/fp32 absorbed queries (latent part, then rope part), request-major;
            1 <= H <= 128. D = v_head_dim + rope dim: 576 = 512 + 64 (CUDA kernel); the Triton
            kernel and the reference also take latent dims (128, 256, 512) x rope dims (32, 64).
        kv_cache: [S, D] or [S, 1, D], q's dtype or fp8 (float8_e4m3fn / float8_e5m2, q fp16 or
            bf16), contiguous (SGLang's MLATokenToKVPool buffer).
        kv_indptr: int32 [B+1], non-decreasing, kv_indptr[0] >= 0 (an offset into kv_indices),
            kv_indptr[-1] <= len(kv_indices). kv_indices: int32 or int64 slot ids in [0, S).
        qo_indptr: int32 [B+1], qo_indptr[0] == 0, non-decreasing, qo_indptr[-1] == T.
        tree_mask: int64 [T] (see spec_kernels.tree_mask_from_parents).
        sm_scale: softmax scale, default 1/sqrt(D). DeepSeek-V3 / Kimi K2.5 scale by
            1/sqrt(qk_nope_head_dim + qk_rope_head_dim) (x the YaRN mscale^2): pass the layer's.
        v_head_dim: the value (latent) width, default 512.
        return_lse: also return the natural-log log-sum-exp of each row's logits, fp32 [T, H].
        out: optional [T, H, v_head_dim] output buffer (q's dtype, contiguous), written and returned.
        impl: "cuda", "triton" or "reference" to force one; default the fastest available.
        num_kv_splits: split every prefix into this many parts (1..64); default from the shapes
            and the GPU (the CTAs it holds at once, spec_kernels.attention.plan), never from the
            tensors' values.
        max_draft_tokens: an upper bound of every n_b (1..64): sizes the launch (default min(T, 64)).
        k_scale, v_scale: an fp8 cache's per-layer scales (required then, refused otherwise): K =
            kv_cache * k_scale, V = kv_cache[:, :v_head_dim] * v_scale (SGLang passes the same
            value for both); floats or 1-element fp32 tensors, as in
            :func:`spec_kernels.tree_verify_attention`, whose fp8 numerics these are.

    Returns:
        o [T, H, v_head_dim] in q's dtype (softmax and accumulation in fp32), or (o, lse).
        A query that sees no key (empty prefix and an empty mask row) gets zeros and lse = -inf.

    Guarantees: every input's dtype, device, rank, shape and contiguity is checked
    (ValueError/TypeError naming it). Index values (indptr rules, n_b <= 64, slot ranges, mask
    bits of later drafts) are checked on CPU tensors, and on CUDA tensors in debug mode
    (SPEC_KERNELS_DEBUG=1) since that needs a host sync; without the check, invalid values give
    meaningless results for the requests concerned, the same in every implementation (rules in
    spec_kernels._checks), and the kernels bound every index they read or write (indptr ranges
    cut to the tensors, slot ids by S), so they never access memory out of bounds. GPU
    paths never sync with the host (CUDA-graph capturable after a warm-up call: Triton autotunes
    on the first call of a shape). Results are deterministic.

    Example:
        >>> mask = spec_kernels.tree_mask_from_parents(parents, qo_indptr)
        >>> o = spec_kernels.mla_tree_verify_attention(q, kv_cache, kv_indptr, kv_indices, qo_indptr,
        ...                                            mask, sm_scale=layer.scaling)
    """
    kv2d, like = _check_inputs(q, kv_cache, kv_indptr, kv_indices, v_head_dim,
                               (("qo_indptr", qo_indptr), ("tree_mask", tree_mask), ("out", out)))
    dev, T, B = q.device, q.shape[0], kv_indptr.numel() - 1
    check_tensor(qo_indptr, "qo_indptr", dim=1, dtypes=(torch.int32,), device=dev, like=like)
    check_shape(qo_indptr, "qo_indptr", (B + 1,), "B+1, like kv_indptr")
    check_tensor(tree_mask, "tree_mask", dim=1, dtypes=(torch.int64,), device=dev, like=like)
    check_shape(tree_mask, "tree_mask", (T,), "one word per query row of q")
    check_max_draft_tokens(max_draft_tokens)
    scales = check_kv_scales(q, kv2d, None, k_scale, v_scale, ("kv_cache", "kv_cache"))
    if values_checkable(kv_indptr, qo_indptr, kv_indices, tree_mask):
        check_draft_values(qo_indptr, kv_indptr, kv_indices, tree_mask, T, kv2d.shape[0], max_draft_tokens,
                            "kv_cache")
    return _run(q, kv2d, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, v_head_dim, return_lse, out, impl,
                num_kv_splits, max_draft_tokens, scales)


def mla_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: Optional[float] = None,
    v_head_dim: int = 512,
    return_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    impl: Optional[str] = None,
    num_kv_splits: Optional[int] = None,
    k_scale: Optional[Union[float, torch.Tensor]] = None,
    v_scale: Optional[Union[float, torch.Tensor]] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Plain MLA decode: one query token per request over all of its KV slots.

    The n_b = 1 case of :func:`mla_tree_verify_attention` (same kernels, no tree mask): q is
    [B, H, D], request b's slots are ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` (its last
    slot is the new token's). A request with no slot gets zeros and lse = -inf. Arguments,
    non-finite inputs, results and guarantees as there.
    """
    kv2d, _ = _check_inputs(q, kv_cache, kv_indptr, kv_indices, v_head_dim, (("out", out),))
    B = kv_indptr.numel() - 1
    if q.shape[0] != B:
        raise ValueError(f"q must have one row per request: q.shape[0]={q.shape[0]} but kv_indptr has B={B}")
    scales = check_kv_scales(q, kv2d, None, k_scale, v_scale, ("kv_cache", "kv_cache"))
    if values_checkable(kv_indptr, kv_indices):
        check_kv_values(kv_indptr, kv_indices, kv2d.shape[0], [0] * B, "kv_cache")
    return _run(q, kv2d, kv_indptr, kv_indices, None, None, sm_scale, v_head_dim, return_lse, out, impl,
                num_kv_splits, 1, scales)


def _run(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, v_head_dim, return_lse, out, impl,
         num_kv_splits, max_draft_tokens, scales: KvScales = NO_SCALES):
    check_num_kv_splits(num_kv_splits)
    out = check_out(out, q, v_head_dim)
    lse = q.new_empty(q.shape[:2], dtype=torch.float32) if return_lse else None
    torch.ops.spec_kernels.mla_tree_verify_attention(
        q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, softmax_scale(sm_scale, q.shape[2]), v_head_dim,
        out, lse, impl or "", int(num_kv_splits or 0), int(max_draft_tokens or 0),
        scales.k, scales.v, scales.k_tensor, scales.v_tensor,
    )
    return (out, lse) if return_lse else out
