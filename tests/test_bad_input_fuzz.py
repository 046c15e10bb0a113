"""Bad-input fuzzer of every public op: hypothesis builds a valid call with small random shapes,
corrupts exactly one argument (dtype, device, rank, shape, stride, value range, indptr order,
NaN/inf, duplicates, sizes 0 and 1) and checks the contract (tests/fuzz_common.py): a
ValueError/TypeError/RuntimeError naming the corrupted argument, or, for input that is legal, the
reference implementation's result (NaN positions included). The stateful KV-slot ops must in
addition leave every state tensor byte for byte as it was when they refuse a call.

Deterministic (derandomize, no example database). SPEC_KERNELS_FUZZ_EXAMPLES=<n> runs n examples
per test instead of the default (a longer profile).
"""
from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
from hypothesis import strategies as st

import spec_kernels
from spec_kernels.kv_slots import page_state_from_free_stack
from spec_kernels.kv_slots import reference as kv_ref
from spec_kernels.mla import reference as mla_ref
from spec_kernels.norm import reference as norm_ref
from spec_kernels.tree_verify import reference as tv_ref
from spec_kernels.attention.plan import MAX_KV_SPLITS
from fuzz_common import (Bad, assert_same_results, check_outcome, clone_value, fuzz_by_kind, new_size, other_rank,
                         poison, resized, strided_copy, wrong_dtype)
from spec_kernels.testing import TREE_KINDS, make_case

IMPLS = ["reference", "triton"]
# examples per (op, corruption kind, impl); SPEC_KERNELS_FUZZ_EXAMPLES=<n> overrides them all
EXAMPLES = dict(dtype=12, device=12, rank=12, stride=12, shape=12, value=12, indptr=12, nonfinite=6, duplicate=8,
                replay=12, missing=6)
META = torch.device("meta")
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
INDEX = (torch.int32, torch.int64)


def draw_kind(data, menu: list[tuple[str, str]], kind: str) -> tuple[str, str]:
    """(kind, argument): an argument the op's corruption menu has for this kind."""
    args = [a for k, a in menu if k == kind]
    assert args, f"no argument to corrupt with {kind}"
    return kind, data.draw(st.sampled_from(args), label=f"{kind} of")


def meta_corruption(data, kw: dict, kind: str, arg: str, allowed: dict, rank_legal=(), contiguous_free=()) -> Bad:
    """The kinds that every tensor argument has: dtype, device, rank, stride. Mutates kw."""
    t = kw[arg]
    if kind == "dtype":
        kw[arg] = wrong_dtype(data, t, allowed[arg])
        return Bad(arg, kind, f"{t.dtype} -> {kw[arg].dtype}", "raise")
    if kind == "device":
        kw[arg] = t.to(META)
        return Bad(arg, kind, "cpu -> meta", "raise")
    if kind == "rank":
        kw[arg] = other_rank(data, t)
        return Bad(arg, kind, f"shape {tuple(t.shape)} -> {tuple(kw[arg].shape)}",
                   "either" if arg in rank_legal else "raise")
    if kind == "stride":
        kw[arg] = strided_copy(t)
        legal = kw[arg].is_contiguous() or arg in contiguous_free
        return Bad(arg, kind, f"strides {tuple(kw[arg].stride())}", "legal" if legal else "raise")
    raise AssertionError(kind)


def indptr_corruption(data, ptr: torch.Tensor, *, starts_at_zero: bool, end: int, name: str,
                      end_exact: bool) -> tuple[torch.Tensor, Bad]:
    """One entry of an indptr moved by +-1, or to a value that breaks its order / start / end.
    `end`: its required last value (end_exact) or the bound of it (an offset indptr)."""
    vals = ptr.tolist()
    i = data.draw(st.integers(0, len(vals) - 1), label=f"{name} entry")
    how = data.draw(st.sampled_from(["+1", "-1", "before previous", "after next", "negative"]), label="how")
    old = vals[i]
    if how == "+1":
        vals[i] += 1
    elif how == "-1":
        vals[i] -= 1
    elif how == "before previous":
        vals[i] = (vals[i - 1] if i else 0) - 1
    elif how == "after next":
        vals[i] = (vals[i + 1] if i + 1 < len(vals) else end) + 1
    else:
        vals[i] = -1
    broken = any(b < a for a, b in zip(vals, vals[1:]))
    broken |= (vals[0] != 0) if starts_at_zero else (vals[0] < 0)
    broken |= (vals[-1] != end) if end_exact else (vals[-1] > end)
    new = torch.tensor(vals, dtype=ptr.dtype)
    return new, Bad(name, "indptr", f"{name}[{i}] {old} -> {vals[i]} ({how}): {vals}", "raise" if broken else "either")


# =========================================================================== attention ops
@st.composite
def attention_case(draw, decode: bool = False):
    """A valid tree-verify (or decode) batch; sizes 0 and 1 are frequent. kv_indices may be a
    window of a larger buffer whose entries outside the window are arbitrary (even invalid)."""
    B = draw(st.integers(0, 3), label="B")
    ns = [1] * B if decode else [draw(st.integers(0, 4), label="n_b") for _ in range(B)]
    prefixes = [draw(st.integers(0, 4), label="prefix") for _ in range(B)]
    hkv = draw(st.sampled_from([1, 2]), label="Hkv")
    hq = hkv * draw(st.sampled_from([1, 2]), label="group")
    case = make_case(ns, prefixes, hq=hq, hkv=hkv, d=64, kind=draw(st.sampled_from(TREE_KINDS)),
                     index_dtype=draw(st.sampled_from(INDEX), label="index dtype"), seed=draw(st.integers(0, 999)))
    S = case.k_cache.shape[0]
    lead, tail = draw(st.integers(0, 2), label="window start"), draw(st.integers(0, 2), label="window tail")
    junk = lambda n: torch.tensor([draw(st.sampled_from([-5, 0, S - 1, S + 3])) for _ in range(n)])  # noqa: E731
    kv_indices = torch.cat([junk(lead), case.kv_indices.long(), junk(tail)]).to(case.kv_indices.dtype)
    kw = dict(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, kv_indptr=(case.kv_indptr + lead).to(torch.int32),
              kv_indices=kv_indices)
    if decode:
        kw["q"] = case.q[:0] if B == 0 else torch.randn(B, hq, 64)
    else:
        kw.update(qo_indptr=case.qo_indptr, tree_mask=case.tree_mask)
    kw["out"] = torch.zeros(kw["q"].shape[0], hq, 64)
    kw["sm_scale"] = draw(st.sampled_from([None, 0.2]), label="sm_scale")
    kw["num_kv_splits"] = draw(st.sampled_from([None, 1, 2]), label="num_kv_splits")
    if not decode:
        most = max(ns, default=0)
        kw["max_draft_tokens"] = draw(st.sampled_from([None, max(most, 1), 64]), label="max_draft_tokens")
    return kw


def attention_corruption(data, kw: dict, kind: str, decode: bool, mla: bool = False) -> Bad:
    """Corrupt one argument of a tree-verify / decode / MLA call in place."""
    cache = ("kv_cache",) if mla else ("k_cache", "v_cache")
    floats = ("q", *cache)
    index = ("kv_indptr", "kv_indices") + (() if decode else ("qo_indptr", "tree_mask"))
    tensors = floats + index + ("out",)
    menu = [(k, a) for k in ("dtype", "device", "rank", "stride") for a in tensors]
    menu += [("shape", a) for a in tensors] + [("nonfinite", a) for a in floats]
    menu += [("value", "kv_indices"), ("duplicate", "kv_indices"), ("indptr", "kv_indptr"), ("value", "sm_scale"),
             ("value", "num_kv_splits")]
    if not decode:
        menu += [("indptr", "qo_indptr"), ("value", "tree_mask"), ("value", "max_draft_tokens")]
    if mla:
        menu += [("value", "v_head_dim")]
    kind, arg = draw_kind(data, menu, kind)
    q = kw["q"]
    allowed = {a: (q.dtype,) for a in cache + ("out",)}
    allowed.update(q=FLOATS, kv_indptr=(torch.int32,), kv_indices=INDEX, qo_indptr=(torch.int32,),
                   tree_mask=(torch.int64,))
    if kind in ("dtype", "device", "rank", "stride"):
        if mla and kind == "rank" and arg == "kv_cache":  # [S, D] <-> [S, 1, D] are both legal: go to [S, D, 1]
            kw[arg] = kw[arg].unsqueeze(-1)
            return Bad(arg, kind, f"shape -> {tuple(kw[arg].shape)}", "raise")
        return meta_corruption(data, kw, kind, arg, allowed)
    if kind == "shape":
        t = kw[arg]
        dim = data.draw(st.integers(0, t.dim() - 1), label="dim")
        size = new_size(data, t.shape[dim])
        kw[arg] = resized(data, t, dim, size)
        return Bad(arg, kind, f"dim {dim}: {t.shape[dim]} -> {size}", "either")
    if kind == "nonfinite":
        kw[arg], how = poison(data, kw[arg])
        return Bad(arg, kind, how, "legal")
    S = kw[cache[0]].shape[0]
    if arg == "kv_indices":
        idx = kw[arg].clone()
        lo, hi = kw["kv_indptr"][0].item(), kw["kv_indptr"][-1].item()
        if idx.numel() == 0:
            return Bad(arg, kind, "empty: unchanged", "legal")
        p = data.draw(st.integers(0, idx.numel() - 1), label="position")
        if kind == "duplicate":  # two positions read one slot: legal (e.g. shared prefixes)
            src = data.draw(st.integers(lo, hi - 1), label="copied position") if hi > lo else p
            idx[p] = idx[src]
            kw[arg] = idx
            used = lo <= p < hi
            ok = not used or 0 <= int(idx[p]) < S
            return Bad(arg, kind, f"kv_indices[{p}] = kv_indices[{src}]", "legal" if ok else "raise")
        big = 2**31 - 1 if idx.dtype == torch.int32 else 2**40
        v = data.draw(st.sampled_from([-1, 0, S - 1, S, S + 1, big, -big]), label="slot")
        idx[p] = v
        kw[arg] = idx
        bad = lo <= p < hi and not 0 <= v < S
        return Bad(arg, kind, f"kv_indices[{p}] = {v} (S = {S}, used window [{lo}, {hi}))", "raise" if bad else "legal")
    if arg == "kv_indptr":
        kw[arg], bad = indptr_corruption(data, kw[arg], starts_at_zero=False, end=kw["kv_indices"].numel(),
                                         name=arg, end_exact=False)
        return bad
    if arg == "qo_indptr":
        kw[arg], bad = indptr_corruption(data, kw[arg], starts_at_zero=True, end=q.shape[0], name=arg, end_exact=True)
        return bad
    if arg == "tree_mask":
        mask = kw[arg].clone()
        if mask.numel() == 0:
            return Bad(arg, kind, "empty: unchanged", "legal")
        t = data.draw(st.integers(0, mask.numel() - 1), label="row")
        qo = kw["qo_indptr"].tolist()
        b = max(i for i in range(len(qo) - 1) if qo[i] <= t < qo[i + 1])
        i = t - qo[b]
        j = data.draw(st.sampled_from(sorted({0, i, i + 1, 63})), label="bit")
        set_bit = data.draw(st.booleans(), label="set (else clear)")
        word = int(mask[t])
        word = word | (1 << j) if set_bit else word & ~(1 << j)
        mask[t] = word - (1 << 64) if word >= 1 << 63 else word
        kw[arg] = mask
        bad = set_bit and j > i
        return Bad(arg, kind, f"tree_mask[{t}] (draft {i}) bit {j} {'set' if set_bit else 'cleared'}",
                   "raise" if bad else "legal")
    if arg == "sm_scale":
        v = data.draw(st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e-3]), label="sm_scale")
        kw[arg] = v
        return Bad(arg, kind, f"sm_scale = {v}", "legal" if math.isfinite(v) else "raise")
    if arg == "num_kv_splits":
        v = data.draw(st.sampled_from([0, 1, MAX_KV_SPLITS, MAX_KV_SPLITS + 1, -1]), label="num_kv_splits")
        kw[arg] = v
        return Bad(arg, kind, f"num_kv_splits = {v}", "legal" if 1 <= v <= MAX_KV_SPLITS else "raise")
    if arg == "max_draft_tokens":
        qo = kw["qo_indptr"].tolist()
        most = max([b - a for a, b in zip(qo, qo[1:])], default=0)
        v = data.draw(st.sampled_from(sorted({0, 1, 64, 65, most, max(most - 1, 0), most + 1})), label="bound")
        kw[arg] = v
        if not 1 <= v <= 64:
            return Bad(arg, kind, f"max_draft_tokens = {v}", "raise")
        # a request with more drafts than the bound: the error is about qo_indptr's counts
        return Bad(arg, kind, f"max_draft_tokens = {v}, largest n_b {most}", "legal" if v >= most else "raise",
                   names=("max_draft_tokens", "qo_indptr"))
    if arg == "v_head_dim":
        v = data.draw(st.sampled_from([64, 127, 256, 512, True, 128.0]), label="v_head_dim")
        kw[arg] = v
        return Bad(arg, kind, f"v_head_dim = {v!r}", "raise")
    raise AssertionError((kind, arg))


def _scale(kw, d):
    s = kw.get("sm_scale")
    return 1 / math.sqrt(d) if s is None else s


def _tv_reference(kw: dict, decode: bool):
    q = kw["q"]
    out = torch.zeros(q.shape[0], q.shape[1], kw["v_cache"].shape[2], dtype=q.dtype)
    lse = torch.zeros(q.shape[:2], dtype=torch.float32)
    tv_ref.tree_verify_attention(q, kw["k_cache"], kw["v_cache"], kw["kv_indptr"], kw["kv_indices"],
                                 None if decode else kw["qo_indptr"], None if decode else kw["tree_mask"],
                                 _scale(kw, q.shape[2]), out, lse, 1 if decode else kw.get("max_draft_tokens") or 0)
    return out, lse


ATTENTION_KINDS = ["dtype", "device", "rank", "stride", "shape", "nonfinite", "value", "indptr", "duplicate"]
NORM_KINDS = ["dtype", "device", "rank", "stride", "shape", "nonfinite", "value", "duplicate"]
KV_KINDS = ["dtype", "device", "rank", "stride", "shape", "value", "duplicate"]


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
@pytest.mark.parametrize("impl", IMPLS)
@fuzz_by_kind(EXAMPLES)
def test_fuzz_tree_verify_attention(impl, kind, data):
    kw = data.draw(attention_case())
    bad = attention_corruption(data, kw, kind, decode=False)
    check_outcome(bad, kw, lambda: spec_kernels.tree_verify_attention(**kw, return_lse=True, impl=impl),
                  lambda: _tv_reference({k: clone_value(v) for k, v in kw.items()}, decode=False))


# --------------------------------------------------------------------------- fp8 KV caches
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_scale_corruption(data, kw: dict) -> Bad:
    """One argument of a valid fp8-cache call changed: a scale (missing, out of range, of another
    type or shape, a tensor form that is legal), a cache's dtype, or q's."""
    arg = data.draw(st.sampled_from(["k_scale", "v_scale", "k_cache", "v_cache", "q"]), label="argument")
    if arg in ("k_scale", "v_scale"):
        forms = {
            "missing": (None, "raise"), "zero": (0.0, "raise"), "negative": (-0.5, "raise"),
            "inf": (math.inf, "raise"), "nan": (math.nan, "raise"), "bool": (True, "raise"), "int": (2, "legal"),
            "string": ("0.5", "raise"), "tiny": (1e-30, "legal"),
            "fp32 [1]": (torch.tensor([0.75]), "legal"), "fp32 0-d": (torch.tensor(0.75), "legal"),
            "fp32 [2]": (torch.tensor([0.5, 0.5]), "raise"), "fp64 [1]": (torch.tensor([0.5], dtype=torch.float64), "raise"),
            "fp32 [1] zero": (torch.zeros(1), "raise"), "meta": (torch.ones(1, device="meta"), "raise"),
        }
        form = data.draw(st.sampled_from(sorted(forms)), label="scale form")
        kw[arg], expect = forms[form]
        return Bad(arg, "value", f"{arg} = {form}", expect)
    if arg == "q":
        new = data.draw(st.sampled_from([torch.float32, torch.float8_e4m3fn, torch.bfloat16]), label="q dtype")
        kw["q"] = kw["q"].to(new)
        kw["out"] = kw["out"].to(new) if new != torch.float8_e4m3fn else kw["out"]
        return Bad(arg, "dtype", f"q -> {new}", "legal" if new == torch.bfloat16 else "raise")
    new = data.draw(st.sampled_from([*FP8_DTYPES, torch.float16]), label="cache dtype")
    old = kw[arg].dtype
    kw[arg] = kw[arg].float().to(new)
    if new == old:
        return Bad(arg, "dtype", f"{arg} {old} unchanged", "legal")
    # the other cache keeps its fp8 dtype: v_cache's error names v_cache; k_cache's may name either
    names = (arg,) if arg == "v_cache" else ("k_cache", "v_cache")
    return Bad(arg, "dtype", f"{arg} {old} -> {new}", "raise", names=names)


def _fp8_reference(kw: dict, decode: bool):
    q = kw["q"]
    out = torch.zeros(q.shape[0], q.shape[1], kw["v_cache"].shape[2], dtype=q.dtype)
    lse = torch.zeros(q.shape[:2], dtype=torch.float32)
    ks, vs = (float(kw[n]) for n in ("k_scale", "v_scale"))
    tv_ref.tree_verify_attention(q, kw["k_cache"], kw["v_cache"], kw["kv_indptr"], kw["kv_indices"],
                                 None if decode else kw["qo_indptr"], None if decode else kw["tree_mask"],
                                 _scale(kw, q.shape[2]), out, lse, 1 if decode else kw.get("max_draft_tokens") or 0,
                                 ks, vs)
    return out, lse


@pytest.mark.parametrize("kind", ["value"])
@pytest.mark.parametrize("decode", [False, True], ids=["verify", "decode"])
@pytest.mark.parametrize("impl", IMPLS)
@fuzz_by_kind({"value": 24})
def test_fuzz_fp8_kv_cache_arguments(impl, decode, kind, data):
    kw = data.draw(attention_case(decode=decode))
    fp8 = data.draw(st.sampled_from(FP8_DTYPES), label="fp8 dtype")
    kw["q"], kw["out"] = kw["q"].to(torch.float16), kw["out"].to(torch.float16)
    kw["k_scale"], kw["v_scale"] = 0.5, 2.0
    kw["k_cache"], kw["v_cache"] = (kw["k_cache"] / 0.5).to(fp8), (kw["v_cache"] / 2.0).to(fp8)
    bad = fp8_scale_corruption(data, kw)
    op = spec_kernels.decode_attention if decode else spec_kernels.tree_verify_attention
    check_outcome(bad, kw, lambda: op(**kw, return_lse=True, impl=impl),
                  lambda: _fp8_reference({k: clone_value(v) for k, v in kw.items()}, decode),
                  compare=lambda got, want, what: assert_same_results(got, want, what, atol=1.6e-2, rtol=8e-3))


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
@pytest.mark.parametrize("impl", IMPLS)
@fuzz_by_kind(EXAMPLES)
def test_fuzz_decode_attention(impl, kind, data):
    kw = data.draw(attention_case(decode=True))
    bad = attention_corruption(data, kw, kind, decode=True)
    check_outcome(bad, kw, lambda: spec_kernels.decode_attention(**kw, return_lse=True, impl=impl),
                  lambda: _tv_reference({k: clone_value(v) for k, v in kw.items()}, decode=True))


# --------------------------------------------------------------------------- MLA
MLA_V, MLA_ROPE = 128, 32  # the smallest latent / rope dims the reference and Triton take


@st.composite
def mla_case(draw, decode: bool = False):
    kw = draw(attention_case(decode=decode))
    T, S = kw["q"].shape[0], kw["k_cache"].shape[0]
    H = draw(st.sampled_from([1, 2]), label="H")
    D = MLA_V + MLA_ROPE
    kv = torch.randn(S, D)
    kw.pop("k_cache"), kw.pop("v_cache")
    kw["kv_cache"] = kv.unsqueeze(1) if draw(st.booleans(), label="[S, 1, D]") else kv
    kw["q"] = torch.randn(T, H, D)
    kw["out"] = torch.zeros(T, H, MLA_V)
    kw["v_head_dim"] = MLA_V
    return kw


def _mla_reference(kw: dict, decode: bool):
    q, kv = kw["q"], kw["kv_cache"]
    kv2d = kv.reshape(kv.shape[0], kv.shape[-1])
    out = torch.zeros(q.shape[0], q.shape[1], kw["v_head_dim"], dtype=q.dtype)
    lse = torch.zeros(q.shape[:2], dtype=torch.float32)
    mla_ref.mla_tree_verify_attention(q, kv2d, kw["kv_indptr"], kw["kv_indices"], None if decode else kw["qo_indptr"],
                                      None if decode else kw["tree_mask"], _scale(kw, q.shape[2]), kw["v_head_dim"],
                                      out, lse, 1 if decode else kw.get("max_draft_tokens") or 0)
    return out, lse


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
@pytest.mark.parametrize("impl", IMPLS)
@fuzz_by_kind(EXAMPLES)
def test_fuzz_mla_tree_verify_attention(impl, kind, data):
    kw = data.draw(mla_case())
    bad = attention_corruption(data, kw, kind, decode=False, mla=True)
    check_outcome(bad, kw, lambda: spec_kernels.mla_tree_verify_attention(**kw, return_lse=True, impl=impl),
                  lambda: _mla_reference({k: clone_value(v) for k, v in kw.items()}, decode=False))


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
@pytest.mark.parametrize("impl", IMPLS)
@fuzz_by_kind(EXAMPLES)
def test_fuzz_mla_decode_attention(impl, kind, data):
    kw = data.draw(mla_case(decode=True))
    bad = attention_corruption(data, kw, kind, decode=True, mla=True)
    check_outcome(bad, kw, lambda: spec_kernels.mla_decode_attention(**kw, return_lse=True, impl=impl),
                  lambda: _mla_reference({k: clone_value(v) for k, v in kw.items()}, decode=True))


# --------------------------------------------------------------------------- tree_mask_from_parents
@pytest.mark.parametrize("kind", ["dtype", "device", "rank", "stride", "shape", "value", "indptr", "duplicate"])
@pytest.mark.parametrize("impl", ["reference"])  # its implementations: reference (CPU) and CUDA; no Triton kernel
@fuzz_by_kind(EXAMPLES)
def test_fuzz_tree_mask_from_parents(impl, kind, data):
    B = data.draw(st.integers(0, 3), label="B")
    ns = [data.draw(st.integers(0, 5), label="n_b") for _ in range(B)]
    case = make_case(ns, [0] * B, hq=1, hkv=1, kind=data.draw(st.sampled_from(TREE_KINDS)),
                     seed=data.draw(st.integers(0, 999)))
    kw = dict(parents=case.parents.to(data.draw(st.sampled_from(INDEX), label="parents dtype")),
              qo_indptr=case.qo_indptr)
    menu = [(k, a) for k in ("dtype", "device", "rank", "stride", "shape") for a in kw]
    menu += [("value", "parents"), ("duplicate", "parents"), ("indptr", "qo_indptr")]
    kind, arg = draw_kind(data, menu, kind)
    T = kw["parents"].numel()
    if kind == "shape":
        size = new_size(data, kw[arg].shape[0])
        kw[arg] = resized(data, kw[arg], 0, size, fill=lambda s: torch.full(s, -1))
        bad = Bad(arg, kind, f"{T if arg == 'parents' else B + 1} -> {size} entries", "either")
    elif kind == "indptr":
        kw[arg], bad = indptr_corruption(data, kw[arg], starts_at_zero=True, end=T, name=arg, end_exact=True)
    elif kind in ("value", "duplicate"):
        par = kw["parents"].clone()
        if T == 0:
            bad = Bad(arg, kind, "empty: unchanged", "legal")
        else:
            t = data.draw(st.integers(0, T - 1), label="row")
            qo = kw["qo_indptr"].tolist()
            i = t - max(qo[b] for b in range(B) if qo[b] <= t < qo[b + 1])
            if kind == "duplicate":  # a sibling of its earlier draft: legal
                v = int(par[t - 1]) if i > 0 else -1
            else:
                v = data.draw(st.sampled_from(sorted({-2, -1, 0, i - 1, i, i + 1, 64})), label="parent")
            par[t] = v
            bad = Bad(arg, kind, f"parents[{t}] (draft {i}) = {v}", "legal" if -1 <= v < i else "raise")
        kw["parents"] = par
    else:
        bad = meta_corruption(data, kw, kind, arg, dict(parents=INDEX, qo_indptr=(torch.int32,)))

    def reference():
        p, qo = clone_value(kw["parents"]), clone_value(kw["qo_indptr"])
        mask = torch.zeros(p.shape[0], dtype=torch.int64)
        tv_ref.tree_mask_from_parents(p, qo, mask)
        return mask

    check_outcome(bad, kw, lambda: spec_kernels.tree_mask_from_parents(**kw, impl=impl), reference)


# =========================================================================== fused_add_rmsnorm
NORM_ARGS = ("x", "residual", "weight")


@st.composite
def norm_case(draw):
    T = draw(st.integers(0, 3), label="tokens")
    H = draw(st.sampled_from([1, 2, 7, 16]), label="hidden")
    dtype = draw(st.sampled_from([torch.float32, torch.float16]), label="dtype")
    gen = torch.Generator().manual_seed(draw(st.integers(0, 999)))
    kw = dict(x=torch.randn(T, H, generator=gen).to(dtype), residual=torch.randn(T, H, generator=gen).to(dtype),
              weight=torch.randn(H, generator=gen).to(dtype), eps=draw(st.sampled_from([1e-6, 0.0, 0.5])))
    if draw(st.booleans(), label="preallocated outputs"):
        kw["out"], kw["residual_out"] = torch.zeros(T, H, dtype=dtype), torch.zeros(T, H, dtype=dtype)
    return kw


def norm_corruption(data, kw: dict, kind: str) -> Bad:
    tensors = NORM_ARGS + (("out", "residual_out") if "out" in kw else ())
    menu = [(k, a) for k in ("dtype", "device", "rank", "stride", "shape") for a in tensors]
    menu += [("nonfinite", a) for a in NORM_ARGS] + [("value", "eps"), ("value", "out_scale")]
    menu += [("duplicate", "out"), ("duplicate", "residual_out")]
    kind, arg = draw_kind(data, menu, kind)
    x = kw["x"]
    T, H = x.shape
    if kind in ("dtype", "device", "rank", "stride"):
        allowed = {a: (x.dtype,) for a in tensors}
        allowed["x"] = FLOATS
        return meta_corruption(data, kw, kind, arg, allowed)
    if kind == "shape":
        t = kw[arg]
        dim = data.draw(st.integers(0, t.dim() - 1), label="dim")
        size = new_size(data, t.shape[dim])
        kw[arg] = resized(data, t, dim, size)
        # x, residual, weight and the outputs must agree: any one size changed alone is a mismatch
        return Bad(arg, kind, f"dim {dim}: {t.shape[dim]} -> {size}", "raise")
    if kind == "nonfinite":
        kw[arg], how = poison(data, kw[arg])
        return Bad(arg, kind, how, "legal")
    if arg == "eps":
        v = data.draw(st.sampled_from([-1e-6, math.nan, math.inf, 0.0, 1e3]), label="eps")
        kw[arg] = v
        return Bad(arg, kind, f"eps = {v}", "legal" if math.isfinite(v) and v >= 0 else "raise")
    if arg == "out_scale":
        v = data.draw(st.sampled_from([0.0, -1.0, math.nan, math.inf, 0.5, 1.0]), label="out_scale")
        kw[arg] = v
        if "out" in kw:
            kw["out"] = kw["out"].to(torch.float8_e4m3fn)
        return Bad(arg, kind, f"out_scale = {v}", "legal" if math.isfinite(v) and v > 0 else "raise")
    # duplicate: an output that is one of the inputs (legal in place), another output, or part of an input
    target = data.draw(st.sampled_from(["x", "residual", "the other output", "part of x", "weight"]),
                       label="aliased with")
    other = "residual_out" if arg == "out" else "out"
    if target in ("x", "residual"):
        kw[arg] = kw[target]
        return Bad(arg, kind, f"{arg} is {target} (in place)", "legal")
    if target == "the other output":
        if other not in kw:
            kw[other] = torch.zeros_like(x)
        kw[arg] = kw[other]
        return Bad(arg, kind, f"{arg} is {other}", "raise" if T * H else "either", names=(arg, other))
    if target == "weight":
        kw[arg] = kw["weight"].expand(T, H)
        return Bad(arg, kind, f"{arg} = weight.expand(T, H)", "raise" if T * H else "legal")
    if T * H <= 1:
        return Bad(arg, kind, "too small to overlap partly: unchanged", "legal")
    flat = torch.zeros(T * H + 1, dtype=x.dtype)
    flat[: T * H] = x.reshape(-1)
    kw["x"] = flat[: T * H].view(T, H)
    kw[arg] = flat[1:].view(T, H)
    return Bad(arg, kind, f"{arg} overlaps x shifted by one element", "raise", names=(arg, "x"))


def _norm_reference(kw: dict):
    kw = {k: clone_value(v) for k, v in kw.items()}
    x = kw["x"]
    out_dtype = torch.float8_e4m3fn if kw.get("out_scale") is not None else x.dtype
    out, res = torch.empty(x.shape, dtype=out_dtype), torch.empty(x.shape, dtype=x.dtype)
    norm_ref.fused_add_rmsnorm(x, kw["residual"], kw["weight"], kw["eps"], out, res, kw.get("out_scale"))
    return out, res


def _norm_compare(got, want, what):
    # fp16 / fp8 outputs may round differently in the last place
    tol = dict(atol=2e-5, rtol=2e-5) if want[1].dtype == torch.float32 and want[0].dtype == torch.float32 else \
        dict(atol=1e-2, rtol=2e-2)
    if want[0].dtype == torch.float8_e4m3fn:
        assert got[0].dtype == want[0].dtype, f"{what}: out dtype {got[0].dtype}"
        assert_same_results(got[0].float(), want[0].float(), what, atol=0.07, rtol=0.07)
        assert_same_results(got[1], want[1], what, **tol)
        return
    assert_same_results(got, want, what, **tol)


@pytest.mark.parametrize("kind", NORM_KINDS)
@pytest.mark.parametrize("impl", IMPLS)
@fuzz_by_kind(EXAMPLES)
def test_fuzz_fused_add_rmsnorm(impl, kind, data):
    kw = data.draw(norm_case())
    bad = norm_corruption(data, kw, kind)
    check_outcome(bad, kw, lambda: spec_kernels.fused_add_rmsnorm(**kw, impl=impl), lambda: _norm_reference(kw),
                  compare=_norm_compare)


# --------------------------------------------------------------------------- allreduce + RMSNorm (one rank)
@pytest.fixture(scope="module")
def single_rank_group():
    """A one-rank gloo group in this process: FusedAllReduce's CPU path (the torch.distributed
    fallback, then fused_add_rmsnorm) with its argument checks; the sum over one rank is x."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.fail("torch.distributed is already initialised in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            yield os.path.join(tmp, "no_tuning.json")
        finally:
            dist.destroy_process_group()


COMMS: dict = {}


def _comm(tuning_path: str, hidden: int, dtype: torch.dtype):
    from spec_kernels.comm import FusedAllReduce

    key = (hidden, dtype)
    if key not in COMMS:
        COMMS[key] = FusedAllReduce(max_tokens=3, hidden_size=hidden, dtype=dtype, device="cpu", timeout_s=30,
                                    tuning_path=tuning_path)
    return COMMS[key]


@pytest.mark.parametrize("kind", NORM_KINDS)
@fuzz_by_kind(EXAMPLES)
def test_fuzz_fused_allreduce_add_rmsnorm(single_rank_group, kind, data):
    kw = data.draw(norm_case())
    comm = _comm(single_rank_group, kw["x"].shape[1], kw["x"].dtype)
    menu = ["norm arguments", "all_reduce"]
    if kind == "shape":
        menu += ["x rows past max_tokens", "x hidden != hidden_size"]
    if kind == "value":
        menu = ["norm arguments"]
    what = data.draw(st.sampled_from(menu), label="comm corruption")
    if what == "norm arguments":
        bad = norm_corruption(data, kw, kind)
        if bad.arg == "x" and bad.kind in ("dtype", "shape"):  # the communicator's own x contract comes first
            bad.expect = "raise"
        call = lambda: comm.all_reduce_add_rmsnorm(**kw)  # noqa: E731
        check_outcome(bad, kw, call, lambda: _norm_reference(kw), compare=_norm_compare)
    elif what == "x rows past max_tokens":
        x = torch.randn(comm.max_tokens + 1, comm.hidden_size).to(comm.dtype)
        kw.update(x=x, residual=torch.zeros_like(x))
        kw.pop("out", None), kw.pop("residual_out", None)
        check_outcome(Bad("x", "shape", f"{x.shape[0]} rows, max_tokens {comm.max_tokens}", "raise"), kw,
                      lambda: comm.all_reduce_add_rmsnorm(**kw), lambda: None)
    elif what == "x hidden != hidden_size":
        T = kw["x"].shape[0]
        for k in ("x", "residual", "out", "residual_out"):
            if k in kw:
                kw[k] = torch.zeros(T, comm.hidden_size + 1, dtype=comm.dtype)
        kw["weight"] = torch.ones(comm.hidden_size + 1, dtype=comm.dtype)
        check_outcome(Bad("x", "shape", f"hidden {comm.hidden_size + 1} != {comm.hidden_size}", "raise"), kw,
                      lambda: comm.all_reduce_add_rmsnorm(**kw), lambda: None)
    else:  # plain all_reduce: x and out
        ar = dict(x=kw["x"])
        if "out" in kw:
            ar["out"] = kw["out"]
        arg = "out" if kind == "duplicate" else data.draw(st.sampled_from(sorted(ar)), label=f"{kind} of")
        if kind == "shape":
            ar[arg] = resized(data, ar[arg], 0, new_size(data, ar[arg].shape[0]))
            bad = Bad(arg, kind, f"{ar[arg].shape[0]} rows", "either" if arg == "x" and "out" not in ar else "raise")
        elif kind == "nonfinite":
            ar[arg], how = poison(data, ar[arg])
            bad = Bad(arg, kind, how, "legal")  # NaN/inf in x is summed like any value; out is overwritten
        elif kind == "duplicate":
            ar["out"] = ar["x"]
            bad = Bad("out", kind, "out is x (in place)", "legal")
        else:
            bad = meta_corruption(data, ar, kind, arg, {"x": (comm.dtype,), "out": (comm.dtype,)})
        ref = ar["x"].clone() if ar["x"].device.type == "cpu" else None
        check_outcome(bad, ar, lambda: comm.all_reduce(**ar), lambda: ref)


# =========================================================================== KV slots
KV_STATE = ("req_to_token", "free_pages", "num_free", "page_state")


def _alloc(kw: dict, impl: str):
    return spec_kernels.alloc_draft_slots(**kw, impl=impl)


def _commit(kw: dict, impl: str):
    return spec_kernels.commit_draft_slots(**kw, impl=impl)


def _state_of(kw: dict) -> list[torch.Tensor]:
    """Every tensor the call may change, as CPU copies (meta tensors as their metadata)."""
    out = []
    for k, v in kw.items():
        for t in (v if isinstance(v, list) else [v]):
            if isinstance(t, torch.Tensor):
                out.append(t.detach().clone() if t.device.type != "meta" else torch.tensor(list(t.shape)))
    return out


def _same_state(before: list[torch.Tensor], after: list[torch.Tensor], what: str) -> None:
    assert len(before) == len(after), f"{what}: {len(before)} tensors before, {len(after)} after"
    for i, (a, b) in enumerate(zip(before, after)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), \
            f"{what}: state tensor {i} changed:\n{a}\n{b}"


@st.composite
def kv_pool(draw):
    """A pool with some admitted requests: (state dict, lens {row: length}, page_size)."""
    P = draw(st.sampled_from([1, 2, 4]), label="page_size")
    num_pages = draw(st.integers(4, 12), label="pages")
    R = draw(st.integers(2, 4), label="rows")
    ctx = 12
    rtt_dtype = draw(st.sampled_from(INDEX), label="req_to_token dtype")
    order = draw(st.permutations(list(range(num_pages))), label="stack order")
    state = dict(req_to_token=torch.full((R, ctx), -1, dtype=rtt_dtype), free_pages=torch.tensor(order),
                 num_free=torch.tensor([num_pages]), page_state=torch.zeros(num_pages, dtype=torch.int32))
    lens = {}
    for r in range(R):
        if draw(st.integers(0, 4), label=f"skip row {r} (if 4)") == 4:
            continue
        L = draw(st.integers(0, 5), label="prompt length")
        if kv_ref.pages_spanned(0, L, P) > int(state["num_free"]):
            continue
        out, status = torch.empty(L, dtype=torch.int64), torch.empty(kv_ref.STATUS_LEN, dtype=torch.int64)
        kv_ref.alloc_draft_slots(state["req_to_token"], torch.tensor([r]), torch.tensor([0]), torch.tensor([L]),
                                 state["free_pages"], state["num_free"], state["page_state"], P, ctx, out, status)
        assert int(status[0]) == kv_ref.STATUS_OK
        lens[r] = L
    return state, lens, P


def _index(values, dtype):
    return torch.tensor(values, dtype=dtype).reshape(len(values))


@st.composite
def alloc_call(draw, pool=None):
    state, lens, P = pool if pool is not None else draw(kv_pool())
    ctx = state["req_to_token"].shape[1]
    max_draft = draw(st.sampled_from([4, 64]), label="max_draft")
    rows = draw(st.permutations(sorted(lens)), label="batch order")
    rows = rows[:len(rows) - draw(st.sampled_from([0, 0, 0, 1, len(rows)]), label="requests left out")]
    counts, pages = [], 0
    for r in rows:
        most = min(max_draft, ctx - lens[r], 5)
        n = draw(st.integers(1, most) if most and draw(st.integers(0, 3), label="no drafts (if 0)") else st.just(0),
                 label="num_draft")
        need = kv_ref.pages_spanned(lens[r], lens[r] + n, P)
        if pages + need > int(state["num_free"]):
            n, need = 0, 0
        counts.append(n)
        pages += need
    idx = draw(st.sampled_from(INDEX), label="index dtype")
    kw = dict(state, req_pool_indices=_index(rows, idx), seq_lens=_index([lens[r] for r in rows], idx),
              num_draft=_index(counts, idx), page_size=P, max_draft=max_draft)
    if draw(st.booleans(), label="total_draft given"):
        kw["total_draft"] = sum(counts) + draw(st.integers(0, 1), label="padding")
    if draw(st.booleans(), label="status buffer"):
        kw["status"] = torch.zeros(kv_ref.STATUS_LEN, dtype=torch.int64)
    return kw, lens


def _ordered(kw: dict, names) -> dict:
    return {k: kw[k] for k in names if k in kw}


ALLOC_ORDER = ("req_to_token", "req_pool_indices", "seq_lens", "num_draft", "free_pages", "num_free", "page_state",
               "page_size", "max_draft", "total_draft", "status")
COMMIT_ORDER = ("req_to_token", "req_pool_indices", "seq_lens", "num_draft", "accept_index", "accept_len",
                "free_pages", "num_free", "page_state", "page_size", "kv_buffers", "max_draft", "status")


@st.composite
def commit_call(draw):
    """A live alloc (made with the reference) and a valid commit of random accepted paths."""
    kw, lens = draw(alloc_call())
    P = kw["page_size"]
    spec_kernels.alloc_draft_slots(**kw, impl="reference")
    rows, counts = kw["req_pool_indices"].tolist(), kw["num_draft"].tolist()
    kv_buffers = None
    if P > 1 or draw(st.booleans(), label="kv_buffers with pages of 1"):
        slots = kw["free_pages"].numel() * P
        kv_buffers = [torch.randn(slots, 2), torch.randint(0, 100, (slots, 3), dtype=torch.int16)]
    paths = []
    for n in counts:
        if kv_buffers is None and P > 1:
            paths.append(list(range(draw(st.integers(0, n), label="accepted prefix"))))
        else:
            chosen = draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=n, unique=True), label="path") if n else []
            paths.append(sorted(chosen))
    width = max([len(p) for p in paths] + [0]) + draw(st.integers(0, 1), label="padding columns")
    idx = kw["req_pool_indices"].dtype
    acc = torch.tensor([p + [-1] * (width - len(p)) for p in paths], dtype=idx).reshape(len(rows), width)
    ckw = {k: kw[k] for k in ("req_to_token", "req_pool_indices", "seq_lens", "num_draft", "free_pages", "num_free",
                              "page_state", "page_size", "max_draft")}
    ckw.update(accept_index=acc, accept_len=_index([len(p) for p in paths], idx), kv_buffers=kv_buffers)
    if draw(st.booleans(), label="status buffer"):
        ckw["status"] = torch.zeros(kv_ref.STATUS_LEN, dtype=torch.int64)
    ckw["check_status"] = True
    return _ordered(ckw, COMMIT_ORDER + ("check_status",)), lens


def pool_invariants(kw: dict, live: dict) -> None:
    """Independent of page_state: the free stack holds no page twice, stays within the pool, and
    no position a request holds (live: row -> length) lies on a free page."""
    cap = kw["free_pages"].numel()
    top = int(kw["num_free"])
    assert 0 <= top <= cap, f"num_free = {top} left [0, {cap}]"
    free = kw["free_pages"][:top].tolist()
    twice = sorted({p for p in free if free.count(p) > 1})
    assert not twice, f"pages {twice} are on the free stack twice (freed twice: they would be handed out twice)"
    P = kw["page_size"]
    rtt = kw["req_to_token"]
    for r, L in live.items():
        pages = set((rtt[r, :L].long() // P).tolist())
        both = pages & set(free)
        assert not both, f"row {r} holds positions on pages {sorted(both)}, which are on the free stack"


def kv_corruption(data, kw: dict, lens: dict, op: str, kind: str) -> Bad:
    """Corrupt one argument of an alloc / commit call in place."""
    tensors = ["req_to_token", "req_pool_indices", "seq_lens", "num_draft", "free_pages", "num_free", "page_state"]
    if op == "commit":
        tensors += ["accept_index", "accept_len"]
    if "status" in kw:
        tensors.append("status")
    menu = [(k, a) for k in ("dtype", "device", "rank", "stride", "shape") for a in tensors]
    values = ["req_pool_indices", "seq_lens", "num_draft", "num_free", "free_pages", "page_state", "req_to_token",
              "page_size", "max_draft"]
    values += ["accept_index", "accept_len"] if op == "commit" else ["total_draft"]
    menu += [("value", a) for a in values]
    menu += [("duplicate", "req_pool_indices"), ("duplicate", "free_pages"), ("duplicate", "req_to_token")]
    if op == "commit":
        menu += [("replay", "req_to_token"), ("duplicate", "accept_index")]
        if kw.get("kv_buffers"):
            menu += [("duplicate", "kv_buffers"), ("dtype", "kv_buffers"), ("device", "kv_buffers"),
                     ("stride", "kv_buffers"), ("shape", "kv_buffers")]
    kind, arg = draw_kind(data, menu, kind)
    B = kw["req_pool_indices"].numel()
    allowed = {a: INDEX for a in tensors}
    allowed.update(free_pages=(torch.int64,), num_free=(torch.int64,), page_state=(torch.int32,), status=(torch.int64,))
    if arg == "kv_buffers":
        bufs = list(kw["kv_buffers"])
        i = data.draw(st.integers(0, len(bufs) - 1), label="buffer")
        name = f"kv_buffers[{i}]"
        if kind == "duplicate":
            bufs.append(bufs[i])
            kw[arg] = bufs
            return Bad(arg, kind, f"kv_buffers[{i}] twice", "raise")
        if kind == "dtype":  # any dtype is legal for a KV buffer
            bufs[i] = bufs[i].to(torch.float64)
            kw[arg] = bufs
            return Bad(arg, kind, f"{name} as float64", "either", names=(name, "kv_buffers"))
        if kind == "device":
            bufs[i] = bufs[i].to(META)
            kw[arg] = bufs
            return Bad(arg, kind, f"{name} on meta", "raise", names=(name, "kv_buffers"))
        if kind == "stride":  # rows must be contiguous
            t = bufs[i]
            wide = torch.zeros(t.shape[0], *t.shape[1:-1], t.shape[-1] * 2, dtype=t.dtype)
            bufs[i] = wide[..., ::2]
            bufs[i].copy_(t)
            kw[arg] = bufs
            return Bad(arg, kind, f"{name} strides {tuple(bufs[i].stride())}",
                       "raise" if not bufs[i][0].is_contiguous() else "either", names=(name, "kv_buffers"))
        bufs[i] = resized(data, bufs[i], 0, new_size(data, bufs[i].shape[0]))
        kw[arg] = bufs
        return Bad(arg, kind, f"{name} rows -> {bufs[i].shape[0]}", "either", names=(name, "kv_buffers"))
    if kind in ("dtype", "device", "rank", "stride"):
        return meta_corruption(data, kw, kind, arg, allowed)
    if kind == "shape":
        t = kw[arg]
        dim = data.draw(st.integers(0, t.dim() - 1), label="dim")
        size = new_size(data, t.shape[dim])
        kw[arg] = resized(data, t, dim, size, fill=lambda s: torch.full(s, -1))
        # req_to_token may have more rows / a longer context; free_pages + page_state a bigger pool...
        return Bad(arg, kind, f"dim {dim}: {t.shape[dim]} -> {size}", "either")
    if kind == "replay":  # the same commit again after it went through (the double-commit bug)
        spec_kernels.commit_draft_slots(**kw, impl="reference")
        P = kw["page_size"]
        released = sum((n - k) if P == 1 else kv_ref.pages_spanned(L + k, L + n, P) for L, n, k in
                       zip(kw["seq_lens"].tolist(), kw["num_draft"].tolist(), kw["accept_len"].tolist()))
        # a repeat that releases nothing is indistinguishable from a first call (documented)
        return Bad("req_to_token", kind, f"the same commit a second time ({released} pages released by the "
                   "first)", "raise" if released else "either",
                   names=("req_to_token", "page_state", "free_pages", "num_free"))
    if kind == "duplicate":
        if arg == "req_pool_indices":
            if B < 2:
                return Bad(arg, kind, "fewer than 2 requests: unchanged", "legal")
            rows = kw[arg].clone()
            i, j = data.draw(st.permutations(list(range(B))), label="pair")[:2]
            rows[i] = rows[j]
            kw[arg] = rows
            return Bad(arg, kind, f"req_pool_indices[{i}] = req_pool_indices[{j}]", "raise")
        if arg == "free_pages":
            top = int(kw["num_free"])
            if top < 2:
                return Bad(arg, kind, "fewer than 2 free pages: unchanged", "legal")
            fp = kw[arg].clone()
            i, j = data.draw(st.permutations(list(range(top))), label="pair")[:2]
            fp[i] = fp[j]
            kw[arg] = fp
            return Bad(arg, kind, f"free_pages[{i}] = free_pages[{j}] (twice on the stack)", "either")
        if arg == "accept_index":
            acc = kw[arg].clone()
            if acc.shape[1] < 2 or B == 0:
                return Bad(arg, kind, "narrower than 2: unchanged", "legal")
            b = data.draw(st.integers(0, B - 1), label="request")
            acc[b, 1] = acc[b, 0]
            kw[arg] = acc
            k = int(kw["accept_len"][b])
            return Bad(arg, kind, f"accept_index[{b}, 1] = accept_index[{b}, 0]",
                       "raise" if k >= 2 or int(acc[b, 0]) != -1 else "legal")
        # req_to_token: a draft slot of one request copied over another's (two positions, one page)
        rtt = kw[arg].clone()
        spots = [(r, p) for r, L, n in zip(kw["req_pool_indices"].tolist(), kw["seq_lens"].tolist(),
                                           kw["num_draft"].tolist()) for p in range(max(L - 1, 0), L + n)]
        if len(spots) < 2:
            return Bad(arg, kind, "fewer than 2 positions: unchanged", "legal")
        a, b = data.draw(st.permutations(spots), label="pair")[:2]
        rtt[a] = rtt[b]
        kw[arg] = rtt
        return Bad(arg, kind, f"req_to_token{list(a)} = req_to_token{list(b)}", "either")
    # value range: +-1 around each bound
    if arg in ("page_size", "max_draft", "total_draft"):
        cur = kw.get(arg)
        cands = {"page_size": [0, -1, 3, True, 2.0, kw["page_size"] * 2],
                 "max_draft": [0, 65, -1, True, 64, 1],
                 "total_draft": [-1, True, 1.5, (cur or 0) + 1, max((cur or 0) - 1, 0)]}[arg]
        v = data.draw(st.sampled_from(cands), label=arg)
        kw[arg] = v
        return Bad(arg, kind, f"{arg} = {v!r}", "either")
    t = kw[arg].clone()
    if t.numel() == 0:
        return Bad(arg, kind, "empty: unchanged", "legal")
    if t.dim() == 2 and arg == "req_to_token":
        spots = [(r, p) for r, L, n in zip(kw["req_pool_indices"].tolist(), kw["seq_lens"].tolist(),
                                           kw["num_draft"].tolist()) for p in range(max(L - 1, 0), L + n)]
        where = data.draw(st.sampled_from(spots), label="position") if spots else (0, 0)
    else:
        where = tuple(data.draw(st.integers(0, s - 1), label="entry") for s in t.shape)
    slots = kw["free_pages"].numel() * kw["page_size"]
    bound = {"req_pool_indices": kw["req_to_token"].shape[0], "seq_lens": kw["req_to_token"].shape[1],
             "num_draft": kw["max_draft"], "num_free": kw["free_pages"].numel(), "free_pages": kw["free_pages"].numel(),
             "page_state": kw["req_to_token"].shape[0] + 1, "req_to_token": slots,
             "accept_index": max(kw["num_draft"].tolist() + [1]),
             "accept_len": kw["accept_index"].shape[1] if "accept_index" in kw else 1}[arg]
    extra = {kv_ref.PAGE_MARK} if arg == "page_state" else set()  # owners are 1..rows; -1 PAGE_SHARED
    v = data.draw(st.sampled_from(sorted({-1, 0, 1, bound - 1, bound, bound + 1, int(t[where]) + 1,
                                          int(t[where]) - 1} | extra)), label="value")
    old = int(t[where])
    t[where] = v
    kw[arg] = t
    # A request's row, length and draft count say which entries of req_to_token it owns: an error
    # about one of those entries ("req_to_token[r, pos] ... (draft i of request b)") is about them too.
    names = (arg, "req_to_token") if arg in ("req_pool_indices", "seq_lens", "num_draft") else (arg,)
    return Bad(arg, kind, f"{arg}{list(where)} {old} -> {v}", "either", names=names)


def _kv_reference_outcome(op: str, kw: dict):
    """The raw reference on copies: (status list, the state tensors and outputs after it)."""
    c = {k: clone_value(v) for k, v in kw.items()}
    status = torch.zeros(kv_ref.STATUS_LEN, dtype=torch.int64)
    if op == "alloc":
        size = c.get("total_draft")
        if size is None:
            size = sum(max(int(n), 0) for n in c["num_draft"].tolist())
        out = torch.empty(size, dtype=torch.int64)
        kv_ref.alloc_draft_slots(c["req_to_token"], c["req_pool_indices"], c["seq_lens"], c["num_draft"],
                                 c["free_pages"], c["num_free"], c["page_state"], c["page_size"], c["max_draft"], out,
                                 status)
        outputs = [out]
    else:
        new = torch.empty_like(c["seq_lens"])
        kv_ref.commit_draft_slots(c["req_to_token"], c["req_pool_indices"], c["seq_lens"], c["num_draft"],
                                  c["accept_index"], c["accept_len"], c["free_pages"], c["num_free"], c["page_state"],
                                  c["page_size"], c["max_draft"], c["kv_buffers"] or [], new, status)
        outputs = [new]
    state = [c[k] for k in KV_STATE] + list(c.get("kv_buffers") or [])
    return status.tolist(), outputs + state


def kv_property(op: str, impl: str, kw: dict, bad: Bad, live_after: dict) -> None:
    """The contract of a KV-slot call: refusals name the argument and change no state tensor;
    accepted calls give the reference's outputs and state, and keep the pool consistent."""
    before = _state_of(kw)
    fn = _alloc if op == "alloc" else _commit

    def reference():
        status, result = _kv_reference_outcome(op, kw)
        if status[0] != kv_ref.STATUS_OK:
            raise AssertionError(f"the reference refuses this call (status {status})")
        return result

    def call():
        out = fn(kw, impl)
        return [out] + [kw[k] for k in KV_STATE] + list(kw.get("kv_buffers") or [])

    if bad.expect == "either":  # the reference decides; an out-of-pages refusal names no argument
        try:
            status, _ = _kv_reference_outcome(op, kw)
        except Exception:  # noqa: BLE001 - input the reference cannot read: it must be refused
            status = None
        if status is not None and status[0] == kv_ref.STATUS_OUT_OF_PAGES:
            bad.names = bad.names + ("out of KV pages",)

    def unchanged():
        _same_state(before, _state_of(kw), f"{bad}: a refused call changed the state")

    consistent = bad.kind == "replay"
    outcome = check_outcome(bad, kw, call, reference, compare=lambda g, w, what: _compare_kv(g, w, what),
                            after_refusal=unchanged)
    if outcome == "ran" and consistent:  # a replayed commit that went through must not break the pool
        pool_invariants(kw, live_after)


def _compare_kv(got, want, what):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), \
            f"{what}: result/state tensor {i} differs from the reference:\n{g}\n{w}"


@pytest.mark.parametrize("kind", KV_KINDS)
@pytest.mark.parametrize("impl", IMPLS)
@fuzz_by_kind(EXAMPLES)
def test_fuzz_alloc_draft_slots(impl, kind, data):
    kw, lens = data.draw(alloc_call())
    kw = _ordered(kw, ALLOC_ORDER)
    live = dict(lens)
    for r, n in zip(kw["req_pool_indices"].tolist(), kw["num_draft"].tolist()):
        live[r] += n
    bad = kv_corruption(data, kw, lens, "alloc", kind)
    kv_property("alloc", impl, kw, bad, live)


@pytest.mark.parametrize("kind", KV_KINDS + ["replay"])
@pytest.mark.parametrize("impl", IMPLS)
@fuzz_by_kind(EXAMPLES)
def test_fuzz_commit_draft_slots(impl, kind, data):
    kw, lens = data.draw(commit_call())
    live = dict(lens)
    for r, k in zip(kw["req_pool_indices"].tolist(), kw["accept_len"].tolist()):
        live[r] += k
    bad = kv_corruption(data, kw, lens, "commit", kind)
    kv_property("commit", impl, kw, bad, live)


def _page_state_reference(kw: dict) -> torch.Tensor:
    """page_state_from_free_stack in plain Python: AssertionError where the input is invalid."""
    fp, nf = kw["free_pages"], kw["num_free"]
    assert fp.dim() == 1 and fp.dtype == torch.int64 and nf.shape == (1,) and nf.dtype == torch.int64
    cap = fp.numel()
    state = [kv_ref.PAGE_SHARED] * cap
    top = int(nf[0])
    assert 0 <= top <= cap, "num_free"
    for p in fp[:top].tolist():
        assert 0 <= p < cap and state[p] == kv_ref.PAGE_SHARED, "a page not of the pool, or twice"
        state[p] = kv_ref.PAGE_FREE
    names = ("req_to_token", "req_pool_indices", "seq_lens")
    given = [n for n in names if n in kw]
    assert len(given) in (0, 3), "requests given in part"
    if given:
        rtt, rows, lens, P = kw["req_to_token"], kw["req_pool_indices"], kw["seq_lens"], kw.get("page_size")
        assert isinstance(P, int) and not isinstance(P, bool) and P >= 1 and P & (P - 1) == 0, "page_size"
        assert rtt.dim() == 2 and rows.dim() == 1 and lens.shape == rows.shape, "shapes"
        assert all(t.dtype in INDEX for t in (rtt, rows, lens)), "dtypes"
        rows, lens = rows.tolist(), lens.tolist()
        assert len(set(rows)) == len(rows), "rows twice"
        owners: dict[int, set] = {}
        for r, L in zip(rows, lens):
            assert 0 <= r < rtt.shape[0] and 0 <= L <= rtt.shape[1], "row or length"
            for slot in rtt[r, :L].tolist():
                assert 0 <= slot < cap * P, "a slot outside the pool"
                assert state[slot // P] != kv_ref.PAGE_FREE, "a held page on the free stack"
                owners.setdefault(slot // P, set()).add(kv_ref.page_owner(r))
        for page, who in owners.items():
            state[page] = who.pop() if len(who) == 1 else kv_ref.PAGE_SHARED
    return torch.tensor(state, dtype=torch.int32)


@pytest.mark.parametrize("kind", KV_KINDS + ["missing"])
@fuzz_by_kind(EXAMPLES)
def test_fuzz_page_state_from_free_stack(kind, data):
    """The stack alone, or with requests (a pool with some admitted: rows, lengths, page size)."""
    requests = kind == "missing" or data.draw(st.booleans(), label="requests given")
    if requests:
        state, lens, P = data.draw(kv_pool())
        rows = data.draw(st.permutations(sorted(lens)), label="requests given")
        rows = rows[:data.draw(st.integers(0, len(rows)), label="how many")]
        idx = data.draw(st.sampled_from(INDEX), label="index dtype")
        kw = dict(free_pages=state["free_pages"], num_free=state["num_free"], req_to_token=state["req_to_token"],
                  req_pool_indices=_index(rows, idx), seq_lens=_index([lens[r] for r in rows], idx), page_size=P)
    else:
        cap = data.draw(st.integers(0, 6), label="pages")
        top = data.draw(st.integers(0, cap), label="num_free")
        order = data.draw(st.permutations(list(range(cap))), label="stack")
        kw = dict(free_pages=torch.tensor(order, dtype=torch.int64).reshape(cap), num_free=torch.tensor([top]))
    cap = kw["free_pages"].numel()
    top = int(kw["num_free"])
    tensors = [a for a in ("free_pages", "num_free", "req_to_token", "req_pool_indices", "seq_lens") if a in kw]
    menu = [(k, a) for k in ("dtype", "device", "rank", "stride", "shape") for a in tensors]
    menu += [("value", "num_free"), ("value", "free_pages"), ("duplicate", "free_pages")]
    if requests:
        menu += [("value", a) for a in ("req_pool_indices", "seq_lens", "req_to_token", "page_size")]
        menu += [("duplicate", "req_pool_indices"), ("duplicate", "req_to_token")]
        menu += [("missing", a) for a in ("req_to_token", "req_pool_indices", "seq_lens", "page_size")]
    kind, arg = draw_kind(data, menu, kind)
    B = kw["req_pool_indices"].numel() if requests else 0
    if kind == "missing":
        del kw[arg]
        bad = Bad(arg, kind, f"{arg} left out", "raise")
    elif kind == "shape":
        size = new_size(data, kw[arg].shape[0])
        kw[arg] = resized(data, kw[arg], 0, size, fill=lambda s: torch.full(s, cap))
        # free_pages or req_to_token longer: more pages or rows; req_pool_indices: seq_lens' shape
        bad = Bad(arg, kind, f"{cap if arg == 'free_pages' else 1} -> {size} entries", "either",
                  names=(arg, "req_pool_indices") if arg == "seq_lens" else (arg,))
    elif kind == "value" and arg == "num_free":
        v = data.draw(st.sampled_from([-1, 0, cap, cap + 1]), label="num_free")
        kw[arg] = torch.tensor([v])
        # a higher stack may put a request's page on it
        bad = Bad(arg, kind, f"num_free = {v} (capacity {cap})", "either" if requests else
                  "legal" if 0 <= v <= cap else "raise")
    elif arg == "free_pages" and kind in ("value", "duplicate"):
        fp = kw[arg].clone()
        if cap == 0:
            bad = Bad(arg, kind, "empty: unchanged", "legal")
        else:
            i = data.draw(st.integers(0, cap - 1), label="entry")
            v = int(fp[(i + 1) % cap]) if kind == "duplicate" else data.draw(st.sampled_from([-1, 0, cap - 1, cap]))
            fp[i] = v
            clash = i < top and list(fp[:top].tolist()).count(v) > 1
            ok = i >= top or (0 <= v < cap and not clash)
            # with requests, a valid stack may now hold a request's page
            bad = Bad(arg, kind, f"free_pages[{i}] = {v} (num_free {top}, capacity {cap})",
                      ("either" if requests else "legal") if ok else "raise")
        kw[arg] = fp
    elif arg == "page_size":
        v = data.draw(st.sampled_from([0, -1, 3, True, 2.0, kw["page_size"] * 2]), label="page_size")
        kw[arg] = v
        bad = Bad(arg, kind, f"page_size = {v!r}", "either")
    elif kind == "duplicate" and arg == "req_pool_indices":
        if B < 2:
            bad = Bad(arg, kind, "fewer than 2 requests: unchanged", "legal")
        else:
            r = kw[arg].clone()
            i, j = data.draw(st.permutations(list(range(B))), label="pair")[:2]
            r[i] = r[j]
            kw[arg] = r
            bad = Bad(arg, kind, f"req_pool_indices[{i}] = req_pool_indices[{j}]", "raise")
    elif kind in ("value", "duplicate") and arg in ("req_pool_indices", "seq_lens", "req_to_token"):
        t = kw[arg].clone()
        if arg == "req_to_token":  # a held position, or one of another request's (a shared page)
            spots = [(r, p) for r, L in zip(kw["req_pool_indices"].tolist(), kw["seq_lens"].tolist())
                     for p in range(L)]
            if not spots:
                bad = Bad(arg, kind, "no held position: unchanged", "legal")
                kw[arg] = t
                return check_outcome(bad, kw, lambda: page_state_from_free_stack(**kw),
                                     lambda: _page_state_reference(kw))
            where = data.draw(st.sampled_from(spots), label="position")
            if kind == "duplicate":
                rows_all = [(r, p) for r in range(t.shape[0]) for p in range(t.shape[1]) if int(t[r, p]) >= 0]
                v = int(t[data.draw(st.sampled_from(rows_all), label="copied from")])
            else:
                v = data.draw(st.sampled_from([-1, 0, cap * kw["page_size"] - 1, cap * kw["page_size"],
                                               int(t[where]) + 1]), label="value")
        else:
            if B == 0:
                kw[arg] = t
                bad = Bad(arg, kind, "no requests: unchanged", "legal")
                return check_outcome(bad, kw, lambda: page_state_from_free_stack(**kw),
                                     lambda: _page_state_reference(kw))
            where = (data.draw(st.integers(0, B - 1), label="entry"),)
            bound = kw["req_to_token"].shape[0 if arg == "req_pool_indices" else 1]
            v = data.draw(st.sampled_from(sorted({-1, 0, bound - 1, bound, bound + 1, int(t[where]) + 1,
                                                  int(t[where]) - 1})), label="value")
        old = int(t[where])
        t[where] = v
        kw[arg] = t
        # a request's row and length say which entries of req_to_token it holds
        names = (arg, "req_to_token") if arg in ("req_pool_indices", "seq_lens") else (arg,)
        bad = Bad(arg, kind, f"{arg}{list(where)} {old} -> {v}", "either", names=names)
    else:
        allowed = dict(free_pages=(torch.int64,), num_free=(torch.int64,), req_to_token=INDEX, req_pool_indices=INDEX,
                       seq_lens=INDEX)
        bad = meta_corruption(data, kw, kind, arg, allowed)
    return check_outcome(bad, kw, lambda: page_state_from_free_stack(**kw), lambda: _page_state_reference(kw))


# =========================================================================== regressions
# What the fuzzer found: errors that named another argument than the bad one.
def test_regression_device_error_names_the_tensor_that_is_elsewhere():
    """The device the others agree on wins (it used to be the first argument's: a q, x, parents or
    free_pages on another device was reported as its neighbour being on the wrong device)."""
    case = make_case([2, 1], [3, 0], hq=2, hkv=1, seed=0)
    with pytest.raises(ValueError, match=r"^q must be on cpu like the other inputs, got meta"):
        spec_kernels.tree_verify_attention(case.q.to(META), *case.args[1:], impl="reference")
    with pytest.raises(ValueError, match=r"^q must be on cpu like the other inputs, got meta"):
        spec_kernels.decode_attention(case.q[:2].to(META), *case.args[1:3], case.kv_indptr, case.kv_indices)
    kv = torch.randn(16, MLA_V + MLA_ROPE)
    with pytest.raises(ValueError, match=r"^q must be on cpu like the other inputs, got meta"):
        spec_kernels.mla_decode_attention(torch.randn(1, 2, MLA_V + MLA_ROPE, device=META), kv,
                                          torch.tensor([0, 3], dtype=torch.int32), torch.arange(3), v_head_dim=MLA_V)
    with pytest.raises(ValueError, match=r"^qo_indptr must be on meta like parents, got cpu"):  # a tie: both named
        spec_kernels.tree_mask_from_parents(case.parents.to(META), case.qo_indptr)
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"^x must be on cpu like residual and weight, got meta"):
        spec_kernels.fused_add_rmsnorm(x.to(META), x, torch.ones(8))
    with pytest.raises(ValueError, match=r"^num_free must be on meta like free_pages, got cpu"):
        page_state_from_free_stack(torch.arange(4, device=META), torch.tensor([4]))


def test_regression_consistency_errors_name_both_sides():
    case = make_case([2, 1], [3, 0], hq=2, hkv=1, seed=0)
    q, k, v, kv_indptr, kv_indices, qo_indptr, mask = case.args
    with pytest.raises(ValueError, match=r"tree_mask must have shape \(4,\) \(one word per query row of q\)"):
        spec_kernels.tree_verify_attention(torch.randn(4, 2, 64), k, v, kv_indptr, kv_indices,
                                           torch.tensor([0, 2, 4], dtype=torch.int32), mask)
    with pytest.raises(ValueError, match=r"out must have shape \(3, 2, 64\) \(\[T, Hq, Dv\]: the rows and heads of q"):
        spec_kernels.tree_verify_attention(*case.args, out=torch.empty(3, 1, 64))
    wide = torch.cat([torch.tensor([-7], dtype=kv_indices.dtype), kv_indices])  # a window onto a bad slot
    with pytest.raises(ValueError, match=r"kv_indices values must be in .* in the window kv_indptr\[0\]:kv_indptr\[-1\]"
                                         r" = 0:6"):
        spec_kernels.tree_verify_attention(q, k, v, torch.tensor([0, 5, 6], dtype=torch.int32), wide, qo_indptr, mask)
    with pytest.raises(ValueError, match=r"tree_mask\[1\] \(request 1, draft 0\) has bit 1 set.*qo_indptr gives them"):
        spec_kernels.tree_verify_attention(q, k, v, torch.tensor([0, 4, 6], dtype=torch.int32), kv_indices,
                                           torch.tensor([0, 1, 3], dtype=torch.int32), mask)
    with pytest.raises(ValueError, match=r"parents\[1\] = 0 \(request 1, draft 0\).*requests as qo_indptr gives them"):
        spec_kernels.tree_mask_from_parents(torch.tensor([-1, 0]), torch.tensor([0, 1, 2], dtype=torch.int32))
