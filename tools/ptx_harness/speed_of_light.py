"""Modelled time of the tree-verify kernels at the benchmark shapes, from interpreter counters.

    python -m tools.ptx_harness.speed_of_light [--gpu h200,rtx-pro-6000] [--quick] [--json out.json]

For each GPU and shape (B requests of L keys, n drafts, Hq:Hkv heads, D = 128, bf16) the CUDA
launch is planned as the binding plans it on that GPU (configuration, resident CTAs, KV splits:
spec_kernels.attention.plan with the GPU's limits), one CTA of it is run in the interpreter at
two prefix lengths, its counters are extrapolated linearly to the keys one CTA of the real launch
streams, and tools/speed_of_light/model.py predicts the launch (plus the split merge when there
are splits) at the rates of tools/speed_of_light/gpus.py. The report names the bottleneck unit
and the fraction of the roofline floor (ideal bytes at peak DRAM bandwidth).

Beside ours, through the same interpreter and model at the same shapes (--no-anchor leaves them
out): our Triton kernel as its launcher plans it, and SGLang 0.5.23's Triton kernels as its triton
backend runs them, the extend kernel with its n x (L + n) mask for verify and the decode kernel
(stage 1 at SGLang's own split count, stage 2) for n = 1. SGLang picks its extend tile from the
CUDA capability, so it is shown the target's. Triton emits wgmma on sm_90, which the interpreter
does not run: for H200 the Triton kernels are compiled with mma.sync instead (a stand-in, slower
than the real code where the tensor unit binds; the report says so on every such row).

Every figure is modelled, none measured; the model's error band is the one calibration.py states.
--json writes pytest-benchmark JSON (predicted seconds in stats.median) for
`python -m spec_kernels.bench compare`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import sys
from typing import Optional, Sequence

from tools.ptx_harness import sglang_kernels
from tools.speed_of_light.gpus import GPUS, LATENCY_CYCLES, Gpu
from tools.speed_of_light.model import (CALIBRATION_BAND, Prediction, Work, combine, expected_range, fit_linear,
                                        distinct_bytes, fmt_seconds, predict, work_from_stats)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
D = 128
SIM_PREFIXES = (128, 256)  # prefix keys of the two simulated points per configuration
MERGE_SPLITS = (2, 4)
# resident CTAs per SM of a split merge (small blocks, no shared memory: its registers are not counted)
MERGE_RESIDENT = 8


@dataclasses.dataclass(frozen=True)
class Shape:
    B: int
    L: int  # keys per request: prefix + drafts
    n: int  # drafts (1: plain decode)
    hq: int
    hkv: int

    @property
    def label(self) -> str:
        kind = "decode" if self.n == 1 else f"verify{self.n}"
        return f"{kind}_B{self.B}_L{self.L}_h{self.hq}x{self.hkv}_d{D}"

    @property
    def group(self) -> int:
        return self.hq // self.hkv

    def ideal_bytes(self, elt: int = 2) -> float:
        """What the op must move once: every K and V row, q read and out written."""
        return self.B * self.L * self.hkv * 2 * D * elt + self.B * self.n * self.hq * 2 * D * elt

    def ideal_flops(self) -> float:
        return 2 * 2 * self.B * self.n * self.hq * self.L * D


def shapes(quick: bool) -> list[Shape]:
    """The gpu-quick benchmark preset's B, L and heads (benchmarks/_timing.py), decode and
    verify n = 4, 8, 16; --quick: one decode and one verify shape."""
    if quick:
        return [Shape(32, 4096, 1, 32, 4), Shape(32, 4096, 16, 32, 4)]
    return [Shape(B, L, n, hq, hkv) for (hq, hkv) in ((32, 4), (32, 8)) for B in (1, 32) for L in (4096, 32768)
            for n in (1, 4, 8, 16)]


MLA_D, MLA_DV = 576, 512  # the latent row (512 + 64 rope) and the value columns the CUDA kernel is built for


@dataclasses.dataclass(frozen=True)
class MlaShape:
    """An MLA verify (decode: n = 1) launch: B requests of L keys (prefix + drafts), n drafts of
    `heads` query heads each, one latent KV row of MLA_D per key."""

    B: int
    L: int
    n: int
    heads: int

    @property
    def label(self) -> str:
        kind = "decode" if self.n == 1 else f"verify{self.n}"
        return f"mla_{kind}_B{self.B}_L{self.L}_h{self.heads}_d{MLA_D}"

    @property
    def rows(self) -> int:  # query rows per request
        return self.n * self.heads

    def ideal_bytes(self, elt: int = 2) -> float:
        """Every latent row once, q read and out written."""
        return self.B * self.L * MLA_D * elt + self.B * self.rows * (MLA_D + MLA_DV) * elt

    def ideal_flops(self) -> float:
        return 2 * self.B * self.rows * self.L * (MLA_D + MLA_DV)


def mla_shapes(quick: bool) -> list[MlaShape]:
    """DeepSeek-V3 (16 heads per rank at TP 8) and Kimi K2.5 (8) at B = 1 and 32, L = 4k and 32k,
    decode and verify n = 4, 8, 16; --quick: DeepSeek-V3's verify n = 16 at L = 4k, B = 1 and 32."""
    if quick:
        return [MlaShape(1, 4096, 16, 16), MlaShape(32, 4096, 16, 16)]
    return [MlaShape(B, L, n, h) for h in (16, 8) for B in (1, 32) for L in (4096, 32768) for n in (1, 4, 8, 16)]


@dataclasses.dataclass(frozen=True)
class TritonTarget:
    """How a Triton kernel is compiled to stand for its code on `gpu`."""

    arch: int  # Triton's GPUTarget arch
    capability: tuple  # what torch.cuda.get_device_capability() would say (SGLang picks its tiles from it)
    mma_v2_only: bool  # sm_90: mma.sync in place of the wgmma Triton emits there (the interpreter runs no wgmma)
    max_smem: int

    @property
    def note(self) -> str:
        return (f"sm_{self.arch}" + (" with mma.sync in place of wgmma (Triton's DISABLE_MMA_V3): a stand-in; "
                                     "wgmma code is faster where the tensor unit binds" if self.mma_v2_only else ""))


def triton_target(gpu: Gpu) -> TritonTarget:
    from spec_kernels.attention.plan import DEVICES

    major = int(gpu.arch[3:].rstrip("a")) // 10
    return TritonTarget(major * 10, (major, 0), major == 9, DEVICES[gpu.key].max_smem_per_cta)


# SGLang's --triton-attention-num-kv-splits default (`python -m sglang.launch_server --help`)
SGLANG_MAX_KV_SPLITS = 8


class Simulator:
    """One CTA's counters per (arch, kernel, n, group, prefix), cached: the interpreter is the slow part."""

    def __init__(self):
        self._cache: dict = {}

    def _cached(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def tree_verify(self, arch: str, n: int, group: int, prefix: int) -> tuple[Work, dict]:
        def make():
            ops = self._run(arch, n, group, prefix, splits=1)
            name, grid, block, smem, st = ops.launches[0]
            ctas = int(math.prod(grid))
            return work_from_stats(st.as_dict(), ctas), dict(grid=list(grid), block=list(block), smem=smem)
        return self._cached(("cuda", arch, n, group, prefix), make)

    def merge(self, arch: str, n: int, group: int, splits: int) -> Work:
        return self._cached(("cuda-merge", arch, n, group, splits), lambda: _merge_work(
            self._run(arch, n, group, 64 * splits, splits=splits), "merge"))

    def mla(self, arch: str, n: int, heads: int, prefix: int) -> tuple[Work, float, dict]:
        """One request's MLA launch at `prefix` keys: (Work per CTA, distinct DRAM bytes of the
        launch: its row blocks read the same latent rows, launch shape)."""
        def make():
            ops = self._run_mla(arch, n, heads, prefix, splits=1)
            name, grid, block, smem, st = ops.launches[0]
            d = st.as_dict()
            return (work_from_stats(d, int(math.prod(grid))), distinct_bytes(d),
                    dict(grid=list(grid), block=list(block), smem=smem))
        return self._cached(("mla", arch, n, heads, prefix), make)

    def mla_merge(self, arch: str, n: int, heads: int, splits: int) -> Work:
        return self._cached(("mla-merge", arch, n, heads, splits), lambda: _merge_work(
            self._run_mla(arch, n, heads, 64 * splits, splits=splits), "mla_merge"))

    def triton(self, target: TritonTarget, kernel: str, *key) -> list:
        """The launches of one Triton run (`_TRITON_RUNS[kernel](*key)`) for `target`, as
        (Work per CTA, distinct DRAM bytes of the launch, launch shape) per launch."""
        return self._triton(target, kernel, *key)[0]

    def sglang_splits(self, target: TritonTarget, *key) -> int:
        """SGLang's split count for a decode batch (_sglang_splits_run's result)."""
        return self._triton(target, "sglang_splits", *key)[1]

    def _triton(self, target, kernel, *key):
        return self._cached((kernel, target) + key, lambda: _run_triton(target, _TRITON_RUNS[kernel], *key))

    @staticmethod
    def _run(arch, n, group, prefix, splits):
        import torch

        from spec_kernels.testing import make_case
        from tools.ptx_harness.cuda_glue import PtxCudaOps, run_tree_verify

        case = make_case([n], [prefix], dtype=torch.bfloat16, seed=1, hq=group, hkv=1, d=D)
        ops = PtxCudaOps(arch=arch, check_races=False, latencies=LATENCY_CYCLES)
        run_tree_verify(case, ops, decode=n == 1, splits=splits)
        return ops


    @staticmethod
    def _run_mla(arch, n, heads, prefix, splits):
        """A chain of n drafts (decode: n = 1 without a tree) after `prefix` keys, through the real
        binding (spec_kernels.mla.cuda) with its ops in the interpreter."""
        import torch

        import spec_kernels.mla.cuda as mla_cuda
        from spec_kernels.testing import ancestor_mask_bits, random_parents
        from tools.ptx_harness.cuda_glue import PtxCudaOps

        gen = torch.Generator().manual_seed(1)
        L = prefix + n
        decode = n == 1
        q = torch.randn(n, heads, MLA_D, generator=gen).to(torch.bfloat16)
        kv_cache = torch.randn(L, MLA_D, generator=gen).to(torch.bfloat16)
        qo_indptr = torch.tensor([0, n], dtype=torch.int32)
        mask = ancestor_mask_bits(torch.tensor(random_parents(n, "chain", gen)), qo_indptr)
        out = torch.empty(n, heads, MLA_DV, dtype=torch.bfloat16)
        ops = PtxCudaOps(arch=arch, check_races=False, latencies=LATENCY_CYCLES)
        saved = mla_cuda.cuda_ops
        mla_cuda.cuda_ops = lambda: ops
        try:
            mla_cuda.mla_tree_verify_attention(q, kv_cache, torch.tensor([0, L], dtype=torch.int32),
                                               torch.randperm(L, generator=gen).to(torch.int32),
                                               None if decode else qo_indptr, None if decode else mask,
                                               MLA_D ** -0.5, MLA_DV, out, torch.empty(n, heads),
                                               num_kv_splits=splits)
        finally:
            mla_cuda.cuda_ops = saved
        return ops


def _merge_work(ops, kernel: str) -> Work:
    """Work per CTA of a split run's last launch, which must be the split merge `kernel`."""
    name, grid, block, smem, st = ops.launches[-1]
    if not name.startswith(kernel):
        raise RuntimeError(f"expected the split merge {kernel} as the last launch, got {name}")
    return work_from_stats(st.as_dict(), int(math.prod(grid)))


def _run_triton(target: TritonTarget, body, *key) -> tuple:
    from tools.ptx_harness.triton_glue import TritonPtxRunner

    runner = TritonPtxRunner(arch=target.arch, check_races=False, max_smem=target.max_smem,
                             mma_v2_only=target.mma_v2_only)
    sees = _sglang_sees(target) if body.__name__.startswith("_sglang") else contextlib.nullcontext()
    with runner.active(), sees:
        value = body(*key)
    out = []
    for launch in runner.launches:
        d = launch.stats.as_dict()
        out.append((work_from_stats(d, int(math.prod(launch.grid))), distinct_bytes(d),
                    dict(kernel=launch.kernel, grid=list(launch.grid), block=list(launch.block), smem=launch.shared)))
    return out, value


@contextlib.contextmanager
def _sglang_sees(target: TritonTarget):
    """SGLang's extend kernel picks its tile from the CUDA capability it read at import: show it
    the target's (on this CPU machine it would take its pre-Ampere fallback tile)."""
    sglang_kernels.loader().extend_attention_fwd()  # imported (installed, or staged) before it is shown anything
    mod = sys.modules["sglang.kernels.ops.attention.extend_attention"]
    saved = {k: getattr(mod, k) for k in ("_is_cuda", "CUDA_CAPABILITY") if hasattr(mod, k)}
    mod._is_cuda, mod.CUDA_CAPABILITY = True, target.capability
    try:
        yield
    finally:
        for k in ("_is_cuda", "CUDA_CAPABILITY"):
            if k in saved:
                setattr(mod, k, saved[k])
            elif hasattr(mod, k):
                delattr(mod, k)


def _tensors(n: int, group: int, prefix: int):
    import torch

    gen = torch.Generator().manual_seed(1)
    L = prefix + n
    k_cache, v_cache = (torch.randn(L, 1, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(n, group, D, generator=gen).to(torch.bfloat16)
    return q, k_cache, v_cache, torch.randperm(L, generator=gen)


def _sglang_extend_run(n: int, group: int, prefix: int) -> None:
    """SGLang 0.5.23's Triton extend kernel as its triton backend runs target verify (the
    n x (L + n) mask, the drafts' K/V contiguous), one request and one KV head."""
    import torch

    extend_attention_fwd = sglang_kernels.loader().extend_attention_fwd()
    q, k_cache, v_cache, slots = _tensors(n, group, prefix)
    L = prefix + n
    mask = torch.ones(n, L, dtype=torch.bool)
    mask[:, prefix:] = torch.tril(torch.ones(n, n, dtype=torch.bool))  # a chain: any tree costs the same
    extend_attention_fwd(q, k_cache[slots[prefix:]], v_cache[slots[prefix:]], torch.empty_like(q), k_cache, v_cache,
                         torch.tensor([0, n], dtype=torch.int32), torch.tensor([0, prefix], dtype=torch.int32),
                         slots[:prefix].long(), mask.flatten(), True, torch.tensor([0, n * L]), n, 1.0, 1.0,
                         sm_scale=D ** -0.5)


def _sglang_decode_run(group: int, keys: int, splits: int) -> None:
    """SGLang 0.5.23's Triton decode kernel (stage 1 over `splits` KV splits of one request's
    `keys` keys, then stage 2, the merge), one request and one KV head. Its stage-1 grid has
    max_kv_splits CTAs per head tile, those past the request's split count returning at once:
    here max_kv_splits = splits, so every simulated CTA works."""
    import torch

    decode_attention_fwd = sglang_kernels.loader().decode_attention_fwd()
    q, k_cache, v_cache, slots = _tensors(1, group, keys - 1)
    logits = torch.empty(1, group, splits, D, dtype=torch.float32)
    lse = torch.empty(1, group, splits, dtype=torch.float32)
    decode_attention_fwd(q, k_cache, v_cache, torch.empty_like(q), torch.tensor([0, keys], dtype=torch.int32),
                         slots.to(torch.int32), logits, lse, torch.tensor([splits], dtype=torch.int32),
                         splits, D ** -0.5, 1.0, 1.0)


def _sglang_splits_run(batch: int, seq_len: int, hq: int, hkv: int, sms: int) -> int:
    """SGLang's own split count for a decode batch (its get_num_kv_splits_triton, as its triton
    backend calls it), compiled and run like the kernels."""
    import torch

    get_num_kv_splits_triton = sglang_kernels.loader().num_kv_splits_kernel()
    out = torch.zeros(batch, dtype=torch.int32)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32)
    get_num_kv_splits_triton[(1,)](out, seq_lens, batch, 1, hq, hkv, SGLANG_MAX_KV_SPLITS, sms,
                                   uneven_batch_ptr=None, MAX_NUM_SEQ=max(256, 1 << (batch - 1).bit_length()))
    return int(out.max())


def _ours_triton_run(n: int, group: int, prefix: int, splits: int) -> None:
    import torch

    import spec_kernels
    from spec_kernels.testing import make_case

    case = make_case([n], [prefix], dtype=torch.bfloat16, seed=1, hq=group, hkv=1, d=D)
    if n == 1:
        spec_kernels.decode_attention(case.q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices,
                                      impl="triton", num_kv_splits=splits)
    else:
        spec_kernels.tree_verify_attention(*case.args, impl="triton", num_kv_splits=splits)


_TRITON_RUNS = {"sglang_extend": _sglang_extend_run, "sglang_decode": _sglang_decode_run,
                "sglang_splits": _sglang_splits_run, "ours_triton": _ours_triton_run}


def _anchor(gpu: Gpu, s: Shape, parts: list[Prediction], ctas: int) -> dict:
    total = combine(parts, ideal_bytes=s.ideal_bytes(), gpu=gpu, ideal_flops=s.ideal_flops()) if len(parts) > 1 \
        else parts[0]
    return dict(prediction=total, ctas=ctas, bandwidth=s.ideal_bytes() / total.seconds)


def _distinct(u0: float, u1: float, x0: float, x1: float, x: float) -> float:
    return u0 + (u1 - u0) * (x - x0) / (x1 - x0)


def sglang_anchor(sim: Simulator, gpu: Gpu, s: Shape) -> dict:
    """SGLang's Triton kernels beside ours: extend (target verify) for n > 1, decode for n = 1."""
    from spec_kernels.attention.plan import DEVICES, KernelResources, resident_ctas_per_sm

    t = triton_target(gpu)
    p0, p1 = SIM_PREFIXES
    limits = DEVICES[gpu.key]

    def resident(cfg):  # registers are not known without ptxas: 255 per thread (the most), the fewest CTAs
        return resident_ctas_per_sm(KernelResources(cfg["block"][0], 255, cfg["smem"]), limits)

    if s.n > 1:
        (w0, u0, cfg), = sim.triton(t, "sglang_extend", s.n, s.group, p0)
        (w1, u1, _), = sim.triton(t, "sglang_extend", s.n, s.group, p1)
        prefix = s.L - s.n
        w = fit_linear(p0, w0, p1, w1, prefix)
        ctas = s.B * s.hkv * math.prod(cfg["grid"])  # its grid: (request, q head, row block)
        p = predict(gpu, w, ctas, resident(cfg), ideal_bytes=s.ideal_bytes(), ideal_flops=s.ideal_flops(),
                    launch_dram_bytes=_distinct(u0, u1, p0, p1, prefix) * s.B * s.hkv)  # q heads share K/V via L2
        return {"sglang_triton_extend": dict(_anchor(gpu, s, [p], ctas), config=cfg, target=t.note)}
    splits = sim.sglang_splits(t, s.B, s.L, s.hq, s.hkv, gpu.sms)
    chunk = -(-s.L // splits)
    (w0, u0, cfg), _ = sim.triton(t, "sglang_decode", s.group, p0, 1)
    (w1, u1, _), _ = sim.triton(t, "sglang_decode", s.group, p1, 1)
    stage1 = fit_linear(p0, w0, p1, w1, chunk)
    ctas = s.B * s.hkv * splits  # its grid is (request, head tile, max splits); splits past the count return at once
    parts = [predict(gpu, stage1, ctas, resident(cfg), ideal_bytes=s.ideal_bytes(), ideal_flops=s.ideal_flops(),
                     launch_dram_bytes=_distinct(u0, u1, p0, p1, chunk) * ctas)]
    (_, _, _), (m0, _, mcfg) = sim.triton(t, "sglang_decode", s.group, 2 * p0, MERGE_SPLITS[0])
    (_, _, _), (m1, _, _) = sim.triton(t, "sglang_decode", s.group, 2 * p0, MERGE_SPLITS[1])
    merge = fit_linear(MERGE_SPLITS[0], m0, MERGE_SPLITS[1], m1, splits)
    parts.append(predict(gpu, merge, s.B * s.hq, resident(mcfg), ideal_bytes=0.0))
    return {"sglang_triton_decode": dict(_anchor(gpu, s, parts, ctas), config=cfg, splits=splits, target=t.note)}


def launch_plan(gpu: Gpu, s: Shape, impl: str = "cuda"):
    """The launch of shape `s` on `gpu` as its launcher plans it (spec_kernels.bench.plan)."""
    from spec_kernels.attention.plan import DEVICES
    from spec_kernels.bench import plan as bench_plan

    shape = bench_plan.Shape(s.label, s.B, s.hq, s.hkv, D, s.L - s.n, s.n)  # there L is the prefix
    return bench_plan.launch_plan(shape, DEVICES[gpu.key], impl)


def triton_ours(sim: Simulator, gpu: Gpu, s: Shape) -> dict:
    """Our Triton kernel planned as its launcher plans it on `gpu` (fixed tile, split count)."""
    from spec_kernels.attention.plan import DEVICES, resident_ctas_per_sm

    t = triton_target(gpu)
    lp = launch_plan(gpu, s, "triton")
    sp = lp.plan
    p0, p1 = SIM_PREFIXES
    (w0, u0, cfg), = sim.triton(t, "ours_triton", s.n, s.group, p0, 1)
    (w1, u1, _), = sim.triton(t, "ours_triton", s.n, s.group, p1, 1)
    per_split = (s.L - s.n) / sp.splits
    ctas = s.B * s.hkv * cfg["grid"][0] * sp.splits
    parts = [predict(gpu, fit_linear(p0, w0, p1, w1, per_split), ctas, resident_ctas_per_sm(lp.kernel, DEVICES[gpu.key]),
                     ideal_bytes=s.ideal_bytes(), ideal_flops=s.ideal_flops())]
    if sp.splits > 1:
        m0, m1 = (sim.triton(t, "ours_triton", s.n, s.group, 64 * k, k)[-1][0] for k in MERGE_SPLITS)
        parts.append(predict(gpu, fit_linear(MERGE_SPLITS[0], m0, MERGE_SPLITS[1], m1, sp.splits), s.B * s.n * s.hq,
                             MERGE_RESIDENT, ideal_bytes=0.0))
    return {"tree_verify_triton": dict(_anchor(gpu, s, parts, ctas), config=cfg, splits=sp.splits, target=t.note)}


def predict_ours(sim: Simulator, gpu: Gpu, s: Shape, block_m: int, res, splits: int) -> tuple[Prediction, list, dict, int]:
    """The CUDA launch of shape `s` at `splits` KV splits (the planned configuration): (the whole
    op's prediction, its launches, the simulated CTA's launch shape, CTAs). Any split count, so
    the report can judge the planner's choice against the others."""
    from spec_kernels.attention.plan import DEVICES, resident_ctas_per_sm

    p0, p1 = SIM_PREFIXES
    (w0, cfg), (w1, _) = sim.tree_verify(gpu.arch, s.n, s.group, p0), sim.tree_verify(gpu.arch, s.n, s.group, p1)
    w = fit_linear(p0, w0, p1, w1, (s.L - s.n) / splits)
    ctas = s.B * s.hkv * cfg["grid"][0] * splits  # grid[0]: row blocks of one (request, KV head)
    resident = resident_ctas_per_sm(res, DEVICES[gpu.key])
    parts = [predict(gpu, w, ctas, resident, ideal_bytes=s.ideal_bytes(), ideal_flops=s.ideal_flops())]
    if splits > 1:
        m0, m1 = (sim.merge(gpu.arch, s.n, s.group, k) for k in MERGE_SPLITS)
        mw = fit_linear(MERGE_SPLITS[0], m0, MERGE_SPLITS[1], m1, splits)
        parts.append(predict(gpu, mw, s.B * s.n * s.hq, MERGE_RESIDENT, ideal_bytes=0.0, dependent=True))
    total = combine(parts, ideal_bytes=s.ideal_bytes(), gpu=gpu, ideal_flops=s.ideal_flops())
    return total, parts, cfg, ctas


def split_check(sim: Simulator, gpu: Gpu, s: Shape, lp) -> dict:
    """The planner judged by the model: the modelled time at every split count the bounds allow,
    the fastest of them, and the count the planner without the bytes (wave efficiency alone, the
    previous rule) would take."""
    sp = lp.plan
    times = {k: predict_ours(sim, gpu, s, lp.block_m, lp.kernel, k)[0].seconds for k in range(1, sp.max_splits + 1)}
    best = min(times, key=times.get)
    waves = lp.wave_rule().splits
    return dict(best_splits=best, best_seconds=times[best], wave_rule_splits=waves, wave_rule_seconds=times[waves],
                planned_over_best=times[sp.splits] / times[best])


def model_shape(sim: Simulator, gpu: Gpu, s: Shape, with_anchor: bool = True) -> dict:
    from spec_kernels.attention.plan import DEVICES, resident_ctas_per_sm

    lp = launch_plan(gpu, s)
    sp = lp.plan
    total, parts, cfg, ctas = predict_ours(sim, gpu, s, lp.block_m, lp.kernel, sp.splits)
    return dict(shape=s.label, gpu=gpu.key, block_m=lp.block_m, splits=sp.splits, split_limit=sp.limit,
                split_check=split_check(sim, gpu, s, lp),
                resident=resident_ctas_per_sm(lp.kernel, DEVICES[gpu.key]), ctas=ctas,
                prediction=total, launches=parts, config=cfg,
                bandwidth=s.ideal_bytes() / total.seconds, ideal_bytes=s.ideal_bytes(),
                anchors={**triton_ours(sim, gpu, s), **sglang_anchor(sim, gpu, s)} if with_anchor else {})


def mla_launch_plan(gpu: Gpu, s: MlaShape):
    """The MLA launch of shape `s` on `gpu` as spec_kernels.mla.cuda plans it."""
    from spec_kernels.attention.plan import DEVICES
    from spec_kernels.bench import plan as bench_plan

    shape = bench_plan.Shape(s.label, s.B, s.heads, 1, MLA_D, s.L - s.n, s.n, mla=True)
    return bench_plan.launch_plan(shape, DEVICES[gpu.key], "cuda")


def mma_fraction(gpu: Gpu, flops: float, seconds: float) -> float:
    """Useful FLOPs per second over the GPU's mma.sync peak (16-bit inputs, fp32 accumulate)."""
    return flops / (seconds * gpu.tensor_flops_per_clk("bf16") * gpu.sms * gpu.clock_hz) if seconds else 0.0


def predict_mla(sim: Simulator, gpu: Gpu, s: MlaShape, res, splits: int) -> tuple[Prediction, list, dict, int]:
    """The CUDA MLA launch of shape `s` at `splits` KV splits: (the whole op's prediction, its
    launches, the simulated launch shape, CTAs). A request's row blocks read the same latent rows
    (one DRAM read, the rest L2 hits): the launch's DRAM bytes are B x splits x one request-split's
    distinct bytes."""
    from spec_kernels.attention.plan import DEVICES, resident_ctas_per_sm

    p0, p1 = SIM_PREFIXES
    (w0, u0, cfg), (w1, u1, _) = sim.mla(gpu.arch, s.n, s.heads, p0), sim.mla(gpu.arch, s.n, s.heads, p1)
    keys = (s.L - s.n) / splits
    ctas = s.B * cfg["grid"][0] * splits  # grid[0]: row blocks of one request
    parts = [predict(gpu, fit_linear(p0, w0, p1, w1, keys), ctas, resident_ctas_per_sm(res, DEVICES[gpu.key]),
                     ideal_bytes=s.ideal_bytes(), ideal_flops=s.ideal_flops(),
                     launch_dram_bytes=_distinct(u0, u1, p0, p1, keys) * s.B * splits)]
    if splits > 1:
        m0, m1 = (sim.mla_merge(gpu.arch, s.n, s.heads, k) for k in MERGE_SPLITS)
        parts.append(predict(gpu, fit_linear(MERGE_SPLITS[0], m0, MERGE_SPLITS[1], m1, splits), s.B * s.rows,
                             MERGE_RESIDENT, ideal_bytes=0.0, dependent=True))
    total = combine(parts, ideal_bytes=s.ideal_bytes(), gpu=gpu, ideal_flops=s.ideal_flops())
    return total, parts, cfg, ctas


def model_mla_shape(sim: Simulator, gpu: Gpu, s: MlaShape) -> dict:
    """The MLA launch as planned, the model's time at every split count its bounds allow, and the
    fraction of the mma.sync peak its useful FLOPs reach."""
    from spec_kernels.attention.plan import DEVICES, resident_ctas_per_sm

    lp = mla_launch_plan(gpu, s)
    sp = lp.plan
    total, parts, cfg, ctas = predict_mla(sim, gpu, s, lp.kernel, sp.splits)
    times = {k: predict_mla(sim, gpu, s, lp.kernel, k)[0].seconds for k in range(1, sp.max_splits + 1)}
    best = min(times, key=times.get)
    return dict(shape=s.label, gpu=gpu.key, block_m=lp.block_m, splits=sp.splits, split_limit=sp.limit,
                split_check=dict(best_splits=best, best_seconds=times[best], planned_over_best=times[sp.splits] / times[best]),
                resident=resident_ctas_per_sm(lp.kernel, DEVICES[gpu.key]), ctas=ctas, prediction=total,
                launches=parts, config=cfg, bandwidth=s.ideal_bytes() / total.seconds, ideal_bytes=s.ideal_bytes(),
                mma_fraction=mma_fraction(gpu, s.ideal_flops(), total.seconds))


def run_mla(gpus: list[str], quick: bool) -> list[dict]:
    sim = Simulator()
    return [model_mla_shape(sim, GPUS[g], s) for g in gpus for s in mla_shapes(quick)]


def run(gpus: list[str], quick: bool, anchor: bool = True) -> list[dict]:
    sim = Simulator()
    return [model_shape(sim, GPUS[g], s, anchor) for g in gpus for s in shapes(quick)]


# The kernels beside ours, in the report's order: what each is
ANCHORS = {
    "tree_verify_triton": "ours, Triton (its launcher's fixed tile and split count)",
    "sglang_triton_extend": "SGLang 0.5.23's Triton extend kernel (target verify: n x (L + n) mask)",
    "sglang_triton_decode": "SGLang 0.5.23's Triton decode kernel (its split count, stage 1 + stage 2)",
}


def print_header() -> None:
    lo, hi = CALIBRATION_BAND
    print("modelled (speed-of-light model, not measured); floor = ideal bytes at peak DRAM bandwidth")
    print("time: with each warp's instructions in the best order its dependences allow; in order: issued in "
          "PTX order (no reordering by the compiler); the code ptxas emits lies between")
    print(f"error band (tools/ptx_harness/calibration.py): on a GPU expect {1 / hi:.2f}x (memory-bound) .. "
          f"{1 / lo:.2f}x (compute-bound) the modelled time")


def print_table(rows: list[dict]) -> None:
    print_header()
    print(f"{'gpu':<13} {'shape':<34} {'rows/CTA':>8} {'splits':>6} {'CTAs':>6} {'time':>10} {'in order':>10}"
          f" {'GB/s':>7} {'floor/t':>7}  bottleneck (unit times)")
    for r in rows:
        p: Prediction = r["prediction"]
        units = ", ".join(f"{u} {fmt_seconds(t)}" for u, t in sorted(p.units.items(), key=lambda kv: -kv[1])[:3])
        print(f"{r['gpu']:<13} {r['shape']:<34} {r['block_m']:>8} {r['splits']:>6} {r['ctas']:>6} "
              f"{fmt_seconds(p.seconds):>10} {fmt_seconds(p.seconds_in_order):>10} {r['bandwidth'] / 1e9:>7.0f} "
              f"{p.of_floor:>7.2f}  {p.bottleneck} ({units})")
    print("\nsplit sizing (tree_verify_cuda): the planner's split count against every count its bounds allow "
          "(the model's fastest) and against the wave-efficiency rule it replaced; time / fastest")
    print(f"{'gpu':<13} {'shape':<34} {'planned':>7} {'bound':>9} {'x best':>7} {'fastest':>7} {'time':>10}"
          f" {'wave rule':>9} {'x best':>7}")
    for r in rows:
        c = r["split_check"]
        print(f"{r['gpu']:<13} {r['shape']:<34} {r['splits']:>7} {r['split_limit']:>9} {c['planned_over_best']:>7.3f} "
              f"{c['best_splits']:>7} {fmt_seconds(c['best_seconds']):>10} {c['wave_rule_splits']:>9} "
              f"{c['wave_rule_seconds'] / c['best_seconds']:>7.3f}")
    for kernel, what in ANCHORS.items():
        have = [r for r in rows if kernel in r.get("anchors", {})]
        if not have:
            continue
        targets = sorted({f"{r['gpu']}: {r['anchors'][kernel]['target']}" for r in have})
        print(f"\n{kernel}: {what}; same shapes; compiled for {'; '.join(targets)}")
        print(f"{'gpu':<13} {'shape':<34} {'CTAs':>6} {'time':>10} {'GB/s':>7} {'floor/t':>7} {'CUDA x faster':>13}"
              f"  bottleneck (unit times)")
        for r in have:
            a = r["anchors"][kernel]
            p: Prediction = a["prediction"]
            units = ", ".join(f"{u} {fmt_seconds(t)}" for u, t in sorted(p.units.items(), key=lambda kv: -kv[1])[:3])
            print(f"{r['gpu']:<13} {r['shape']:<34} {a['ctas']:>6} {fmt_seconds(p.seconds):>10} "
                  f"{a['bandwidth'] / 1e9:>7.0f} {p.of_floor:>7.2f} "
                  f"{p.seconds / r['prediction'].seconds:>13.2f}  {p.bottleneck} ({units})")


def print_mla_table(rows: list[dict]) -> None:
    print("\nMLA verify (mla_tree_verify_cuda; modelled): floor = the larger of the ideal bytes at peak DRAM "
          "bandwidth and the useful FLOPs at the mma.sync peak; mma = useful FLOP/s / mma.sync peak; "
          "x best = time at the planned split count / at the model's fastest")
    print(f"{'gpu':<13} {'shape':<34} {'rows/CTA':>8} {'splits':>6} {'CTAs':>6} {'time':>10} {'in order':>10}"
          f" {'GB/s':>7} {'mma':>5} {'floor/t':>7} {'x best':>6} {'fastest':>7}  bottleneck (unit times)")
    for r in rows:
        p: Prediction = r["prediction"]
        c = r["split_check"]
        units = ", ".join(f"{u} {fmt_seconds(t)}" for u, t in sorted(p.units.items(), key=lambda kv: -kv[1])[:3])
        print(f"{r['gpu']:<13} {r['shape']:<34} {r['block_m']:>8} {r['splits']:>6} {r['ctas']:>6} "
              f"{fmt_seconds(p.seconds):>10} {fmt_seconds(p.seconds_in_order):>10} {r['bandwidth'] / 1e9:>7.0f} "
              f"{r['mma_fraction']:>5.2f} {p.of_floor:>7.2f} "
              f"{c['planned_over_best']:>6.3f} {c['best_splits']:>7}  {p.bottleneck} ({units})")


def _entry(kernel: str, r: dict, seconds: float, extra: dict) -> dict:
    """One pytest-benchmark entry: the modelled seconds as the statistics."""
    return {"name": f"sol::{kernel}[{r['gpu']}-{r['shape']}]", "group": "speed-of-light",
            "params": {"gpu": r["gpu"], "shape": r["shape"]},
            "stats": {"min": seconds, "max": seconds, "mean": seconds, "median": seconds, "rounds": 1, "iterations": 1},
            "extra_info": {"unit": "seconds (modelled, not measured)",
                           "expected_seconds_on_gpu": list(expected_range(seconds)), **extra}}


def to_benchmark_json(rows: list[dict], mla_rows: Sequence[dict] = ()) -> dict:
    from tools.ptx_harness.report import _commit

    benches = []
    for r in rows:
        p: Prediction = r["prediction"]
        benches.append(_entry("tree_verify_cuda", r, p.seconds, {
            "bottleneck": p.bottleneck, "of_floor": p.of_floor, "units": p.units, "splits": r["splits"],
            "seconds_in_order": p.seconds_in_order,
            "ctas": r["ctas"], "block_m": r["block_m"], "resident": r["resident"], "gbps": r["bandwidth"] / 1e9,
            "split_limit": r["split_limit"], "split_check": r["split_check"],
            "bytes": r["ideal_bytes"], "calibration_band": list(CALIBRATION_BAND)}))
        for kernel, a in r.get("anchors", {}).items():
            ap: Prediction = a["prediction"]
            benches.append(_entry(kernel, r, ap.seconds, {
                "bottleneck": ap.bottleneck, "of_floor": ap.of_floor, "units": ap.units, "ctas": a["ctas"],
                "gbps": a["bandwidth"] / 1e9, "cuda_faster_by": ap.seconds / p.seconds, "compiled_for": a["target"],
                "launch": a["config"], **({"splits": a["splits"]} if "splits" in a else {})}))
    for r in mla_rows:
        p = r["prediction"]
        benches.append(_entry("mla_tree_verify_cuda", r, p.seconds, {
            "bottleneck": p.bottleneck, "of_floor": p.of_floor, "floor_unit": p.floor_unit, "units": p.units,
            "seconds_in_order": p.seconds_in_order,
            "splits": r["splits"], "ctas": r["ctas"], "block_m": r["block_m"], "resident": r["resident"],
            "gbps": r["bandwidth"] / 1e9, "mma_fraction": r["mma_fraction"], "split_limit": r["split_limit"],
            "split_check": r["split_check"], "bytes": r["ideal_bytes"], "calibration_band": list(CALIBRATION_BAND)}))
    return {"machine_info": {"node": "speed-of-light model", "note": "modelled from interpreter counters"},
            "commit_info": _commit(), "benchmarks": benches,
            "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": "sol"}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.ptx_harness.speed_of_light", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="h200,rtx-pro-6000", help="comma-separated keys of tools/speed_of_light/gpus.py")
    ap.add_argument("--quick", action="store_true", help="two shapes per GPU (about a minute)")
    ap.add_argument("--json", help="write pytest-benchmark-compatible JSON here")
    ap.add_argument("--no-anchor", action="store_true", help="leave out the kernels beside ours (our Triton, SGLang's)")
    ap.add_argument("--family", default="gqa,mla", help="comma-separated: gqa (tree verify / decode), mla")
    args = ap.parse_args(argv)
    families = {f.strip() for f in args.family.split(",") if f.strip()}
    if not families or families - {"gqa", "mla"}:
        ap.error(f"--family: choose from gqa, mla; got {args.family!r}")
    gpus = [g.strip() for g in args.gpu.split(",") if g.strip()]
    unknown = [g for g in gpus if g not in GPUS or g == "a100"]
    if unknown:
        ap.error(f"--gpu: unknown or calibration-only {unknown}; choose from h200, rtx-pro-6000")
    rows = run(gpus, args.quick, not args.no_anchor) if "gqa" in families else []
    mla_rows = run_mla(gpus, args.quick) if "mla" in families else []
    if rows:
        print_table(rows)
    else:
        print_header()
    if mla_rows:
        print_mla_table(mla_rows)
    for key in gpus:
        if GPUS[key].assumed:
            print(f"{key}: rates without a public source (assumed): {', '.join(GPUS[key].assumed)}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(to_benchmark_json(rows, mla_rows), f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
