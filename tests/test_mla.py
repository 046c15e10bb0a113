"""mla_tree_verify_attention / mla_decode_attention: the reference vs a naive float64 MLA oracle,
the Triton kernel (interpreter on CPU, compiled on GPU) vs the reference over random trees and
mixed draft counts, bad input, and the op layer (fake tensors, torch.compile). CUDA vs the
reference runs on a GPU only (marked `gpu`). Shapes are small: the interpreter is slow."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import spec_kernels
from spec_kernels.mla import mla_decode_attention, mla_tree_verify_attention, triton_kernel
from spec_kernels.mla.api import MLA
from spec_kernels.testing import ancestor_mask_bits, mask_visible_slots, random_parents, visible_slots

ATOL = 2e-3  # fp32 compute


@dataclass
class MlaCase:
    q: torch.Tensor  # [T, H, Dv + Dr]
    kv_cache: torch.Tensor  # [S, Dv + Dr]
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    qo_indptr: torch.Tensor
    tree_mask: torch.Tensor
    parents: torch.Tensor
    dv: int

    @property
    def args(self):
        return (self.q, self.kv_cache, self.kv_indptr, self.kv_indices, self.qo_indptr, self.tree_mask)

    @property
    def decode_args(self):
        return (self.q, self.kv_cache, self.kv_indptr, self.kv_indices)


def make_mla_case(ns, prefixes, *, heads=8, dv=512, dr=64, dtype=torch.float32, kind="random",
                  index_dtype=torch.int32, seed=0, device="cpu") -> MlaCase:
    """Request b: ns[b] drafts (a random tree of `kind`) after prefixes[b] prefix slots; all slots
    a random subset of a larger pool, so a kernel that ignores kv_indices cannot pass."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [p + n for p, n in zip(prefixes, ns)]
    num_slots = sum(kv_lens) + 7
    parents = torch.tensor([p for n in ns for p in random_parents(n, kind, gen)], dtype=torch.int64)
    qo_indptr = torch.tensor([0] + list(ns), dtype=torch.int64).cumsum(0).to(torch.int32)
    case = MlaCase(
        q=torch.randn(sum(ns), heads, dv + dr, generator=gen).to(dtype),
        kv_cache=torch.randn(num_slots, dv + dr, generator=gen).to(dtype),
        kv_indptr=torch.tensor([0] + kv_lens, dtype=torch.int64).cumsum(0).to(torch.int32),
        kv_indices=torch.randperm(num_slots, generator=gen)[: sum(kv_lens)].to(index_dtype),
        qo_indptr=qo_indptr, tree_mask=ancestor_mask_bits(parents, qo_indptr), parents=parents, dv=dv,
    )
    return MlaCase(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in vars(case).values()))


def naive_mla(case: MlaCase, sm_scale=None, decode=False):
    """Float64 MLA written from the model's definition, independently of spec_kernels: the score
    is the latent (nope) product plus the rope product, the value is the latent part; a dense
    list of visible slots per query; no bit tricks, no log-sum-exp tricks."""
    q, kv = case.q.double(), case.kv_cache.double()
    T, H, D = q.shape
    dv = case.dv
    scale = sm_scale if sm_scale is not None else 1 / math.sqrt(D)
    out = torch.zeros(T, H, dv, dtype=torch.float64)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64)
    for t, rows in visible_slots(case, decode):
        latent, rope = kv[rows, :dv], kv[rows, dv:]
        s = (q[t, :, :dv] @ latent.T + q[t, :, dv:] @ rope.T) * scale  # [H, visible]
        out[t] = torch.softmax(s, -1) @ latent
        lse[t] = torch.logsumexp(s, -1)
    return out, lse


# (draft counts, prefix lengths, tree kind, heads): random trees, mixed n_b including 0, empty
# prefixes, H in {1, 8, 16} (16 = DeepSeek-V3 at TP8, 8 = Kimi K2.5 at TP8).
GRID = [
    pytest.param([3, 5, 16], [37, 0, 70], "chain", 8, id="chains-h8"),
    pytest.param([7, 0, 12], [5, 40, 33], "random", 16, id="random-h16-zero-drafts"),
    pytest.param([9, 4, 1], [50, 17, 0], "forest", 1, id="forest-h1"),
    pytest.param([6, 2], [0, 0], "wide", 8, id="empty-prefixes"),
    pytest.param([64], [20], "random", 1, id="n64"),
]


@pytest.mark.parametrize("ns,prefixes,kind,heads", GRID)
def test_reference_matches_naive_mla(ns, prefixes, kind, heads):
    case = make_mla_case(ns, prefixes, heads=heads, kind=kind, seed=1)
    out, lse = mla_tree_verify_attention(*case.args, return_lse=True, impl="reference")
    want, want_lse = naive_mla(case)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ns,prefixes,kind,heads", GRID)
@pytest.mark.parametrize("splits", [None, 3])
def test_triton_matches_reference(ns, prefixes, kind, heads, splits):
    case = make_mla_case(ns, prefixes, heads=heads, kind=kind, seed=2)
    ref, ref_lse = mla_tree_verify_attention(*case.args, return_lse=True, impl="reference")
    out, lse = mla_tree_verify_attention(*case.args, return_lse=True, impl="triton", num_kv_splits=splits)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL, rtol=0)


@pytest.mark.parametrize("dv,dr", [(128, 32), (256, 64)])
def test_other_latent_and_rope_dims(dv, dr):
    case = make_mla_case([4, 9], [20, 45], heads=4, dv=dv, dr=dr, seed=3)
    want, _ = naive_mla(case)
    ref = mla_tree_verify_attention(*case.args, v_head_dim=dv, impl="reference")
    out = mla_tree_verify_attention(*case.args, v_head_dim=dv, impl="triton", num_kv_splits=2)
    torch.testing.assert_close(ref.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_small_tiles_many_row_blocks_and_tail_tiles():
    # 16-row / 16-key tiles: 80 rows span five blocks and the 40-draft tail three tiles.
    case = make_mla_case([40, 6], [50, 3], heads=2, kind="random", seed=4)
    want = mla_tree_verify_attention(*case.args, sm_scale=0.05, impl="reference")
    out = torch.empty_like(want)
    triton_kernel.mla_tree_verify_attention(case.q, case.kv_cache, *case.args[2:], 0.05, 512, out, None,
                                            num_kv_splits=4, block_m=16, block_n=16)
    torch.testing.assert_close(out, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_3d_cache_int64_indices_sm_scale_and_out_buffer(impl):
    case = make_mla_case([6, 2], [31, 8], heads=4, index_dtype=torch.int64, seed=5)
    out = torch.full((8, 4, 512), float("nan"))
    got = mla_tree_verify_attention(case.q, case.kv_cache[:, None], *case.args[2:], sm_scale=0.07, out=out, impl=impl)
    assert got is out
    want, _ = naive_mla(case, sm_scale=0.07)
    torch.testing.assert_close(out.double(), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_inputs(dtype):
    # The interpreter computes in fp32 after exact loads; the output is rounded to dtype.
    case = make_mla_case([5, 3], [40, 12], heads=8, dtype=dtype, seed=6)
    ref = mla_tree_verify_attention(*case.args, impl="reference")
    out = mla_tree_verify_attention(*case.args, impl="triton", num_kv_splits=2)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


def test_query_that_sees_nothing_gets_zeros_and_minus_inf_lse():
    case = make_mla_case([3], [0], heads=2, kind="chain", seed=7)
    case.tree_mask[1] = 0  # draft 1 sees no key at all
    for impl in ("reference", "triton"):
        out, lse = mla_tree_verify_attention(*case.args, return_lse=True, impl=impl, num_kv_splits=2)
        assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("splits", [None, 4])
def test_decode_triton_matches_reference_and_naive(splits):
    case = make_mla_case([1] * 4, [0, 9, 70, 33], heads=16, seed=8)
    ref, ref_lse = mla_decode_attention(*case.decode_args, return_lse=True, impl="reference")
    out, lse = mla_decode_attention(*case.decode_args, return_lse=True, impl="triton", num_kv_splits=splits)
    want, want_lse = naive_mla(case, decode=True)
    torch.testing.assert_close(ref.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL, rtol=0)


def test_decode_equals_tree_verify_with_one_draft_and_is_deterministic():
    case = make_mla_case([1, 1, 1], [10, 0, 77], heads=8, seed=9)
    tree = mla_tree_verify_attention(*case.args, impl="triton", num_kv_splits=3)
    dec = mla_decode_attention(*case.decode_args, impl="triton", num_kv_splits=3)
    torch.testing.assert_close(dec, tree, atol=1e-6, rtol=0)
    assert torch.equal(dec, mla_decode_attention(*case.decode_args, impl="triton", num_kv_splits=3))


def test_max_draft_tokens_bound_sizes_the_launch():
    case = make_mla_case([16, 3], [40, 0], heads=4, seed=12)
    ref = mla_tree_verify_attention(*case.args, impl="reference")
    out = mla_tree_verify_attention(*case.args, impl="triton", max_draft_tokens=16)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="request 0 has 16 draft tokens, at most 8 max_draft_tokens"):
        mla_tree_verify_attention(*case.args, impl="triton", max_draft_tokens=8)


def test_invalid_index_values_stay_in_bounds():
    """What the value checks reject on CPU (they are skipped on CUDA outside debug mode) must not
    make the kernel touch memory out of bounds: here the Triton kernel is called directly with a
    slot id past the cache and a qo_indptr past T; the other request's rows are unaffected."""
    case = make_mla_case([4, 2], [10, 3], heads=2, dv=128, dr=32, seed=13)
    want = mla_tree_verify_attention(*case.args, v_head_dim=128, impl="reference")
    kv_indices = case.kv_indices.clone()
    kv_indices[kv_indices.numel() - 3] = 10**9  # request 1's last prefix slot
    out = torch.zeros_like(want)
    triton_kernel.mla_tree_verify_attention(case.q, case.kv_cache, case.kv_indptr, kv_indices, case.qo_indptr,
                                            case.tree_mask, 0.1, 128, out, None, num_kv_splits=2)
    torch.testing.assert_close(out[:4], mla_tree_verify_attention(*case.args, v_head_dim=128, sm_scale=0.1,
                                                                  impl="reference")[:4], atol=ATOL, rtol=0)
    assert torch.isfinite(out).all()
    qo_past_t = torch.tensor([0, 4, 40], dtype=torch.int32)  # rows 4..39 of 6, KV positions past kv_indices
    triton_kernel.mla_tree_verify_attention(case.q, case.kv_cache, torch.tensor([0, 14, 90], dtype=torch.int32),
                                            case.kv_indices, qo_past_t, case.tree_mask, 0.1, 128, out, None)
    assert torch.isfinite(out).all()


def test_empty_batch():
    case = make_mla_case([], [], heads=4, seed=11)
    for impl in ("reference", "triton"):
        assert mla_tree_verify_attention(*case.args, impl=impl).shape == (0, 4, 512)


# ----------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def small():
    return make_mla_case([4, 2], [10, 3], heads=4, dv=128, dr=32, seed=0)


def _call(case, **overrides):
    args = dict(q=case.q, kv_cache=case.kv_cache, kv_indptr=case.kv_indptr, kv_indices=case.kv_indices,
                qo_indptr=case.qo_indptr, tree_mask=case.tree_mask)
    kwargs = {k: overrides.pop(k) for k in list(overrides) if k not in args}
    args.update(overrides)
    return mla_tree_verify_attention(**args, impl=kwargs.pop("impl", "reference"), **{"v_head_dim": 128, **kwargs})


def test_valid_small_case_runs(small):
    assert _call(small).shape == (6, 4, 128)


@pytest.mark.parametrize("make_bad,exc,match", [
    (lambda c: dict(q=c.q.to(torch.int32)), ValueError, "q must have dtype float16, bfloat16, float32"),
    (lambda c: dict(kv_cache=c.kv_cache.half()), ValueError, "kv_cache must have dtype float32"),
    (lambda c: dict(kv_indptr=c.kv_indptr.long()), ValueError, "kv_indptr must have dtype int32"),
    (lambda c: dict(kv_indices=c.kv_indices.float()), ValueError, "kv_indices must have dtype int32, int64"),
    (lambda c: dict(qo_indptr=c.qo_indptr.long()), ValueError, "qo_indptr must have dtype int32"),
    (lambda c: dict(tree_mask=c.tree_mask.int()), ValueError, "tree_mask must have dtype int64"),
    (lambda c: dict(q=c.q.numpy()), TypeError, "q must be a torch.Tensor"),
    (lambda c: dict(kv_cache=c.kv_cache.to("meta")), ValueError, "kv_cache must be on cpu"),
    (lambda c: dict(q=c.q[0]), ValueError, r"q must be 3-D, got shape \(4, 160\)"),
    (lambda c: dict(kv_cache=c.kv_cache[:, None].expand(-1, 2, -1).contiguous()), ValueError,
     r"kv_cache must be \[S, D\] or \[S, 1, D\]"),
    (lambda c: dict(kv_cache=c.kv_cache[:, :96].contiguous()), ValueError, "kv_cache head dim must equal q's"),
    (lambda c: dict(kv_cache=c.kv_cache.t().contiguous().t()), ValueError, "kv_cache must be contiguous"),
    (lambda c: dict(q=torch.randn(6, 129, 160)), ValueError, r"q must have 1..128 heads, got 129"),
    (lambda c: dict(v_head_dim=100), ValueError, "v_head_dim 100 is not supported"),
    (lambda c: dict(v_head_dim=128.0), TypeError, "v_head_dim must be an int"),
    (lambda c: dict(qo_indptr=c.qo_indptr[:2]), ValueError, r"qo_indptr must have shape \(3,\)"),
    (lambda c: dict(tree_mask=c.tree_mask[:5]), ValueError, r"tree_mask must have shape \(6,\)"),
    (lambda c: dict(out=torch.empty(6, 4, 160)), ValueError, r"out must have shape \(6, 4, 128\)"),
    (lambda c: dict(qo_indptr=torch.tensor([0, 3, 2], dtype=torch.int32)), ValueError,
     "qo_indptr must be non-decreasing"),
    (lambda c: dict(kv_indptr=torch.tensor([0, 3, 8], dtype=torch.int32)), ValueError,
     "request 0 has 4 draft tokens but only 3 KV slots"),
    (lambda c: dict(kv_indices=c.kv_indices + 1000), ValueError, r"kv_indices values must be in \[0"),
    (lambda c: dict(sm_scale=float("inf")), ValueError, "sm_scale must be finite"),
    (lambda c: dict(num_kv_splits=65), ValueError, r"num_kv_splits must be in \[1, 64\]"),
    (lambda c: dict(impl="cuda"), RuntimeError, "impl='cuda' is not available: the cuda impl needs CUDA tensors"),
    (lambda c: dict(impl="fast"), ValueError, "impl must be one of"),
])
def test_bad_input_raises_naming_the_argument(small, make_bad, exc, match):
    with pytest.raises(exc, match=match):
        _call(small, **make_bad(small))


def test_decode_needs_one_query_per_request(small):
    with pytest.raises(ValueError, match=r"q must have one row per request: q.shape\[0\]=6 but kv_indptr has B=2"):
        mla_decode_attention(*small.decode_args, v_head_dim=128)


def test_cuda_supports_only_aligned_half_576_512():
    from spec_kernels.mla import cuda

    q = torch.empty(1, 8, 576, dtype=torch.bfloat16)
    kv = torch.empty(10, 576, dtype=torch.bfloat16)
    assert cuda.supports(q, kv, 512) is None
    assert "float16/bfloat16" in cuda.supports(q.float(), kv.float(), 512)
    assert "head dim 576 with v_head_dim 512" in cuda.supports(q[..., :160], kv[:, :160], 128)
    assert "torch.float16 KV cache with torch.bfloat16 queries" in cuda.supports(q, kv.half(), 512)
    misaligned = torch.empty(1 + q.numel(), dtype=torch.bfloat16)[1:].view(1, 8, 576)
    assert "16-byte aligned" in cuda.supports(misaligned, kv, 512)


# ----------------------------------------------------------------------------- op layer
def test_fake_tensors_and_meta_give_shapes_without_running(small):
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = [mode.from_tensor(t) for t in small.args]
        out, lse = mla_tree_verify_attention(*fake, v_head_dim=128, return_lse=True)
        dec = mla_decode_attention(fake[0][:2], fake[1][:, None], *fake[2:4], v_head_dim=128)
    assert out.shape == (6, 4, 128) and out.dtype == torch.float32
    assert lse.shape == (6, 4) and lse.dtype == torch.float32
    assert dec.shape == (2, 4, 128)
    meta = mla_tree_verify_attention(*(t.to("meta") for t in small.args), v_head_dim=128)
    assert meta.device.type == "meta" and meta.shape == (6, 4, 128)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_torch_compile_fullgraph_matches_eager(small, impl):
    def step(q, kv_cache, kv_indptr, kv_indices, qo_indptr, parents):
        mask = spec_kernels.tree_mask_from_parents(parents, qo_indptr)
        o, lse = mla_tree_verify_attention(q, kv_cache, kv_indptr, kv_indices, qo_indptr, mask, v_head_dim=128,
                                           return_lse=True, impl=impl)
        return o * 2, lse

    args = (*small.args[:5], small.parents)
    got, got_lse = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    want, want_lse = step(*args)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(got_lse, want_lse, atol=0, rtol=0)


def test_opcheck(small):
    out, lse = torch.empty(6, 4, 128), torch.empty(6, 4)
    torch.library.opcheck(torch.ops.spec_kernels.mla_tree_verify_attention.default,
                          (*small.args, 0.1, 128, out, lse, "reference", 0, 0))
    torch.library.opcheck(torch.ops.spec_kernels.mla_tree_verify_attention.default,
                          (*small.args[:4], None, None, 0.1, 128, out[:2].clone(), None, "reference", 0, 1))


def test_dispatch_on_cpu_is_triton_under_the_interpreter(small):
    assert MLA.select(torch.device("cpu"), None, args=(small.q, small.kv_cache, 128))[0] == "triton"


# ----------------------------------------------------------------------------- GPU
GPU_GRID = GRID + [
    pytest.param([16] * 8, [4096] * 8, "random", 16, id="gpu-b8-l4k-h16"),
    pytest.param([16, 1, 64, 0], [20000, 100, 1000, 7], "random", 8, id="gpu-20k-mixed-h8"),
    pytest.param([4] * 64, [300] * 64, "random", 128, id="gpu-b64-h128"),
    # 15 rows: the CUDA kernel's 16-row CTA with 32-key tiles (a partial prefix tile, 2 splits of 4097)
    pytest.param([3, 1, 1], [4097, 31, 0], "random", 3, id="gpu-bm16-h3"),
]


def _gpu_impls(dtype):
    return ["triton"] + (["cuda"] if dtype != torch.float32 else [])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ns,prefixes,kind,heads", GPU_GRID)
def test_gpu_kernels_match_reference(ns, prefixes, kind, heads, dtype):
    case = make_mla_case(ns, prefixes, heads=heads, kind=kind, dtype=dtype, seed=12, device="cuda")
    ref, ref_lse = mla_tree_verify_attention(*case.args, sm_scale=0.07, return_lse=True, impl="reference")
    tol = ATOL if dtype == torch.float32 else 2e-2
    for impl in _gpu_impls(dtype):
        for splits in (None, 3):
            out, lse = mla_tree_verify_attention(*case.args, sm_scale=0.07, return_lse=True, impl=impl,
                                                 num_kv_splits=splits)
            torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol, msg=f"{impl} splits={splits}")
            torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol, msg=f"{impl} splits={splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [1, 8, 16, 128])
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_gpu_cuda_decode_and_determinism(heads, splits):
    case = make_mla_case([1] * 33, [0] + [4097] * 32, heads=heads, dtype=torch.bfloat16, seed=14, device="cuda")
    ref, ref_lse = mla_decode_attention(*case.decode_args, sm_scale=0.07, return_lse=True, impl="reference")
    out, lse = mla_decode_attention(*case.decode_args, sm_scale=0.07, return_lse=True, impl="cuda",
                                    num_kv_splits=splits)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-2)
    again = mla_decode_attention(*case.decode_args, sm_scale=0.07, impl="cuda", num_kv_splits=splits)
    assert torch.equal(out, again)  # bitwise deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_triton_autotuned_matches_reference(monkeypatch, dtype):
    # gpu_check.sh runs the kernel tests untuned; this is the tuned path benchmarks and servers take.
    monkeypatch.setenv("SPEC_KERNELS_TRITON_AUTOTUNE", "1")
    tol = ATOL if dtype == torch.float32 else 2e-2
    case = make_mla_case([16, 1, 0, 9], [4000, 70, 0, 1000], heads=16, dtype=dtype, seed=16, device="cuda")
    ref = mla_tree_verify_attention(*case.args, sm_scale=0.07, impl="reference")
    out = mla_tree_verify_attention(*case.args, sm_scale=0.07, impl="triton")
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    args = (case.q[:4], case.kv_cache, case.kv_indptr, case.kv_indices)  # one query per request
    ref = mla_decode_attention(*args, sm_scale=0.07, impl="reference")
    out = mla_decode_attention(*args, sm_scale=0.07, impl="triton")
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("ns", [[], [0, 0]], ids=["no-request", "no-draft"])
def test_gpu_empty_batches(ns):
    # T = 0 must return an empty output on every impl (CUDA launches nothing), not fail its checks.
    case = make_mla_case(ns, [5] * len(ns), heads=8, dtype=torch.bfloat16, seed=11, device="cuda")
    for impl in ("cuda", "triton", "reference"):
        out, lse = mla_tree_verify_attention(*case.args, return_lse=True, impl=impl)
        assert out.shape == (0, 8, 512) and lse.shape == (0, 8)
        if not ns:
            assert mla_decode_attention(*case.decode_args, impl=impl).shape == (0, 8, 512)


@pytest.mark.gpu
def test_gpu_cuda_is_the_default_and_graph_capturable():
    case = make_mla_case([16, 3, 9], [5000, 70, 0], heads=16, dtype=torch.bfloat16, seed=15, device="cuda")
    assert MLA.select(case.q.device, None, args=(case.q, case.kv_cache, 512))[0] == "cuda"

    def run():
        return mla_tree_verify_attention(*case.args, sm_scale=0.07)

    eager = run()  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    case.q.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(captured, eager)
    torch.testing.assert_close(captured, run(), atol=0, rtol=0)


# ----------------------------------------------------------------------------- non-finite inputs
# As for tree_verify_attention: a NaN/inf logit among the keys a row sees (its query, or the cached
# row of such a slot: the latent part is K and V, the rope part K only) makes the row's output and
# lse NaN; a row that sees nothing gets zeros and lse = -inf.
def _mla_nonfinite_case(dv=128, dr=32, dtype=torch.float32, device="cpu"):
    case = make_mla_case([4, 3, 2], [12, 5, 0], heads=3, dv=dv, dr=dr, kind="chain", dtype=dtype, seed=31)
    kv = case.kv_indices.tolist()
    nan, inf = float("nan"), float("inf")
    case.q[1, 2, 10] = nan  # request 0, draft 1, head 2
    case.kv_cache[kv[3], dv + 5] = inf  # request 0's prefix, rope part: every row of request 0
    case.kv_cache[kv[16 + 5 + 1], dv + 1] = -inf  # request 1's draft 1, rope part: the rows that see it
    case.tree_mask[7] = 0  # request 2 (empty prefix), draft 0: sees nothing ...
    case.q[7] = nan  # ... so neither its NaN query ...
    case.kv_cache[kv[24 + 1], :dv] = nan  # ... nor draft 1's NaN latent (V) reaches it; draft 1 sees it
    return MlaCase(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in vars(case).values()))


def _mla_expected_nonfinite(case, decode=False):
    q, kv = case.q.cpu().double(), case.kv_cache.cpu().double()
    T, H, _ = q.shape
    row_nan = torch.zeros(T, H, dtype=torch.bool)
    seen = torch.zeros(T, H, dtype=torch.bool)
    cpu = MlaCase(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in vars(case).values()))
    for t, rows in mask_visible_slots(cpu, decode):
        seen[t] = True
        row_nan[t] = (~torch.isfinite(q[t])).any(-1) | (~torch.isfinite(kv[rows])).any()
    return row_nan, seen


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN through numpy (interpreter)
@pytest.mark.parametrize("impl,splits", [("reference", None), ("triton", None), ("triton", 3)])
def test_nan_and_inf_inputs_give_nan_rows(impl, splits):
    case = _mla_nonfinite_case()
    row_nan, seen = _mla_expected_nonfinite(case)
    assert row_nan.sum() >= 14 and (~seen).sum() == 3
    out, lse = mla_tree_verify_attention(*case.args, v_head_dim=128, return_lse=True, impl=impl,
                                         num_kv_splits=splits)
    assert torch.equal(torch.isnan(lse), row_nan)
    assert torch.equal(torch.isnan(out), row_nan[..., None].expand_as(out))
    assert torch.all(out[~seen] == 0) and torch.all(lse[~seen] == float("-inf"))
    clean = make_mla_case([4, 3, 2], [12, 5, 0], heads=3, dv=128, dr=32, kind="chain", seed=31)
    clean.tree_mask[7] = 0
    want, want_lse = mla_tree_verify_attention(*clean.args, v_head_dim=128, return_lse=True, impl="reference")
    ok = seen & ~row_nan
    torch.testing.assert_close(out[ok], want[ok], atol=ATOL, rtol=0)
    torch.testing.assert_close(lse[ok], want_lse[ok], atol=ATOL, rtol=0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("impl,splits", [("reference", None), ("triton", 2)])
def test_decode_nan_inputs(impl, splits):
    case = make_mla_case([1] * 3, [0, 9, 40], heads=4, dv=128, dr=32, seed=32)
    kv = case.kv_indices.tolist()
    case.kv_indptr[1] = 0  # request 0 has no KV slot ...
    case.q[0] = float("nan")  # ... so its NaN query does not matter
    case.q[1, 3, 0] = float("nan")  # request 1, head 3
    case.kv_cache[kv[11 + 7], 50] = -float("inf")  # request 2 (slots 11..51): every head
    out, lse = mla_decode_attention(*case.decode_args, v_head_dim=128, return_lse=True, impl=impl,
                                    num_kv_splits=splits)
    row_nan, seen = _mla_expected_nonfinite(case, decode=True)
    assert row_nan.sum() == 5 and (~seen).sum() == 4
    assert torch.equal(torch.isnan(lse), row_nan)
    assert torch.equal(torch.isnan(out), row_nan[..., None].expand_as(out))
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))


# ----------------------------------------------------------------------------- unchecked index values
def _mla_invalid_cases():
    base = make_mla_case([3, 2, 4, 1], [10, 0, 20, 5], heads=2, dv=128, dr=32, seed=33)
    g = torch.Generator().manual_seed(33)
    i32 = dict(dtype=torch.int32)
    bad_slots = base.kv_indices.clone()
    bad_slots[[2, 20, 44]] = torch.tensor([-7, 10**6, base.kv_cache.shape[0]], dtype=bad_slots.dtype)
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
    return {name: {**dict(q=base.q, kv_cache=base.kv_cache, kv_indptr=base.kv_indptr, kv_indices=base.kv_indices,
                          qo_indptr=base.qo_indptr, tree_mask=base.tree_mask, max_draft_tokens=0), **c}
            for name, c in changes.items()}


MLA_INVALID = _mla_invalid_cases()


def _claimed(qo_indptr, bound, T=10):
    qo, claimed = qo_indptr.tolist(), torch.zeros(T, dtype=torch.bool)
    for b in range(len(qo) - 1):
        lo = min(max(qo[b], 0), T)
        claimed[lo:min(min(max(qo[b + 1], lo), T), lo + bound)] = True
    return claimed


@pytest.mark.parametrize("name", list(MLA_INVALID))
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_and_reference_agree_on_unchecked_invalid_indices(name, splits):
    from spec_kernels.mla import reference

    c = MLA_INVALID[name]
    args = [c[k] for k in ("q", "kv_cache", "kv_indptr", "kv_indices", "qo_indptr", "tree_mask")]
    with pytest.raises(ValueError):  # what the API says about it on CPU
        mla_tree_verify_attention(*args, v_head_dim=128, max_draft_tokens=c["max_draft_tokens"] or None)
    claimed = _claimed(c["qo_indptr"], c["max_draft_tokens"] or 64)
    assert claimed.sum() >= 4
    outs = {}
    for impl in ("reference", "triton"):
        out, lse = torch.full((10, 2, 128), 7.0), torch.full((10, 2), 7.0)
        if impl == "reference":
            reference.mla_tree_verify_attention(*args, 0.1, 128, out, lse, c["max_draft_tokens"])
        else:
            triton_kernel.mla_tree_verify_attention(*args, 0.1, 128, out, lse, num_kv_splits=splits,
                                                    max_draft_tokens=c["max_draft_tokens"])
        assert torch.isfinite(out[claimed]).all()
        if splits == 1:  # without a merge pass, rows no request claims are not written
            assert torch.all(out[~claimed] == 7.0)
        outs[impl] = (out[claimed], lse[claimed])
    torch.testing.assert_close(outs["triton"][0], outs["reference"][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(outs["triton"][1], outs["reference"][1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kv_indptr", [[-3, 3, 6], [-2, -1, 6], [0, 7, 3]])
def test_decode_unchecked_invalid_kv_indptr(kv_indptr, small):
    from spec_kernels.mla import reference

    kv_indptr = torch.tensor(kv_indptr, dtype=torch.int32)
    args = (small.q[:2].contiguous(), small.kv_cache, kv_indptr, small.kv_indices)
    with pytest.raises(ValueError, match="kv_indptr"):
        mla_decode_attention(*args, v_head_dim=128)
    ref, ref_lse = torch.empty(2, 4, 128), torch.empty(2, 4)
    reference.mla_tree_verify_attention(*args, None, None, 0.1, 128, ref, ref_lse)
    out, lse = torch.empty(2, 4, 128), torch.empty(2, 4)
    triton_kernel.mla_tree_verify_attention(*args, None, None, 0.1, 128, out, lse, num_kv_splits=2)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL, rtol=0)


@pytest.mark.parametrize("make_bad,match", [
    (lambda c: dict(kv_indptr=torch.tensor([-3, 8, 10], dtype=torch.int32)), r"kv_indptr\[0\] must be >= 0"),
    (lambda c: dict(qo_indptr=torch.tensor([-1, 4, 6], dtype=torch.int32)), r"qo_indptr\[0\] must be 0"),
    (lambda c: dict(tree_mask=c.tree_mask | torch.tensor([0, 0, 0, 0, 1 << 2, 0])),
     r"tree_mask\[4\] \(request 1, draft 0\) has bit 2 set, but request 1 has only 2 draft tokens"),
    (lambda c: dict(tree_mask=c.tree_mask | torch.tensor([0, 1 << 3, 0, 0, 0, 0])),
     r"tree_mask\[1\] \(request 0, draft 1\) has bit 3 set: draft 3 comes later"),
])
def test_bad_index_values_and_mask_bits(small, make_bad, match):
    with pytest.raises(ValueError, match=match):
        _call(small, **make_bad(small))


def test_decode_negative_kv_indptr_is_rejected(small):
    for bad in ([-3, 3, 6], [-2, -1, 6]):
        with pytest.raises(ValueError, match=r"kv_indptr\[0\] must be >= 0"):
            mla_decode_attention(small.q[:2].contiguous(), small.kv_cache, torch.tensor(bad, dtype=torch.int32),
                                 small.kv_indices, v_head_dim=128)


# ----------------------------------------------------------------------------- GPU: the rules above
@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_gpu_nan_and_inf_inputs_give_nan_rows(impl, splits):
    case = _mla_nonfinite_case(dv=512, dr=64, dtype=torch.bfloat16, device="cuda")
    row_nan, seen = _mla_expected_nonfinite(case)
    out, lse = mla_tree_verify_attention(*case.args, return_lse=True, impl=impl, num_kv_splits=splits)
    out, lse = out.float().cpu(), lse.cpu()
    assert torch.equal(torch.isnan(lse), row_nan)
    assert torch.equal(torch.isnan(out), row_nan[..., None].expand_as(out))
    assert torch.all(out[~seen] == 0) and torch.all(lse[~seen] == float("-inf"))
    ref, ref_lse = mla_tree_verify_attention(*case.args, return_lse=True, impl="reference")
    torch.testing.assert_close(out, ref.float().cpu(), atol=2e-2, rtol=2e-2, equal_nan=True)
    torch.testing.assert_close(lse, ref_lse.cpu(), atol=2e-2, rtol=2e-2, equal_nan=True)
    args = (case.q[:3].contiguous(), case.kv_cache, case.kv_indptr, case.kv_indices)  # decode: one query each
    dec, dec_lse = mla_decode_attention(*args, return_lse=True, impl=impl, num_kv_splits=splits)
    want, want_lse = mla_decode_attention(*args, return_lse=True, impl="reference")
    assert torch.isnan(dec_lse).any()
    torch.testing.assert_close(dec.float(), want.float(), atol=2e-2, rtol=2e-2, equal_nan=True)
    torch.testing.assert_close(dec_lse, want_lse, atol=2e-2, rtol=2e-2, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MLA_INVALID))
@pytest.mark.parametrize("splits", [1, 3])
def test_gpu_cuda_and_reference_agree_on_unchecked_invalid_indices(name, splits):
    from spec_kernels.mla import cuda as cuda_binding
    from spec_kernels.mla import reference

    c = MLA_INVALID[name]
    g = torch.Generator().manual_seed(34)  # the CUDA kernel is built for 576 = 512 + 64
    q = torch.randn(10, 2, 576, generator=g).to("cuda", torch.bfloat16)
    kv_cache = torch.randn(c["kv_cache"].shape[0], 576, generator=g).to("cuda", torch.bfloat16)
    args = [q, kv_cache] + [c[k].cuda() for k in ("kv_indptr", "kv_indices", "qo_indptr", "tree_mask")]
    claimed = _claimed(c["qo_indptr"], c["max_draft_tokens"] or 64)
    outs = {}
    for impl in ("reference", "cuda"):
        out = torch.full((10, 2, 512), 7.0, dtype=torch.bfloat16, device="cuda")
        lse = torch.full((10, 2), 7.0, device="cuda")
        if impl == "reference":
            reference.mla_tree_verify_attention(*args, 0.05, 512, out, lse, c["max_draft_tokens"])
        else:
            cuda_binding.mla_tree_verify_attention(*args, 0.05, 512, out, lse, num_kv_splits=splits,
                                                   max_draft_tokens=c["max_draft_tokens"])
        torch.cuda.synchronize()
        outs[impl] = (out.float().cpu()[claimed], lse.cpu()[claimed])
    assert torch.isfinite(outs["cuda"][0]).all()
    torch.testing.assert_close(outs["cuda"][0], outs["reference"][0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs["cuda"][1], outs["reference"][1], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_debug_mode_checks_index_values_and_mask_bits():
    case = make_mla_case([4, 2], [10, 3], heads=8, dtype=torch.bfloat16, seed=35, device="cuda")
    bad_mask = case.tree_mask.clone()
    bad_mask[4] |= 1 << 2  # request 1 has 2 drafts
    spec_kernels.set_debug_checks(True)
    try:
        with pytest.raises(ValueError, match=r"kv_indptr\[0\] must be >= 0"):
            mla_tree_verify_attention(case.q, case.kv_cache, torch.tensor([-3, 8, 19], dtype=torch.int32,
                                                                          device="cuda"), *case.args[3:])
        with pytest.raises(ValueError, match=r"tree_mask\[4\] \(request 1, draft 0\) has bit 2 set"):
            mla_tree_verify_attention(*case.args[:5], bad_mask)
    finally:
        spec_kernels.set_debug_checks(None)
    out = mla_tree_verify_attention(*case.args[:5], bad_mask)  # unchecked: runs, bits ignored
    torch.testing.assert_close(out, mla_tree_verify_attention(*case.args), atol=0, rtol=0)


@pytest.mark.gpu
def test_gpu_every_configuration_runs_and_matches_the_reference():
    """Each compiled CUDA MLA configuration (16-bit and fp8 caches) that this GPU can run is
    launched (the launch rule steered by spec_kernels.testing.launch_rule_as_on to the shared
    memory of the named GPU whose rule takes it: on an H200 both 64-row ones) and matches the
    reference."""
    from torch.profiler import ProfilerActivity, profile

    from spec_kernels import _ops
    from spec_kernels.attention.plan import DEVICES, device_limits
    from spec_kernels.mla import cuda as mla_cuda
    from spec_kernels.testing import launch_rule_as_on

    own = device_limits(torch.cuda.current_device())
    for c in (c for c in _ops.kernel_configs() if c.kernel == mla_cuda.KERNEL):
        fp8 = bool(c.kv_fp8)
        fits = [lim for lim in DEVICES.values() if lim.smem_per_sm <= own.smem_per_sm]
        found = next(((n, lim) for lim in fits for n in (1, 2, 4)
                      if (lambda s: (s.block_m, s.block_n) == (c.block_m, c.block_n))(
                          mla_cuda.launch_config(16 * n, lim, fp8))), None)
        if found is None:  # sm_90's configuration on a GPU with less shared memory
            assert c.smem_bytes > own.max_smem_per_cta, c
            continue
        n, lim = found
        case = make_mla_case([n], [300], heads=16, dtype=torch.bfloat16, seed=43, device="cuda")
        kv, kw = case.kv_cache, {}
        if fp8:
            kv, kw = kv.float().div(0.05).to(torch.float8_e4m3fn), dict(k_scale=0.05, v_scale=0.05)
        args = (case.q, kv, *case.args[2:])
        want = mla_tree_verify_attention(*args, sm_scale=0.07, impl="reference", max_draft_tokens=n, **kw)
        with launch_rule_as_on(lim.smem_per_sm), profile(activities=[ProfilerActivity.CUDA]) as prof:
            got = mla_tree_verify_attention(*args, sm_scale=0.07, impl="cuda", max_draft_tokens=n, **kw)
            torch.cuda.synchronize()
        instance = f"mla_tree_verify_kernel<__nv_bfloat16, {c.template_args.replace(',', ', ')}>"
        assert any(instance in e.key for e in prof.key_averages()), instance
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2, msg=instance)
