"""Tree-verify attention: public functions, their checks, and the torch custom ops behind them.

    torch.ops.spec_kernels.tree_verify_attention   (decode is the same op with qo_indptr=None)
    torch.ops.spec_kernels.tree_mask_from_parents

Each custom op mutates a preallocated output and returns nothing, has a fake implementation
(FakeTensorMode, torch.compile(fullgraph=True)), and picks its implementation with the dispatch
rule of spec_kernels._ops (cuda -> triton -> reference, or the one forced with impl=).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_indptr_values,
    check_shape,
    check_tensor,
    common_device,
    values_checkable,
)
from .._limits import MAX_DRAFT_TOKENS
from .._ops import cuda_ops, op_impls
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

HEAD_DIMS = (64, 128, 256)

TREE_VERIFY = op_impls("tree_verify_attention")
TREE_MASK = op_impls("tree_mask_from_parents")

TREE_VERIFY.register("cuda", supports=cuda_binding.supports)(cuda_binding.tree_verify_attention)
TREE_VERIFY.register("triton")(triton_kernel.tree_verify_attention)


@TREE_VERIFY.register("reference")
def _tree_verify_reference(q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask,
                           sm_scale, out, lse, num_kv_splits=0, max_draft_tokens=0, scales=NO_SCALES):
    # The reference is exact and loops over requests: no splits, no launch sizing (the draft
    # bound only matters for unchecked input: drafts past it are left unwritten, as by the kernels).
    k_scale, v_scale = scales.values()
    reference.tree_verify_attention(q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr,
                                    tree_mask, sm_scale, out, lse, max_draft_tokens, k_scale, v_scale)



@TREE_MASK.register("cuda")
def _tree_mask_cuda(parents, qo_indptr, tree_mask):
    cuda_ops().tree_mask_from_parents(parents.to(torch.int64), qo_indptr, tree_mask)


TREE_MASK.register("reference")(reference.tree_mask_from_parents)


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("spec_kernels::tree_verify_attention", mutates_args=("out", "lse"))
def _tree_verify_op(
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
    impl: str,
    num_kv_splits: int,
    max_draft_tokens: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    k_scale_tensor: Optional[torch.Tensor] = None,
    v_scale_tensor: Optional[torch.Tensor] = None,
) -> None:
    _, fn = TREE_VERIFY.select(q.device, impl or None, args=(q, k_cache, v_cache))
    fn(q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, out, lse, num_kv_splits,
       max_draft_tokens, **scales_kwargs(k_scale, v_scale, k_scale_tensor, v_scale_tensor))


@_tree_verify_op.register_fake
def _(q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, out, lse, impl, num_kv_splits,
      max_draft_tokens, k_scale=1.0, v_scale=1.0, k_scale_tensor=None, v_scale_tensor=None):
    return None


@torch.library.custom_op("spec_kernels::tree_verify_attention_run",
                         mutates_args=("out", "lse", "o_partial", "lse_partial"))
def _tree_verify_run_op(
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
    """The planned launch (spec_kernels.tree_verify.plan.TreeVerifyPlan.run): the implementation,
    the splits, their minimum share and the split buffers come from the plan."""
    fn = TREE_VERIFY.impls[impl]
    scales = scales_kwargs(k_scale, v_scale, k_scale_tensor, v_scale_tensor)
    if impl == "reference":
        fn(q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, out, lse, num_kv_splits,
           max_draft_tokens, **scales)
        return
    fn(q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, out, lse, num_kv_splits,
       max_draft_tokens, workspace=SplitWorkspace(num_kv_splits, min_chunk, o_partial, lse_partial), **scales)


@_tree_verify_run_op.register_fake
def _(q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, out, lse, o_partial, lse_partial,
      impl, num_kv_splits, min_chunk, max_draft_tokens, k_scale=1.0, v_scale=1.0, k_scale_tensor=None,
      v_scale_tensor=None):
    return None


@torch.library.custom_op("spec_kernels::tree_mask_from_parents", mutates_args=("tree_mask",))
def _tree_mask_op(parents: torch.Tensor, qo_indptr: torch.Tensor, tree_mask: torch.Tensor, impl: str) -> None:
    _, fn = TREE_MASK.select(parents.device, impl or None)
    fn(parents, qo_indptr, tree_mask)


@_tree_mask_op.register_fake
def _(parents, qo_indptr, tree_mask, impl):
    return None


# --------------------------------------------------------------------------- checks
def _check_kv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr, kv_indices, others=()):
    """Metadata checks of the tensors every call has; returns the device all tensors (others
    included: the call's other tensors, for the device vote) must be on and how errors name it."""
    dev, like = common_device([("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("kv_indptr", kv_indptr),
                               ("kv_indices", kv_indices), *others])
    check_tensor(q, "q", dim=3, dtypes=FLOAT_DTYPES, device=dev, like=like)
    check_tensor(k_cache, "k_cache", dim=3, device=dev, like=like)
    check_tensor(v_cache, "v_cache", dim=3, device=dev, like=like)
    check_kv_dtypes(q, k_cache, v_cache)
    check_tensor(kv_indptr, "kv_indptr", dim=1, dtypes=(torch.int32,), device=dev, like=like)
    check_tensor(kv_indices, "kv_indices", dim=1, dtypes=INDEX_DTYPES, device=dev, like=like)
    _, Hq, D = q.shape
    S, Hkv, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"k_cache head dim must equal q's ({D}), got k_cache shape {tuple(k_cache.shape)}")
    if D not in HEAD_DIMS:
        raise ValueError(f"q head dim must be one of {HEAD_DIMS}, got {D}")
    if tuple(v_cache.shape[:2]) != (S, Hkv):
        raise ValueError(f"v_cache must have shape ({S}, {Hkv}, Dv) like k_cache, got {tuple(v_cache.shape)}")
    if v_cache.shape[2] not in HEAD_DIMS:
        raise ValueError(f"v_cache head dim must be one of {HEAD_DIMS}, got {v_cache.shape[2]}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k_cache heads ({Hkv})")
    if kv_indptr.numel() < 1:
        raise ValueError("kv_indptr must have B+1 >= 1 entries")
    return dev, like


# --------------------------------------------------------------------------- public API
def tree_verify_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    qo_indptr: torch.Tensor,
    tree_mask: torch.Tensor,
    sm_scale: Optional[float] = None,
    return_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    impl: Optional[str] = None,
    num_kv_splits: Optional[int] = None,
    max_draft_tokens: Optional[int] = None,
    k_scale: Optional[Union[float, torch.Tensor]] = None,
    v_scale: Optional[Union[float, torch.Tensor]] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Attention of a batch of draft-token trees over a paged (token-slot) KV cache.

    Request b owns queries ``q[qo_indptr[b]:qo_indptr[b+1]]`` (its n_b draft tokens in draft
    order, 0 <= n_b <= 64) and KV slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``: first its
    prefix (every draft sees all of it), then the slots of its n_b drafts in draft order. Draft
    i of a request sees draft j iff bit j of ``tree_mask[qo_indptr[b] + i]`` is set (build it
    with :func:`tree_mask_from_parents`); only bits 0..i may be set (the draft itself and earlier
    drafts, i.e. its ancestors). Query head h reads KV head ``h // (Hq // Hkv)``.

    Args:
        q: [T, Hq, D] fp16/bf16/fp32, T = qo_indptr[-1]. D in {64, 128, 256}.
        k_cache: [S, Hkv, D], q's dtype, or an fp8 cache (float8_e4m3fn / float8_e5m2, q fp16 or
            bf16) holding K / k_scale; Hq must be a multiple of Hkv (MHA, GQA, MQA).
        v_cache: [S, Hkv, Dv], Dv in {64, 128, 256}, k_cache's dtype.
        kv_indptr: int32 [B+1], non-decreasing, kv_indptr[0] >= 0 (an offset: kv_indices may be a
            window of a larger buffer), kv_indptr[-1] <= len(kv_indices), and at least n_b slots
            per request. kv_indices: int32 or int64 slot ids in [0, S).
        qo_indptr: int32 [B+1], non-decreasing, qo_indptr[0] == 0, qo_indptr[-1] == T.
        tree_mask: int64 [T]; row qo_indptr[b] + i may set bits 0..i only.
        sm_scale: softmax scale, default 1/sqrt(D).
        return_lse: also return the natural-log log-sum-exp of each row's logits, fp32 [T, Hq].
        out: optional [T, Hq, Dv] output buffer (q's dtype), written in place and returned.
        impl: "cuda", "triton" or "reference" to force one; default the fastest available.
        num_kv_splits: split every prefix into this many parts (flash-decoding); default from
            the shapes and the GPU (the CTAs it holds at once, spec_kernels.attention.plan), never
            from the tensors' values.
        max_draft_tokens: an upper bound of every n_b (1..64), e.g. the server's draft-token
            count; it only sizes the launch (default min(T, 64)). A request with more drafts
            than this bound is a contract violation: checked on CPU / in debug mode, and its
            extra rows otherwise get unspecified values.
        k_scale, v_scale: an fp8 cache's per-layer scales (required then, refused otherwise): K =
            k_cache * k_scale, V = v_cache * v_scale. A Python float (finite, > 0), or a
            1-element fp32 tensor on the cache's device, read by the kernel on the device (a CUDA
            graph replay uses its current value; its value is checked on CPU / in debug mode).

    Returns:
        o [T, Hq, Dv] in q's dtype (softmax and accumulation in fp32), or (o, lse).
        A query that sees no key (empty prefix and an empty mask row) gets zeros and lse = -inf.

    fp8 caches: the fp8 values are converted exactly to q's dtype (every e4m3fn / e5m2 value is
    an fp16 and a bf16 value) and feed the same dots as a cache of q's dtype; k_scale multiplies
    the logits and v_scale the output, in fp32. So the error against a float64 computation on
    the dequantised values is that of the fp16 / bf16 path. An e4m3fn NaN byte (0x7f / 0xff) in
    a K row a query sees makes that row NaN, an e5m2 inf or NaN likewise, as below.

    Non-finite inputs (the same in every implementation, as in torch SDPA and FlashInfer):
        * NaN or +-inf in a query row, or in the K row of a slot it sees, makes that row's
          output and lse NaN (a -inf logit is not read as "masked");
        * NaN or inf in the V row of a slot a row sees makes those output columns NaN or inf
          (the lse depends on the logits only); such a V value in a draft slot the row does not
          see may reach it as well (its zero weight times NaN is NaN), so do not rely on it;
        * a row that sees no slot gets zeros and lse = -inf, whatever its query or the V rows
          hold.

    Guarantees: every input's dtype, device, rank, shape and contiguity is checked (ValueError
    or TypeError naming it). Index values (the indptr rules above, n_b <= 64, slot ranges, mask
    bits of later drafts or past n_b) are checked on CPU tensors, and on CUDA tensors in debug
    mode (SPEC_KERNELS_DEBUG=1) since that needs a host sync. Unchecked invalid values never make
    a kernel access memory out of bounds, and all implementations treat them alike (indptr
    ranges cut to the tensors, bad slot ids read as zero rows, mask bits of later drafts ignored:
    spec_kernels._checks), but the results for the requests concerned are meaningless. The GPU
    paths launch without host synchronisation, so they can be captured in a CUDA graph (warm
    up first: Triton autotunes on the first call of a shape). Results are deterministic.

    Example:
        >>> mask = spec_kernels.tree_mask_from_parents(parents, qo_indptr)
        >>> o = spec_kernels.tree_verify_attention(q, k_cache, v_cache, kv_indptr, kv_indices,
        ...                                        qo_indptr, mask)
    """
    dev, like = _check_kv(q, k_cache, v_cache, kv_indptr, kv_indices,
                          (("qo_indptr", qo_indptr), ("tree_mask", tree_mask), ("out", out)))
    B = kv_indptr.numel() - 1
    T = q.shape[0]
    check_tensor(qo_indptr, "qo_indptr", dim=1, dtypes=(torch.int32,), device=dev, like=like)
    check_shape(qo_indptr, "qo_indptr", (B + 1,), "B+1, like kv_indptr")
    check_tensor(tree_mask, "tree_mask", dim=1, dtypes=(torch.int64,), device=dev, like=like)
    check_shape(tree_mask, "tree_mask", (T,), "one word per query row of q")
    check_max_draft_tokens(max_draft_tokens)
    scales = check_kv_scales(q, k_cache, v_cache, k_scale, v_scale)
    if values_checkable(kv_indptr, qo_indptr, kv_indices, tree_mask):
        check_draft_values(qo_indptr, kv_indptr, kv_indices, tree_mask, T, k_cache.shape[0], max_draft_tokens)
    return _run(q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, return_lse,
                out, impl, num_kv_splits, max_draft_tokens, scales)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: Optional[float] = None,
    return_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    impl: Optional[str] = None,
    num_kv_splits: Optional[int] = None,
    k_scale: Optional[Union[float, torch.Tensor]] = None,
    v_scale: Optional[Union[float, torch.Tensor]] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Plain decode attention: one query per request over all of its KV slots.

    The n_b = 1 case of :func:`tree_verify_attention` (same kernel, no tree mask):
    q is [B, Hq, D], request b's slots are ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``
    (its last slot is the new token's; kv_indptr non-decreasing, kv_indptr[0] >= 0,
    kv_indptr[-1] <= len(kv_indices)). A request with no slot gets zeros and lse = -inf.
    Arguments, non-finite inputs, results and guarantees as there.
    """
    _check_kv(q, k_cache, v_cache, kv_indptr, kv_indices, (("out", out),))
    B = kv_indptr.numel() - 1
    if q.shape[0] != B:
        raise ValueError(f"q must have one row per request: q.shape[0]={q.shape[0]} but kv_indptr has B={B}")
    scales = check_kv_scales(q, k_cache, v_cache, k_scale, v_scale)
    if values_checkable(kv_indptr, kv_indices):
        check_kv_values(kv_indptr, kv_indices, k_cache.shape[0], [0] * B)
    return _run(q, k_cache, v_cache, kv_indptr, kv_indices, None, None, sm_scale, return_lse,
                out, impl, num_kv_splits, 1, scales)


def _run(q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, return_lse,
         out, impl, num_kv_splits, max_draft_tokens, scales: KvScales = NO_SCALES):
    check_num_kv_splits(num_kv_splits)
    out = check_out(out, q, v_cache.shape[2])
    lse = q.new_empty(q.shape[:2], dtype=torch.float32) if return_lse else None
    torch.ops.spec_kernels.tree_verify_attention(
        q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask,
        softmax_scale(sm_scale, q.shape[2]), out, lse, impl or "", int(num_kv_splits or 0), int(max_draft_tokens or 0),
        scales.k, scales.v, scales.k_tensor, scales.v_tensor,
    )
    return (out, lse) if return_lse else out


def tree_mask_from_parents(parents: torch.Tensor, qo_indptr: torch.Tensor, impl: Optional[str] = None) -> torch.Tensor:
    """The tree mask of :func:`tree_verify_attention` from parent pointers.

    Args:
        parents: int32/int64 [T]; ``parents[qo_indptr[b] + i]`` is the index (within request b)
            of draft i's parent, or -1 for a root. Parents must precede their children
            (-1 <= parents[i] < i), as in EAGLE and Medusa trees.
        qo_indptr: int32 [B+1], request b's drafts are rows qo_indptr[b]:qo_indptr[b+1] (<= 64);
            qo_indptr[0] == 0, non-decreasing, qo_indptr[-1] == T.
    Returns:
        int64 [T]: bit j of row i set iff draft j is draft i itself or one of its ancestors.
    qo_indptr and parent values are checked on CPU tensors (and on CUDA in debug mode, see
    tree_verify_attention). Unchecked on CUDA, an invalid link ends that row's walk and an invalid
    qo_indptr is cut to [0, T) like in tree_verify_attention (rows no request claims are left
    unwritten); never a bad access.
    """
    dev, like = common_device([("parents", parents), ("qo_indptr", qo_indptr)])
    check_tensor(parents, "parents", dim=1, dtypes=INDEX_DTYPES, device=dev, like=like)
    check_tensor(qo_indptr, "qo_indptr", dim=1, dtypes=(torch.int32,), device=dev, like=like)
    if qo_indptr.numel() < 1:
        raise ValueError("qo_indptr must have B+1 >= 1 entries")
    T = parents.shape[0]
    if values_checkable(parents, qo_indptr):
        qo = check_indptr_values(qo_indptr, "qo_indptr", T, "parents.shape[0]")
        pv = parents.tolist()
        for b in range(len(qo) - 1):
            if qo[b + 1] - qo[b] > MAX_DRAFT_TOKENS:
                raise ValueError(f"qo_indptr: request {b} has {qo[b + 1] - qo[b]} draft tokens, at most {MAX_DRAFT_TOKENS}")
            for i in range(qo[b + 1] - qo[b]):
                p = pv[qo[b] + i]
                if not -1 <= p < i:
                    raise ValueError(f"parents[{qo[b] + i}] = {p} (request {b}, draft {i}) must be -1 or "
                                     f"the index of an earlier draft of the same request (0..{i - 1}; requests as "
                                     f"qo_indptr gives them)")
    tree_mask = torch.empty(T, dtype=torch.int64, device=parents.device)
    torch.ops.spec_kernels.tree_mask_from_parents(parents, qo_indptr, tree_mask, impl or "")
    return tree_mask
