"""Per-GPU rates of the speed-of-light model, each with its public source: the one table.

Peak figures only (vendor data, or a microbenchmark's measured ceiling of one instruction): the
model predicts the time at these rates, and calibration.py says how far real kernels on a named
GPU fall short of that. "derived" means arithmetic from the cited inputs; "assumed" means no
public figure was found: those rates are named in every report that depends on them.

The figures of the two target GPUs are those of spec_kernels.attention.plan.DEVICES (the split
planner's), so the planner and the model cannot drift apart; this table adds their sources.

Shared memory (32 banks x 4 bytes: one 128-byte wavefront per clock per SM) and issue (4 warp
schedulers per SM, one warp-instruction per clock each) are the same on sm_80, sm_90 and sm_120
(CUDA C++ Programming Guide, "Compute Capabilities"; the H100 whitepaper's SM diagram).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from spec_kernels.attention.plan import DEVICES  # the figures the split planner uses too: written once


@dataclasses.dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    arch: str  # the PTX target the model's counters come from
    sms: int
    clock_hz: float  # SM clock under load
    dram_peak_bytes_per_s: float
    l2_bytes_per_s: float
    mma_flops_per_clk: Mapping[str, float]  # mma.sync FLOPs per clock per SM, by input dtype
    dram_latency_s: float
    launch_overhead_s: float
    sources: Mapping[str, str]
    dependent_launch_overhead_s: float = 0.5e-6  # a kernel launched as a programmatic dependent
    shared_wavefronts_per_clk: float = 1.0
    issue_per_clk_per_scheduler: float = 1.0
    schedulers: int = 4

    @property
    def dram_bytes_per_s(self) -> float:
        return self.dram_peak_bytes_per_s

    def tensor_flops_per_clk(self, dtype: str) -> float:
        # fp8 caches are converted to bf16/f16 before the mma: the same rate
        rate = self.mma_flops_per_clk.get(dtype) or self.mma_flops_per_clk.get("bf16")
        if not rate:
            raise KeyError(f"{self.key}: no mma.sync rate for {dtype}")
        return rate

    @property
    def assumed(self) -> list[str]:
        return sorted(k for k, v in self.sources.items() if v.startswith("assumed"))


_SHARED = "CUDA C++ Programming Guide, Compute Capabilities: 32 banks of 4 bytes per clock"
_LAT = ("assumed: no public DRAM latency table could be read; ~480 clk global / ~250 clk L2 hit is the "
        "order of magnitude microbenchmark papers report for A100 and H800 (Luo et al., arXiv 2402.13499)")
_LAUNCH = ("assumed: back-to-back kernels in a CUDA graph start about 1-2 us apart; no published "
           "microbenchmark of it was found")
_PDL = ("assumed: a kernel launched as a programmatic dependent is scheduled while the kernel before it "
        "drains; left is the wait for that grid's end and memory flush, taken as a third of a launch; "
        "no published figure was found (scripts/gpu_check.sh measures the merge with and without it)")
_L2 = "assumed: 2x the DRAM peak (no public L2 bandwidth table could be read); the reports name it when it binds"

# Cycles from an instruction's issue until a dependent instruction can read its result, by the
# interpreter's instruction class (ptxsim Stats.warp_instr's keys): the per-warp latency clock
# (Machine(latencies=...)) and the model's "warp latency" unit read it. Global loads, cp.async and
# barriers count 1: memory latency is the "latency" unit's and the pipeline fill's, a barrier's
# wait is the clock alignment itself.
LATENCY_CYCLES = {"other": 4, "sfu": 20, "shfl": 30, "ld.shared": 30, "ldmatrix": 30, "atom": 30, "mma": 32,
                  "ld.global": 1, "st.shared": 1, "st.global": 1, "stmatrix": 1, "cp.async": 1, "branch": 1,
                  "barrier": 1}
_LATENCY = ("assumed: the order of magnitude microbenchmark papers report for Volta to Ampere (dependent "
            "FFMA ~4 cycles, shared-memory loads ~20-30, HMMA m16n8k16 ~30, MUFU ~20); no sm_90 / sm_120 "
            "table could be read; the same for every GPU here")


def _planner(key: str) -> dict:
    """The rates spec_kernels.attention.plan.DEVICES holds for a named GPU."""
    d = DEVICES[key]
    return dict(sms=d.sms, clock_hz=d.clock_hz, dram_peak_bytes_per_s=d.dram_bytes_per_s,
                l2_bytes_per_s=d.l2_bytes_per_s,
                mma_flops_per_clk={"bf16": d.mma_flops_per_clk, "f16": d.mma_flops_per_clk},
                dram_latency_s=d.dram_latency_s, launch_overhead_s=d.launch_overhead_s,
                dependent_launch_overhead_s=d.dependent_launch_overhead_s)


GPUS: dict[str, Gpu] = {
    # H200: mma.sync on Hopper reaches ~63-65% of the wgmma peak of 4096 FLOP/clk/SM (989 TFLOPS
    # at 1.83 GHz x 132 SMs): 0.64 x 4096
    "h200": Gpu(
        "h200", "NVIDIA H200 SXM (sm_90)", "sm_90a", **_planner("h200"),
        sources={
            "sms": "NVIDIA H200 datasheet: the GH100 of the H100 SXM, 132 SMs",
            "clock_hz": "H100 SXM5 max boost 1980 MHz (observed: smallscientist1/cutlass-kernels, "
                        "src/fmha-pipeline/myrun.md); assumed the same for H200 (same die, 700 W)",
            "dram_peak_bytes_per_s": "NVIDIA H200 datasheet: 4.8 TB/s HBM3e",
            "l2_bytes_per_s": _L2,
            "mma_flops_per_clk": "~63-65% of peak for mma.sync on Hopper: Luo et al., arXiv 2501.12084, as "
                                 "cited in waynehacking8/blackwell-tensorcore-kernels results/mma_ablation.md; "
                                 "peak 989 TFLOPS dense BF16 (H100/H200 datasheets) = 4096 FLOP/clk/SM",
            "shared_wavefronts_per_clk": _SHARED,
            "dram_latency_s": _LAT, "launch_overhead_s": _LAUNCH, "dependent_launch_overhead_s": _PDL,
            "latency_cycles": _LATENCY,
        }),
    "rtx-pro-6000": Gpu(
        "rtx-pro-6000", "NVIDIA RTX PRO 6000 Blackwell (sm_120)", "sm_120a", **_planner("rtx-pro-6000"),
        sources={
            "sms": "NVIDIA RTX PRO 6000 Blackwell launch specifications: 24,064 CUDA cores, 188 SMs",
            "clock_hz": "derived: 125 TFLOPS FP32 (launch specifications) / (24,064 cores x 2) = 2.6 GHz",
            "dram_peak_bytes_per_s": "launch specifications: 96 GB GDDR7, 512-bit, 28 Gbps = 1792 GB/s",
            "l2_bytes_per_s": _L2,
            "mma_flops_per_clk": "measured mma.sync m16n8k16 f16 -> f32 1023.8 FLOP/clk/SM on an RTX PRO 6000 "
                                 "(waynehacking8/blackwell-tensorcore-kernels results/mma_rate_probe.csv): "
                                 "FP32 accumulate at full rate",
            "shared_wavefronts_per_clk": _SHARED,
            "dram_latency_s": _LAT, "launch_overhead_s": _LAUNCH, "dependent_launch_overhead_s": _PDL,
            "latency_cycles": _LATENCY,
        }),
    # calibration only (calibration.py): GPUs that published figures were measured on
    "a100": Gpu(
        "a100", "NVIDIA A100 SXM4 (sm_80)", "sm_80", sms=108, clock_hz=1.41e9,
        dram_peak_bytes_per_s=2.039e12, l2_bytes_per_s=4.078e12,
        mma_flops_per_clk={"bf16": 2048.0, "f16": 2048.0},
        dram_latency_s=600e-9, launch_overhead_s=1.5e-6,
        sources={
            "sms": "NVIDIA A100 whitepaper: 108 SMs",
            "clock_hz": "A100-SXM4 boost 1410 MHz, held under load (chipsandcheese.com, 2023-07-02 H100 article)",
            "dram_peak_bytes_per_s": "derived: HBM2e 5120-bit x 1593 MHz x 2 = 2.039 TB/s (A100 80GB SXM4)",
            "l2_bytes_per_s": _L2,
            "mma_flops_per_clk": "derived: 312 TFLOPS dense FP16/BF16 (A100 datasheet) / (108 SMs x 1.41 GHz)",
            "shared_wavefronts_per_clk": _SHARED,
            "dram_latency_s": _LAT, "launch_overhead_s": _LAUNCH, "dependent_launch_overhead_s": _PDL,
            "latency_cycles": _LATENCY,
        }),
}


def gpu(key: str) -> Gpu:
    try:
        return GPUS[key]
    except KeyError:
        raise KeyError(f"unknown GPU {key!r}; known: {', '.join(GPUS)}") from None
