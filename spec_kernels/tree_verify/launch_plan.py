"""Launch sizing shared by the Triton and CUDA attention kernels: rows per request and KV splits.

Both depend only on tensor shapes and the GPU's properties, never on index values, so no call
syncs with the host and every launch can be captured in a CUDA graph.

Rows. A request's query rows are its n_b drafts x the GQA group (MLA: x the heads). The grid is
sized for the largest n_b the shapes allow (:func:`max_rows`): the caller's max_draft_tokens, or
else min(T, 64), because requests may have 0 drafts, so one request can hold all T tokens (and a
mask word covers 64 drafts). That bound is sound for every valid input, but when T tokens are
spread over B requests the rows that hold work are about ceil(T / B) x group per request
(exactly that in a uniform batch, which is what a speculative-decoding server runs); the grid's
other row blocks exit at once. The split planner therefore counts the CTAs that do work
(:func:`expected_rows`), not the grid's upper bound.

KV splits. One CTA streams one split of a request's prefix for one (KV head, row block). All
CTAs of a launch stream about the same number of keys, so the launch takes about
``waves x keys per split`` where ``waves = ceil(ctas x splits / slots)`` and ``slots`` is how
many CTAs the GPU holds at once (SMs x CTAs resident per SM, from the kernel's registers,
threads and shared memory: :func:`resident_ctas_per_sm`). With keys per split = prefix /
splits, the time is proportional to ``waves / splits``, i.e. inversely to the wave efficiency
``ctas x splits / (waves x slots)``. :func:`plan` picks the fewest splits whose efficiency is
within EFFICIENCY_TOLERANCE of the best one reachable, where a split keeps at least
MIN_SPLIT_KEYS prefix keys (the kernels enforce it too: a split's fixed costs, the Q tile, the
partial output and its share of the merge, stay small beside its keys) and there are at most
MAX_KV_SPLITS. Fewer splits among near-equals: less
merge work and fewer fp32 partial outputs.

The prefix length comes from shapes too: kv_indices holds every request's slots, so
kv_indices.numel() / B - n is the mean prefix (a longer buffer only allows more splits, and the
kernels still keep MIN_SPLIT_KEYS per split, so extra splits stay empty and cheap).

    python -m spec_kernels.tree_verify --gpu h200 [--impl triton]   # the plan of the benchmark shapes
    (the same as python -m spec_kernels.tree_verify.launch_plan)
"""
from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from .._ops import sm_count
from .reference import MAX_DRAFT_TOKENS

MAX_KV_SPLITS = 64
MIN_SPLIT_KEYS = 256  # automatic splits stream at least this many prefix keys each
EFFICIENCY_TOLERANCE = 0.03  # take the fewest splits within 3% of the best wave efficiency
TARGET_EFFICIENCY = 0.9  # a plan below it is bounded by MIN_SPLIT_KEYS or MAX_KV_SPLITS, not by the waves


# --------------------------------------------------------------------------- device limits
@dataclass(frozen=True)
class DeviceLimits:
    """What bounds the CTAs resident on one SM (CUDA programming guide, "Compute capabilities")."""

    name: str
    sms: int
    regs_per_sm: int = 65536
    smem_per_sm: int = 228 * 1024  # shared memory an SM can give to its CTAs, bytes
    max_threads_per_sm: int = 2048
    max_ctas_per_sm: int = 32
    smem_reserved_per_cta: int = 1024  # the runtime's own shared memory per CTA (sm_80 and later)
    reg_alloc_unit: int = 256  # registers are allocated per warp in multiples of this
    max_smem_per_cta: int = 227 * 1024  # opt-in limit of one CTA


# Named GPUs, for planning without one (the CLI, tests). sm_90 (H100 / H200): 228 KB of shared
# memory per SM, 227 KB per CTA, 2048 threads. sm_120 (RTX PRO 6000 Blackwell, GeForce RTX 50):
# 100 KB per SM, 99 KB per CTA, 1536 threads (48 warps), 32 CTAs. Both: 64K 32-bit registers.
DEVICES: dict[str, DeviceLimits] = {
    "h200": DeviceLimits("NVIDIA H200 (sm_90)", sms=132),
    "rtx-pro-6000": DeviceLimits("NVIDIA RTX PRO 6000 Blackwell (sm_120)", sms=188, smem_per_sm=100 * 1024,
                                 max_threads_per_sm=1536, max_smem_per_cta=99 * 1024),
}

# Resident CTAs per SM by compute capability, which torch's device properties do not report.
_MAX_CTAS_PER_SM = {(7, 5): 16, (8, 6): 16, (8, 7): 16, (8, 9): 24}


def device_limits(device_index: int) -> DeviceLimits:
    """The limits of a CUDA device: its SM count (sm_count) and torch's device properties; the
    H200's per-SM figures where torch cannot report them."""
    return _device_limits(device_index, sm_count(device_index))


@functools.lru_cache(maxsize=None)
def _device_limits(device_index: int, sms: int) -> DeviceLimits:
    if not torch.cuda.is_available():  # a device stood in for by tools that compile without one
        return DeviceLimits("CUDA device", sms=sms)
    props = torch.cuda.get_device_properties(device_index)
    base = DEVICES["rtx-pro-6000"] if props.major == 12 else DEVICES["h200"]
    return DeviceLimits(
        name=props.name,
        sms=sms,
        regs_per_sm=getattr(props, "regs_per_multiprocessor", 0) or base.regs_per_sm,
        smem_per_sm=getattr(props, "shared_memory_per_multiprocessor", 0) or base.smem_per_sm,
        max_threads_per_sm=getattr(props, "max_threads_per_multi_processor", 0) or base.max_threads_per_sm,
        max_ctas_per_sm=_MAX_CTAS_PER_SM.get((props.major, props.minor), 32),
        max_smem_per_cta=getattr(props, "shared_memory_per_block_optin", 0) or base.max_smem_per_cta,
    )


# --------------------------------------------------------------------------- kernel resources
@dataclass(frozen=True)
class KernelResources:
    """One CTA's needs: threads, registers per thread (ptxas), shared memory in bytes."""

    threads: int
    regs_per_thread: int
    smem_bytes: int


# Registers per thread of the CUDA kernels, from the extension build's ptxas output (setup.py
# passes -Xptxas=-v: "Used N registers" per kernel in the build log of
# `python setup.py build_ext --inplace`, or compile one file:
#   nvcc -O3 -Xptxas=-v --expt-relaxed-constexpr -std=c++20 -Icsrc/include \
#        -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_120a,code=sm_120a \
#        -c csrc/tree_verify/tree_verify_attention.cu -o /tmp/tv.o
# ). The larger of the sm_90a and sm_120a figures (fp16 and bf16 are equal). Shared memory and
# threads are the kernels' own constants (TileConfig / MlaTile); a stale register figure only
# mis-sizes the splits, never breaks a launch.
# Tree verify by (head dim, rows per CTA): 64 rows is the default configuration, 32 the D = 128
# decode one, 128 the D = 128 one for more than 64 rows (TileConfig<D, rows>).
CUDA_TREE_VERIFY_REGS = {(64, 64): 156, (128, 64): 243, (256, 64): 255, (128, 32): 190, (128, 128): 233}
CUDA_MLA_REGS = {16: 252, 32: 235, 64: 255}  # BLOCK_M (mla_block_m) -> registers
_CUDA_THREADS = 128  # kWarps = 4 in both kernels (8 in tree verify's 128-row and MLA's 64-row configurations)


def cuda_tree_verify_resources(head_dim: int, block_m: int = 64) -> KernelResources:
    """csrc/tree_verify/tree_verify_attention.cu (TileConfig<D, block_m>::kSmemBytes): K and V
    stages (three at D = 128, else two) of 64 keys (32 at D = 256 and in the 32-row configuration),
    the Q tile (D > 128; at D <= 128 Q lives in registers, staged in the last K and V stages) and
    the slot ids of 4 tiles. 4 warps; 8 for 128 rows."""
    stage_keys = 32 if block_m == 32 or head_dim >= 256 else 64
    stages = 3 if head_dim == 128 else 2
    q_elems = 0 if head_dim <= 128 else block_m * head_dim
    smem = (q_elems + 2 * stages * stage_keys * head_dim) * 2 + 4 * stage_keys * 8
    threads = 2 * _CUDA_THREADS if block_m == 128 else _CUDA_THREADS
    return KernelResources(threads, CUDA_TREE_VERIFY_REGS.get((head_dim, block_m), 255), smem)


def cuda_tree_verify_block_m(head_dim: int, rows: int, limits: Optional[DeviceLimits] = None) -> int:
    """Rows per CTA of the configuration a CUDA launch of `rows` (max_rows) takes
    (tree_verify_attention.cu launch()): at D = 128, 128 for more than 64 rows (each K/V tile read
    once for up to 128 rows) and 32 for at most 16 rows where two such CTAs fit on an SM and two
    64-row ones do not (sm_120; needs `limits`); else 64. For counting CTAs, 32 and 64 agree
    (<= 16 rows are one CTA either way)."""
    if head_dim != 128:
        return 64
    if rows > 64:
        return 128
    if rows > 16 or limits is None:
        return 64
    per_cta = limits.smem_reserved_per_cta
    large = cuda_tree_verify_resources(128).smem_bytes + per_cta
    small = cuda_tree_verify_resources(128, 32).smem_bytes + per_cta
    return 32 if 2 * large > limits.smem_per_sm and 2 * small <= limits.smem_per_sm else 64


def cuda_tree_verify_kernel(head_dim: int, rows: int) -> Callable[[DeviceLimits], KernelResources]:
    """The resources of the configuration a launch of `rows` (max_rows) takes on a device."""
    return lambda limits: cuda_tree_verify_resources(head_dim, cuda_tree_verify_block_m(head_dim, rows, limits))


def cuda_mla_resources(block_m: int) -> KernelResources:
    """csrc/mla/mla_tree_verify_attention.cu (MlaTile::kSmemBytes): 4 warps (8 at block_m 64), Q
    tile (576 columns; 448 at block_m 64, whose first 128 stay in registers), 3 (block_m 32) or 2
    stages of block_n = 8 x warps x 16 / block_m keys, P (rows padded by 16 bytes), the row maxima,
    the slot ids of 4 tiles."""
    threads = 2 * _CUDA_THREADS if block_m == 64 else _CUDA_THREADS
    block_n = threads * 4 // block_m
    stages = 3 if block_m == 32 else 2
    q_cols = 448 if block_m == 64 else 576
    smem = ((block_m * q_cols + stages * block_n * 576) * 2 + block_m * (block_n * 2 + 16)
            + block_n // 8 * block_m * 4 + 4 * block_n * 8)
    return KernelResources(threads, CUDA_MLA_REGS.get(block_m, 255), smem)


# Triton kernels, from `python tools/triton_compile_report.py --ci --kernels tree_verify,mla`
# (its "smem" and "regs" columns; the larger of sm_90 and sm_120). Tree verify, bf16, D = 128,
# BLOCK_M 32, 4 warps: 188 registers, 44.5 KB; MLA, BLOCK_M 32, 8 warps: 177 registers, 55.1 KB.
# Both shared memory figures are the Q tile plus ONE K and V tile plus a few KB of scratch (the
# compiler keeps the other pipeline stage in registers), which triton_tree_verify_smem models.
# 8-warp tree-verify tiles (BLOCK_M >= 64, head dim 256) are taken at the 255-register ceiling.
# The autotuner may pick another tile than the one planned for; this sizes the common case.
TRITON_TREE_VERIFY_REGS = {4: 188, 8: 255}  # num_warps -> registers
TRITON_MLA_REGS = 177
TRITON_SCRATCH_SMEM = 4608  # bytes beyond the tiles (44.5 KB - 8 KB Q - 32 KB K and V)


def triton_resources(num_warps: int, smem_bytes: int, regs_per_thread: int = 255) -> KernelResources:
    return KernelResources(num_warps * 32, regs_per_thread, smem_bytes)


def triton_tree_verify_resources(block_m: int, block_n: int, num_warps: int, head_dim: int, v_head_dim: int,
                                 elt: int) -> KernelResources:
    smem = (block_m * head_dim + block_n * (head_dim + v_head_dim)) * elt + TRITON_SCRATCH_SMEM
    return triton_resources(num_warps, smem, TRITON_TREE_VERIFY_REGS.get(num_warps, 255))


def triton_mla_resources(block_m: int, head_dim: int, elt: int) -> KernelResources:
    """spec_kernels/mla/triton_kernel.py on a GPU: 8 warps, Q tile + one 16-key latent tile."""
    return triton_resources(8, (block_m + 16) * head_dim * elt + 1024, TRITON_MLA_REGS)


def resident_ctas_per_sm(kernel: KernelResources, limits: DeviceLimits) -> int:
    """CTAs of `kernel` one SM holds at once: the tightest of the thread, register, shared
    memory and CTA limits (the arithmetic of CUDA's occupancy calculator). At least 1: a kernel
    that does not fit fails its launch, the planner does not decide that."""
    warps = -(-kernel.threads // 32)
    by_threads = limits.max_threads_per_sm // (warps * 32)
    regs_per_warp = -(-kernel.regs_per_thread * 32 // limits.reg_alloc_unit) * limits.reg_alloc_unit
    by_regs = (limits.regs_per_sm // regs_per_warp) // warps if regs_per_warp else limits.max_ctas_per_sm
    smem = kernel.smem_bytes + limits.smem_reserved_per_cta
    by_smem = limits.smem_per_sm // smem if kernel.smem_bytes else limits.max_ctas_per_sm
    return max(1, min(by_threads, by_regs, by_smem, limits.max_ctas_per_sm))


# --------------------------------------------------------------------------- rows
def max_rows(num_tokens: int, group: int, decode: bool, max_draft_tokens: int = 0) -> int:
    """Upper bound of a request's query rows (n_b x GQA group): sizes the grid. Without the
    caller's bound on n_b (max_draft_tokens = 0) it is min(T, 64) x group: requests may have no
    drafts, so one of them may hold all T tokens; the kernels compute at most 64 drafts."""
    if decode:
        return group
    return min(num_tokens, max_draft_tokens or MAX_DRAFT_TOKENS) * group


def expected_rows(num_tokens: int, num_requests: int, group: int, decode: bool, max_draft_tokens: int = 0) -> int:
    """Rows that hold work per request when the T tokens are spread evenly over the B requests
    (a uniform batch: exact; a mixed one: the mean), never more than :func:`max_rows`. Plans the
    splits; the grid stays sized by max_rows."""
    bound = max_rows(num_tokens, group, decode, max_draft_tokens)
    if decode or num_requests <= 0:
        return bound
    return max(group, min(bound, -(-num_tokens // num_requests) * group))


# --------------------------------------------------------------------------- the planner
@dataclass(frozen=True)
class SplitPlan:
    ctas: int  # CTAs with work, per split
    slots: int  # CTAs resident on the whole GPU at once
    per_sm: int  # of which per SM
    splits: int
    max_splits: int  # the bound from MIN_SPLIT_KEYS and MAX_KV_SPLITS
    waves: int
    efficiency: float  # ctas x splits / (waves x slots)
    limit: str  # what bounded the choice: "waves" (the best efficiency), "keys" or "cap"


def _efficiency(ctas: int, splits: int, slots: int) -> tuple[int, float]:
    total = ctas * splits
    waves = -(-total // slots)
    return waves, total / (waves * slots)


@functools.lru_cache(maxsize=4096)
def plan(ctas: int, slots: int, per_sm: int, prefix_keys: Optional[int]) -> SplitPlan:
    """Split count for `ctas` working CTAs per split on `slots` resident slots, with a mean
    prefix of `prefix_keys` keys per request (None: unknown, only the cap bounds the splits)."""
    by_keys = MAX_KV_SPLITS if prefix_keys is None else max(1, prefix_keys // MIN_SPLIT_KEYS)
    max_splits = max(1, min(MAX_KV_SPLITS, by_keys))
    if ctas <= 0:
        return SplitPlan(0, slots, per_sm, 1, max_splits, 0, 0.0, "waves")
    effs = [_efficiency(ctas, s, slots) for s in range(1, max_splits + 1)]
    best = max(e for _, e in effs)
    splits = next(s for s, (_, e) in enumerate(effs, start=1) if e >= best * (1 - EFFICIENCY_TOLERANCE))
    waves, eff = effs[splits - 1]
    # What bounded it: "waves" when it fills the GPU to TARGET_EFFICIENCY; below that, more
    # splits would always do better (with enough of them the waves fill up), so the bound on the
    # split count stopped it: "keys" (too few prefix keys for more splits of MIN_SPLIT_KEYS) or
    # "cap" (MAX_KV_SPLITS).
    limit = "waves" if eff >= TARGET_EFFICIENCY else "keys" if by_keys < MAX_KV_SPLITS else "cap"
    return SplitPlan(ctas, slots, per_sm, splits, max_splits, waves, eff, limit)


def split_plan(limits: DeviceLimits, kernel: KernelResources, num_requests: int, num_kv_heads: int, rows: int,
               block_m: int, prefix_keys: Optional[int]) -> SplitPlan:
    per_sm = resident_ctas_per_sm(kernel, limits)
    ctas = num_requests * num_kv_heads * -(-rows // block_m)
    return plan(ctas, per_sm * limits.sms, per_sm, prefix_keys)


def mean_prefix(kv_tokens: Optional[int], num_requests: int, rows_per_request: int, group: int) -> Optional[int]:
    """Mean prefix keys per request from kv_indices.numel() (a shape): the slots less the drafts."""
    if kv_tokens is None or num_requests <= 0:
        return None
    return max(0, kv_tokens // num_requests - rows_per_request // max(group, 1))


def num_kv_splits(device: torch.device, num_requests: int, num_kv_heads: int, rows: int, block_m: int,
                  kernel: Union[KernelResources, Callable[[DeviceLimits], KernelResources], None] = None,
                  prefix_keys: Optional[int] = None) -> int:
    """KV splits per request for a launch of num_requests x num_kv_heads x ceil(rows / block_m)
    working CTAs per split (rows: :func:`expected_rows`) of `kernel` (its resources, or a function
    of the device limits giving them; None: one CTA per SM) with a mean prefix of `prefix_keys`
    keys (:func:`mean_prefix`; None: unknown). 1 on CPU. Shapes and device properties only."""
    if device.type != "cuda" or num_requests == 0:
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    limits = device_limits(index)
    if callable(kernel):
        kernel = kernel(limits)
    kernel = kernel or KernelResources(limits.max_threads_per_sm, 0, 0)
    return split_plan(limits, kernel, num_requests, num_kv_heads, rows, block_m, prefix_keys).splits


# --------------------------------------------------------------------------- the CLI
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


def _triton_tile(shape: Shape, limits: DeviceLimits) -> tuple[int, KernelResources]:
    """BLOCK_M and resources of the Triton launch (bf16), as its launcher plans them."""
    rows = max_rows(shape.B * shape.n, shape.heads // shape.kv_heads, shape.n == 1, shape.n)
    if shape.mla:
        from ..mla import triton_kernel as mla

        block_m = mla.default_block_m(rows)
        return block_m, triton_mla_resources(block_m, shape.head_dim, 2)
    from . import triton_kernel as tv

    block_m = tv._default_block_m(rows, shape.head_dim)
    return block_m, tv._plan_resources(block_m, shape.head_dim, shape.head_dim, 2, False)


def plan_shape(shape: Shape, limits: DeviceLimits, impl: str = "cuda") -> tuple[int, SplitPlan]:
    """(BLOCK_M, plan) of one benchmark shape, as the launcher would plan it on `limits`."""
    group = shape.heads // shape.kv_heads
    decode = shape.n == 1
    T = shape.B * shape.n
    grid_rows = max_rows(T, group, decode, shape.n)
    rows = expected_rows(T, shape.B, group, decode, shape.n)
    if impl == "cuda":
        if shape.mla:
            from ..mla.cuda import block_m as mla_block_m

            block_m = mla_block_m(grid_rows)
            kernel = cuda_mla_resources(block_m)
        else:
            block_m = cuda_tree_verify_block_m(shape.head_dim, grid_rows, limits)
            kernel = cuda_tree_verify_resources(shape.head_dim, block_m)
    else:
        block_m, kernel = _triton_tile(shape, limits)
    prefix = mean_prefix(shape.B * (shape.L + shape.n), shape.B, rows, group)  # kv_indices: L + n slots each
    return block_m, split_plan(limits, kernel, shape.B, shape.kv_heads, rows, block_m, prefix)


def format_table(shapes: Sequence[Shape], limits: DeviceLimits, impl: str) -> str:
    lines = [f"{limits.name}: {limits.sms} SMs; {impl} kernels; MIN_SPLIT_KEYS={MIN_SPLIT_KEYS}, "
             f"MAX_KV_SPLITS={MAX_KV_SPLITS}",
             f"{'model':<18} {'B':>4} {'n':>3} {'heads':>6} {'D':>4} {'L':>6} {'BM':>4} {'CTAs':>5} "
             f"{'/SM':>4} {'slots':>5} {'splits':>6} {'waves':>5} {'eff':>5}  bound"]
    for s in shapes:
        block_m, p = plan_shape(s, limits, impl)
        lines.append(f"{s.model:<18} {s.B:>4} {s.n:>3} {f'{s.heads}/{s.kv_heads}':>6} {s.head_dim:>4} {s.L:>6} "
                     f"{block_m:>4} {p.ctas:>5} {p.per_sm:>4} {p.slots:>5} {p.splits:>6} {p.waves:>5} "
                     f"{p.efficiency:>5.2f}  {p.limit}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m spec_kernels.tree_verify.launch_plan") -> int:
    ap = argparse.ArgumentParser(prog=prog,
                                 description="KV-split plan of the decode-step benchmark shapes on a named GPU.")
    ap.add_argument("--gpu", choices=sorted(DEVICES), default="h200")
    ap.add_argument("--impl", choices=("cuda", "triton"), default="cuda")
    ap.add_argument("--grid", choices=("decode-step", "tree-verify"), default="decode-step",
                    help="the decode-step benchmark's models (default) or the tree-verify kernel benchmark's grid")
    ap.add_argument("--model", default="", help="only the shapes of this model preset")
    opts = ap.parse_args(argv)
    shapes = [s for s in benchmark_shapes(opts.grid) if not opts.model or s.model == opts.model]
    print(format_table(shapes, DEVICES[opts.gpu], opts.impl))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
