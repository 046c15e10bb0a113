"""tree_verify_attention / decode_attention: reference vs a naive dense-mask oracle, and the
Triton kernel (interpreter on CPU, compiled on GPU) vs the reference over random batches."""
import pytest
import torch

import spec_kernels
from spec_kernels.tree_verify import triton_kernel
from tree_cases import make_case, naive_attention

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
