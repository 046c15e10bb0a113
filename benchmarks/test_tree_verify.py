"""Tree-verify attention vs plain decode vs dense-mask SDPA, plus the streaming-bandwidth ceiling.

    pytest benchmarks/ --benchmark-only                                  # preset by device
    SPEC_KERNELS_BENCH_PRESET=gpu-quick pytest benchmarks/ --benchmark-only --benchmark-json=out.json

What is timed, per case (B requests, each with L prefix slots and n draft tokens; GQA Hq:Hkv,
head dim D = Dv; presets in benchmarks/_timing.py):

* n > 1: ``spec_kernels.tree_verify_attention`` over a random tree per request (random
  topologically ordered parents -> ``tree_mask_from_parents``);
* n = 1: ``spec_kernels.decode_attention``, plain decode at the same B and L;
* every implementation that can run here, side by side: ``triton`` now, ``cuda`` as soon as
  ``op_impls("tree_verify_attention").unavailable_reason("cuda", device)`` is None, the
  ``reference`` on CPU only (it loops over requests on the host: an oracle, not a contender);
* ``sglang-triton``, the anchor the targets name (n > 1): SGLang 0.5.23's Triton
  ``extend_attention_fwd`` as its triton backend runs TARGET_VERIFY: the prefix read through
  kv_indices, the drafts' K/V as contiguous tensors (in a server, the verify tokens' fresh K/V),
  the full n x (L + n) boolean mask per request (built outside the timing). It is imported by
  benchmarks/_sglang_kernels.py, which also loads it on the GPU machine where SGLang is not
  installed (staged sources, SPEC_KERNELS_SGLANG_SRC); absent, it is reported as skipped.
* ``sdpa``, a second anchor: gather each request's K/V rows from the paged cache (index_select) and
  run ``torch.nn.functional.scaled_dot_product_attention`` with a dense boolean mask of n x (L+n)
  per request (no mask for n = 1). GQA is handled by packing the group's query heads into the
  query rows ([B, Hkv, n*group, D], what our kernel does too) rather than repeating K/V, so the
  anchor is not penalised for the head layout; the gather is timed, since the cache is paged.

``test_forced_splits`` times our fastest kernel here through ``TreeVerifyPlan`` at the planner's
KV split count and at forced counts (the preset's ``split_shapes`` x ``split_counts``), with the
speed-of-light model's time for each count on a GPU (``spec_kernels.bench.plan``), so that a GPU
run shows whether the planned count is the fastest.

Inputs are random (never zeros), slot ids are a random permutation of the cache's slots, and a
GPU round rotates over several disjoint input sets so that it streams >= 4x the L2 cache.
Outputs are checked against the reference once per case (small cases) before timing.

Bytes: extra_info["bytes"] is what the op must move at least once:
    B*(L+n)*Hkv*(D+Dv)*elt   (every K and V row of every request, read once)
  + B*n*Hq*(D+Dv)*elt        (q read, out written)
ignoring the O(B*n) indices and mask words. extra_info["gbps"] = bytes / median time (decimal
GB/s); the same bytes are used for every impl, so for SDPA (which also writes and re-reads the
gathered copy) it is an effective rate. ``test_stream_bandwidth`` measures the ceiling in the
same run: ``read`` = torch.sum over a buffer far larger than L2 (bytes read), ``copy`` =
copy_ between two such buffers (bytes read + written).

Timing method (see benchmarks/_timing.py): warm-up first (Triton compiles and autotunes on the
first call of a shape); on a GPU one round = several calls captured in one CUDA graph (eager if
capture fails: extra_info["timing"]) timed with a clock that calls torch.cuda.synchronize(); all
statistics are per call.

GPU targets (docs/design.md), tree verify at n = 16, L >= 4k, GQA 4-8:
  * time <= 1.15 x plain decode (n = 1) at the same B and L        (the "/dec" column)
  * >= 80% of the GPU's measured streaming-read bandwidth          (the "%rd" column)
  * >= 3x faster than SGLang's Triton extend-with-mask kernel      (the sglang-triton column)
No GPU figure has been measured yet: the only runs so far are CPU runs of the tiny preset
through the Triton interpreter, whose times say nothing about GPU performance.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F

import _sglang_kernels
import _timing
import spec_kernels
from spec_kernels._ops import op_impls

PRESET = _timing.active_preset()
DEVICE = _timing.bench_device()
DTYPE = getattr(torch, PRESET.dtype)
CHECK_MAX_KV_ROWS = 1 << 18  # compare with the reference only where its host loop is cheap


KV_SCALE = 0.5  # the fp8 rows' k_scale and v_scale


@dataclass(frozen=True)
class Case:
    """B requests, each with L prefix KV slots and n draft tokens (n = 1: plain decode); kv: the
    cache in the model dtype, or "fp8_e4m3" (q in the preset's dtype, fp16 when that is fp32)."""

    B: int
    L: int
    n: int
    Hq: int
    Hkv: int
    D: int
    kv: str = "model"

    @property
    def q_dtype(self) -> torch.dtype:
        return DTYPE if self.kv == "model" or DTYPE in (torch.float16, torch.bfloat16) else torch.float16

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.q_dtype if self.kv == "model" else torch.float8_e4m3fn

    @property
    def dtype_label(self) -> str:
        """The summary's dtype column: q's dtype, and the cache's when it is fp8."""
        q = str(self.q_dtype)[6:]
        return q if self.kv == "model" else {"float16": "f16", "bfloat16": "bf16"}[q] + "+e4m3kv"

    @property
    def Dv(self) -> int:
        return self.D

    @property
    def id(self) -> str:
        kv = "" if self.kv == "model" else f"-kv_{self.kv}"
        return f"B{self.B}-L{self.L}-n{self.n}-h{self.Hq}x{self.Hkv}-d{self.D}-{str(self.q_dtype)[6:]}{kv}"

    @property
    def group(self) -> str:  # pytest-benchmark's table: one group per (B, L, heads)
        return f"B={self.B} L={self.L} Hq/Hkv={self.Hq}/{self.Hkv} D={self.D} {PRESET.dtype}"

    @property
    def kv_rows(self) -> int:
        return self.B * (self.L + self.n)

    @property
    def bytes(self) -> int:
        """Bytes a kernel reads and writes at least: every KV row once, q in, out back."""
        kv = self.kv_rows * self.Hkv * (self.D + self.Dv) * self.kv_dtype.itemsize
        return kv + self.B * self.n * self.Hq * (self.D + self.Dv) * self.q_dtype.itemsize


def attention_impls(device: torch.device) -> list[str]:
    """What runs side by side: our kernels usable on `device`, the reference where it is the only
    non-interpreted one (CPU; on a GPU its host loop is no contender), and the SDPA anchor."""
    op = op_impls("tree_verify_attention")
    impls = [impl for impl in ("cuda", "triton") if op.unavailable_reason(impl, device) is None]
    if device.type == "cpu":
        impls.append("reference")
    return impls + ["sglang-triton", "sdpa"]


def unsupported_reason(impl: str, case: Case) -> Optional[str]:
    """Why `impl` cannot run `case`, or None: beyond the device, an impl may reject the
    arguments (the CUDA kernel takes fp16/bf16 only), decided from shapes and dtypes alone."""
    if case.kv != "model" and impl in ("sdpa", "sglang-triton"):
        return "fp8 cache: this anchor runs on the model-dtype row of the same shape"
    if impl == "sdpa":
        return None
    if impl == "sglang-triton":
        if case.n == 1:
            return "the verify anchor (plain decode has its own kernel in SGLang)"
        return _sglang_kernels.unavailable_reason()
    q = torch.empty(1, case.Hq, case.D, dtype=case.q_dtype, device="meta")
    k = torch.empty(1, case.Hkv, case.D, dtype=case.kv_dtype, device="meta")
    v = torch.empty(1, case.Hkv, case.Dv, dtype=case.kv_dtype, device="meta")
    return op_impls("tree_verify_attention").unavailable_reason(impl, DEVICE, args=(q, k, v))


CASES = [Case(B, L, n, hq, hkv, PRESET.head_dim)
         for hq, hkv in PRESET.heads for B in PRESET.batch_sizes for L in PRESET.prefix_lens
         for n in PRESET.draft_counts]
IMPLS = attention_impls(DEVICE)
# The fp8-cache rows: our kernels only, beside the model-dtype rows of the same shapes.
FP8_CASES = [Case(c.B, c.L, c.n, c.Hq, c.Hkv, c.D, "fp8_e4m3") for c in CASES]
FP8_IMPLS = [i for i in IMPLS if i in ("cuda", "triton")]


# --------------------------------------------------------------------------- inputs
@dataclass
class InputSet:
    q: torch.Tensor  # [B*n, Hq, D]
    kv_indices: torch.Tensor  # int32 [B*(L+n)]
    tree_mask: Optional[torch.Tensor]  # int64 [B*n]; None for decode
    dense_mask: Optional[torch.Tensor]  # bool [B, 1, n*group, L+n], SDPA's; None for decode


@dataclass
class Inputs:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kv_indptr: torch.Tensor
    qo_indptr: torch.Tensor
    sets: list[InputSet]
    scales: dict  # k_scale / v_scale of an fp8 cache, else empty


def random_parents(B: int, n: int) -> torch.Tensor:
    """One random tree per request: draft 0 is the root, draft i's parent is uniform in [0, i)."""
    parents = (torch.rand(B, n) * torch.arange(n)).long()
    parents[:, 0] = -1
    return parents.flatten().to(DEVICE)


def dense_mask(case: Case, tree_mask: torch.Tensor) -> torch.Tensor:
    """SDPA's boolean mask: every prefix slot visible, draft j visible to draft i per the tree;
    rows packed like the queries (row = draft * group + head in group)."""
    B, n, L = case.B, case.n, case.L
    draft_bits = (tree_mask.view(B, n, 1) >> torch.arange(n, device=DEVICE)) & 1  # [B, n, n]
    prefix = torch.ones(B, n, L, dtype=torch.bool, device=DEVICE)
    mask = torch.cat([prefix, draft_bits.bool()], dim=2)  # [B, n, L+n]
    return mask.repeat_interleave(case.Hq // case.Hkv, dim=1).unsqueeze(1)


def make_inputs(case: Case, num_sets: int, need_dense_mask: bool) -> Inputs:
    """One cache holding `num_sets` disjoint input sets; each set's slots are a random permutation
    of its own part of the cache (so requests read scattered rows, as with page size 1)."""
    rows = case.kv_rows
    k_cache = torch.randn(num_sets * rows, case.Hkv, case.D, dtype=case.q_dtype, device=DEVICE)
    v_cache = torch.randn(num_sets * rows, case.Hkv, case.Dv, dtype=case.q_dtype, device=DEVICE)
    scales = {}
    if case.kv != "model":
        k_cache, v_cache = ((c.float() / KV_SCALE).to(case.kv_dtype) for c in (k_cache, v_cache))
        scales = dict(k_scale=KV_SCALE, v_scale=KV_SCALE)
    steps = torch.arange(case.B + 1, dtype=torch.int32, device=DEVICE)
    kv_indptr, qo_indptr = steps * (case.L + case.n), steps * case.n
    sets = []
    for s in range(num_sets):
        kv_indices = (s * rows + torch.randperm(rows, device=DEVICE)).to(torch.int32)
        q = torch.randn(case.B * case.n, case.Hq, case.D, dtype=case.q_dtype, device=DEVICE)
        tree_mask = dense = None
        if case.n > 1:
            tree_mask = spec_kernels.tree_mask_from_parents(random_parents(case.B, case.n), qo_indptr)
            dense = dense_mask(case, tree_mask) if need_dense_mask else None
        sets.append(InputSet(q, kv_indices, tree_mask, dense))
    return Inputs(k_cache, v_cache, kv_indptr, qo_indptr, sets, scales)


# --------------------------------------------------------------------------- the calls
def sdpa_attention(case: Case, inp: Inputs, s: InputSet, out: torch.Tensor) -> None:
    B, n, Hkv, D, Dv = case.B, case.n, case.Hkv, case.D, case.Dv
    group = case.Hq // Hkv
    k = inp.k_cache.index_select(0, s.kv_indices).view(B, case.L + n, Hkv, D).transpose(1, 2)
    v = inp.v_cache.index_select(0, s.kv_indices).view(B, case.L + n, Hkv, Dv).transpose(1, 2)
    q = s.q.view(B, n, Hkv, group, D).transpose(1, 2).reshape(B, Hkv, n * group, D)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=s.dense_mask)  # [B, Hkv, n*group, Dv]
    out.view(B, n, Hkv, group, Dv).copy_(o.view(B, Hkv, n, group, Dv).transpose(1, 2))


def sglang_attention(case: Case, inp: Inputs, s: InputSet, out: torch.Tensor) -> Callable[[], None]:
    """SGLang's extend_attention_fwd with the arguments its triton backend passes for TARGET_VERIFY;
    everything but the kernel (mask, the drafts' contiguous K/V) is prepared here, untimed."""
    extend_attention_fwd = _sglang_kernels.extend_attention_fwd()
    B, n, L = case.B, case.n, case.L
    steps = torch.arange(B + 1, device=DEVICE)
    slots = s.kv_indices.view(B, L + n).long()
    prefix_indices, draft_slots = slots[:, :L].flatten(), slots[:, L:].flatten()
    k_new, v_new = inp.k_cache[draft_slots], inp.v_cache[draft_slots]
    draft_bits = ((s.tree_mask.view(B, n, 1) >> torch.arange(n, device=DEVICE)) & 1).bool()
    mask = torch.cat([torch.ones(B, n, L, dtype=torch.bool, device=DEVICE), draft_bits], dim=2).flatten()
    prefix_indptr, mask_indptr = (steps * L).to(torch.int32), steps * (n * (L + n))
    sm_scale = case.D ** -0.5

    def call():
        extend_attention_fwd(s.q, k_new, v_new, out, inp.k_cache, inp.v_cache, inp.qo_indptr, prefix_indptr,
                             prefix_indices, mask, True, mask_indptr, n, 1.0, 1.0, sm_scale=sm_scale)
    return call


def launcher(impl: str, case: Case, inp: Inputs, s: InputSet, out: torch.Tensor) -> Callable[[], None]:
    """A zero-argument call of `impl` on input set `s`, writing `out`."""
    if impl == "sdpa":
        return lambda: sdpa_attention(case, inp, s, out)
    if impl == "sglang-triton":
        return sglang_attention(case, inp, s, out)
    if case.n == 1:
        return lambda: spec_kernels.decode_attention(
            s.q, inp.k_cache, inp.v_cache, inp.kv_indptr, s.kv_indices, out=out, impl=impl, **inp.scales)
    # max_draft_tokens: the server knows its tree size; it sizes the launch for n, not 64.
    return lambda: spec_kernels.tree_verify_attention(
        s.q, inp.k_cache, inp.v_cache, inp.kv_indptr, s.kv_indices, inp.qo_indptr, s.tree_mask,
        out=out, impl=impl, max_draft_tokens=case.n, **inp.scales)


def check_against_reference(impl: str, case: Case, inp: Inputs, out: torch.Tensor) -> None:
    """A benchmark of a wrong result is worthless: compare set 0 with the reference first."""
    if impl == "reference" or case.kv_rows > CHECK_MAX_KV_ROWS:
        return
    expected = torch.empty_like(out)
    launcher("reference", case, inp, inp.sets[0], expected)()
    launcher(impl, case, inp, inp.sets[0], out)()
    tol = 1e-3 if case.q_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol, msg=lambda m: f"{impl} vs reference: {m}")


# --------------------------------------------------------------------------- benchmarks
@pytest.mark.parametrize("op", ["read", "copy"])
def test_stream_bandwidth(benchmark, bench_results, op):
    """The ceiling the attention GB/s are compared with (the %rd column of the summary)."""
    benchmark.group = "streaming bandwidth"
    src = torch.rand(PRESET.stream_bytes // 4, device=DEVICE)
    if op == "read":
        call, nbytes = (lambda: torch.sum(src)), src.nbytes
    else:
        dst = torch.empty_like(src)
        call, nbytes = (lambda: dst.copy_(src)), 2 * src.nbytes
    info = _timing.measure(benchmark, [call], DEVICE, PRESET.rounds)
    _timing.record(benchmark, bench_results, nbytes, kind="stream", op=op, **info)


# --------------------------------------------------------------------------- forced split counts
# Our fastest kernel here (CUDA where it runs, else Triton) at the planned split count and at
# forced ones, so a GPU run shows whether the planner's count is the fastest and where the
# model's predicted time per count departs from the measured one.
SPLIT_IMPL = next(i for i in ("cuda", "triton") if i in IMPLS)
SPLIT_CASES = [Case(B, L, n, *PRESET.heads[0], PRESET.head_dim) for B, L, n in PRESET.split_shapes]


def modelled_split_seconds(case: Case, splits: int) -> Optional[float]:
    """The speed-of-light model's time of `case` at `splits` on this GPU (None on a CPU)."""
    if DEVICE.type != "cuda":
        return None
    from spec_kernels.attention.plan import device_limits
    from spec_kernels.bench.plan import Shape, launch_plan

    lp = launch_plan(Shape("bench", case.B, case.Hq, case.Hkv, case.D, case.L, case.n),
                     device_limits(DEVICE.index), SPLIT_IMPL)
    return lp.seconds_at(splits)


@pytest.mark.parametrize("case,forced", [pytest.param(c, k, id=f"{c.id}-{SPLIT_IMPL}-{'planned' if k == 0 else f'splits{k}'}")
                                         for c in SPLIT_CASES for k in (0,) + PRESET.split_counts])
def test_forced_splits(benchmark, bench_results, case, forced):
    """tree_verify through TreeVerifyPlan with num_kv_splits = `forced` (0: the planner's count)."""
    benchmark.group = f"forced splits: {case.group} n={case.n} {SPLIT_IMPL}"
    inp = make_inputs(case, _timing.input_sets_for(case.bytes, DEVICE), need_dense_mask=False)
    plans = [spec_kernels.TreeVerifyPlan(inp.kv_indptr, s.kv_indices, inp.qo_indptr, s.tree_mask,
                                         num_q_heads=case.Hq, num_kv_heads=case.Hkv, head_dim=case.D,
                                         dtype=case.q_dtype, max_draft_tokens=case.n,
                                         num_kv_splits=forced or None, impl=SPLIT_IMPL) for s in inp.sets]
    splits = plans[0].num_kv_splits
    assert forced in (0, splits), f"forced {forced} splits, the plan has {splits}"
    out = torch.empty(case.B * case.n, case.Hq, case.Dv, dtype=case.q_dtype, device=DEVICE)
    if case.kv_rows <= CHECK_MAX_KV_ROWS:  # a wrong result is worth no timing
        expected = torch.empty_like(out)
        launcher("reference", case, inp, inp.sets[0], expected)()
        plans[0].run(inp.sets[0].q, inp.k_cache, inp.v_cache, out=out)
        tol = 1e-3 if case.q_dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out, expected, atol=tol, rtol=tol, msg=lambda m: f"{splits} splits vs reference: {m}")
    calls = [(lambda p=p, s=s: p.run(s.q, inp.k_cache, inp.v_cache, out=out)) for p, s in zip(plans, inp.sets)]
    info = _timing.measure(benchmark, calls, DEVICE, PRESET.rounds)
    _timing.record(benchmark, bench_results, case.bytes, kind="split_sweep", op="tree_verify", impl=SPLIT_IMPL,
                   B=case.B, L=case.L, n=case.n, Hq=case.Hq, Hkv=case.Hkv, D=case.D, Dv=case.Dv,
                   dtype=case.dtype_label, forced=forced, splits=splits,
                   modelled_s=modelled_split_seconds(case, splits), **info)


# --------------------------------------------------------------------------- merge launch
# The CUDA path at its planned split count with the split merge launched as a programmatic
# dependent of the attention kernel (the default) and as a plain launch, side by side.
@pytest.mark.parametrize("case,pdl", [pytest.param(c, p, id=f"{c.id}-cuda-{'dependent' if p else 'plain'}")
                                      for c in SPLIT_CASES for p in (True, False)])
def test_merge_launch(benchmark, bench_results, case, pdl):
    """tree_verify through TreeVerifyPlan (CUDA), the merge launched as a programmatic dependent or not."""
    if "cuda" not in IMPLS:
        pytest.skip("the merge launch is the CUDA extension's: needs it built, on a GPU")
    from spec_kernels.testing import programmatic_launch

    benchmark.group = f"merge launch: {case.group} n={case.n}"
    inp = make_inputs(case, _timing.input_sets_for(case.bytes, DEVICE), need_dense_mask=False)
    plans = [spec_kernels.TreeVerifyPlan(inp.kv_indptr, s.kv_indices, inp.qo_indptr, s.tree_mask,
                                         num_q_heads=case.Hq, num_kv_heads=case.Hkv, head_dim=case.D,
                                         dtype=case.q_dtype, max_draft_tokens=case.n, impl="cuda") for s in inp.sets]
    out = torch.empty(case.B * case.n, case.Hq, case.Dv, dtype=case.q_dtype, device=DEVICE)
    calls = [(lambda p=p, s=s: p.run(s.q, inp.k_cache, inp.v_cache, out=out)) for p, s in zip(plans, inp.sets)]
    with programmatic_launch(pdl):
        if case.kv_rows <= CHECK_MAX_KV_ROWS:  # a wrong result is worth no timing
            expected = torch.empty_like(out)
            launcher("reference", case, inp, inp.sets[0], expected)()
            calls[0]()
            tol = 1e-3 if case.q_dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
        info = _timing.measure(benchmark, calls, DEVICE, PRESET.rounds)
    _timing.record(benchmark, bench_results, case.bytes, kind="merge_launch", op="tree_verify", impl="cuda",
                   B=case.B, L=case.L, n=case.n, Hq=case.Hq, Hkv=case.Hkv, D=case.D, Dv=case.Dv,
                   dtype=case.dtype_label, dependent=pdl, splits=plans[0].num_kv_splits,
                   modelled_s=modelled_split_seconds(case, plans[0].num_kv_splits) if pdl else None, **info)


@pytest.mark.parametrize("case,impl", [pytest.param(c, i, id=f"{c.id}-{i}") for c in CASES for i in IMPLS] +
                         [pytest.param(c, i, id=f"{c.id}-{i}") for c in FP8_CASES for i in FP8_IMPLS])
def test_attention(benchmark, bench_results, case, impl):
    benchmark.group = case.group
    reason = unsupported_reason(impl, case)
    if reason is not None:
        pytest.skip(f"{impl}: {reason}")
    inp = make_inputs(case, _timing.input_sets_for(case.bytes, DEVICE), need_dense_mask=impl == "sdpa")
    out = torch.empty(case.B * case.n, case.Hq, case.Dv, dtype=case.q_dtype, device=DEVICE)
    if impl == "sglang-triton":  # an anchor that cannot compile here (other Triton) is absent, not our failure
        try:
            launcher(impl, case, inp, inp.sets[0], out)()
        except Exception as exc:  # noqa: BLE001
            pytest.skip(f"{impl}: SGLang's kernel does not run here ({type(exc).__name__}: {str(exc)[:300]})")
    check_against_reference(impl, case, inp, out)
    calls = [launcher(impl, case, inp, s, out) for s in inp.sets]
    info = _timing.measure(benchmark, calls, DEVICE, PRESET.rounds)
    _timing.record(benchmark, bench_results, case.bytes, kind="attention",
                   op="decode" if case.n == 1 else "tree_verify", impl=impl,
                   B=case.B, L=case.L, n=case.n, Hq=case.Hq, Hkv=case.Hkv, D=case.D, Dv=case.Dv,
                   dtype=case.dtype_label, kv_dtype=str(case.kv_dtype)[6:], **info)
