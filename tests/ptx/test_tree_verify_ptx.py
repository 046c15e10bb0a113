"""The compiled tree-verify / decode attention kernels (csrc/tree_verify/*.cu, sm_120a PTX) run by
the PTX interpreter against the reference, through the real Python binding
(spec_kernels.tree_verify.cuda: launch plan, split buffers) with cuda_ops pointing at the
interpreter.

Tolerances: the reference runs in fp32 on the same fp16/bf16 inputs. The kernel rounds P to the
input type for the PV mma and rounds the output once, so |err| <= ~2 ulp of the input type at the
output's magnitude (|out| < 4 here): 2e-2 for bf16 (ulp 2^-8 at 1..2), 5e-3 for fp16 (2^-10).
lse is computed in fp32 from fp32 logits: 1e-4.
"""
import pytest
import torch

import spec_kernels
from spec_kernels.tree_verify import cuda as tv_cuda
from spec_kernels.testing import make_case

from tools.ptx_harness.cuda_glue import PtxCudaOps
from tools.ptx_harness.cuda_glue import run_tree_verify as run_ptx

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def reference(case, decode=False, sm_scale=None):
    T = case.kv_indptr.numel() - 1 if decode else case.q.shape[0]
    if decode:
        return spec_kernels.decode_attention(case.q[:T].float(), case.k_cache.float(), case.v_cache.float(),
                                             case.kv_indptr, case.kv_indices, sm_scale=sm_scale, impl="reference",
                                             return_lse=True)
    return spec_kernels.tree_verify_attention(case.q.float(), case.k_cache.float(), case.v_cache.float(),
                                              case.kv_indptr, case.kv_indices, case.qo_indptr, case.tree_mask,
                                              sm_scale=sm_scale, impl="reference", return_lse=True)


def check(case, dtype, **kw):
    ops = PtxCudaOps()
    out, lse = run_ptx(case, ops, **kw)
    ref, ref_lse = reference(case, kw.get("decode", False))
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-4, rtol=1e-4, equal_nan=True)
    return ops


# (draft counts, prefix lengths, hq, hkv, head dim, dtype, tree kind, forced splits, index dtype)
CASES = [
    ([5, 0, 17], [70, 3, 0], 4, 2, 64, torch.bfloat16, "random", 2, torch.int32),   # n_b 0, empty prefix, split
    ([3, 9], [0, 130], 2, 2, 64, torch.float16, "forest", 0, torch.int64),         # 3 tiles, partial, int64 idx
    ([64], [5], 2, 1, 64, torch.bfloat16, "chain", 0, torch.int32),                # n_b = 64: two row blocks
    ([7, 2], [40, 65], 4, 1, 128, torch.float16, "wide", 3, torch.int32),          # D 128, 3 splits
    ([4], [33], 2, 1, 256, torch.bfloat16, "random", 0, torch.int32),              # D 256 (32-key stages)
    ([9, 2], [380, 3], 2, 1, 128, torch.bfloat16, "random", 0, torch.int64),      # D 128: 3 stages, 7 tiles
    # D 128, > 64 rows: 128-row CTAs (8 warps); 16 x 8 = 128 rows, 5 x 8 = 40 (warps_m 4 x warps_n 2),
    # an empty request, a second row block of the grid (max_rows 168) with no rows; 2 splits
    ([16, 5, 0], [300, 70, 3], 8, 1, 128, torch.float16, "random", 2, torch.int32),
]


@pytest.mark.parametrize("ns,prefixes,hq,hkv,d,dtype,kind,splits,idx", CASES,
                         ids=[f"case{i}" for i in range(len(CASES))])
def test_tree_verify_matches_reference(ns, prefixes, hq, hkv, d, dtype, kind, splits, idx):
    case = make_case(ns, prefixes, hq=hq, hkv=hkv, d=d, dtype=dtype, kind=kind, index_dtype=idx, seed=sum(ns) + d)
    ops = check(case, dtype, splits=splits)
    names = [l[0] for l in ops.launches]
    assert any(n.startswith("tree_verify_kernel") for n in names)
    assert ("merge_splits" in " ".join(names)) == (splits > 1)


@pytest.mark.parametrize("dtype,splits,d", [(torch.bfloat16, 0, 64), (torch.float16, 2, 64), (torch.bfloat16, 0, 128),
                                            (torch.float16, 2, 128)])
def test_decode_matches_reference(dtype, splits, d):
    case = make_case([1, 1, 1], [9, 66, 1 if d == 64 else 260], hq=8, hkv=2, d=d, dtype=dtype, seed=3)
    ops = check(case, dtype, decode=True, splits=splits)
    # sm_120 (100 KB per SM): D = 128 decode takes the small configuration (two CTAs per SM)
    small = [l[0] for l in ops.launches if l[0].startswith("tree_verify_kernel")][0].endswith("Li32ELb0ELi1E")
    assert small == (d == 128)


def test_decode_sm90a_large_configuration():
    """sm_90a (228 KB per SM) keeps the large D = 128 configuration for decode: 4 warps on 16 keys
    each of a 64-key stage."""
    case = make_case([1, 1], [300, 5], hq=8, hkv=1, d=128, dtype=torch.bfloat16, seed=4)
    ops = PtxCudaOps(arch="sm_90a")
    out, lse = run_ptx(case, ops, decode=True)
    assert [l[0] for l in ops.launches] == ["tree_verify_kernelI13__nv_bfloat16Li128ELi64ELb0ELi1E"]
    ref, ref_lse = reference(case, decode=True)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-4, rtol=1e-4)


def test_nan_in_attended_key_gives_nan_row_only():
    case = make_case([3, 2], [20, 4], hq=2, hkv=1, d=64, dtype=torch.bfloat16, kind="chain", seed=5)
    # poison the K row of request 1's first prefix slot: every row of request 1 sees it
    slot = int(case.kv_indices[int(case.kv_indptr[1])])
    case.k_cache[slot, 0, 3] = float("nan")
    ops = PtxCudaOps()
    out, lse = run_ptx(case, ops)
    assert torch.isnan(out[3:].float()).all() and torch.isnan(lse[3:]).all()
    assert torch.isfinite(out[:3].float()).all() and torch.isfinite(lse[:3]).all()
    ref, ref_lse = reference(case)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2, equal_nan=True)


def growing_scores_case(seed=31):
    """Request 0's prefix keys scaled up tile by tile (x 1, 4, 7, ...): its rows' running max
    jumps by more than 2^8 at most tiles (the O / l rescale), by less within them; request 1 is
    plain random (the max stays within 2^8 of the first tile's: no rescale after it)."""
    case = make_case([5, 3], [600, 200], hq=4, hkv=1, d=128, dtype=torch.bfloat16, kind="random", seed=seed)
    start = int(case.kv_indptr[0])
    for pos in range(600):
        slot = int(case.kv_indices[start + pos])
        case.k_cache[slot] = (case.k_cache[slot].float() * (1 + 3 * (pos // 64))).to(case.k_cache.dtype)
    return case


@pytest.mark.parametrize("splits", [0, 2])
def test_running_max_growing_across_tiles(splits):
    case = growing_scores_case()
    check(case, torch.bfloat16, splits=splits)
    _, ref_lse = reference(case)
    assert ref_lse[:5].max() > ref_lse[5:].max() + 30  # the case grows the max far beyond 2^8


def infinite_logit_case():
    """Request 1's prefix key 70 (in tile 1, a full one) has an infinite element that its head-0
    rows multiply by -1 and its head-1 rows by +1."""
    case = make_case([3, 2], [200, 200], hq=2, hkv=1, d=64, dtype=torch.bfloat16, kind="chain", seed=6)
    case.k_cache[int(case.kv_indices[int(case.kv_indptr[1]) + 70]), 0, 3] = float("inf")
    case.q[3:, 0, 3] = -1.0
    case.q[3:, 1, 3] = 1.0
    return case


@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
def test_infinite_logit_in_a_full_tile_gives_nan_rows(arch):
    """An infinite K element in a prefix tile without masked keys (the fast path, which finds it
    from the raw scores' extremes): every row that sees it is NaN, the other request's are not,
    whether its logit is -inf (head 0: the key would just weigh 0) or +inf (head 1); an infinite
    Q element (row 2 of request 0) does the same to its own row only."""
    case = infinite_logit_case()
    case.q[2, 1, 5] = float("-inf")
    ops = PtxCudaOps(arch=arch)
    out, lse = run_ptx(case, ops)
    ref, ref_lse = reference(case)
    assert torch.isnan(out[3:].float()).all() and torch.isnan(lse[3:]).all()
    assert torch.isnan(out[2, 1].float()).all() and torch.isnan(lse[2, 1])
    assert torch.isfinite(out[:2].float()).all() and torch.isfinite(out[2, 0].float()).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2, equal_nan=True)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-4, rtol=1e-4, equal_nan=True)


@pytest.mark.parametrize("sm_scale", [-0.125, -4.0, 0.0])
def test_negative_and_zero_softmax_scale(sm_scale):
    """A negative scale makes the raw scores' minimum the row max (at -4 a tile's scores span far
    more than 2^128, so any other max overflows the weights); zero gives uniform weights."""
    case = make_case([6, 2], [300, 70], hq=4, hkv=2, d=64, dtype=torch.bfloat16, kind="random", seed=9)
    ops = PtxCudaOps()
    out, lse = run_ptx(case, ops, sm_scale=sm_scale)
    ref, ref_lse = reference(case, sm_scale=sm_scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-4, rtol=1e-4)


def test_counters_read_each_kv_byte_once():
    """Tree verify with n = 16 drafts on a 240-key prefix, all 4 query heads of the KV head in
    one CTA: every K and V byte the request references is read exactly once, and no ldmatrix or
    cp.async store has a shared-memory bank conflict."""
    case = make_case([16], [240], hq=4, hkv=1, d=64, dtype=torch.bfloat16, kind="random", seed=7)
    ops = check(case, torch.bfloat16)
    stats = [l[4] for l in ops.launches if l[0].startswith("tree_verify_kernel")][0]
    kv_bytes = 256 * 64 * 2            # keys x D x bf16, per cache
    assert stats.region_read["k_cache"] == kv_bytes, stats.region_read
    assert stats.region_read["v_cache"] == kv_bytes, stats.region_read
    assert stats.bank_conflicts.get("ldmatrix.sync.aligned.m8n8.x4.shared.b16", 0) == 0
    assert stats.bank_conflicts.get("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", 0) == 0
    assert stats.bank_conflicts.get("cp.async.cg.shared.global", 0) == 0


def test_wide_configuration_reads_kv_once():
    """n = 16 drafts x GQA 8 = 128 rows at D = 128: one 8-warp CTA holds all of them, so every K
    and V byte of the request is read once (64-row CTAs read it twice), with no bank conflict."""
    case = make_case([16], [240], hq=8, hkv=1, d=128, dtype=torch.bfloat16, kind="random", seed=8)
    ops = check(case, torch.bfloat16, max_draft_tokens=16)
    launch = [l for l in ops.launches if l[0].startswith("tree_verify_kernel")][0]
    assert launch[0].endswith("Li128ELi128ELb0ELi1E") and launch[1] == (1, 1) and launch[2] == (256,)
    stats = launch[4]
    kv_bytes = 256 * 128 * 2  # keys x D x bf16, per cache
    assert stats.region_read["k_cache"] == kv_bytes, stats.region_read
    assert stats.region_read["v_cache"] == kv_bytes, stats.region_read
    for op in ("ldmatrix.sync.aligned.m8n8.x4.shared.b16", "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
               "cp.async.cg.shared.global"):
        assert stats.bank_conflicts.get(op, 0) == 0, (op, stats.bank_conflicts)


# sm_90a, more than 64 rows at D = 128: the 128-row configuration with two m tiles per warp
# (draft counts, prefixes, hq, hkv, dtype, tree kind, forced splits)
PAIRED_CASES = [
    ([16, 5, 0], [300, 70, 3], 8, 1, torch.float16, "random", 2),  # 128 rows (4 x 2 warps), 40 (2 x 4), none
    ([9, 16], [130, 0], 8, 1, torch.bfloat16, "forest", 0),        # 72 rows: a half-empty warp, an idle one
    ([13, 4], [250, 61], 16, 2, torch.bfloat16, "chain", 3),       # 104 rows, 2 KV heads, 3 splits
]


@pytest.mark.parametrize("ns,prefixes,hq,hkv,dtype,kind,splits", PAIRED_CASES,
                         ids=[f"case{i}" for i in range(len(PAIRED_CASES))])
def test_sm90a_two_m_tiles_per_warp(ns, prefixes, hq, hkv, dtype, kind, splits):
    case = make_case(ns, prefixes, hq=hq, hkv=hkv, d=128, dtype=dtype, kind=kind, seed=sum(ns) + hq)
    ops = PtxCudaOps(arch="sm_90a")
    out, lse = run_ptx(case, ops, splits=splits)
    launch = [l for l in ops.launches if l[0].startswith("tree_verify_kernel")][0]
    assert launch[0].endswith("Li128ELi128ELb0ELi2E") and launch[2] == (256,), launch[:3]
    ref, ref_lse = reference(case)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-4, rtol=1e-4, equal_nan=True)
    stats = launch[4]
    for op in ("ldmatrix.sync.aligned.m8n8.x4.shared.b16", "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
               "cp.async.cg.shared.global"):
        assert stats.bank_conflicts.get(op, 0) == 0, (op, stats.bank_conflicts)


def test_sm90a_two_m_tiles_read_two_thirds_of_the_shared_bytes():
    """Per KV tile each of the 8 warps of the two-m-tile configuration loads K, V and Q fragments
    of 8 KB (192 KB) where the one-m-tile configuration loads K and V of 16 KB (256 KB)."""
    case = make_case([16], [256], hq=8, hkv=1, d=128, dtype=torch.bfloat16, kind="random", seed=8)
    per_tile = {}
    for arch in ("sm_90a", "sm_120a"):
        ops = PtxCudaOps(arch=arch)
        run_ptx(case, ops)
        st = [l[4] for l in ops.launches if l[0].startswith("tree_verify_kernel")][0]
        per_tile[arch] = st.shared_bytes["ldmatrix"]
    # 4 prefix tiles and the tail tile of 16 drafts, which the warps of the second key half skip
    # (two m tiles) and every warp reads whole (one m tile, which also loads Q into registers once)
    assert per_tile["sm_120a"] == 5 * 256 * 1024 + 8 * 16 * 128 * 2
    assert per_tile["sm_90a"] == 4 * 192 * 1024 + 96 * 1024


def test_sm90a_ptx_matches_reference():
    """The sm_90a build (H100/H200) compiles the same source to different PTX: run it too."""
    case = make_case([5, 2], [70, 0], hq=4, hkv=2, d=64, dtype=torch.bfloat16, kind="random", seed=21)
    ops = PtxCudaOps(arch="sm_90a")
    out, lse = run_ptx(case, ops, splits=2)
    ref, ref_lse = reference(case)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-4, rtol=1e-4)


def test_planned_workspace_gives_the_one_call_result():
    """The CUDA binding with a plan's SplitWorkspace (splits, min_chunk and the split buffers made
    once, spec_kernels.TreeVerifyPlan) writes what the one-call path writes, bit for bit, and its
    kernels write the plan's partial buffers (NaN before the launch)."""
    from spec_kernels.attention.plan import SplitWorkspace

    case = make_case([3, 6], [150, 40], hq=4, hkv=2, d=64, dtype=torch.float16, seed=9)
    T, Hq, D = case.q.shape
    want, want_lse = run_ptx(case, PtxCudaOps(), splits=3)
    ws = SplitWorkspace.make(3, True, T, Hq, D, case.q.device)
    ws.o_partial.fill_(float("nan"))
    ws.lse_partial.fill_(float("nan"))
    out = torch.full((T, Hq, D), float("nan"), dtype=case.q.dtype)
    lse = torch.full((T, Hq), float("nan"))
    saved = tv_cuda.cuda_ops
    ops = PtxCudaOps()
    tv_cuda.cuda_ops = lambda: ops
    try:
        tv_cuda.tree_verify_attention(case.q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices,
                                      case.qo_indptr, case.tree_mask, D ** -0.5, out, lse, workspace=ws)
    finally:
        tv_cuda.cuda_ops = saved
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert not ws.lse_partial.isnan().all() and any("merge_splits" in launch[0] for launch in ops.launches)


@pytest.mark.parametrize("arch", ["sm_120a", "sm_90a"])
def test_split_merges_wait_for_the_attention_kernel(arch):
    """Both attention families launch their split merge as a programmatic dependent (the planner's
    KernelResources.dependent_merge says so): in the shipped PTX every merge kernel's
    griddepcontrol.wait comes before its first global load, and every attention kernel lets its
    dependents start (griddepcontrol.launch_dependents)."""
    import os

    from ptxsim.launch import module_of
    from tools.ptx_harness.build import cuda_ptx
    from tools.ptx_harness.cuda_glue import REPO

    assert tv_cuda.cuda_tree_verify_resources(128, 64).dependent_merge
    for cu, merge, attention in (("tree_verify/tree_verify_attention.cu", "merge_splits_kernel", "tree_verify_kernel"),
                                 ("mla/mla_tree_verify_attention.cu", "mla_merge_splits_kernel", "mla_tree_verify_kernel")):
        mod = module_of(cuda_ptx(os.path.join(REPO, "csrc", cu), arch))
        merges = [e for n, e in mod.entries.items() if merge in n and (merge != "merge_splits_kernel" or "mla" not in n)]
        kernels = [e for n, e in mod.entries.items() if attention in n]
        assert merges and kernels, sorted(mod.entries)
        for e in merges:
            ops = [i.opcode for i in e.instrs]
            assert "griddepcontrol.wait" in ops, e.name
            first_load = next(k for k, op in enumerate(ops) if op.startswith("ld.global"))
            assert ops.index("griddepcontrol.wait") < first_load, e.name
        for e in kernels:
            assert "griddepcontrol.launch_dependents" in [i.opcode for i in e.instrs], e.name
