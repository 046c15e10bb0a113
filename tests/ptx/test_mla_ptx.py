"""The compiled sm_120a PTX of the MLA tree-verify attention kernel (csrc/mla/mla_tree_verify_attention.cu,
split-KV partials + combine) run through tools/ptxsim, against the PyTorch reference.

The real Python binding (spec_kernels.mla.cuda: launch plan, split buffers) runs with its cuda_ops
patched to tests/ptx/cuda_glue.PtxCudaOps, which fills MlaParams and sizes grid / block / shared
memory like csrc/mla/mla_binding.cpp and the .cu launch(). Cases are tiny (one CTA handles up to 32 rows x 576
dims, and the interpreter runs every thread): bf16 and fp16, tree verify and decode, empty
prefixes, partial key tiles, mixed draft counts including 0, one and several KV splits, 16- and
32-row CTAs, several row blocks per request, int32 and int64 slot ids, NaN in a cached row.
"""
from __future__ import annotations

import math

import pytest
import torch

from tools.ptx_harness import build
from spec_kernels.testing import ancestor_mask_bits, random_parents

import spec_kernels.mla.cuda as mla_cuda
from spec_kernels.mla import reference

pytestmark = [
    pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not found (set CUDA_HOME): the kernel's PTX cannot "
                       "be produced"),
    # The epilogue computes acc * (1 / l) before selecting 0 for rows that saw no key (l = 0): the
    # discarded 0 * inf makes numpy warn inside the interpreter; the selected value is 0.
    pytest.mark.filterwarnings("ignore:invalid value encountered in multiply"),
]

D, DV = mla_cuda.HEAD_DIM, mla_cuda.V_HEAD_DIM  # 576 = 512 latent + 64 rope

# Half an ulp of the storage dtype, relative: bf16 keeps 8 significant bits, fp16 11.
HALF_ULP = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


@pytest.fixture
def ops(monkeypatch):
    from tools.ptx_harness.cuda_glue import PtxCudaOps

    o = PtxCudaOps()
    monkeypatch.setattr(mla_cuda, "cuda_ops", lambda: o)
    return o


def make_case(ns, prefixes, heads, dtype, *, decode=False, index_dtype=torch.int32, seed=0):
    """Request b: ns[b] drafts (a random tree) after prefixes[b] prefix slots (decode: one query per
    request over all prefixes[b] slots); the slots are a random subset of a larger pool."""
    gen = torch.Generator().manual_seed(seed)
    if decode:
        ns = [1] * len(prefixes)
        kv_lens = list(prefixes)
    else:
        kv_lens = [p + n for p, n in zip(prefixes, ns)]
    num_slots = sum(kv_lens) + 5
    T = sum(ns)
    parents = torch.tensor([p for n in ns for p in random_parents(n, "random", gen)], dtype=torch.int64)
    qo_indptr = torch.tensor([0] + list(ns), dtype=torch.int64).cumsum(0).to(torch.int32)
    return dict(
        q=torch.randn(T, heads, D, generator=gen).to(dtype),
        kv_cache=torch.randn(num_slots, D, generator=gen).to(dtype),
        kv_indptr=torch.tensor([0] + kv_lens, dtype=torch.int64).cumsum(0).to(torch.int32),
        kv_indices=torch.randperm(num_slots, generator=gen)[: sum(kv_lens)].to(index_dtype),
        qo_indptr=None if decode else qo_indptr,
        tree_mask=None if decode else ancestor_mask_bits(parents, qo_indptr),
    )


def run_both(c, *, splits, max_draft_tokens=0, sm_scale=None):
    """(kernel out, kernel lse, reference out, reference lse). The kernel's buffers start as NaN so
    that a row it does not write cannot pass."""
    q = c["q"]
    T, H, _ = q.shape
    sm_scale = sm_scale if sm_scale is not None else 1 / math.sqrt(D)
    args = (q, c["kv_cache"], c["kv_indptr"], c["kv_indices"], c["qo_indptr"], c["tree_mask"], sm_scale, DV)
    out = torch.full((T, H, DV), float("nan"), dtype=q.dtype)
    lse = torch.full((T, H), float("nan"))
    mla_cuda.mla_tree_verify_attention(*args, out, lse, num_kv_splits=splits, max_draft_tokens=max_draft_tokens)
    ref = torch.empty(T, H, DV, dtype=q.dtype)
    ref_lse = torch.empty(T, H)
    reference.mla_tree_verify_attention(*args, ref, ref_lse, max_draft_tokens)
    return out, lse, ref, ref_lse


def assert_matches(c, out, lse, ref, ref_lse):
    """Tolerances from the arithmetic the kernel does differently from the fp32 reference:
    * the logits and every lse input are fp32 on both sides (the interpreter's mma sums the exact
      products, within ~1 fp32 ulp of the hardware): lse agrees to a few fp32 ulps -> 1e-5;
    * P (softmax weights, <= 1) is rounded to the storage dtype before P @ V (mma inputs), so
      each term p_j v_j carries a relative error <= half an ulp: |err| <= HALF_ULP * max|v|
      (the row sum l is taken before that rounding) -> atol;
    * both outputs are then rounded to the storage dtype independently: one ulp of the value,
      i.e. 2 * HALF_ULP relative -> rtol."""
    half_ulp = HALF_ULP[out.dtype]
    vmax = c["kv_cache"][:, :DV].float().nan_to_num(0.0).abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), atol=half_ulp * vmax, rtol=2 * half_ulp, equal_nan=True)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5, equal_nan=True)


def assert_reads_each_kv_row_once_per_row_block(ops, c, max_rows):
    """The kernel's point: every (request, 16/32/64-row block) CTA streams the request's KV rows once
    for all its query rows, over all splits together (prefix shares + the tail in the last split),
    and the swizzled 1152-byte rows give no shared-memory bank conflicts (cp.async stores,
    ldmatrix of Q, K and V^T)."""
    H = c["q"].shape[1]
    block_m = mla_cuda.block_m(max_rows)
    kv = c["kv_indptr"].tolist()
    qo = c["qo_indptr"].tolist() if c["qo_indptr"] is not None else list(range(len(kv)))
    rows = [min((qo[b + 1] - qo[b]) * H, max_rows) for b in range(len(kv) - 1)]
    expected = sum(-(-r // block_m) * (kv[b + 1] - kv[b]) for b, r in enumerate(rows)) * D * 2
    (stats,) = [st for name, *_, st in ops.launches if "mla_tree_verify_kernel" in name]
    assert stats.region_read["kv_cache"] == expected, stats.region_read
    conflicts = {k: int(v) for k, v in stats.bank_conflicts.items() if v}
    assert not conflicts, conflicts


@pytest.mark.parametrize(
    "dtype,ns,prefixes,heads,splits,max_draft,index_dtype",
    [
        # mixed n_b incl. 0, an empty prefix, partial tiles (5, 3 keys), 20 rows -> one 32-row CTA
        pytest.param(torch.bfloat16, [2, 0, 3], [5, 3, 0], 4, 1, 0, torch.int32, id="bf16-tree-split1-bm32"),
        # the same batch with max_draft_tokens=3 -> 12 rows: 16-row CTAs (32-key tiles); 3 splits: a
        # 70-key prefix splits into 32 + 32 + 6, a 4-key one into 4 + nothing + nothing, the empty
        # prefix's splits see nothing (lse_s = -inf)
        pytest.param(torch.bfloat16, [3, 0, 2], [70, 4, 0], 4, 3, 3, torch.int64, id="bf16-tree-split3-bm16"),
        # fp16, 2 splits of a 33-key prefix: ceil(33 / 2) rounded up to whole 16-key tiles = 32 + 1
        # (a one-key partial tile)
        pytest.param(torch.float16, [2, 1], [33, 0], 3, 2, 0, torch.int32, id="f16-tree-split2"),
        # 3 drafts x 16 heads = 48 rows: one 64-row CTA (8 warps), rows 48-63 empty
        pytest.param(torch.float16, [3], [7], 16, 1, 0, torch.int32, id="f16-tree-bm64"),
        # 5 x 16 = 80 and 2 x 16 = 32 rows: two 64-row blocks per request (the second 16 rows or
        # none), 2 splits of a 40-key prefix (32 + 8 keys: 16-key tiles)
        pytest.param(torch.bfloat16, [5, 2], [40, 9], 16, 2, 0, torch.int64, id="bf16-tree-bm64-two-row-blocks"),
        # 17 drafts: two tail tiles (mask bit 16 in the second); 64 drafts x 1 head: one 64-row
        # block, four tail tiles, mask bit 63 (the sign bit of the int64 word)
        pytest.param(torch.bfloat16, [17, 2], [3, 20], 1, 2, 0, torch.int32, id="bf16-tree-17-drafts"),
        pytest.param(torch.float16, [64], [0], 1, 1, 0, torch.int64, id="f16-tree-64-drafts"),
    ],
)
def test_tree_verify_matches_reference(ops, dtype, ns, prefixes, heads, splits, max_draft, index_dtype):
    c = make_case(ns, prefixes, heads, dtype, index_dtype=index_dtype, seed=sum(prefixes) + heads)
    out, lse, ref, ref_lse = run_both(c, splits=splits, max_draft_tokens=max_draft)
    assert_matches(c, out, lse, ref, ref_lse)
    names = [name for name, *_ in ops.launches]
    assert any("mla_tree_verify_kernel" in n for n in names)
    assert any("mla_merge_splits_kernel" in n for n in names) == (splits > 1)
    grid_y = {g[1] for name, g, *_ in ops.launches if "mla_tree_verify_kernel" in name}
    assert grid_y == {splits}
    assert_reads_each_kv_row_once_per_row_block(ops, c, min(sum(ns), max_draft or 64) * heads)


# sm_90's configuration for 64-row CTAs (MlaTile<4, kFp8, 4>: 32-key tiles, 32 x 32 S units over
# a quarter of the dims each, partial sums added through shared memory): the sm_90a PTX, where the
# launch takes it (an H200's shared memory holds it; sm_120's does not).
@pytest.mark.parametrize(
    "dtype,ns,prefixes,heads,splits,max_draft,index_dtype",
    [
        # 48 rows in one CTA (rows 48-63 empty), a 7-key prefix (one partial 32-key tile)
        pytest.param(torch.float16, [3], [7], 16, 1, 0, torch.int32, id="f16-tree-h16"),
        # two row blocks per request, 2 splits of a 70-key prefix (64 + 6 keys), an empty prefix
        pytest.param(torch.bfloat16, [5, 2], [70, 0], 16, 2, 0, torch.int64, id="bf16-tree-two-row-blocks-split2"),
        # 64 drafts x 1 head: two tail tiles, mask bits 32-63 in the second
        pytest.param(torch.float16, [64], [33], 1, 1, 0, torch.int32, id="f16-tree-64-drafts"),
    ],
)
def test_sm90_k_split_configuration_matches_reference(monkeypatch, dtype, ns, prefixes, heads, splits, max_draft,
                                                      index_dtype):
    from tools.ptx_harness.cuda_glue import PtxCudaOps
    from tools.ptx_harness.shipped import device_smem

    ops = PtxCudaOps(arch="sm_90a")
    monkeypatch.setattr(mla_cuda, "cuda_ops", lambda: ops)
    assert _ops_shape(64, "sm_90a").block_n == 32 and _ops_shape(64, "sm_120a").block_n == 16
    c = make_case(ns, prefixes, heads, dtype, index_dtype=index_dtype, seed=sum(prefixes) + heads)
    out, lse, ref, ref_lse = run_both(c, splits=splits, max_draft_tokens=max_draft)
    assert_matches(c, out, lse, ref, ref_lse)
    (name,) = [n for n, *_ in ops.launches if "mla_tree_verify_kernel" in n]
    assert name.endswith("Li4ELb0ELi4E"), name  # <T, 4 m tiles, 16-bit cache, k split 4>
    assert_reads_each_kv_row_once_per_row_block(ops, c, min(sum(ns), max_draft or 64) * heads)
    assert device_smem("sm_90a")[0] >= _ops_shape(64, "sm_90a").smem_bytes > 99 * 1024


def _ops_shape(rows, arch):
    from spec_kernels import _ops
    from tools.ptx_harness.shipped import device_smem

    return _ops.mla_launch_config(rows, *device_smem(arch))


@pytest.mark.parametrize(
    "dtype,prefixes,heads,splits",
    [
        # 16 heads (DeepSeek-V3 at TP8) -> one 16-row CTA (32-key tiles) per request; a request with
        # no slot (zeros, lse = -inf), 1 key, 40 keys over 2 splits (32 + an 8-key partial tile)
        pytest.param(torch.bfloat16, [0, 1, 40], 16, 2, id="bf16-decode-h16-split2"),
        # odd head count, no split
        pytest.param(torch.float16, [9, 3], 5, 1, id="f16-decode-h5-split1"),
        # 40 heads -> one 64-row CTA (8 warps) per request, rows 40-63 empty; 2 splits
        pytest.param(torch.bfloat16, [20, 3], 40, 2, id="bf16-decode-h40-bm64"),
    ],
)
def test_decode_matches_reference(ops, dtype, prefixes, heads, splits):
    c = make_case(None, prefixes, heads, dtype, decode=True, seed=7 + heads)
    out, lse, ref, ref_lse = run_both(c, splits=splits)
    assert_matches(c, out, lse, ref, ref_lse)
    assert_reads_each_kv_row_once_per_row_block(ops, c, heads)
    if prefixes[0] == 0:  # a request with no key: zeros and lse = -inf, not NaN
        assert torch.equal(out[0].float(), torch.zeros_like(out[0].float()))
        assert torch.isneginf(lse[0]).all()


def test_nan_in_a_cached_row_follows_the_reference(ops):
    """Non-finite values as documented (spec_kernels.tree_verify.reference): NaN in the K part of a
    slot a row sees makes that row's output and lse NaN; the slot's V part enters every row of the
    request as weight * V, so a row that does not see the slot gets NaN in those columns only
    (0 * NaN), with a finite lse. Request: 3 drafts (a chain) after 2 prefix keys; NaN in column
    100 (latent: K and V) of draft 1's slot, seen by drafts 1 and 2, not by draft 0."""
    c = make_case([3], [2], 2, torch.bfloat16, seed=3)
    c["tree_mask"] = torch.tensor([0b1, 0b11, 0b111], dtype=torch.int64)
    draft1_slot = int(c["kv_indices"][2 + 1])
    c["kv_cache"][draft1_slot, 100] = float("nan")
    out, lse, ref, ref_lse = run_both(c, splits=2)
    assert torch.isnan(out[1:]).all() and torch.isnan(lse[1:]).all()
    nan_cols = torch.isnan(out[0]).any(0).nonzero().flatten().tolist()
    assert nan_cols == [100] and torch.isfinite(lse[0]).all()
    assert_matches(c, out, lse, ref, ref_lse)


def _invalid_cases():
    """Unchecked invalid index values (the CPU API refuses them; on a GPU they reach the kernel
    without debug checks): every one must stay inside the tensors (the interpreter raises on any
    out-of-bounds access) and give the reference's rows for the queries some request claims."""
    i32 = dict(dtype=torch.int32)
    base = make_case([3, 2, 4, 1], [10, 0, 20, 5], 1, torch.bfloat16, seed=33)  # kv_indptr 0 13 15 39 45
    bad_slots = base["kv_indices"].clone()
    bad_slots[[2, 20, 44]] = torch.tensor([-7, 10**6, base["kv_cache"].shape[0]], dtype=bad_slots.dtype)
    g = torch.Generator().manual_seed(33)
    changes = {
        "negative_kv_indptr": dict(kv_indptr=torch.tensor([-3, 13, 15, 39, 45], **i32)),
        "negative_qo_and_kv": dict(qo_indptr=torch.tensor([0, -1, 5, 9, 10], **i32),
                                   kv_indptr=torch.tensor([0, -4, 15, 39, 45], **i32)),
        "decreasing_kv_indptr": dict(kv_indptr=torch.tensor([0, 13, 15, 2, 45], **i32)),
        "unordered_qo_indptr": dict(qo_indptr=torch.tensor([6, 8, 2, 5, 6], **i32)),
        "kv_indptr_past_the_end": dict(kv_indptr=torch.tensor([0, 13, 15, 39, 10**6], **i32)),
        "bad_slot_ids": dict(kv_indices=bad_slots),
        "garbage_mask_bits": dict(tree_mask=torch.randint(-2**63, 2**63 - 1, (10,), generator=g)),
        "more_drafts_than_the_bound": dict(max_draft_tokens=2),
    }
    return {name: {**base, "max_draft_tokens": 0, **c} for name, c in changes.items()}


INVALID = _invalid_cases()


def _claimed(qo_indptr, bound, T):
    """Query rows some request owns after the kernels cut qo_indptr to [0, T] and n_b to the bound."""
    qo, claimed = qo_indptr.tolist(), torch.zeros(T, dtype=torch.bool)
    for b in range(len(qo) - 1):
        lo = min(max(qo[b], 0), T)
        claimed[lo:min(min(max(qo[b + 1], lo), T), lo + bound)] = True
    return claimed


@pytest.mark.parametrize("name,splits", [(name, 1 + i % 2) for i, name in enumerate(INVALID)])
def test_unchecked_invalid_indices_stay_in_bounds_and_match_the_reference(ops, name, splits):
    c = INVALID[name]
    q = c["q"]
    T, H, _ = q.shape
    args = (q, c["kv_cache"], c["kv_indptr"], c["kv_indices"], c["qo_indptr"], c["tree_mask"], 0.04, DV)
    out, lse = torch.full((T, H, DV), 7.0, dtype=q.dtype), torch.full((T, H), 7.0)
    mla_cuda.mla_tree_verify_attention(*args, out, lse, num_kv_splits=splits, max_draft_tokens=c["max_draft_tokens"])
    ref, ref_lse = torch.full_like(out, 7.0), torch.full_like(lse, 7.0)
    reference.mla_tree_verify_attention(*args, ref, ref_lse, c["max_draft_tokens"])
    claimed = _claimed(c["qo_indptr"], c["max_draft_tokens"] or 64, T)
    assert claimed.sum() >= 4 and torch.isfinite(out[claimed]).all()
    if splits == 1:  # without the combine pass, rows no request claims are not written
        assert torch.all(out[~claimed] == 7.0) and torch.all(lse[~claimed] == 7.0)
    # the claimed rows: the tolerance of assert_matches (a row that sees nothing: 0 and -inf on both sides)
    vmax = c["kv_cache"][:, :DV].float().abs().max().item()
    torch.testing.assert_close(out[claimed].float(), ref[claimed].float(), atol=HALF_ULP[q.dtype] * vmax,
                               rtol=2 * HALF_ULP[q.dtype])
    torch.testing.assert_close(lse[claimed], ref_lse[claimed], atol=1e-5, rtol=1e-5)


def test_planned_workspace_gives_the_one_call_result(ops):
    """The CUDA binding with a plan's SplitWorkspace (spec_kernels.mla.MlaPlan) writes what the
    one-call path writes, bit for bit, through the plan's partial buffers."""
    from spec_kernels.attention.plan import SplitWorkspace

    c = make_case([2, 3], [90, 20], 4, torch.bfloat16, seed=4)
    q = c["q"]
    T, H, _ = q.shape
    args = (q, c["kv_cache"], c["kv_indptr"], c["kv_indices"], c["qo_indptr"], c["tree_mask"], 1 / math.sqrt(D), DV)
    want, want_lse = torch.empty(T, H, DV, dtype=q.dtype), torch.empty(T, H)
    mla_cuda.mla_tree_verify_attention(*args, want, want_lse, num_kv_splits=2)
    ws = SplitWorkspace.make(2, True, T, H, DV, q.device)
    ws.lse_partial.fill_(float("nan"))
    out, lse = torch.full((T, H, DV), float("nan"), dtype=q.dtype), torch.full((T, H), float("nan"))
    mla_cuda.mla_tree_verify_attention(*args, out, lse, workspace=ws)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert not ws.lse_partial.isnan().all()
