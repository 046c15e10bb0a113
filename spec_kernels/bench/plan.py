"""python -m spec_kernels.bench plan: the KV-split plan (spec_kernels.attention.plan) of the
benchmarks' shapes on a named GPU, as the CUDA or Triton launchers of both attention families
would plan them.

    python -m spec_kernels.bench plan --gpu h200|rtx-pro-6000 [--impl triton] [--grid tree-verify]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..attention.plan import (
    DEVICES,
    MAX_KV_SPLITS,
    MIN_SPLIT_KEYS,
    DeviceLimits,
    KernelResources,
    SplitCost,
    SplitPlan,
    SplitTraffic,
    expected_rows,
    max_rows,
    mean_prefix,
    plan,
    split_cost,
    split_plan,
)
from ..mla import cuda as mla_cuda
from ..mla import triton_kernel as mla_triton
from ..tree_verify import cuda as tv_cuda
from ..tree_verify import triton_kernel as tv_triton


@dataclass(frozen=True)
class Shape:
    model: str
    B: int
    heads: int  # Hq (MLA: heads)
    kv_heads: int  # Hkv (MLA: 1)
    head_dim: int
    L: int  # prefix keys per request
    n: int  # draft tokens per request (1: plain decode)
    mla: bool = False


def benchmark_shapes(grid: str = "decode-step") -> list[Shape]:
    """The benchmarks' GPU grids (preset `gpu`). "decode-step" (benchmarks/decode_step_models.py):
    per-rank attention of its models at every B and n (n = 1: plain decode), L = 2048.
    "tree-verify" (benchmarks/test_tree_verify.py, benchmarks/_timing.py): GQA 32/4 and 32/8,
    D = 128, B in 1..64, L in 1024..32768, n in 1..64."""
    if grid == "tree-verify":
        return [Shape(f"gqa-{hq}/{hkv}", B, hq, hkv, 128, L, n)
                for hq, hkv in ((32, 4), (32, 8)) for n in (1, 16, 32, 64)
                for L in (1024, 4096, 16384, 32768) for B in (1, 8, 32, 64)]
    if grid != "decode-step":
        raise ValueError(f"grid must be 'decode-step' or 'tree-verify', got {grid!r}")
    models = [("llama-3.1-8b-tp1", 32, 8, 128, False), ("llama-3.3-70b-tp8", 8, 1, 128, False),
              ("deepseek-v3-tp8", 16, 1, 576, True), ("kimi-k2.5-tp8", 8, 1, 576, True)]
    return [Shape(m, B, hq, hkv, d, 2048, n, mla)
            for m, hq, hkv, d, mla in models
            for n in (1, 4, 8, 16, 32)
            for B in (1, 2, 5, 10, 30, 70, 100, 250)]


def _block_m(shape: Shape, limits: DeviceLimits, impl: str) -> int:
    """Rows per CTA of the launch (bf16), as its launcher picks them."""
    grid_rows = max_rows(shape.B * shape.n, shape.heads // shape.kv_heads, shape.n == 1, shape.n)
    if impl == "cuda":
        return (mla_cuda.block_m(grid_rows) if shape.mla
                else tv_cuda.cuda_tree_verify_block_m(shape.head_dim, grid_rows, limits))
    return (mla_triton.default_block_m(grid_rows) if shape.mla
            else tv_triton.default_block_m(grid_rows, shape.head_dim))


def launch_resources(shape: Shape, limits: DeviceLimits, impl: str, block_m: int) -> tuple[KernelResources, SplitTraffic]:
    """One CTA's resources and the split traffic of the launch (bf16), as its launcher plans them."""
    if impl == "cuda":
        if shape.mla:
            return mla_cuda.cuda_mla_resources(block_m, limits=limits), mla_cuda.split_traffic()
        return (tv_cuda.cuda_tree_verify_resources(shape.head_dim, block_m, limits=limits),
                tv_cuda.split_traffic(shape.head_dim))
    if shape.mla:
        return (mla_triton.triton_mla_resources(block_m, shape.head_dim, 2),
                mla_triton.split_traffic(shape.head_dim, mla_cuda.V_HEAD_DIM, 2))
    return (tv_triton.planned_resources(block_m, shape.head_dim, shape.head_dim, 2, False),
            tv_triton.split_traffic(shape.head_dim, shape.head_dim, 2))


@dataclass(frozen=True)
class LaunchPlan:
    """One benchmark shape's launch as its launcher plans it: rows per CTA, one CTA's resources,
    the split traffic and cost model, the mean prefix and the split plan."""

    block_m: int
    kernel: KernelResources
    traffic: SplitTraffic
    cost: SplitCost
    prefix: int
    plan: SplitPlan

    def seconds_at(self, splits: int) -> float:
        """The cost model's time of this launch at `splits` (planned or forced)."""
        return self.cost.seconds(self.plan.ctas, self.plan.per_sm, splits, self.prefix)

    def wave_rule(self) -> SplitPlan:
        """The plan without the bytes (wave efficiency alone), for comparison."""
        p = self.plan
        return plan(p.ctas, p.slots, p.per_sm, self.prefix)


def launch_plan(shape: Shape, limits: DeviceLimits, impl: str = "cuda") -> LaunchPlan:
    """The launch of one benchmark shape, as the launcher would plan it on `limits`."""
    group = shape.heads // shape.kv_heads
    rows = expected_rows(shape.B * shape.n, shape.B, group, shape.n == 1, shape.n)
    block_m = _block_m(shape, limits, impl)
    kernel, traffic = launch_resources(shape, limits, impl, block_m)
    prefix = mean_prefix(shape.B * (shape.L + shape.n), shape.B, rows, group)  # kv_indices: L + n slots each
    return LaunchPlan(block_m, kernel, traffic, split_cost(limits, kernel, traffic, rows, block_m), prefix,
                      split_plan(limits, kernel, shape.B, shape.kv_heads, rows, block_m, prefix, traffic))


def plan_shape(shape: Shape, limits: DeviceLimits, impl: str = "cuda") -> tuple[int, SplitPlan]:
    """(BLOCK_M, plan) of one benchmark shape, as the launcher would plan it on `limits`."""
    lp = launch_plan(shape, limits, impl)
    return lp.block_m, lp.plan


def format_table(shapes: Sequence[Shape], limits: DeviceLimits, impl: str) -> str:
    lines = [f"{limits.name}: {limits.sms} SMs; {impl} kernels; MIN_SPLIT_KEYS={MIN_SPLIT_KEYS}, "
             f"MAX_KV_SPLITS={MAX_KV_SPLITS}",
             f"{'model':<18} {'B':>4} {'n':>3} {'heads':>6} {'D':>4} {'L':>6} {'BM':>4} {'CTAs':>5} "
             f"{'/SM':>4} {'slots':>5} {'splits':>6} {'waves':>5} {'eff':>5} {'model':>9} {'partial':>7}  bound"]
    for s in shapes:
        block_m, p = plan_shape(s, limits, impl)
        lines.append(f"{s.model:<18} {s.B:>4} {s.n:>3} {f'{s.heads}/{s.kv_heads}':>6} {s.head_dim:>4} {s.L:>6} "
                     f"{block_m:>4} {p.ctas:>5} {p.per_sm:>4} {p.slots:>5} {p.splits:>6} {p.waves:>5} "
                     f"{p.efficiency:>5.2f} {p.seconds * 1e6:>7.1f}us {p.partial_fraction:>7.2f}  {p.limit}")
    return "\n".join(lines)


def add_parser(commands) -> None:
    ap = commands.add_parser("plan", help="the KV-split plan of the benchmark shapes on a named GPU",
                             description="KV-split plan of the benchmark shapes on a named GPU: rows per CTA, "
                                         "CTAs, resident CTAs per SM, splits, waves, wave efficiency, the planner's "
                                         "modelled cost (not a measurement), partial bytes over K/V bytes, and what "
                                         "bounded the split count.")
    ap.add_argument("--gpu", choices=sorted(DEVICES), default="h200")
    ap.add_argument("--impl", choices=("cuda", "triton"), default="cuda")
    ap.add_argument("--grid", choices=("decode-step", "tree-verify"), default="decode-step",
                    help="the decode-step benchmark's models (default) or the tree-verify kernel benchmark's grid")
    ap.add_argument("--model", default="", help="only the shapes of this model preset")
    ap.set_defaults(run=run)


def run(opts) -> int:
    shapes = [s for s in benchmark_shapes(opts.grid) if not opts.model or s.model == opts.model]
    print(format_table(shapes, DEVICES[opts.gpu], opts.impl))
    return 0
