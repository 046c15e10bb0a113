"""tree_verify_attention / decode_attention: reference vs a naive dense-mask oracle, and the
Triton kernel (interpreter on CPU, compiled on GPU) vs the reference over random batches."""
import pytest
import torch

import spec_kernels
from spec_kernels.tree_verify import reference, triton_kernel
from spec_kernels.testing import make_case, mask_visible_slots, naive_attention

ATOL = 2e-3  # the bound for fp32 compute

# (draft counts, prefix lengths, tree kind, Hq, Hkv): random trees, odd sizes, empty prefixes,
# mixed draft counts including 0, MHA / GQA 4 / GQA 8 / MQA.
GRID = [
    pytest.param([3, 5, 16], [37, 0, 150], "chain", 8, 2, id="chains-gqa4"),
    pytest.param([7, 1, 12], [5, 90, 33], "wide", 8, 2, id="wide-gqa4"),
    pytest.param([9, 16], [123, 17], "random", 8, 1, id="deep-mqa"),
    pytest.param([16, 0, 4, 0], [64, 40, 0, 0], "forest", 8, 1, id="forest-gqa8-zero-drafts"),
    pytest.param([1, 1, 1, 1, 1], [0, 1, 63, 64, 65], "chain", 2, 2, id="n1-mha"),
    pytest.param([64], [30], "random", 4, 1, id="n64-gqa4"),
    pytest.param([64, 2], [0, 0], "chain", 2, 2, id="n64-empty-prefix"),
    pytest.param([5, 11, 3], [0, 0, 0], "random", 4, 4, id="empty-prefixes"),
]


@pytest.mark.parametrize("ns,prefixes,kind,hq,hkv", GRID)
def test_reference_matches_naive_dense_mask(ns, prefixes, kind, hq, hkv):
    case = make_case(ns, prefixes, hq=hq, hkv=hkv, kind=kind, seed=1)
    out, lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl="reference")
    want, want_lse = naive_attention(case)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ns,prefixes,kind,hq,hkv", GRID)
@pytest.mark.parametrize("splits", [None, 3])
def test_triton_matches_reference(ns, prefixes, kind, hq, hkv, splits):
    case = make_case(ns, prefixes, hq=hq, hkv=hkv, kind=kind, seed=2)
    ref, ref_lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl="reference")
    out, lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl="triton", num_kv_splits=splits)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL, rtol=0)


@pytest.mark.parametrize("d,dv", [(128, 128), (128, 64), (256, 256)])
def test_triton_head_dims(d, dv):
    case = make_case([4, 9], [20, 45], hq=4, hkv=2, d=d, dv=dv, seed=3)
    ref = spec_kernels.tree_verify_attention(*case.args, impl="reference")
    out = spec_kernels.tree_verify_attention(*case.args, impl="triton", num_kv_splits=2)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_triton_small_tiles_many_row_blocks_and_tail_tiles():
    # 16-row / 16-key tiles: rows span several blocks and the 40-draft tail spans three tiles.
    case = make_case([40, 6], [50, 3], hq=4, hkv=1, kind="random", seed=4)
    ref = spec_kernels.tree_verify_attention(*case.args, impl="reference")
    out = torch.empty_like(ref)
    triton_kernel.tree_verify_attention(*case.args, 0.125, out, None, num_kv_splits=4, block_m=16, block_n=16)
    want = spec_kernels.tree_verify_attention(*case.args, sm_scale=0.125, impl="reference")
    torch.testing.assert_close(out, want, atol=ATOL, rtol=0)
    assert not torch.equal(out, ref)  # the scale was really applied


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_sm_scale_int64_indices_and_out_buffer(impl):
    case = make_case([6, 2], [31, 8], hq=4, hkv=2, index_dtype=torch.int64, seed=5)
    out = torch.full((8, 4, 64), float("nan"))
    got = spec_kernels.tree_verify_attention(*case.args, sm_scale=0.3, out=out, impl=impl)
    assert got is out
    want, _ = naive_attention(case, sm_scale=0.3)
    torch.testing.assert_close(out.double(), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_inputs(dtype):
    # The interpreter computes in fp32 after exact loads; the output is rounded to dtype.
    case = make_case([5, 3], [40, 12], hq=4, hkv=2, dtype=dtype, seed=6)
    ref = spec_kernels.tree_verify_attention(*case.args, impl="reference")
    out = spec_kernels.tree_verify_attention(*case.args, impl="triton", num_kv_splits=2)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


def test_query_that_sees_nothing_gets_zeros_and_minus_inf_lse():
    case = make_case([3], [0], hq=2, hkv=1, kind="chain", seed=7)
    case.tree_mask[1] = 0  # draft 1 sees no key at all
    for impl in ("reference", "triton"):
        out, lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl=impl, num_kv_splits=2)
        assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("splits", [None, 2, 5])
def test_decode_triton_matches_reference_and_naive(splits):
    case = make_case([1] * 5, [0, 9, 70, 128, 33], hq=8, hkv=2, seed=8)
    ref, ref_lse = spec_kernels.decode_attention(case.q, case.k_cache, case.v_cache, case.kv_indptr,
                                                 case.kv_indices, return_lse=True, impl="reference")
    out, lse = spec_kernels.decode_attention(case.q, case.k_cache, case.v_cache, case.kv_indptr,
                                             case.kv_indices, return_lse=True, impl="triton", num_kv_splits=splits)
    want, want_lse = naive_attention(case, decode=True)
    torch.testing.assert_close(ref.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL, rtol=0)


def test_decode_equals_tree_verify_with_one_draft():
    case = make_case([1, 1, 1], [10, 0, 77], hq=4, hkv=1, seed=9)
    tree = spec_kernels.tree_verify_attention(*case.args, impl="triton")
    dec = spec_kernels.decode_attention(case.q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices, impl="triton")
    torch.testing.assert_close(dec, tree, atol=1e-6, rtol=0)


def test_triton_is_deterministic():
    case = make_case([16, 7], [100, 60], hq=8, hkv=2, seed=10)
    a = spec_kernels.tree_verify_attention(*case.args, impl="triton", num_kv_splits=3)
    b = spec_kernels.tree_verify_attention(*case.args, impl="triton", num_kv_splits=3)
    assert torch.equal(a, b)


def test_max_draft_tokens_bound_sizes_the_launch():
    case = make_case([16, 3, 16], [40, 0, 7], hq=8, hkv=2, seed=12)
    ref = spec_kernels.tree_verify_attention(*case.args, impl="reference")
    out = spec_kernels.tree_verify_attention(*case.args, impl="triton", max_draft_tokens=16)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="request 0 has 16 draft tokens, at most 8 max_draft_tokens"):
        spec_kernels.tree_verify_attention(*case.args, impl="triton", max_draft_tokens=8)


def test_triton_kernel_stays_in_bounds_on_malformed_indices():
    # The API rejects these on CPU; the kernel itself (what runs on CUDA without debug checks)
    # must still never touch memory outside the tensors: bad slots and indptr ends are skipped.
    case = make_case([4, 3], [20, 6], hq=4, hkv=2, seed=13)
    kv_indices = case.kv_indices.clone()
    kv_indices[3], kv_indices[30] = 10**6, -5
    kv_indptr = case.kv_indptr.clone()
    kv_indptr[-1] += 50  # past the end of kv_indices
    out = torch.full((7, 4, 64), float("nan"))
    triton_kernel.tree_verify_attention(case.q, case.k_cache, case.v_cache, kv_indptr, kv_indices, case.qo_indptr,
                                        case.tree_mask, 0.125, out, None, num_kv_splits=2)
    assert torch.isfinite(out).all()


def test_empty_batch():
    case = make_case([], [], hq=4, hkv=2, seed=11)
    for impl in ("reference", "triton"):
        out = spec_kernels.tree_verify_attention(*case.args, impl=impl)
        assert out.shape == (0, 4, 64)


def test_fixed_tile_falls_back_when_shared_memory_is_short(monkeypatch):
    """With autotune off on a GPU, a tile whose shared memory exceeds the device's (sm_120: 99 KB
    at head dim 256) fails its launch with OutOfResources before anything is queued; the launcher
    takes the next smaller tile and keeps it for the shape. (Triton itself faked here: on CPU the
    interpreter has no shared-memory limit.)"""
    from triton.runtime.errors import OutOfResources

    tried = []

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, BLOCK_N, num_warps, num_stages=3, **meta):
                tried.append((BLOCK_N, num_stages))
                if BLOCK_N * num_stages > limit:
                    raise OutOfResources(BLOCK_N * num_stages, limit, "shared memory")
            return launch

    monkeypatch.setattr(triton_kernel, "_tree_verify_fwd_kernel", Kernel())
    monkeypatch.setattr(triton_kernel, "triton_interpreting", lambda: False)
    monkeypatch.setattr(triton_kernel, "_kernel_for_launch", lambda: (None, True))
    monkeypatch.setattr(triton_kernel, "_fixed_tile_for", {})
    case = make_case([3, 2], [5, 0], hq=4, hkv=2, seed=3, dtype=torch.float16)
    c = case.args
    out = torch.empty(c[0].shape[0], 4, 64, dtype=torch.float16)

    def run():
        triton_kernel.tree_verify_attention(*c[:6], c[6], 0.125, out, None, num_kv_splits=1)

    limit = 64
    run()
    assert tried == [(64, 3), (64, 2), (32, 2)]
    tried.clear()
    run()
    assert tried == [(32, 2)]  # kept for the shape
    limit = 8
    monkeypatch.setattr(triton_kernel, "_fixed_tile_for", {})
    tried.clear()
    with pytest.raises(OutOfResources):
        run()
    assert tried == list(triton_kernel._FIXED_TILES)
    # head dim 256 and fp32 inputs start narrower (they do not fit sm_120 at BLOCK_N 64)
    assert triton_kernel._fixed_tiles(256, False)[0] == (32, 2) and triton_kernel._fixed_tiles(64, True)[0] == (16, 2)


# ----------------------------------------------------------------------------- GPU
GPU_GRID = GRID + [
    pytest.param([16] * 8, [4096] * 8, "random", 32, 8, id="gpu-b8-l4k"),
    pytest.param([16, 1, 64], [32768, 100, 1000], "random", 32, 4, id="gpu-32k-mixed"),
    pytest.param([16], [131072], "chain", 8, 1, id="gpu-128k"),
    pytest.param([4] * 256, [512] * 256, "random", 16, 2, id="gpu-b256"),
]


def _gpu_impls(dtype):
    # The CUDA kernel runs fp16/bf16 on tensor cores; fp32 goes to Triton.
    return ["triton"] + (["cuda"] if dtype != torch.float32 else [])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ns,prefixes,kind,hq,hkv", GPU_GRID)
def test_gpu_kernels_match_reference(ns, prefixes, kind, hq, hkv, dtype):
    case = make_case(ns, prefixes, hq=hq, hkv=hkv, d=128, kind=kind, dtype=dtype, seed=12, device="cuda")
    ref, ref_lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl="reference")
    tol = ATOL if dtype == torch.float32 else 2e-2
    for impl in _gpu_impls(dtype):
        for splits in (None, 3):
            out, lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl=impl, num_kv_splits=splits)
            torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol, msg=f"{impl} splits={splits}")
            torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol, msg=f"{impl} splits={splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_cuda_head_dims(d, dtype):
    case = make_case([16, 1, 40, 0], [3000, 17, 0, 9], hq=16, hkv=2, d=d, dtype=dtype, seed=13, device="cuda")
    ref = spec_kernels.tree_verify_attention(*case.args, impl="reference")
    out = spec_kernels.tree_verify_attention(*case.args, impl="cuda")
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_gpu_cuda_decode_and_determinism(splits):
    case = make_case([1] * 33, [0] + [4097] * 32, hq=32, hkv=8, d=128, dtype=torch.bfloat16, seed=14, device="cuda")
    args = (case.q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices)
    ref, ref_lse = spec_kernels.decode_attention(*args, return_lse=True, impl="reference")
    out, lse = spec_kernels.decode_attention(*args, return_lse=True, impl="cuda", num_kv_splits=splits)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-2)
    again = spec_kernels.decode_attention(*args, impl="cuda", num_kv_splits=splits)
    assert torch.equal(out, again)  # bitwise deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [True, False])
def test_gpu_dependent_and_plain_merge_launches_give_the_same_bytes(decode):
    """The split merge launched as a programmatic dependent (the default) and as a plain launch:
    bitwise the same output and lse, eagerly and replayed from a CUDA graph (a graph records the
    programmatic edge), at several split counts."""
    from spec_kernels.testing import programmatic_launch

    case = make_case([1] * 5 if decode else [16, 3, 9, 1], [4000, 37, 2500, 901, 5][:5 if decode else 4], hq=32,
                     hkv=4, d=128, dtype=torch.bfloat16, seed=17, device="cuda")
    run = (lambda s: spec_kernels.decode_attention(case.q, case.k_cache, case.v_cache, case.kv_indptr,
                                                   case.kv_indices, return_lse=True, impl="cuda", num_kv_splits=s)) \
        if decode else (lambda s: spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl="cuda",
                                                                    num_kv_splits=s))
    for splits in (2, 5, 16):
        with programmatic_launch(False):
            plain = run(splits)
        with programmatic_launch(True):
            dependent = run(splits)
            graph, out = torch.cuda.CUDAGraph(), None
            run(splits)  # warm-up outside the capture (launch attributes, allocator)
            with torch.cuda.graph(graph):
                out = run(splits)
            graph.replay()
            torch.cuda.synchronize()
        for got in (dependent, out):
            assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1]), f"{splits} splits"


@pytest.mark.gpu
def test_gpu_cuda_kernel_stays_in_bounds_on_malformed_indices():
    from spec_kernels.tree_verify import cuda as cuda_binding

    case = make_case([4, 3], [20, 6], hq=4, hkv=2, d=128, dtype=torch.bfloat16, seed=13, device="cuda")
    kv_indices = case.kv_indices.clone()
    kv_indices[3], kv_indices[30] = 10**6, -5
    kv_indptr = case.kv_indptr.clone()
    kv_indptr[-1] += 50  # past the end of kv_indices
    out = torch.full((7, 4, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    cuda_binding.tree_verify_attention(case.q, case.k_cache, case.v_cache, kv_indptr, kv_indices, case.qo_indptr,
                                       case.tree_mask, 0.125, out, None, num_kv_splits=2)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_triton_autotuned_matches_reference(monkeypatch, dtype):
    # gpu_check.sh runs the kernel tests untuned (one compile per shape instead of one per config);
    # this is the tuned path that benchmarks and servers take, verify and decode.
    monkeypatch.setenv("SPEC_KERNELS_TRITON_AUTOTUNE", "1")
    tol = ATOL if dtype == torch.float32 else 2e-2
    case = make_case([16, 1, 0, 9], [4000, 70, 0, 1000], hq=32, hkv=8, d=128, dtype=dtype, seed=16, device="cuda")
    ref = spec_kernels.tree_verify_attention(*case.args, impl="reference")
    out = spec_kernels.tree_verify_attention(*case.args, impl="triton")
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    args = (case.q[:4], case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices)  # one query per request
    ref = spec_kernels.decode_attention(*args, impl="reference")
    out = spec_kernels.decode_attention(*args, impl="triton")
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("ns", [[], [0, 0]], ids=["no-request", "no-draft"])
def test_gpu_empty_batches(ns):
    # T = 0 must return an empty output on every impl (CUDA launches nothing), not fail its checks.
    case = make_case(ns, [5] * len(ns), hq=8, hkv=2, d=128, dtype=torch.bfloat16, seed=11, device="cuda")
    for impl in ("cuda", "triton", "reference"):
        out, lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl=impl)
        assert out.shape == (0, 8, 128) and lse.shape == (0, 8)
        if not ns:
            args = (case.q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices)
            assert spec_kernels.decode_attention(*args, impl=impl).shape == (0, 8, 128)


@pytest.mark.gpu
def test_gpu_cuda_is_the_default_for_half_inputs():
    from spec_kernels.tree_verify.api import TREE_VERIFY

    case = make_case([4], [100], hq=8, hkv=2, d=128, dtype=torch.float16, seed=15, device="cuda")
    assert TREE_VERIFY.select(case.q.device, None, args=case.args[:3])[0] == "cuda"
    q32 = case.q.float()
    assert TREE_VERIFY.select(case.q.device, None, args=(q32, case.k_cache.float(), case.v_cache.float()))[0] == "triton"


# ----------------------------------------------------------------------------- non-finite inputs
# The rule (docstrings): a NaN/inf logit among the keys a row sees (NaN/inf in its query or in the
# K row of such a slot) makes the row's output and lse NaN; NaN in a V row the row sees makes that
# output column NaN; a row that sees nothing gets zeros and lse = -inf, whatever its query holds.
def _nonfinite_case(d=64, dtype=torch.float32, device="cpu"):
    """Three requests (drafts 5 / 3 / 2 after prefixes 40 / 6 / 0, chains) with NaN and inf put
    in q, K and V; returns the case and the bad entries, described by (token, head) / slot."""
    case = make_case([5, 3, 2], [40, 6, 0], hq=4, hkv=2, d=d, kind="chain", dtype=dtype, seed=21)
    kv = case.kv_indices.tolist()
    case.q[1, 2, 5] = float("nan")  # request 0, draft 1, head 2
    case.k_cache[kv[10], 0, 3] = float("inf")  # request 0's prefix, KV head 0 (query heads 0-1)
    case.k_cache[kv[45 + 6 + 1], 1, 0] = -float("inf")  # request 1's draft 1, KV head 1 (heads 2-3)
    case.v_cache[kv[45 + 2], 0, 7] = float("nan")  # request 1's prefix, KV head 0, column 7
    case.tree_mask[8] = 0  # request 2 (empty prefix), draft 0: sees nothing ...
    case.q[8] = float("nan")  # ... so its NaN query does not matter
    case.v_cache[kv[54 + 1], :, :] = float("nan")  # request 2's draft 1: draft 0 does not see it
    return type(case)(*(t.to(device) for t in vars(case).values()))


def _expected_nonfinite(case, decode=False):
    """From the definition (visible slots per row): NaN rows, NaN columns, unseen rows."""
    q, k, v = case.q.cpu().double(), case.k_cache.cpu().double(), case.v_cache.cpu().double()
    T, hq, _ = q.shape
    group = hq // k.shape[1]
    row_nan = torch.zeros(T, hq, dtype=torch.bool)
    col_nan = torch.zeros(T, hq, v.shape[2], dtype=torch.bool)
    seen = torch.zeros(T, hq, dtype=torch.bool)
    cpu_case = type(case)(*(t.cpu() for t in vars(case).values()))
    for t, rows in mask_visible_slots(cpu_case, decode):
        for h in range(hq):
            seen[t, h] = True
            row_nan[t, h] = bool((~torch.isfinite(q[t, h])).any() or (~torch.isfinite(k[rows, h // group])).any())
            col_nan[t, h] = torch.isnan(v[rows, h // group]).any(0)
    return row_nan, col_nan, seen


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN through numpy (interpreter)
@pytest.mark.parametrize("impl,splits", [("reference", None), ("triton", None), ("triton", 3)])
def test_nan_and_inf_inputs_give_nan_rows(impl, splits):
    case = _nonfinite_case()
    row_nan, col_nan, seen = _expected_nonfinite(case)
    assert row_nan.sum() >= 10 and col_nan.any() and (~seen).any()  # the case exercises every rule
    out, lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl=impl, num_kv_splits=splits)
    assert torch.equal(torch.isnan(lse), row_nan)
    assert torch.equal(torch.isnan(out), row_nan[..., None] | col_nan)
    assert torch.all(out[~seen] == 0) and torch.all(lse[~seen] == float("-inf"))
    # rows that see no bad value are the clean computation: compare with inputs made finite there
    clean = make_case([5, 3, 2], [40, 6, 0], hq=4, hkv=2, kind="chain", seed=21)
    clean.tree_mask[8] = 0
    want, want_lse = spec_kernels.tree_verify_attention(*clean.args, return_lse=True, impl="reference")
    ok = seen & ~row_nan & ~col_nan.any(-1)
    torch.testing.assert_close(out[ok], want[ok], atol=ATOL, rtol=0)
    torch.testing.assert_close(lse[ok], want_lse[ok], atol=ATOL, rtol=0)
    if impl == "triton":
        ref, ref_lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl="reference")
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0, equal_nan=True)
        torch.testing.assert_close(lse, ref_lse, atol=ATOL, rtol=0, equal_nan=True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("impl,splits", [("reference", None), ("triton", None), ("triton", 2)])
def test_decode_nan_inputs(impl, splits):
    case = make_case([1] * 4, [0, 9, 70, 33], hq=4, hkv=2, seed=22)
    kv = case.kv_indices.tolist()
    case.q[1, 3, 0] = float("nan")  # request 1, head 3
    case.k_cache[kv[11 + 5], 0, 1] = -float("inf")  # request 2 (slots 11..81), KV head 0: heads 0-1
    case.v_cache[kv[82 + 2], 1, 4] = float("nan")  # request 3 (slots 82..115), KV head 1: column 4 of heads 2-3
    case.kv_indptr[1] = 0  # request 0 has no KV slot (request 1 takes its slot) ...
    case.q[0] = float("nan")  # ... so it gets zeros and lse -inf, whatever its query
    args = (case.q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices)
    out, lse = spec_kernels.decode_attention(*args, return_lse=True, impl=impl, num_kv_splits=splits)
    row_nan, col_nan, seen = _expected_nonfinite(case, decode=True)
    assert row_nan.sum() == 3 and col_nan.sum() == 2 and (~seen).sum() == 4
    assert torch.equal(torch.isnan(lse), row_nan)
    assert torch.equal(torch.isnan(out), row_nan[..., None] | col_nan)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))


# ----------------------------------------------------------------------------- unchecked index values
# What the API rejects on CPU (and on CUDA in debug mode) reaches the kernels unchecked on CUDA.
# Every implementation cuts indptr ranges to the tensors, reads bad slot ids as zero rows, ignores
# mask bits of later drafts and leaves drafts past the launch's bound unwritten: they agree.
def _invalid_index_cases():
    base = make_case([3, 2, 4, 1], [10, 0, 20, 5], hq=4, hkv=2, kind="random", seed=23)
    g = torch.Generator().manual_seed(23)
    cases = {}

    def variant(name, **changes):
        cases[name] = {**dict(q=base.q, k_cache=base.k_cache, v_cache=base.v_cache, kv_indptr=base.kv_indptr,
                              kv_indices=base.kv_indices, qo_indptr=base.qo_indptr, tree_mask=base.tree_mask,
                              max_draft_tokens=0), **changes}

    i32 = dict(dtype=torch.int32)
    variant("negative_kv_indptr", kv_indptr=torch.tensor([-3, 13, 15, 39, 45], **i32))
    variant("negative_qo_and_kv", qo_indptr=torch.tensor([0, -1, 5, 9, 10], **i32),
            kv_indptr=torch.tensor([0, -4, 15, 39, 45], **i32))
    variant("decreasing_kv_indptr", kv_indptr=torch.tensor([0, 13, 15, 2, 45], **i32))
    # out of order and not from 0: requests claim rows 6-7, none, 2-4, 5; rows 0, 1, 8, 9 stay unwritten
    variant("unordered_qo_indptr", qo_indptr=torch.tensor([6, 8, 2, 5, 6], **i32))
    variant("kv_indptr_past_the_end", kv_indptr=torch.tensor([0, 13, 15, 39, 10**6], **i32))
    variant("qo_indptr_past_the_end", qo_indptr=torch.tensor([0, 3, 5, 9, 40], **i32))
    bad_slots = base.kv_indices.clone()
    bad_slots[[2, 20, 44]] = torch.tensor([-7, 10**6, base.k_cache.shape[0]], dtype=bad_slots.dtype)
    variant("bad_slot_ids", kv_indices=bad_slots)
    variant("garbage_mask_bits", tree_mask=torch.randint(-2**63, 2**63 - 1, (10,), generator=g))
    variant("more_drafts_than_the_bound", max_draft_tokens=2)
    return cases


INVALID_CASES = _invalid_index_cases()


@pytest.mark.parametrize("name", list(INVALID_CASES))
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_and_reference_agree_on_unchecked_invalid_indices(name, splits):
    c = INVALID_CASES[name]
    with pytest.raises(ValueError):  # what the API says about it on CPU
        spec_kernels.tree_verify_attention(*(c[k] for k in ("q", "k_cache", "v_cache", "kv_indptr", "kv_indices",
                                                             "qo_indptr", "tree_mask")),
                                           max_draft_tokens=c["max_draft_tokens"] or None)
    outs = {}
    for impl in ("reference", "triton"):
        out = torch.full((10, 4, 64), 7.0)
        lse = torch.full((10, 4), 7.0)
        args = (c["q"], c["k_cache"], c["v_cache"], c["kv_indptr"], c["kv_indices"], c["qo_indptr"], c["tree_mask"],
                0.125, out, lse)
        if impl == "reference":
            reference.tree_verify_attention(*args, c["max_draft_tokens"])
        else:
            triton_kernel.tree_verify_attention(*args, num_kv_splits=splits, max_draft_tokens=c["max_draft_tokens"])
        outs[impl] = (out, lse)
    # the rows some request claims (its query range cut to [0, T), its first max_draft_tokens
    # drafts); the others get unspecified values (with KV splits, the merge writes every row)
    qo, bound = c["qo_indptr"].tolist(), c["max_draft_tokens"] or 64
    claimed = torch.zeros(10, dtype=torch.bool)
    for b in range(4):
        lo = min(max(qo[b], 0), 10)
        hi = min(max(qo[b + 1], lo), 10)
        claimed[lo:min(hi, lo + bound)] = True
    assert claimed.sum() >= 4
    for impl, (out, lse) in outs.items():
        assert torch.isfinite(out[claimed]).all(), impl
        if splits == 1:
            assert torch.all(out[~claimed] == 7.0) and torch.all(lse[~claimed] == 7.0), impl
    torch.testing.assert_close(outs["triton"][0][claimed], outs["reference"][0][claimed], atol=ATOL, rtol=0)
    torch.testing.assert_close(outs["triton"][1][claimed], outs["reference"][1][claimed], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kv_indptr", [[-3, 3, 6], [-2, -1, 6], [0, 7, 3], [4, 2, 9]])
@pytest.mark.parametrize("splits", [1, 2])
def test_decode_unchecked_invalid_kv_indptr(kv_indptr, splits):
    case = make_case([1, 1], [4, 4], hq=4, hkv=2, seed=24)
    kv_indptr = torch.tensor(kv_indptr, dtype=torch.int32)
    args = (case.q, case.k_cache, case.v_cache, kv_indptr, case.kv_indices)
    with pytest.raises(ValueError, match="kv_indptr"):
        spec_kernels.decode_attention(*args)
    ref, ref_lse = torch.empty(2, 4, 64), torch.empty(2, 4)
    reference.tree_verify_attention(*args, None, None, 0.125, ref, ref_lse)
    out, lse = torch.empty(2, 4, 64), torch.empty(2, 4)
    triton_kernel.tree_verify_attention(*args, None, None, 0.125, out, lse, num_kv_splits=splits)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL, rtol=0)
    # the cut ranges: request b reads kv_indices[lo:hi] cut to [0, 10)
    lo = [min(max(kv_indptr[b].item(), 0), 10) for b in range(2)]
    hi = [min(max(kv_indptr[b + 1].item(), lo[b]), 10) for b in range(2)]
    for b in range(2):
        if hi[b] == lo[b]:
            assert torch.all(out[b] == 0) and torch.all(lse[b] == float("-inf"))
        else:
            want = spec_kernels.decode_attention(case.q[b:b + 1], case.k_cache, case.v_cache,
                                                 torch.tensor([0, hi[b] - lo[b]], dtype=torch.int32),
                                                 case.kv_indices[lo[b]:hi[b]].contiguous(), sm_scale=0.125,
                                                 impl="reference")
            torch.testing.assert_close(out[b:b + 1], want, atol=ATOL, rtol=0)


def test_kv_indptr_may_start_at_an_offset():
    # kv_indices as a window of a larger buffer: kv_indptr[0] > 0 is allowed (and checked >= 0).
    case = make_case([4, 2], [10, 3], hq=4, hkv=2, seed=25)
    want = spec_kernels.tree_verify_attention(*case.args, impl="reference")
    pad = torch.full((5,), 10**6, dtype=case.kv_indices.dtype)  # never read: outside every range
    kv_indices = torch.cat([pad, case.kv_indices, pad])
    kv_indptr = case.kv_indptr + 5
    for impl in ("reference", "triton"):
        got = spec_kernels.tree_verify_attention(case.q, case.k_cache, case.v_cache, kv_indptr, kv_indices,
                                                 case.qo_indptr, case.tree_mask, impl=impl)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- GPU: the rules above
@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_gpu_nan_and_inf_inputs_give_nan_rows(impl, splits):
    case = _nonfinite_case(d=128, dtype=torch.bfloat16, device="cuda")
    row_nan, col_nan, seen = _expected_nonfinite(case)
    out, lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl=impl, num_kv_splits=splits)
    out, lse = out.float().cpu(), lse.cpu()
    assert torch.equal(torch.isnan(lse), row_nan)
    assert torch.equal(torch.isnan(out), row_nan[..., None] | col_nan)
    assert torch.all(out[~seen] == 0) and torch.all(lse[~seen] == float("-inf"))
    ref, ref_lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl="reference")
    torch.testing.assert_close(out, ref.float().cpu(), atol=2e-2, rtol=2e-2, equal_nan=True)
    torch.testing.assert_close(lse, ref_lse.cpu(), atol=2e-2, rtol=2e-2, equal_nan=True)

    args = (case.q[:3].contiguous(), case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices)  # one query each
    dec, dec_lse = spec_kernels.decode_attention(*args, return_lse=True, impl=impl, num_kv_splits=splits)
    want, want_lse = spec_kernels.decode_attention(*args, return_lse=True, impl="reference")
    assert torch.isnan(dec_lse).any() and torch.isnan(dec).any()
    torch.testing.assert_close(dec.float(), want.float(), atol=2e-2, rtol=2e-2, equal_nan=True)
    torch.testing.assert_close(dec_lse, want_lse, atol=2e-2, rtol=2e-2, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(INVALID_CASES))
@pytest.mark.parametrize("splits", [1, 3])
def test_gpu_cuda_and_reference_agree_on_unchecked_invalid_indices(name, splits):
    from spec_kernels.tree_verify import cuda as cuda_binding

    c = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in INVALID_CASES[name].items()}
    for key in ("q", "k_cache", "v_cache"):
        c[key] = c[key].to(torch.bfloat16)
    qo, bound = c["qo_indptr"].tolist(), c["max_draft_tokens"] or 64
    claimed = torch.zeros(10, dtype=torch.bool)
    for b in range(4):
        lo = min(max(qo[b], 0), 10)
        claimed[lo:min(min(max(qo[b + 1], lo), 10), lo + bound)] = True
    outs = {}
    for impl in ("reference", "cuda"):
        out = torch.full((10, 4, 64), 7.0, dtype=torch.bfloat16, device="cuda")
        lse = torch.full((10, 4), 7.0, device="cuda")
        args = (c["q"], c["k_cache"], c["v_cache"], c["kv_indptr"], c["kv_indices"], c["qo_indptr"], c["tree_mask"],
                0.125, out, lse)
        if impl == "reference":
            reference.tree_verify_attention(*args, c["max_draft_tokens"])
        else:
            cuda_binding.tree_verify_attention(*args, num_kv_splits=splits, max_draft_tokens=c["max_draft_tokens"])
        torch.cuda.synchronize()
        outs[impl] = (out.float().cpu()[claimed], lse.cpu()[claimed])
    assert torch.isfinite(outs["cuda"][0]).all()
    torch.testing.assert_close(outs["cuda"][0], outs["reference"][0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs["cuda"][1], outs["reference"][1], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_debug_mode_checks_index_values_and_mask_bits():
    case = make_case([4, 2], [10, 3], hq=4, hkv=2, d=128, dtype=torch.bfloat16, seed=26, device="cuda")
    bad_kv = torch.tensor([-3, 8, 20], dtype=torch.int32, device="cuda")
    bad_mask = case.tree_mask.clone()
    bad_mask[1] |= 1 << 3  # draft 1 sees draft 3: a later draft
    spec_kernels.set_debug_checks(True)
    try:
        with pytest.raises(ValueError, match=r"kv_indptr\[0\] must be >= 0"):
            spec_kernels.tree_verify_attention(case.q, case.k_cache, case.v_cache, bad_kv, case.kv_indices,
                                               case.qo_indptr, case.tree_mask)
        with pytest.raises(ValueError, match=r"tree_mask\[1\] \(request 0, draft 1\) has bit 3 set"):
            spec_kernels.tree_verify_attention(case.q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices,
                                               case.qo_indptr, bad_mask)
        with pytest.raises(ValueError, match="kv_indptr must be non-decreasing"):
            spec_kernels.decode_attention(case.q[:2].contiguous(), case.k_cache, case.v_cache,
                                          torch.tensor([0, 9, 3], dtype=torch.int32, device="cuda"), case.kv_indices)
    finally:
        spec_kernels.set_debug_checks(None)
    # outside debug mode the same call runs (no host sync), in bounds
    out = spec_kernels.tree_verify_attention(case.q, case.k_cache, case.v_cache, bad_kv, case.kv_indices,
                                             case.qo_indptr, bad_mask)
    torch.cuda.synchronize()
    assert out.shape == (6, 4, 128)


# ----------------------------------------------------------------------------- GPU: every configuration
def _launched_kernels(fn) -> set:
    """The CUDA kernel names (demangled, as the profiler gives them) that fn() launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages()}


# (drafts, q heads, KV heads) of one request: 1, 16, 32, 64 and 128 rows per (request, KV head)
_CONFIG_CANDIDATES = [(1, 4, 4), (4, 8, 2), (8, 8, 2), (16, 8, 2), (16, 32, 4)]


@pytest.mark.gpu
def test_gpu_every_configuration_runs_and_matches_the_reference():
    """Each compiled CUDA tree-verify configuration (16-bit and fp8 caches) that this GPU can run
    is launched (the launch rule steered by spec_kernels.testing.launch_rule_as_on to the shared
    memory of the named GPU whose rule takes it) and matches the reference."""
    from spec_kernels import _ops
    from spec_kernels.attention.plan import DEVICES, device_limits
    from spec_kernels.testing import launch_rule_as_on
    from spec_kernels.tree_verify import cuda as tv_cuda

    own = device_limits(torch.cuda.current_device())
    ran = set()
    for c in (c for c in _ops.kernel_configs() if c.kernel == tv_cuda.KERNEL):
        fp8 = bool(c.kv_fp8)
        found = next(((n, hq, hkv, lim) for lim in DEVICES.values() if lim.smem_per_sm <= own.smem_per_sm
                      for n, hq, hkv in _CONFIG_CANDIDATES
                      for s in [tv_cuda.cuda_tree_verify_launch(c.head_dim, n * hq // hkv, lim, fp8)]
                      if (s.block_m, s.warp_rows) == (c.block_m, c.warp_rows)), None)
        assert found is not None, f"no case reaches {c.template_args} on this GPU"
        n, hq, hkv, lim = found
        case = make_case([n], [300], hq=hq, hkv=hkv, d=c.head_dim, dtype=torch.bfloat16, seed=41, device="cuda")
        k, v, kw = case.k_cache, case.v_cache, {}
        if fp8:
            k, v = (t.float().div(0.05).to(torch.float8_e4m3fn) for t in (k, v))
            kw = dict(k_scale=0.05, v_scale=0.05)
        args = (case.q, k, v, *case.args[3:])
        want = spec_kernels.tree_verify_attention(*args, impl="reference", max_draft_tokens=n, **kw)
        with launch_rule_as_on(lim.smem_per_sm):
            got = {}
            names = _launched_kernels(lambda: got.setdefault("out", spec_kernels.tree_verify_attention(
                *args, impl="cuda", max_draft_tokens=n, **kw)))
        instance = f"tree_verify_kernel<__nv_bfloat16, {c.template_args.replace(',', ', ')}>"
        assert any(instance in name for name in names), (instance, names)
        torch.testing.assert_close(got["out"].float(), want.float(), atol=2e-2, rtol=2e-2, msg=instance)
        ran.add(c.template_args)
    assert ran
