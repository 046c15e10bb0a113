"""fp8 KV caches (float8_e4m3fn, float8_e5m2) with per-layer scales in tree-verify and decode
attention: the reference dequantises (value = fp8 * scale) and runs the same math; the Triton
kernel converts the fp8 values exactly to q's dtype, folds k_scale into the logits' scale and
v_scale into the output. Checked against float64 softmax attention on the dequantised values,
bit-for-bit against the bf16 path where the scales are powers of two (then the dequantised
values are bf16 values and scaling commutes with every rounding), over random trees, odd sizes,
empty prefixes and mixed draft counts; plus the NaN contract, the plan path and the refusals."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import triton
import triton.language as tl

import spec_kernels
from spec_kernels.attention.triton_common import fp8_bits_to_float
from spec_kernels.testing import make_case, naive_attention
from spec_kernels.tree_verify import cuda as cuda_binding
from spec_kernels.tree_verify.plan import TreeVerifyPlan

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3fn", "e5m2"]
# (drafts per request, prefix per request, tree kind, q heads, kv heads): random trees, chains,
# an empty prefix, a request without drafts, one request only.
GRID = [
    ([3, 1, 0, 5], [7, 0, 3, 40], "random", 4, 2),
    ([6], [0], "chain", 2, 2),
    ([1, 9, 2], [33, 5, 1], "random", 8, 1),
]
HALF_TOL = dict(atol=1e-2, rtol=1e-2)  # bf16 outputs against the float64 / fp32 result


def quantise(case, fp8, k_scale, v_scale):
    """fp8 caches holding case's K / V divided by the scales, and the case with the dequantised
    caches (float64) for the float64 reference."""
    k8 = (case.k_cache.float() / k_scale).to(fp8)
    v8 = (case.v_cache.float() / v_scale).to(fp8)
    deq = dataclasses.replace(case, k_cache=k8.double() * k_scale, v_cache=v8.double() * v_scale)
    return k8, v8, deq


def _scale_args(kind, k_scale, v_scale):
    if kind == "tensor":
        return torch.tensor([k_scale], dtype=torch.float32), torch.tensor([v_scale], dtype=torch.float32)
    return k_scale, v_scale


# --------------------------------------------------------------------------- the interpreter's fp8 decode
@triton.jit
def _decode_kernel(X, Y, n, E5M2: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(Y + o, fp8_bits_to_float(tl.load(X + o, mask=o < n, other=0), E5M2), mask=o < n)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_fp8_bit_decode_is_torchs_conversion_for_every_byte(fp8):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = torch.empty(256)
    _decode_kernel[(1,)](codes, got, 256, E5M2=fp8 == torch.float8_e5m2, BLOCK=256)
    want = codes.view(fp8).float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok], want[ok]) and torch.equal(torch.signbit(got[ok]), torch.signbit(want[ok]))


# --------------------------------------------------------------------------- values
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("ns,prefixes,kind,hq,hkv", GRID)
def test_reference_is_attention_on_the_dequantised_values(fp8, ns, prefixes, kind, hq, hkv):
    case = make_case(ns, prefixes, kind=kind, hq=hq, hkv=hkv, dtype=torch.bfloat16, seed=len(ns))
    k8, v8, deq = quantise(case, fp8, 0.37, 1.9)
    want, want_lse = naive_attention(deq)
    out, lse = spec_kernels.tree_verify_attention(case.q, k8, v8, *case.args[3:], return_lse=True, impl="reference",
                                                  k_scale=0.37, v_scale=1.9)
    torch.testing.assert_close(out.double(), want, **HALF_TOL)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("ns,prefixes,kind,hq,hkv", GRID)
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
def test_triton_matches_reference(fp8, ns, prefixes, kind, hq, hkv, splits, scale_kind):
    case = make_case(ns, prefixes, kind=kind, hq=hq, hkv=hkv, dtype=torch.bfloat16, seed=7 + len(ns))
    k8, v8, deq = quantise(case, fp8, 0.05, 3.0)
    ks, vs = _scale_args(scale_kind, 0.05, 3.0)
    got, got_lse = spec_kernels.tree_verify_attention(case.q, k8, v8, *case.args[3:], return_lse=True, impl="triton",
                                                      num_kv_splits=splits, k_scale=ks, v_scale=vs)
    ref, ref_lse = spec_kernels.tree_verify_attention(case.q, k8, v8, *case.args[3:], return_lse=True,
                                                      impl="reference", k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got.float(), ref.float(), **HALF_TOL)
    torch.testing.assert_close(got_lse, ref_lse, atol=1e-4, rtol=1e-4)
    want, _ = naive_attention(deq)
    torch.testing.assert_close(got.double(), want, **HALF_TOL)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("splits", [None, 2])
def test_power_of_two_scales_give_the_bf16_paths_bits(fp8, splits):
    """With scales 2^n the dequantised values are bf16 values: the fp8 path must give exactly the
    bits of the bf16 path on a cache holding them (its error is the bf16 path's, not more)."""
    case = make_case([4, 2, 7], [19, 0, 6], hq=4, hkv=2, d=64, dtype=torch.bfloat16, seed=5)
    k8, v8, deq = quantise(case, fp8, 0.125, 4.0)
    k16, v16 = deq.k_cache.to(torch.bfloat16), deq.v_cache.to(torch.bfloat16)
    assert torch.equal(k16.double(), deq.k_cache) and torch.equal(v16.double(), deq.v_cache)
    for impl in ("reference", "triton"):
        got, got_lse = spec_kernels.tree_verify_attention(case.q, k8, v8, *case.args[3:], return_lse=True, impl=impl,
                                                          num_kv_splits=splits, k_scale=0.125, v_scale=4.0)
        bf16, bf16_lse = spec_kernels.tree_verify_attention(case.q, k16, v16, *case.args[3:], return_lse=True,
                                                            impl=impl, num_kv_splits=splits)
        assert torch.equal(got.view(torch.int16), bf16.view(torch.int16)), impl
        assert torch.equal(got_lse, bf16_lse), impl


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_decode(fp8, impl):
    case = make_case([1] * 5, [0, 3, 17, 1, 64], hq=8, hkv=2, d=128, dtype=torch.float16, seed=11)
    k8, v8, deq = quantise(case, fp8, 0.2, 0.7)
    got = spec_kernels.decode_attention(case.q, k8, v8, case.kv_indptr, case.kv_indices, impl=impl,
                                        k_scale=0.2, v_scale=torch.tensor([0.7]))
    want, _ = naive_attention(deq, decode=True)
    torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN through numpy (interpreter)
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_nan_byte_in_a_visible_k_row_makes_that_row_nan(fp8, impl):
    """0x7f is NaN in both formats: the existing NaN contract (a NaN logit -> NaN output and lse)."""
    case = make_case([2, 3], [4, 5], hq=2, hkv=1, d=64, dtype=torch.bfloat16, seed=2)
    k8, v8, _ = quantise(case, fp8, 0.5, 0.5)
    prefix_slot = int(case.kv_indices[int(case.kv_indptr[1])])  # request 1's first prefix slot
    k8.view(torch.uint8)[prefix_slot, 0, 3] = 0x7F
    out, lse = spec_kernels.tree_verify_attention(case.q, k8, v8, *case.args[3:], return_lse=True, impl=impl,
                                                  k_scale=0.5, v_scale=0.5)
    r1 = slice(int(case.qo_indptr[1]), int(case.qo_indptr[2]))
    assert torch.isnan(out[r1].float()).all() and torch.isnan(lse[r1]).all()
    assert torch.isfinite(out[:int(case.qo_indptr[1])].float()).all()


def test_plan_run_equals_the_one_call_function():
    case = make_case([3, 5], [9, 2], hq=4, hkv=2, d=64, dtype=torch.bfloat16, seed=4)
    k8, v8, _ = quantise(case, torch.float8_e4m3fn, 0.3, 0.6)
    plan = TreeVerifyPlan(case.kv_indptr, case.kv_indices, case.qo_indptr, case.tree_mask, num_q_heads=4,
                          num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    assert plan.impl == "triton"  # on CPU (the CUDA kernel needs CUDA tensors)
    got = plan.run(case.q, k8, v8, k_scale=0.3, v_scale=torch.tensor([0.6]))
    want = spec_kernels.tree_verify_attention(case.q, k8, v8, *case.args[3:], k_scale=0.3, v_scale=0.6)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError, match="k_cache must have dtype float8_e4m3fn"):
        plan.run(case.q, case.k_cache, case.v_cache)
    with pytest.raises(ValueError, match="v_scale is required"):
        plan.run(case.q, k8, v8, k_scale=0.3)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_cuda_kernel_takes_fp8_caches(fp8):
    """The CUDA tree-verify kernel has an fp8 instance of every configuration (run by the PTX
    interpreter in tests/ptx/test_tree_verify_fp8_ptx.py): supports() accepts fp8 caches with
    fp16 / bf16 queries, and still declines a 16-bit cache unlike the query's."""
    for dtype in (torch.bfloat16, torch.float16):
        case = make_case([2], [3], d=128, dtype=dtype)
        k8 = case.k_cache.to(fp8)
        assert cuda_binding.supports(case.q, k8, case.v_cache.to(fp8)) is None
    mixed = cuda_binding.supports(case.q, case.k_cache.bfloat16(), case.v_cache.bfloat16())
    assert "torch.bfloat16 KV cache with torch.float16 queries" in mixed and "fp8" not in mixed
    assert "float32" in cuda_binding.supports(case.q.float(), k8, k8)
    # a row stride that is not a multiple of 16 bytes (an fp8 row of 8 elements' offset) goes to Triton
    odd = torch.empty(k8.shape[0], k8.shape[1], 136, dtype=fp8)[:, :, :128]
    assert "strides" in cuda_binding.supports(case.q, odd, odd)


def test_the_custom_op_with_fp8_caches_passes_opcheck():
    """FakeTensor and AOT dispatch with fp8 caches and tensor scales."""
    case = make_case([2, 1], [3, 0], dtype=torch.bfloat16)
    k8, v8, _ = quantise(case, torch.float8_e5m2, 0.5, 2.0)
    out = torch.empty(case.q.shape[0], case.q.shape[1], case.v_cache.shape[2], dtype=torch.bfloat16)
    args = (case.q, k8, v8, *case.args[3:], 0.125, out, None, "reference", 0, 0, 1.0, 1.0,
            torch.tensor([0.5]), torch.tensor([2.0]))
    # test_schema is left out: its mutation check multiplies the fp8 inputs, which torch's CPU
    # kernels do not implement for fp8 (the op does not mutate them: mutates_args names out, lse).
    torch.library.opcheck(torch.ops.spec_kernels.tree_verify_attention.default, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


# --------------------------------------------------------------------------- bad input
def _call(case, k, v, **kw):
    return spec_kernels.tree_verify_attention(case.q if "q" not in kw else kw.pop("q"), k, v, *case.args[3:], **kw)


@pytest.mark.parametrize("what,mutate,match", [
    ("fp8 q", lambda c, k8, v8: dict(q=c.q.to(torch.float8_e4m3fn), k=k8, v=v8, k_scale=1.0, v_scale=1.0),
     "q must have dtype"),
    ("fp32 q with an fp8 cache", lambda c, k8, v8: dict(q=c.q.float(), k=k8, v=v8, k_scale=1.0, v_scale=1.0),
     "q must be float16 or bfloat16 to read an fp8 k_cache"),
    ("K and V of different fp8 types", lambda c, k8, v8: dict(k=k8, v=v8.float().to(torch.float8_e5m2), k_scale=1.0,
                                                              v_scale=1.0), "v_cache must have dtype float8_e4m3fn .k_cache's."),
    ("no k_scale", lambda c, k8, v8: dict(k=k8, v=v8, v_scale=1.0), "k_scale is required"),
    ("no v_scale", lambda c, k8, v8: dict(k=k8, v=v8, k_scale=1.0), "v_scale is required"),
    ("a scale for a bf16 cache", lambda c, k8, v8: dict(k=c.k_cache, v=c.v_cache, k_scale=1.0),
     "k_scale is given but k_cache is bfloat16"),
    ("zero", lambda c, k8, v8: dict(k=k8, v=v8, k_scale=0.0, v_scale=1.0), "k_scale must be finite and > 0"),
    ("negative", lambda c, k8, v8: dict(k=k8, v=v8, k_scale=1.0, v_scale=-2.0), "v_scale must be finite and > 0"),
    ("inf", lambda c, k8, v8: dict(k=k8, v=v8, k_scale=math.inf, v_scale=1.0), "k_scale must be finite and > 0"),
    ("nan", lambda c, k8, v8: dict(k=k8, v=v8, k_scale=1.0, v_scale=math.nan), "v_scale must be finite and > 0"),
    ("a CPU tensor scale of 0", lambda c, k8, v8: dict(k=k8, v=v8, k_scale=torch.zeros(1), v_scale=1.0),
     "k_scale must be finite and > 0"),
    ("a bool", lambda c, k8, v8: dict(k=k8, v=v8, k_scale=True, v_scale=1.0), "k_scale must be a float"),
    ("a float64 tensor", lambda c, k8, v8: dict(k=k8, v=v8, k_scale=torch.ones(1, dtype=torch.float64), v_scale=1.0),
     "k_scale must have dtype float32"),
    ("two values", lambda c, k8, v8: dict(k=k8, v=v8, k_scale=1.0, v_scale=torch.ones(2)), "v_scale must hold one value"),
    ("a meta tensor scale", lambda c, k8, v8: dict(k=k8, v=v8, k_scale=torch.ones(1, device="meta"), v_scale=1.0),
     "k_scale must be on cpu"),
])
def test_bad_fp8_arguments_are_refused_naming_them(what, mutate, match):
    case = make_case([2, 1], [3, 2], dtype=torch.bfloat16)
    k8, v8, _ = quantise(case, torch.float8_e4m3fn, 1.0, 1.0)
    kw = mutate(case, k8, v8)
    k, v = kw.pop("k"), kw.pop("v")
    out = torch.full((case.q.shape[0], case.q.shape[1], case.v_cache.shape[2]), 7.0, dtype=torch.bfloat16)
    with pytest.raises((ValueError, TypeError), match=match):
        _call(case, k, v, out=out, **kw)
    assert (out == 7.0).all(), f"{what}: the refused call wrote its output"
    if kw.get("k_scale") is not None and kw.get("v_scale") is not None and k.dtype == v.dtype:
        with pytest.raises((ValueError, TypeError), match=match):  # decode takes the same arguments
            spec_kernels.decode_attention(kw.pop("q", case.q)[:2], k, v, case.kv_indptr, case.kv_indices, **kw)


# --------------------------------------------------------------------------- MLA (one latent cache: K = row, V = its latent part)
def mla_case(ns, prefixes, heads=8, d=576, seed=0):
    case = make_case(ns, prefixes, hq=heads, hkv=1, d=d, dtype=torch.bfloat16, seed=seed)
    return case, case.k_cache[:, 0].contiguous()


def _mla(case, kv, **kw):
    return spec_kernels.mla_tree_verify_attention(case.q, kv, case.kv_indptr, case.kv_indices, case.qo_indptr,
                                                  case.tree_mask, **kw)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("ns,prefixes", [([3, 0, 5], [6, 2, 30]), ([1], [0])])
@pytest.mark.parametrize("splits", [None, 2])
def test_mla_triton_matches_reference_and_float64(fp8, ns, prefixes, splits):
    case, kv = mla_case(ns, prefixes, seed=len(ns))
    kv8 = (kv.float() / 0.3).to(fp8)
    got, got_lse = _mla(case, kv8, impl="triton", num_kv_splits=splits, return_lse=True, k_scale=0.3,
                        v_scale=torch.tensor([0.3]))
    ref, ref_lse = _mla(case, kv8, impl="reference", return_lse=True, k_scale=0.3, v_scale=0.3)
    torch.testing.assert_close(got.float(), ref.float(), **HALF_TOL)
    torch.testing.assert_close(got_lse, ref_lse, atol=1e-4, rtol=1e-4)
    deq = dataclasses.replace(case, k_cache=kv8.double()[:, None] * 0.3, v_cache=kv8.double()[:, None, :512] * 0.3)
    want, _ = naive_attention(deq)
    torch.testing.assert_close(got.double(), want, **HALF_TOL)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_mla_power_of_two_scales_give_the_bf16_paths_bits(fp8):
    case, kv = mla_case([2, 4], [9, 3], heads=4, d=288, seed=6)  # 256 latent + 32 rope
    kv8 = (kv.float() / 0.5).to(fp8)
    kv16 = (kv8.float() * 0.5).to(torch.bfloat16)
    for impl in ("reference", "triton"):
        kw = dict(impl=impl, v_head_dim=256, return_lse=True)
        got, got_lse = _mla(case, kv8, k_scale=0.5, v_scale=0.5, **kw)
        want, want_lse = _mla(case, kv16, **kw)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)) and torch.equal(got_lse, want_lse), impl


def test_mla_decode_plan_and_refusals():
    case, kv = mla_case([1, 1, 1], [4, 0, 12], seed=3)
    kv8 = (kv.float() / 0.25).to(torch.float8_e4m3fn)
    got = spec_kernels.mla_decode_attention(case.q, kv8, case.kv_indptr, case.kv_indices, impl="triton",
                                            k_scale=0.25, v_scale=0.25)
    ref = spec_kernels.mla_decode_attention(case.q, kv8, case.kv_indptr, case.kv_indices, impl="reference",
                                            k_scale=0.25, v_scale=0.25)
    torch.testing.assert_close(got.float(), ref.float(), **HALF_TOL)
    plan = spec_kernels.mla.MlaPlan(case.kv_indptr, case.kv_indices, num_heads=8, kv_dtype=torch.float8_e4m3fn)
    assert torch.equal(plan.run(case.q, kv8, k_scale=0.25, v_scale=0.25).view(torch.int16), got.view(torch.int16))
    assert spec_kernels.mla.cuda.supports(case.q, kv8, 512) is None  # its fp8 instances: tests/ptx
    with pytest.raises(ValueError, match="k_scale is required: kv_cache is float8_e4m3fn"):
        spec_kernels.mla_decode_attention(case.q, kv8, case.kv_indptr, case.kv_indices, v_scale=1.0)
    with pytest.raises(ValueError, match="v_scale is given but kv_cache is bfloat16"):
        spec_kernels.mla_decode_attention(case.q, kv, case.kv_indptr, case.kv_indices, v_scale=1.0)
    with pytest.raises(ValueError, match="q must be float16 or bfloat16 to read an fp8 kv_cache"):
        spec_kernels.mla_decode_attention(case.q.float(), kv8, case.kv_indptr, case.kv_indices, k_scale=1.0,
                                          v_scale=1.0)


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("ns,prefixes,kind,hq,hkv", GRID)
def test_gpu_triton_matches_reference(fp8, ns, prefixes, kind, hq, hkv):
    case = make_case(ns, prefixes, kind=kind, hq=hq, hkv=hkv, dtype=torch.bfloat16, seed=3, device="cuda")
    k8, v8, _ = quantise(case, fp8, 0.05, 3.0)
    scales = (torch.tensor([0.05], device="cuda"), torch.tensor([3.0], device="cuda"))
    got = spec_kernels.tree_verify_attention(case.q, k8, v8, *case.args[3:], k_scale=scales[0], v_scale=scales[1])
    ref = spec_kernels.tree_verify_attention(case.q, k8, v8, *case.args[3:], impl="reference", k_scale=0.05,
                                             v_scale=3.0)
    torch.testing.assert_close(got.float(), ref.float(), **HALF_TOL)


# (drafts, prefixes, hq, hkv, head dim, max_draft_tokens): every CUDA tree-verify configuration's
# fp8 instance (64 rows at D 64 / 128 / 256, 128 rows at D 128; decode below takes the 32-row one
# on sm_120 and the 64-row one on sm_90)
CUDA_FP8_TV = [([5, 0, 17], [70, 3, 0], 4, 2, 64, 0), ([7, 2], [40, 300], 4, 1, 128, 0),
               ([4], [70], 2, 1, 256, 0), ([16, 5], [300, 70], 8, 1, 128, 16)]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("ns,prefixes,hq,hkv,d,max_draft", CUDA_FP8_TV)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_cuda_fp8_matches_reference(fp8, ns, prefixes, hq, hkv, d, max_draft, dtype):
    case = make_case(ns, prefixes, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=5, device="cuda")
    k8, v8, _ = quantise(case, fp8, 0.05, 3.0)
    kw = dict(k_scale=0.05, v_scale=3.0, return_lse=True)
    got, got_lse = spec_kernels.tree_verify_attention(case.q, k8, v8, *case.args[3:], impl="cuda",
                                                      max_draft_tokens=max_draft or None, **kw)
    ref, ref_lse = spec_kernels.tree_verify_attention(case.q, k8, v8, *case.args[3:], impl="reference", **kw)
    torch.testing.assert_close(got.float(), ref.float(), **HALF_TOL)
    torch.testing.assert_close(got_lse, ref_lse.float(), atol=1e-4, rtol=1e-4)
    # decode on the same caches (D = 128: the 32-row configuration on sm_120)
    B = case.kv_indptr.numel() - 1
    q1 = case.q[:B].contiguous()
    got = spec_kernels.decode_attention(q1, k8, v8, case.kv_indptr, case.kv_indices, impl="cuda", k_scale=0.05,
                                        v_scale=3.0)
    ref = spec_kernels.decode_attention(q1, k8, v8, case.kv_indptr, case.kv_indices, impl="reference", k_scale=0.05,
                                        v_scale=3.0)
    torch.testing.assert_close(got.float(), ref.float(), **HALF_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("ns,heads", [([3, 1], 4), ([3, 2], 7), ([5, 2], 16)])  # 16-, 32-, 64-row CTAs
def test_gpu_cuda_mla_fp8_matches_reference(fp8, ns, heads):
    case, kv = mla_case(ns, [40, 9], heads=heads, seed=4)
    case = type(case)(*(t.cuda() for t in vars(case).values()))
    kv8 = (kv.float() / 0.02).to(fp8).cuda()
    kw = dict(k_scale=0.02, v_scale=0.03, return_lse=True)
    got, got_lse = _mla(case, kv8, impl="cuda", **kw)
    ref, ref_lse = _mla(case, kv8, impl="reference", **kw)
    torch.testing.assert_close(got.float(), ref.float(), **HALF_TOL)
    torch.testing.assert_close(got_lse, ref_lse.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_reads_updated_scale_tensors():
    """A captured CUDA-kernel call with scale tensors: replayed after the tensors change in place,
    it gives the result of the new scales (no recapture)."""
    case = make_case([4, 2], [60, 9], hq=4, hkv=2, d=128, dtype=torch.bfloat16, seed=8, device="cuda")
    k8, v8, _ = quantise(case, torch.float8_e4m3fn, 0.05, 3.0)
    ks, vs = torch.tensor([0.05], device="cuda"), torch.tensor([3.0], device="cuda")
    plan = spec_kernels.TreeVerifyPlan(*case.args[3:], num_q_heads=4, num_kv_heads=2, head_dim=128,
                                       dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, impl="cuda")
    out = torch.empty_like(case.q)
    plan.run(case.q, k8, v8, out=out, k_scale=ks, v_scale=vs)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(case.q, k8, v8, out=out, k_scale=ks, v_scale=vs)
    ks.fill_(0.1)
    vs.fill_(1.5)
    graph.replay()
    torch.cuda.synchronize()
    want = spec_kernels.tree_verify_attention(case.q, k8, v8, *case.args[3:], impl="reference", k_scale=0.1,
                                              v_scale=1.5)
    torch.testing.assert_close(out.float(), want.float(), **HALF_TOL)


def test_compiles_with_fullgraph_and_tensor_scales():
    case = make_case([3, 2], [4, 1], dtype=torch.bfloat16, seed=9)
    k8, v8, _ = quantise(case, torch.float8_e4m3fn, 0.25, 0.5)
    scales = (torch.tensor([0.25]), torch.tensor([0.5]))

    def step(q, k, v, ks, vs):
        return spec_kernels.tree_verify_attention(q, k, v, *case.args[3:], impl="reference", k_scale=ks, v_scale=vs)

    got = torch.compile(step, fullgraph=True)(case.q, k8, v8, *scales)
    assert torch.equal(got.view(torch.int16), step(case.q, k8, v8, *scales).view(torch.int16))


# --------------------------------------------------------------------------- Triton mutants
# Deliberate bugs in spec_kernels/tree_verify/triton_kernel.py's fp8 path: each edit's text must
# occur exactly once; the patched module replaces the Triton implementation and the named check
# must fail. name: (old text, new text, (fp8 dtype, scale kind) of the check)
TRITON_MUTANTS = {
    "v_scale_dropped": ("            acc = acc * v_scale\n", "            acc = acc * 1.0\n", (torch.float8_e4m3fn, "float")),
    "k_scale_dropped": ("        qk_scale = qk_scale * k_scale\n", "        qk_scale = qk_scale\n",
                        (torch.float8_e4m3fn, "float")),
    "k_scale_tensor_ignored": ("        qk_scale = qk_scale * tl.load(K_SCALE)\n", "        qk_scale = qk_scale * k_scale\n",
                               (torch.float8_e4m3fn, "tensor")),
    "e5m2_read_as_e4m3fn": ("E5M2=k_cache.dtype == torch.float8_e5m2", "E5M2=False", (torch.float8_e5m2, "float")),
}


def _mutant_check(fp8, scale_kind):
    test_triton_matches_reference(fp8, *GRID[0], None, scale_kind)


@pytest.mark.parametrize("name", sorted(TRITON_MUTANTS))
def test_triton_mutant_is_caught(name, tmp_path, monkeypatch):
    import importlib.util
    import inspect

    from spec_kernels.tree_verify import api, triton_kernel

    old, new, check = TRITON_MUTANTS[name]
    _mutant_check(*check)  # passes unmutated
    text = inspect.getsource(triton_kernel)
    assert text.count(old) == 1, f"mutant text found {text.count(old)} times in triton_kernel.py: {old!r}"
    path = tmp_path / f"triton_kernel_{name}.py"
    path.write_text(text.replace(old, new))
    spec = importlib.util.spec_from_file_location(f"spec_kernels.tree_verify._mutant_{name}", path)
    mutant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutant)
    monkeypatch.setitem(api.TREE_VERIFY.impls, "triton", mutant.tree_verify_attention)
    with pytest.raises(AssertionError):
        _mutant_check(*check)


# The same for spec_kernels/mla/triton_kernel.py: (old text, new text, fp8 dtype of the check).
MLA_TRITON_MUTANTS = {
    "mla_v_scale_dropped": ("            acc = acc * v_scale\n", "            acc = acc * 1.0\n", torch.float8_e4m3fn),
    "mla_v_scale_tensor_ignored": ("        v_scale = tl.load(V_SCALE)\n", "        v_scale = v_scale\n",
                                   torch.float8_e4m3fn),
    "mla_e5m2_read_as_e4m3fn": ("E5M2=kv_cache.dtype == torch.float8_e5m2", "E5M2=False", torch.float8_e5m2),
}


def _mla_mutant_check(fp8):
    test_mla_triton_matches_reference_and_float64(fp8, [3, 0, 5], [6, 2, 30], None)


@pytest.mark.parametrize("name", sorted(MLA_TRITON_MUTANTS))
def test_mla_triton_mutant_is_caught(name, tmp_path, monkeypatch):
    import importlib.util
    import inspect

    from spec_kernels.mla import api, triton_kernel

    old, new, fp8 = MLA_TRITON_MUTANTS[name]
    _mla_mutant_check(fp8)  # passes unmutated
    text = inspect.getsource(triton_kernel)
    assert text.count(old) == 1, f"mutant text found {text.count(old)} times in mla/triton_kernel.py: {old!r}"
    path = tmp_path / f"mla_triton_kernel_{name}.py"
    path.write_text(text.replace(old, new))
    spec = importlib.util.spec_from_file_location(f"spec_kernels.mla._mutant_{name}", path)
    mutant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutant)
    monkeypatch.setitem(api.MLA.impls, "triton", mutant.mla_tree_verify_attention)
    with pytest.raises(AssertionError):
        _mla_mutant_check(fp8)
