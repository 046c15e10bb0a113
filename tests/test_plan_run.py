"""Plan once per batch, run per layer (TreeVerifyPlan, MlaPlan): the same results as the one-call
functions, bit for bit, for every implementation that runs here, over random trees, odd sizes,
empty prefixes and mixed draft counts, decode included; the split buffers made once and reused;
bad layouts and layer tensors refused naming the argument."""
import pytest
import torch

import spec_kernels
from spec_kernels import TreeVerifyPlan
from spec_kernels.mla import MlaPlan
from spec_kernels.testing import make_case

IMPLS = ["reference", "triton"]


def _plan(case, impl, decode=False, **kw):
    T, Hq, D = case.q.shape
    Hkv, Dv = case.k_cache.shape[1], case.v_cache.shape[2]
    layout = (case.kv_indptr, case.kv_indices) if decode else (case.kv_indptr, case.kv_indices, case.qo_indptr,
                                                               case.tree_mask)
    return TreeVerifyPlan(*layout, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, v_head_dim=Dv, dtype=case.q.dtype,
                          impl=impl, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ns,prefixes,splits", [([3, 1, 4], [0, 37, 130], None), ([5], [300], 3),
                                                ([1, 0, 2], [64, 9, 0], None), ([2, 2], [600, 1], 2)])
def test_tree_verify_plan_runs_like_the_one_call_function(impl, ns, prefixes, splits):
    case = make_case(ns, prefixes, hq=4, hkv=2, d=64, dtype=torch.float16, seed=sum(prefixes))
    plan = _plan(case, impl, num_kv_splits=splits, max_draft_tokens=max(ns) or 1)
    for layer in range(3):  # three layers: different K/V and q, one plan
        q = case.q + layer
        k, v = case.k_cache * (layer + 1), case.v_cache - layer
        want, want_lse = spec_kernels.tree_verify_attention(
            q, k, v, case.kv_indptr, case.kv_indices, case.qo_indptr, case.tree_mask, return_lse=True, impl=impl,
            num_kv_splits=splits, max_draft_tokens=max(ns) or 1)
        got, got_lse = plan.run(q, k, v, return_lse=True)
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_plan_runs_like_decode_attention(impl):
    case = make_case([1, 1, 1, 1], [0, 5, 70, 257], hq=8, hkv=2, d=128, dtype=torch.bfloat16, seed=4)
    plan = _plan(case, impl, decode=True)
    B = case.kv_indptr.numel() - 1
    q = case.q[:B]
    out = torch.empty(B, 8, 128, dtype=torch.bfloat16)
    got = plan.run(q, case.k_cache, case.v_cache, out=out)
    want = spec_kernels.decode_attention(q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices, impl=impl)
    assert got is out and torch.equal(got, want)


def test_split_buffers_are_made_once():
    case = make_case([2, 3], [400, 500], dtype=torch.float16, seed=1)
    plan = _plan(case, "triton", num_kv_splits=4)
    ws = plan.workspace
    assert plan.num_kv_splits == 4 and ws.o_partial.shape == (4, 5, 4, 64) and ws.lse_partial.shape == (4, 5, 4)
    before = (ws.o_partial.data_ptr(), ws.lse_partial.data_ptr())
    plan.run(case.q, case.k_cache, case.v_cache)
    plan.run(case.q, case.k_cache, case.v_cache)
    assert (plan.workspace.o_partial.data_ptr(), plan.workspace.lse_partial.data_ptr()) == before


def test_split_workspace_plan_forced_and_automatic():
    from spec_kernels.attention.plan import MIN_SPLIT_KEYS, SplitWorkspace

    def never():
        raise AssertionError("a forced split count must not run the planner")

    forced = SplitWorkspace.plan(3, never, 5, 4, 64, torch.device("cpu"))
    assert (forced.splits, forced.min_chunk) == (3, 0) and forced.o_partial.shape == (3, 5, 4, 64)
    auto = SplitWorkspace.plan(None, lambda: 2, 5, 4, 64, torch.device("cpu"))
    assert (auto.splits, auto.min_chunk) == (2, MIN_SPLIT_KEYS) and auto.lse_partial.shape == (2, 5, 4)
    one = SplitWorkspace.plan(0, lambda: 1, 5, 4, 64, torch.device("cpu"))
    assert (one.splits, one.o_partial, one.lse_partial) == (1, None, None)


@pytest.mark.parametrize("decode", [False, True])
def test_one_call_and_plan_split_through_the_same_planner(monkeypatch, decode):
    """The one-call functions are plan + run in one: both get their split from SplitWorkspace.plan
    with the implementation's planner, so a change to the planner reaches both."""
    from spec_kernels.attention import plan as attention_plan

    calls = []
    real = attention_plan.SplitWorkspace.plan

    def recording(num_kv_splits, auto, *rest):
        ws = real(num_kv_splits, auto, *rest)
        calls.append((bool(num_kv_splits), ws.splits, ws.min_chunk, rest))
        return ws

    monkeypatch.setattr(attention_plan.SplitWorkspace, "plan", staticmethod(recording))
    case = make_case([1, 1] if decode else [3, 2], [300, 40], dtype=torch.float16, seed=2)
    args = (case.kv_indptr, case.kv_indices) if decode else (case.kv_indptr, case.kv_indices, case.qo_indptr,
                                                             case.tree_mask)
    q = case.q[:2] if decode else case.q
    if decode:
        spec_kernels.decode_attention(q, case.k_cache, case.v_cache, *args, impl="triton")
    else:
        spec_kernels.tree_verify_attention(q, case.k_cache, case.v_cache, *args, impl="triton")
    _plan(case, "triton", decode=decode).run(q, case.k_cache, case.v_cache)
    assert len(calls) == 2 and calls[0] == calls[1], calls


def test_plan_refuses_bad_layouts_and_layer_tensors():
    case = make_case([2, 1], [3, 4], dtype=torch.float16)
    with pytest.raises(ValueError, match="kv_indptr"):
        TreeVerifyPlan(case.kv_indptr.long(), case.kv_indices, case.qo_indptr, case.tree_mask, num_q_heads=4,
                       num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="head_dim"):
        TreeVerifyPlan(case.kv_indptr, case.kv_indices, case.qo_indptr, case.tree_mask, num_q_heads=4,
                       num_kv_heads=2, head_dim=96)
    with pytest.raises(ValueError, match="num_q_heads"):
        TreeVerifyPlan(case.kv_indptr, case.kv_indices, case.qo_indptr, case.tree_mask, num_q_heads=3,
                       num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="qo_indptr and tree_mask"):
        TreeVerifyPlan(case.kv_indptr, case.kv_indices, case.qo_indptr, None, num_q_heads=4, num_kv_heads=2,
                       head_dim=64)
    plan = _plan(case, "reference")
    with pytest.raises(ValueError, match="q must have shape"):
        plan.run(case.q[:2], case.k_cache, case.v_cache)
    with pytest.raises(ValueError, match="k_cache"):
        plan.run(case.q, case.k_cache.float(), case.v_cache)
    with pytest.raises(ValueError, match="v_cache"):
        plan.run(case.q, case.k_cache, case.v_cache[:, :1])
    # Slot ids are checked against the first run's cache (CPU tensors): a cache too small is refused.
    with pytest.raises(ValueError, match="k_cache"):
        plan.run(case.q, case.k_cache[:2], case.v_cache[:2])


def _mla_case(ns, prefixes, H=4, dtype=torch.float16, seed=0):
    base = make_case(ns, prefixes, hq=H, hkv=1, d=64, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    S = base.k_cache.shape[0]
    q = torch.randn(base.q.shape[0], H, 576, generator=gen).to(dtype)
    kv = torch.randn(S, 1, 576, generator=gen).to(dtype)
    return base, q, kv


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("decode", [False, True])
def test_mla_plan_runs_like_the_one_call_functions(impl, decode):
    base, q, kv = _mla_case([2, 3, 1] if not decode else [1, 1, 1], [40, 0, 300], seed=7)
    B = base.kv_indptr.numel() - 1
    if decode:
        q = q[:B]
        plan = MlaPlan(base.kv_indptr, base.kv_indices, num_heads=4, dtype=q.dtype, impl=impl)
        want = spec_kernels.mla_decode_attention(q, kv, base.kv_indptr, base.kv_indices, impl=impl)
    else:
        plan = MlaPlan(base.kv_indptr, base.kv_indices, base.qo_indptr, base.tree_mask, num_heads=4, dtype=q.dtype,
                       impl=impl, max_draft_tokens=3)
        want = spec_kernels.mla_tree_verify_attention(q, kv, base.kv_indptr, base.kv_indices, base.qo_indptr,
                                                      base.tree_mask, impl=impl, max_draft_tokens=3)
    assert torch.equal(plan.run(q, kv), want)


def test_run_ops_pass_opcheck():
    case = make_case([3, 2], [40, 300], dtype=torch.float32, seed=2)
    T, Hq, D = case.q.shape
    out, lse = torch.empty(T, Hq, D), torch.empty(T, Hq)
    o_part, lse_part = torch.empty(2, T, Hq, D), torch.empty(2, T, Hq)
    layout = (case.kv_indptr, case.kv_indices, case.qo_indptr, case.tree_mask)
    for impl, splits, parts in (("reference", 1, (None, None)), ("triton", 2, (o_part, lse_part))):
        torch.library.opcheck(torch.ops.spec_kernels.tree_verify_attention_run.default,
                              (case.q, case.k_cache, case.v_cache, *layout, 0.125, out, lse, *parts, impl, splits,
                               0, 0))
    base, q, kv = _mla_case([2, 1], [30, 5], dtype=torch.float32, seed=3)
    torch.library.opcheck(torch.ops.spec_kernels.mla_tree_verify_attention_run.default,
                          (q, kv.view(-1, 576), base.kv_indptr, base.kv_indices, base.qo_indptr, base.tree_mask,
                           0.05, 512, torch.empty(3, 4, 512), None, None, None, "reference", 1, 0, 0))


@pytest.mark.parametrize("impl", IMPLS)
def test_plan_run_compiles_fullgraph(impl):
    case = make_case([4, 1], [50, 9], dtype=torch.float32, seed=5)
    plan = _plan(case, impl, num_kv_splits=2)
    plan.run(case.q, case.k_cache, case.v_cache)  # the first run checks the values (CPU)

    def layer(q, k, v):
        return plan.run(q, k, v) * 2

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(case.q, case.k_cache, case.v_cache), layer(case.q, case.k_cache, case.v_cache))


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [False, True])
def test_gpu_plan_is_captured_and_replayed(decode):
    case = make_case([16, 3, 9], [5000, 70, 0], hq=8, hkv=2, d=128, dtype=torch.bfloat16, seed=1, device="cuda")
    plan = _plan(case, None, decode=decode, max_draft_tokens=None if decode else 16)
    q = case.q[:3] if decode else case.q
    eager = plan.run(q, case.k_cache, case.v_cache)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = plan.run(q, case.k_cache, case.v_cache)
    q.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(captured, eager)
    want = (spec_kernels.decode_attention(q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices) if decode
            else spec_kernels.tree_verify_attention(*case.args, max_draft_tokens=16))
    torch.testing.assert_close(captured, want, atol=0, rtol=0)
