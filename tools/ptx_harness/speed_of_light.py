"""Modelled time of the tree-verify kernels at the benchmark shapes, from interpreter counters.

    python -m tools.ptx_harness.speed_of_light [--gpu h200,rtx-pro-6000] [--quick] [--json out.json]

For each GPU and shape (B requests of L keys, n drafts, Hq:Hkv heads, D = 128, bf16) the CUDA
launch is planned as the binding plans it on that GPU (configuration, resident CTAs, KV splits:
spec_kernels.attention.plan with the GPU's limits), one CTA of it is run in the interpreter at
two prefix lengths, its counters are extrapolated linearly to the keys one CTA of the real launch
streams, and tools/speed_of_light/model.py predicts the launch (plus the split merge when there
are splits) at the rates of tools/speed_of_light/gpus.py. The report names the bottleneck unit
and the fraction of the roofline floor (ideal bytes at peak DRAM bandwidth).

Every figure is modelled, none measured; the model's error band is the one calibration.py states.
--json writes pytest-benchmark JSON (predicted seconds in stats.median) for
`python -m spec_kernels.bench compare`.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
from typing import Optional

from tools.speed_of_light.gpus import GPUS, Gpu
from tools.speed_of_light.model import (CALIBRATION_BAND, Prediction, Work, combine, expected_range, fit_linear,
                                        fmt_seconds, predict, work_from_stats)

D = 128
SIM_PREFIXES = (128, 256)  # prefix keys of the two simulated points per configuration
MERGE_SPLITS = (2, 4)


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


class Simulator:
    """One CTA's counters per (arch, n, group, prefix), cached: the interpreter is the slow part."""

    def __init__(self):
        self._tv: dict = {}
        self._merge: dict = {}
        self._sglang: dict = {}

    def tree_verify(self, arch: str, n: int, group: int, prefix: int) -> tuple[Work, dict]:
        key = (arch, n, group, prefix)
        if key not in self._tv:
            ops = self._run(arch, n, group, prefix, splits=1)
            name, grid, block, smem, st = ops.launches[0]
            ctas = int(math.prod(grid))
            self._tv[key] = (work_from_stats(st.as_dict(), ctas), dict(grid=list(grid), block=list(block), smem=smem))
        return self._tv[key]

    def merge(self, arch: str, n: int, group: int, splits: int) -> Work:
        key = (arch, n, group, splits)
        if key not in self._merge:
            ops = self._run(arch, n, group, 64 * splits, splits=splits)
            name, grid, block, smem, st = ops.launches[-1]
            if not name.startswith("merge"):
                raise RuntimeError(f"expected the split merge as the last launch, got {name}")
            self._merge[key] = work_from_stats(st.as_dict(), int(math.prod(grid)))
        return self._merge[key]

    def sglang_extend(self, n: int, group: int, prefix: int) -> tuple[Work, float, dict]:
        """SGLang 0.5.23's Triton extend kernel as its triton backend runs target verify (the
        n x (L + n) mask, the drafts' K/V contiguous), compiled for sm_120, for one request and
        one KV head: per-CTA work, the launch's distinct DRAM bytes, the launch's shape."""
        key = (n, group, prefix)
        if key not in self._sglang:
            self._sglang[key] = _run_sglang_extend(n, group, prefix)
        return self._sglang[key]

    @staticmethod
    def _run(arch, n, group, prefix, splits):
        import torch

        from spec_kernels.testing import make_case
        from tools.ptx_harness.cuda_glue import PtxCudaOps, run_tree_verify

        case = make_case([n], [prefix], dtype=torch.bfloat16, seed=1, hq=group, hkv=1, d=D)
        ops = PtxCudaOps(arch=arch, check_races=False)
        run_tree_verify(case, ops, decode=n == 1, splits=splits)
        return ops


def _run_sglang_extend(n: int, group: int, prefix: int):
    import torch

    from tools.ptx_harness.triton_glue import TritonPtxRunner

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "benchmarks"))
    import _sglang_kernels  # the benchmark's loader of SGLang's kernel (installed, or staged sources)

    extend_attention_fwd = _sglang_kernels.extend_attention_fwd()
    L = prefix + n
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = (torch.randn(L, 1, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(n, group, D, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    slots = torch.randperm(L, generator=gen)
    mask = torch.ones(n, L, dtype=torch.bool)
    mask[:, prefix:] = torch.tril(torch.ones(n, n, dtype=torch.bool))  # a chain: any tree costs the same
    runner = TritonPtxRunner(arch=120, check_races=False)
    with runner.active():
        extend_attention_fwd(q, k_cache[slots[prefix:]], v_cache[slots[prefix:]], out, k_cache, v_cache,
                             torch.tensor([0, n], dtype=torch.int32), torch.tensor([0, prefix], dtype=torch.int32),
                             slots[:prefix].long(), mask.flatten(), True, torch.tensor([0, n * L]), n, 1.0, 1.0,
                             sm_scale=D ** -0.5)
    launch = runner.launches[-1]
    d = launch.stats.as_dict()
    ctas = int(math.prod(launch.grid))
    distinct = sum(d["unique_bytes_read_by_buffer"].values()) + sum(d["unique_bytes_written_by_buffer"].values())
    return work_from_stats(d, ctas), float(distinct), dict(grid=list(launch.grid), block=list(launch.block),
                                                           smem=launch.shared, config=launch.kernel)


def sglang_anchor(sim: Simulator, gpu: Gpu, s: Shape) -> Optional[dict]:
    """The anchor beside our kernel: RTX PRO 6000 only (for sm_90 Triton emits wgmma, which the
    interpreter does not execute), verify only (its decode is another kernel)."""
    if gpu.key != "rtx-pro-6000" or s.n == 1:
        return None
    from spec_kernels.attention.plan import DEVICES, KernelResources, resident_ctas_per_sm

    p0, p1 = SIM_PREFIXES
    (w0, u0, cfg), (w1, u1, _) = sim.sglang_extend(s.n, s.group, p0), sim.sglang_extend(s.n, s.group, p1)
    prefix = s.L - s.n
    w = fit_linear(p0, w0, p1, w1, prefix)
    distinct = (u0 + (u1 - u0) * (prefix - p0) / (p1 - p0)) * s.B * s.hkv
    ctas = s.B * s.hkv * math.prod(cfg["grid"])  # its grid: (request, q head, row block)
    # registers are not known without ptxas: 255 per thread (the most), so the fewest resident CTAs
    resident = resident_ctas_per_sm(KernelResources(cfg["block"][0], 255, cfg["smem"]), DEVICES[gpu.key])
    p = predict(gpu, w, ctas, resident, ideal_bytes=s.ideal_bytes(), ideal_flops=s.ideal_flops(),
                launch_dram_bytes=distinct)  # the q heads of a group read the same K/V (through L2)
    return dict(prediction=p, ctas=ctas, resident=resident, bandwidth=s.ideal_bytes() / p.seconds)


def plan_launch(gpu: Gpu, s: Shape):
    """(block_m, resources, SplitPlan) of the CUDA launch on `gpu`, as the binding plans it."""
    from spec_kernels.attention.plan import DEVICES, expected_rows, max_rows, mean_prefix, split_plan
    from spec_kernels.tree_verify.cuda import cuda_tree_verify_block_m, cuda_tree_verify_resources

    limits = DEVICES[gpu.key]
    decode = s.n == 1
    T = s.B * s.n
    rows = max_rows(T, s.group, decode, s.n)
    work = expected_rows(T, s.B, s.group, decode, s.n)
    block_m = cuda_tree_verify_block_m(D, rows, limits)
    res = cuda_tree_verify_resources(D, block_m)
    sp = split_plan(limits, res, s.B, s.hkv, work, block_m, mean_prefix(s.B * s.L, s.B, work, s.group))
    return block_m, res, sp


def model_shape(sim: Simulator, gpu: Gpu, s: Shape, with_anchor: bool = True) -> dict:
    from spec_kernels.attention.plan import DEVICES, resident_ctas_per_sm

    block_m, res, sp = plan_launch(gpu, s)
    p0, p1 = SIM_PREFIXES
    (w0, cfg), (w1, _) = sim.tree_verify(gpu.arch, s.n, s.group, p0), sim.tree_verify(gpu.arch, s.n, s.group, p1)
    prefix = s.L - s.n
    per_split = prefix / sp.splits
    w = fit_linear(p0, w0, p1, w1, per_split)
    m_blocks = cfg["grid"][0]  # row blocks of one (request, KV head)
    ctas = s.B * s.hkv * m_blocks * sp.splits
    resident = resident_ctas_per_sm(res, DEVICES[gpu.key])
    parts = [predict(gpu, w, ctas, resident, ideal_bytes=s.ideal_bytes(), ideal_flops=s.ideal_flops())]
    if sp.splits > 1:
        m0, m1 = (sim.merge(gpu.arch, s.n, s.group, k) for k in MERGE_SPLITS)
        mw = fit_linear(MERGE_SPLITS[0], m0, MERGE_SPLITS[1], m1, sp.splits)
        parts.append(predict(gpu, mw, s.B * s.n * s.hq, 8, ideal_bytes=0.0))
    total = combine(parts, ideal_bytes=s.ideal_bytes(), gpu=gpu, ideal_flops=s.ideal_flops())
    return dict(shape=s.label, gpu=gpu.key, block_m=block_m, splits=sp.splits, resident=resident, ctas=ctas,
                prediction=total, launches=parts, config=cfg,
                bandwidth=s.ideal_bytes() / total.seconds, ideal_bytes=s.ideal_bytes(),
                sglang=sglang_anchor(sim, gpu, s) if with_anchor else None)


def run(gpus: list[str], quick: bool, anchor: bool = True) -> list[dict]:
    sim = Simulator()
    return [model_shape(sim, GPUS[g], s, anchor) for g in gpus for s in shapes(quick)]


def print_table(rows: list[dict]) -> None:
    lo, hi = CALIBRATION_BAND
    print("modelled (speed-of-light model, not measured); floor = ideal bytes at peak DRAM bandwidth")
    print(f"error band (tools/ptx_harness/calibration.py): on a GPU expect {1 / hi:.2f}x (memory-bound) .. "
          f"{1 / lo:.2f}x (compute-bound) the modelled time")
    print(f"{'gpu':<13} {'shape':<34} {'rows/CTA':>8} {'splits':>6} {'CTAs':>6} {'time':>10} {'GB/s':>7}"
          f" {'floor/t':>7}  bottleneck (unit times)")
    for r in rows:
        p: Prediction = r["prediction"]
        units = ", ".join(f"{u} {fmt_seconds(t)}" for u, t in sorted(p.units.items(), key=lambda kv: -kv[1])[:3])
        print(f"{r['gpu']:<13} {r['shape']:<34} {r['block_m']:>8} {r['splits']:>6} {r['ctas']:>6} "
              f"{fmt_seconds(p.seconds):>10} {r['bandwidth'] / 1e9:>7.0f} {p.of_floor:>7.2f}  {p.bottleneck} ({units})")
    anchors = [r for r in rows if r.get("sglang")]
    if anchors:
        print("\nanchor: SGLang 0.5.23's Triton extend kernel (target verify, n x (L + n) mask), same shapes, sm_120")
        print(f"{'gpu':<13} {'shape':<34} {'CTAs':>6} {'time':>10} {'GB/s':>7} {'floor/t':>7} {'ours x faster':>13}"
              f"  bottleneck (unit times)")
        for r in anchors:
            a: Prediction = r["sglang"]["prediction"]
            units = ", ".join(f"{u} {fmt_seconds(t)}" for u, t in sorted(a.units.items(), key=lambda kv: -kv[1])[:3])
            print(f"{r['gpu']:<13} {r['shape']:<34} {r['sglang']['ctas']:>6} {fmt_seconds(a.seconds):>10} "
                  f"{r['sglang']['bandwidth'] / 1e9:>7.0f} {a.of_floor:>7.2f} "
                  f"{a.seconds / r['prediction'].seconds:>13.2f}  {a.bottleneck} ({units})")
    for key in sorted({r["gpu"] for r in rows}):
        assumed = GPUS[key].assumed
        if assumed:
            print(f"{key}: rates without a public source (assumed): {', '.join(assumed)}")


def _entry(kernel: str, r: dict, seconds: float, extra: dict) -> dict:
    """One pytest-benchmark entry: the modelled seconds as the statistics."""
    return {"name": f"sol::{kernel}[{r['gpu']}-{r['shape']}]", "group": "speed-of-light",
            "params": {"gpu": r["gpu"], "shape": r["shape"]},
            "stats": {"min": seconds, "max": seconds, "mean": seconds, "median": seconds, "rounds": 1, "iterations": 1},
            "extra_info": {"unit": "seconds (modelled, not measured)",
                           "expected_seconds_on_gpu": list(expected_range(seconds)), **extra}}


def to_benchmark_json(rows: list[dict]) -> dict:
    from tools.ptx_harness.report import _commit

    benches = []
    for r in rows:
        p: Prediction = r["prediction"]
        benches.append(_entry("tree_verify_cuda", r, p.seconds, {
            "bottleneck": p.bottleneck, "of_floor": p.of_floor, "units": p.units, "splits": r["splits"],
            "ctas": r["ctas"], "block_m": r["block_m"], "resident": r["resident"], "gbps": r["bandwidth"] / 1e9,
            "bytes": r["ideal_bytes"], "calibration_band": list(CALIBRATION_BAND)}))
        if r.get("sglang"):
            a: Prediction = r["sglang"]["prediction"]
            benches.append(_entry("sglang_triton_extend", r, a.seconds, {
                "bottleneck": a.bottleneck, "of_floor": a.of_floor, "units": a.units, "ctas": r["sglang"]["ctas"],
                "gbps": r["sglang"]["bandwidth"] / 1e9, "ours_faster_by": a.seconds / p.seconds}))
    return {"machine_info": {"node": "speed-of-light model", "note": "modelled from interpreter counters"},
            "commit_info": _commit(), "benchmarks": benches,
            "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": "sol"}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.ptx_harness.speed_of_light", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="h200,rtx-pro-6000", help="comma-separated keys of tools/speed_of_light/gpus.py")
    ap.add_argument("--quick", action="store_true", help="two shapes per GPU (about a minute)")
    ap.add_argument("--json", help="write pytest-benchmark-compatible JSON here")
    ap.add_argument("--no-anchor", action="store_true", help="leave out SGLang's Triton extend kernel")
    args = ap.parse_args(argv)
    gpus = [g.strip() for g in args.gpu.split(",") if g.strip()]
    unknown = [g for g in gpus if g not in GPUS or g == "a100"]
    if unknown:
        ap.error(f"--gpu: unknown or calibration-only {unknown}; choose from h200, rtx-pro-6000")
    rows = run(gpus, args.quick, not args.no_anchor)
    print_table(rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(to_benchmark_json(rows), f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
