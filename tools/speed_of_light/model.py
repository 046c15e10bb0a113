"""Predicted time of one kernel launch from its per-CTA work: the slowest unit, per wave.

A launch is `ctas` CTAs of identical work (`Work`, per CTA: what the interpreter counted for one
CTA, scaled to the real shape), `resident` of which fit on one SM at once. The busiest SM runs
k = ceil(ctas / SMs) of them. Each unit of that SM (the four schedulers' issue, shared memory,
the tensor cores) needs k x (its per-CTA work) / (its rate); the memory system needs the launch's
DRAM and L2 bytes over their bandwidths; and a memory stream of one CTA runs no faster than its
bytes in flight per DRAM latency (Little's law, which is what leaves a GPU with few CTAs short of
bandwidth; it is modelled where the kernel's in-flight bytes are known, its cp.async stages). The
slowest of these is the bottleneck (with the interpreter's per-warp latency clock, also the "warp
latency" unit: the busiest warp's dependent-latency critical path, once per round of the CTAs an
SM holds together, whose warps share its schedulers and hide each other's waits); the launch adds one pipeline fill (its chain of dependent
global loads, each a DRAM latency: later waves overlap the earlier ones' tails) and the launch
overhead (less for a programmatic dependent, whose launch overlaps the kernel before it).

The roofline floor of the same launch is its ideal bytes at peak DRAM bandwidth or its useful
FLOPs at the tensor peak, whichever is longer; `Prediction.of_floor` is floor / predicted.
Nothing here is measured: the rates are the table in gpus.py.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional

from .gpus import Gpu

# predicted / published time over the calibration cases (tools/ptx_harness/calibration.py, its
# last run in benchmarks/results/model/calibration.json; tests/ptx/test_sol_report.py holds the two
# in step): a kernel the model predicts at t runs in about t / 0.86 (memory-bound, the streaming
# kernels) to t / 0.57 (compute-bound, the fused-attention tutorial) on the GPU.
CALIBRATION_BAND = (0.57, 0.86)

MMA_FLOPS = {"m16n8k16": 2 * 16 * 8 * 16, "m16n8k8": 2 * 16 * 8 * 8, "m16n8k32": 2 * 16 * 8 * 32}


def mma_flops(forms: Mapping[str, float]) -> dict[str, float]:
    """FLOPs per input dtype from a count of mma forms (`mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`)."""
    out: dict[str, float] = {}
    for form, n in forms.items():
        parts = form.split(".")
        shape = next(p for p in parts if p.startswith("m16"))
        dtype = parts[-2]  # the B operand's type (A's is the one before it)
        out[dtype] = out.get(dtype, 0.0) + n * MMA_FLOPS[shape]
    return out


@dataclasses.dataclass(frozen=True)
class Work:
    """One CTA's work, in the interpreter's units."""

    issue: float  # warp-instructions of the busiest warp scheduler
    shared_wavefronts: float  # 128-byte shared-memory wavefronts (ldmatrix, ld/st.shared, cp.async writes)
    tensor_flops: Mapping[str, float]  # mma FLOPs by input dtype
    l2_bytes: float  # bytes requested from L2 (32-byte sectors, per warp-instruction)
    dram_bytes: float  # distinct bytes read and written (32-byte sectors)
    in_flight_bytes: float  # most bytes one CTA has in flight (cp.async stages)
    load_chain: int  # dependent global loads before the first tile can start
    warp_cycles: float = 0.0  # the busiest warp's dependent-latency critical path (0: not counted)
    warp_cycles_in_order: float = 0.0  # the same, issuing in PTX order (no reordering)

    def scaled(self, k: float) -> "Work":
        return Work(self.issue * k, self.shared_wavefronts * k, {d: f * k for d, f in self.tensor_flops.items()},
                    self.l2_bytes * k, self.dram_bytes * k, self.in_flight_bytes, self.load_chain,
                    self.warp_cycles * k, self.warp_cycles_in_order * k)


@dataclasses.dataclass(frozen=True)
class Prediction:
    gpu: str
    seconds: float
    bottleneck: str
    units: dict  # unit -> seconds it needs (the bottleneck's is the largest)
    floor_seconds: float
    floor_unit: str
    waves: int
    ctas: int
    resident: int
    # the time with the warps' latency clock in PTX order (no reordering by the compiler): the
    # other end of the range the "warp latency" unit (a perfect schedule) opens
    seconds_in_order: float = 0.0

    @property
    def of_floor(self) -> float:
        """Floor / predicted: 1.0 is the roofline."""
        return self.floor_seconds / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["of_floor"] = self.of_floor
        return d


def predict(gpu: Gpu, work: Work, ctas: int, resident: int, *, ideal_bytes: float, ideal_flops: float = 0.0,
            flops_dtype: str = "bf16", launches: int = 1, launch_dram_bytes: Optional[float] = None,
            dependent: bool = False) -> Prediction:
    """Predicted time of `ctas` CTAs of `work` each, `resident` per SM, on `gpu`; the floor from
    `ideal_bytes` (what the op must move once) and `ideal_flops` (its useful tensor FLOPs).
    launch_dram_bytes: the launch's distinct DRAM bytes where its CTAs read the same inputs (their
    L2 hits); by default every CTA's distinct bytes are its own (ctas x work.dram_bytes).
    dependent: the launch is a programmatic dependent of the one before (its fixed cost is
    gpu.dependent_launch_overhead_s, not a launch's)."""
    if ctas < 1 or resident < 1:
        raise ValueError(f"ctas ({ctas}) and resident ({resident}) must be >= 1")
    clk = gpu.clock_hz
    per_sm = math.ceil(ctas / gpu.sms)  # CTAs the busiest SM runs
    waves = math.ceil(ctas / (gpu.sms * resident))
    concurrent = min(resident, per_sm)  # CTAs of one SM in flight together
    units = {
        "issue": per_sm * work.issue / gpu.issue_per_clk_per_scheduler / clk,
        "shared memory": per_sm * work.shared_wavefronts / gpu.shared_wavefronts_per_clk / clk,
        "tensor": sum(per_sm * f / gpu.tensor_flops_per_clk(d) for d, f in work.tensor_flops.items()) / clk,
        "L2": ctas * work.l2_bytes / gpu.l2_bytes_per_s,
        "DRAM": (ctas * work.dram_bytes if launch_dram_bytes is None else launch_dram_bytes) / gpu.dram_bytes_per_s,
    }
    rounds = math.ceil(per_sm / concurrent)  # the CTAs that share the SM's schedulers hide each other's waits
    if work.warp_cycles > 0:
        units["warp latency"] = rounds * work.warp_cycles / clk
    if work.in_flight_bytes > 0:
        per_cta_rate = work.in_flight_bytes / gpu.dram_latency_s
        share = 1.0 if launch_dram_bytes is None else min(1.0, launch_dram_bytes / max(ctas * work.dram_bytes, 1.0))
        units["latency"] = per_sm * work.dram_bytes * share / (concurrent * per_cta_rate)
    bottleneck = max(units, key=units.get)
    fill = work.load_chain * gpu.dram_latency_s  # the first tile's dependent loads; later waves overlap
    overhead = launches * (gpu.dependent_launch_overhead_s if dependent else gpu.launch_overhead_s)
    seconds = units[bottleneck] + fill + overhead
    in_order = max(units[bottleneck], rounds * work.warp_cycles_in_order / clk) + fill + overhead
    floor = {"DRAM": ideal_bytes / gpu.dram_peak_bytes_per_s,
             "tensor": ideal_flops / (gpu.tensor_flops_per_clk(flops_dtype) * gpu.sms * clk) if ideal_flops else 0.0}
    floor_unit = max(floor, key=floor.get)
    return Prediction(gpu.key, seconds, bottleneck, units, floor[floor_unit], floor_unit, waves, ctas, resident,
                      in_order)


def combine(parts: list[Prediction], *, ideal_bytes: float, gpu: Gpu, ideal_flops: float = 0.0,
            flops_dtype: str = "bf16") -> Prediction:
    """Launches run one after another (a kernel and its merge): times add; the bottleneck is the
    longest launch's; one floor for the whole op."""
    if not parts:
        raise ValueError("no launches")
    seconds = sum(p.seconds for p in parts)
    longest = max(parts, key=lambda p: p.seconds)
    floor = {"DRAM": ideal_bytes / gpu.dram_peak_bytes_per_s,
             "tensor": ideal_flops / (gpu.tensor_flops_per_clk(flops_dtype) * gpu.sms * gpu.clock_hz) if ideal_flops
             else 0.0}
    floor_unit = max(floor, key=floor.get)
    units: dict[str, float] = {}
    for p in parts:
        for u, s in p.units.items():
            units[u] = units.get(u, 0.0) + s
    return Prediction(gpu.key, seconds, longest.bottleneck, units, floor[floor_unit], floor_unit,
                      sum(p.waves for p in parts), longest.ctas, longest.resident,
                      sum(p.seconds_in_order or p.seconds for p in parts))


def distinct_bytes(stats: Mapping) -> float:
    """The distinct bytes a launch read and wrote (32-byte sectors per buffer, the interpreter's
    unique_bytes_*_by_buffer): its DRAM traffic if nothing is evicted."""
    return float(sum(stats.get("unique_bytes_read_by_buffer", {}).values()) +
                 sum(stats.get("unique_bytes_written_by_buffer", {}).values()))


def work_from_stats(stats: Mapping, ctas: int, schedulers: int = 4) -> Work:
    """Per-CTA work from a ptxsim `Stats.as_dict()` of a launch of `ctas` identical CTAs."""
    shared = sum(stats.get("shared_wavefronts", {}).values())
    dram = distinct_bytes(stats)
    return Work(issue=stats["issue_per_scheduler_max"], shared_wavefronts=shared / ctas,
                tensor_flops={d: f / ctas for d, f in mma_flops(stats.get("mma", {})).items()},
                l2_bytes=stats["l2_sector_requests"] * 32 / ctas, dram_bytes=dram / ctas,
                in_flight_bytes=stats.get("cp_async_bytes_in_flight_max", 0),
                load_chain=stats.get("longest_dependent_global_load_chain", 0),
                warp_cycles=stats.get("warp_latency_cycles_max", 0),
                warp_cycles_in_order=stats.get("warp_latency_cycles_in_order_max", 0))


def fit_linear(x0: float, w0: Work, x1: float, w1: Work, x: float) -> Work:
    """The work at x from two measured points (the counters are linear in the tiles a CTA runs)."""
    if x1 == x0:
        raise ValueError("two distinct points are needed")
    t = (x - x0) / (x1 - x0)

    def lerp(a, b):
        return max(0.0, a + (b - a) * t)

    dtypes = set(w0.tensor_flops) | set(w1.tensor_flops)
    return Work(lerp(w0.issue, w1.issue), lerp(w0.shared_wavefronts, w1.shared_wavefronts),
                {d: lerp(w0.tensor_flops.get(d, 0.0), w1.tensor_flops.get(d, 0.0)) for d in dtypes},
                lerp(w0.l2_bytes, w1.l2_bytes), lerp(w0.dram_bytes, w1.dram_bytes),
                max(w0.in_flight_bytes, w1.in_flight_bytes), max(w0.load_chain, w1.load_chain),
                lerp(w0.warp_cycles, w1.warp_cycles), lerp(w0.warp_cycles_in_order, w1.warp_cycles_in_order))


def expected_range(seconds: float) -> tuple[float, float]:
    """The time a GPU is expected to take for a predicted `seconds`, from CALIBRATION_BAND."""
    lo, hi = CALIBRATION_BAND
    return seconds / hi, seconds / lo


def fmt_seconds(s: Optional[float]) -> str:
    if s is None:
        return "-"
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"
