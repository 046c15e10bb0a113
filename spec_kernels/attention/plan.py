"""Launch sizing shared by the attention kernels (tree verify and MLA, Triton and CUDA): device
limits, resident CTAs, rows per request and KV splits. Shapes only: each kernel's own resource
model (threads, registers, shared memory of one CTA) lives next to that kernel.

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

KV splits. One CTA streams one split of a request's prefix for one (KV head, row block). A split
count s costs, in seconds (:class:`SplitCost`, the speed-of-light report's model reduced to the
terms the split count moves):

* the stream: max(DRAM, L2, latency, compute). DRAM: the K/V bytes of every (request, KV head)
  once (its row blocks' CTAs run side by side and read the same rows: one DRAM read, the rest L2
  hits) plus, with s > 1, every CTA's fp32 partial output, at the GPU's DRAM bandwidth. L2: every
  CTA's K/V bytes and partials at the (assumed) L2 bandwidth. Latency: the busiest SM runs
  k = ceil(ctas x s / SMs) CTAs, min(k, resident per SM) at a time, and one CTA streams no faster
  than its bytes in flight (its shared-memory stages) per DRAM latency (Little's law). Compute:
  those k CTAs' mma FLOPs at the SM's mma.sync peak, or their instructions on one warp scheduler
  (ISSUE_PER_KEY ...), whichever is longer. The first term is what more splits cannot beat; the
  other two are what they fix where the GPU has few CTAs;
* with s > 1, the merge: the partials read back and the output written, at DRAM bandwidth, and
  one more launch.

:func:`plan` takes the fewest splits whose cost is within COST_TOLERANCE of the cheapest, where a
split keeps at least MIN_SPLIT_KEYS prefix keys (the kernels enforce it too) and there are at
most MAX_KV_SPLITS. So a 128-row CTA, whose partial output (64 KB) is half the K/V bytes of a
256-key split, is split only where the GPU would otherwise wait on latency, and a batch that
already streams at full bandwidth is not split at all. Without the bytes (``cost=None``) the
planner falls back to wave efficiency alone, ``ctas x s / (waves x slots)`` with
``waves = ceil(ctas x s / slots)``, the fewest splits within EFFICIENCY_TOLERANCE of the best.

The prefix length comes from shapes too: kv_indices holds every request's slots, so
kv_indices.numel() / B - n is the mean prefix (a longer buffer only allows more splits, and the
kernels still keep MIN_SPLIT_KEYS per split, so extra splits stay empty and cheap).

    python -m spec_kernels.bench plan --gpu h200 [--impl triton]   # the plan of the benchmark shapes
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from .._limits import MAX_DRAFT_TOKENS
from .._ops import sm_count

MAX_KV_SPLITS = 64
MIN_SPLIT_KEYS = 64  # automatic splits stream at least this many prefix keys each (the cost decides above it)
EFFICIENCY_TOLERANCE = 0.03  # without the bytes: the fewest splits within 3% of the best wave efficiency
TARGET_EFFICIENCY = 0.9  # such a plan below it is bounded by MIN_SPLIT_KEYS or MAX_KV_SPLITS, not by the waves
COST_TOLERANCE = 0.03  # with the bytes: the fewest splits within 3% of the cheapest
PARTIAL_BYTES_PER_ROW_EXTRA = 4  # a split's fp32 log-sum-exp beside its fp32 output row
MMA_ROWS = 16  # the rows of one mma tile (m16n8k16): a CTA's tensor work is per 16 query rows
# A CTA's instructions on its busiest warp scheduler, per 128 + 128 K/V columns: per key
# ISSUE_PER_KEY + ISSUE_PER_KEY_ROW x its rows, and once ISSUE_PER_CTA_ROW x its tile's rows (at
# least 64: Q, the softmax state, the epilogue). Fitted to the PTX interpreter's counts of the
# CUDA tree-verify configurations on sm_90 and sm_120 (tests/ptx/test_sol_report.py holds them to
# it); the Triton and MLA kernels are assumed alike per K/V column.
ISSUE_PER_KEY = 13.0
ISSUE_PER_KEY_ROW = 0.15
ISSUE_PER_CTA_ROW = 35.0


def issue_per_cta(rows: int, keys: float, columns: int = 256) -> float:
    """Modelled busiest-scheduler instructions of one attention CTA with `rows` working rows over
    `keys` keys of `columns` K + V columns (the constants above)."""
    scale = columns / 256
    return scale * (ISSUE_PER_CTA_ROW * max(rows, 64) + keys * (ISSUE_PER_KEY + ISSUE_PER_KEY_ROW * rows))


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
    # what the split cost needs (SplitCost); the speed-of-light model reads the same figures
    dram_bytes_per_s: float = 4.8e12  # peak DRAM bandwidth
    dram_latency_s: float = 600e-9  # a load's round trip to DRAM (assumed: no public table)
    launch_overhead_s: float = 1.5e-6  # one more kernel in a CUDA graph (assumed: no published figure)
    # one more kernel launched as a programmatic dependent of the one before (its launch overlaps
    # that kernel's last CTAs; what is left is the wait for that grid's end): assumed, no published figure
    dependent_launch_overhead_s: float = 0.5e-6
    clock_hz: float = 1.98e9  # SM clock under load
    mma_flops_per_clk: float = 0.64 * 4096  # mma.sync 16-bit -> fp32 peak of one SM per clock
    l2_over_dram: float = 2.0  # L2 bandwidth / DRAM bandwidth (assumed: no public figure)

    @property
    def l2_bytes_per_s(self) -> float:
        return self.l2_over_dram * self.dram_bytes_per_s

    @property
    def tensor_flops_per_s_per_sm(self) -> float:
        return self.mma_flops_per_clk * self.clock_hz


# Named GPUs, for planning without one (the CLI, tests). sm_90 (H100 / H200): 228 KB of shared
# memory per SM, 227 KB per CTA, 2048 threads. sm_120 (RTX PRO 6000 Blackwell, GeForce RTX 50):
# 100 KB per SM, 99 KB per CTA, 1536 threads (48 warps), 32 CTAs. Both: 64K 32-bit registers.
# DRAM and mma.sync rates: H200 4.8 TB/s HBM3e and 0.64 x 4096 FLOP/clk at 1.98 GHz, RTX PRO 6000
# 1.792 TB/s GDDR7 and 1024 FLOP/clk at 2.6 GHz (tools/speed_of_light/gpus.py reads them from here
# and cites their sources). A GPU torch reports gets the figures of its architecture's named one:
# only the balance of bytes against latency, compute and launches depends on them.
DEVICES: dict[str, DeviceLimits] = {
    "h200": DeviceLimits("NVIDIA H200 (sm_90)", sms=132),
    "rtx-pro-6000": DeviceLimits("NVIDIA RTX PRO 6000 Blackwell (sm_120)", sms=188, smem_per_sm=100 * 1024,
                                 max_threads_per_sm=1536, max_smem_per_cta=99 * 1024, dram_bytes_per_s=1.792e12,
                                 clock_hz=2.6e9, mma_flops_per_clk=1024.0),
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
    # what torch reports of this device; the rates it does not report (DRAM, launch, tensor
    # throughput) stay those of the named GPU of the same architecture
    return dataclasses.replace(
        base,
        name=props.name,
        sms=sms,
        regs_per_sm=getattr(props, "regs_per_multiprocessor", 0) or base.regs_per_sm,
        smem_per_sm=getattr(props, "shared_memory_per_multiprocessor", 0) or base.smem_per_sm,
        max_threads_per_sm=getattr(props, "max_threads_per_multi_processor", 0) or base.max_threads_per_sm,
        max_ctas_per_sm=_MAX_CTAS_PER_SM.get((props.major, props.minor), 32),
        max_smem_per_cta=getattr(props, "shared_memory_per_block_optin", 0) or base.max_smem_per_cta,
        clock_hz=(getattr(props, "clock_rate", 0) or base.clock_hz / 1e3) * 1e3,  # kHz
    )


# --------------------------------------------------------------------------- kernel resources
@dataclass(frozen=True)
class KernelResources:
    """One CTA's needs: threads, registers per thread (ptxas), shared memory in bytes; and whether
    the kernel's split merge is launched as its programmatic dependent (the CUDA kernels': the
    merge's fixed cost is then DeviceLimits.dependent_launch_overhead_s, not a whole launch)."""

    threads: int
    regs_per_thread: int
    smem_bytes: int
    dependent_merge: bool = False


def triton_resources(num_warps: int, smem_bytes: int, regs_per_thread: int = 255) -> KernelResources:
    return KernelResources(num_warps * 32, regs_per_thread, smem_bytes)


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
class SplitTraffic:
    """The bytes (and FLOPs) a split moves, from the op's shapes: K/V bytes per prefix key of one
    KV head (GQA: (D + Dv) x the cache's element size; MLA: the latent row), the q.k and output
    head dims and the output's element size. A split writes, per query row, Dv fp32 outputs and
    one fp32 log-sum-exp; the merge reads them back and writes the row."""

    kv_bytes_per_key: int
    head_dim: int
    v_head_dim: int
    out_elt: int = 2

    @property
    def flops_per_row_key(self) -> int:  # q.k and p.v of one query row and one key
        return 2 * (self.head_dim + self.v_head_dim)

    @property
    def partial_bytes_per_row(self) -> int:
        return 4 * self.v_head_dim + PARTIAL_BYTES_PER_ROW_EXTRA

    @property
    def out_bytes_per_row(self) -> int:
        return self.out_elt * self.v_head_dim


@dataclass(frozen=True)
class SplitCost:
    """What a launch's split count costs (module docstring): the device's SMs, DRAM bandwidth and
    latency, mma.sync rate per SM and launch overhead; one CTA's K/V bytes and tensor FLOPs per
    key, its bytes in flight and partial output; the merge's output bytes per CTA."""

    sms: int
    dram_bytes_per_s: float
    l2_bytes_per_s: float
    dram_latency_s: float
    launch_overhead_s: float
    tensor_flops_per_s_per_sm: float
    clock_hz: float
    kv_bytes_per_key: int
    flops_per_key: int
    issue_per_key: float  # busiest-scheduler instructions of one CTA per key, and per CTA
    issue_per_cta: float
    in_flight_bytes: int
    partial_bytes_per_cta: int
    out_bytes_per_cta: int
    row_blocks: int = 1  # CTAs that read the same K/V stream (one (request, KV head)'s row blocks)

    def terms(self, ctas: int, per_sm: int, splits: int, prefix_keys: int) -> dict[str, float]:
        """Seconds per term at `splits`: "DRAM", "L2", "latency" and "compute" (the stream takes
        the longest), "merge"."""
        total = ctas * splits
        keys = prefix_keys / splits
        cta_bytes = keys * self.kv_bytes_per_key + (self.partial_bytes_per_cta if splits > 1 else 0)
        k = -(-total // self.sms)  # CTAs of the busiest SM
        rate = self.in_flight_bytes / self.dram_latency_s
        merge = 0.0
        if splits > 1:
            merge = (total * self.partial_bytes_per_cta + ctas * self.out_bytes_per_cta) / self.dram_bytes_per_s \
                + self.launch_overhead_s
        dram = total * (keys * self.kv_bytes_per_key / self.row_blocks +
                        (self.partial_bytes_per_cta if splits > 1 else 0))
        return {"DRAM": dram / self.dram_bytes_per_s, "L2": total * cta_bytes / self.l2_bytes_per_s,
                "latency": k * cta_bytes / (min(k, per_sm) * rate) if rate else 0.0,
                "compute": k * max(keys * self.flops_per_key / self.tensor_flops_per_s_per_sm,
                                   (self.issue_per_cta + keys * self.issue_per_key) / self.clock_hz),
                "merge": merge}

    def seconds(self, ctas: int, per_sm: int, splits: int, prefix_keys: int) -> float:
        t = self.terms(ctas, per_sm, splits, prefix_keys)
        return max(t["DRAM"], t["L2"], t["latency"], t["compute"]) + t["merge"]


@dataclass(frozen=True)
class SplitPlan:
    ctas: int  # CTAs with work, per split
    slots: int  # CTAs resident on the whole GPU at once
    per_sm: int  # of which per SM
    splits: int
    max_splits: int  # the bound from MIN_SPLIT_KEYS and MAX_KV_SPLITS
    waves: int
    efficiency: float  # ctas x splits / (waves x slots)
    # what bounded the choice: with the bytes, the stream's binding term, "bandwidth" (full DRAM
    # or L2 bandwidth: no split count does better), "compute" or "latency" (the SMs' work or the bytes in
    # flight, where more splits cost more in partials and merge than they save), or "keys" / "cap"
    # (more splits might pay; MIN_SPLIT_KEYS or MAX_KV_SPLITS stop them); without the bytes
    # "waves" (the waves are full), "keys" or "cap"
    limit: str
    seconds: float = 0.0  # the modelled cost of the plan (with the bytes)
    partial_fraction: float = 0.0  # partial bytes written and read back / K/V bytes read


def _efficiency(ctas: int, splits: int, slots: int) -> tuple[int, float]:
    total = ctas * splits
    waves = -(-total // slots)
    return waves, total / (waves * slots)


@functools.lru_cache(maxsize=4096)
def plan(ctas: int, slots: int, per_sm: int, prefix_keys: Optional[int], cost: Optional[SplitCost] = None) -> SplitPlan:
    """Split count for `ctas` working CTAs per split on `slots` resident slots (`per_sm` per SM),
    with a mean prefix of `prefix_keys` keys per request (None: unknown, only the cap bounds the
    splits): the fewest splits within COST_TOLERANCE of the cheapest by `cost`, or, without it
    (or without the prefix), within EFFICIENCY_TOLERANCE of the best wave efficiency."""
    by_keys = MAX_KV_SPLITS if prefix_keys is None else max(1, prefix_keys // MIN_SPLIT_KEYS)
    max_splits = max(1, min(MAX_KV_SPLITS, by_keys))
    bound = "keys" if by_keys < MAX_KV_SPLITS else "cap"
    if ctas <= 0:
        return SplitPlan(0, slots, per_sm, 1, max_splits, 0, 0.0, "waves")
    effs = [_efficiency(ctas, s, slots) for s in range(1, max_splits + 1)]
    if cost is None or not prefix_keys:
        best = max(e for _, e in effs)
        splits = next(s for s, (_, e) in enumerate(effs, start=1) if e >= best * (1 - EFFICIENCY_TOLERANCE))
        waves, eff = effs[splits - 1]
        # "waves" when it fills the GPU to TARGET_EFFICIENCY; below that, more splits would always
        # do better (with enough of them the waves fill up), so the bound on the count stopped it.
        return SplitPlan(ctas, slots, per_sm, splits, max_splits, waves, eff,
                         "waves" if eff >= TARGET_EFFICIENCY else bound)
    secs = [cost.seconds(ctas, per_sm, s, prefix_keys) for s in range(1, max_splits + 1)]
    cheapest = min(secs)
    splits = next(s for s, t in enumerate(secs, start=1) if t <= cheapest / (1 - COST_TOLERANCE))
    waves, eff = effs[splits - 1]
    terms = cost.terms(ctas, per_sm, splits, prefix_keys)
    binding = max(("DRAM", "L2", "latency", "compute"), key=terms.get)
    if binding in ("DRAM", "L2"):
        limit = "bandwidth"
    elif splits == max_splits:
        limit = bound
    else:
        limit = binding
    kv = prefix_keys * cost.kv_bytes_per_key
    partial = 2 * splits * cost.partial_bytes_per_cta / kv if splits > 1 else 0.0
    return SplitPlan(ctas, slots, per_sm, splits, max_splits, waves, eff, limit, secs[splits - 1], partial)


def split_cost(limits: DeviceLimits, kernel: KernelResources, traffic: SplitTraffic, rows: int,
               block_m: int) -> SplitCost:
    """The cost model of a launch whose CTAs hold min(rows, block_m) working rows each (rows per
    (request, KV head): :func:`expected_rows`), run their mma on those rows rounded up to the
    16-row mma tile, and keep their shared-memory stages in flight."""
    rows_per_cta = min(rows, block_m) if rows > 0 else 0
    mma_rows = -(-rows_per_cta // MMA_ROWS) * MMA_ROWS
    columns = traffic.head_dim + traffic.v_head_dim
    fixed = issue_per_cta(rows_per_cta, 0, columns)
    return SplitCost(limits.sms, limits.dram_bytes_per_s, limits.l2_bytes_per_s, limits.dram_latency_s,
                     limits.dependent_launch_overhead_s if kernel.dependent_merge else limits.launch_overhead_s,
                     limits.tensor_flops_per_s_per_sm, limits.clock_hz, traffic.kv_bytes_per_key,
                     mma_rows * traffic.flops_per_row_key, issue_per_cta(rows_per_cta, 1, columns) - fixed, fixed,
                     kernel.smem_bytes, rows_per_cta * traffic.partial_bytes_per_row,
                     rows_per_cta * traffic.out_bytes_per_row, max(1, -(-rows // block_m)))


def split_plan(limits: DeviceLimits, kernel: KernelResources, num_requests: int, num_kv_heads: int, rows: int,
               block_m: int, prefix_keys: Optional[int], traffic: Optional[SplitTraffic] = None) -> SplitPlan:
    per_sm = resident_ctas_per_sm(kernel, limits)
    ctas = num_requests * num_kv_heads * -(-rows // block_m)
    cost = split_cost(limits, kernel, traffic, rows, block_m) if traffic is not None else None
    return plan(ctas, per_sm * limits.sms, per_sm, prefix_keys, cost)


def mean_prefix(kv_tokens: Optional[int], num_requests: int, rows_per_request: int, group: int) -> Optional[int]:
    """Mean prefix keys per request from kv_indices.numel() (a shape): the slots less the drafts."""
    if kv_tokens is None or num_requests <= 0:
        return None
    return max(0, kv_tokens // num_requests - rows_per_request // max(group, 1))


def num_kv_splits(device: torch.device, num_requests: int, num_kv_heads: int, rows: int, block_m: int,
                  kernel: Union[KernelResources, Callable[[DeviceLimits], KernelResources], None] = None,
                  prefix_keys: Optional[int] = None, traffic: Optional[SplitTraffic] = None) -> int:
    """KV splits per request for a launch of num_requests x num_kv_heads x ceil(rows / block_m)
    working CTAs per split (rows: :func:`expected_rows`) of `kernel` (its resources, or a function
    of the device limits giving them; None: one CTA per SM) with a mean prefix of `prefix_keys`
    keys (:func:`mean_prefix`; None: unknown) moving `traffic` bytes (None: wave efficiency
    alone). 1 on CPU. Shapes and device properties only."""
    if device.type != "cuda" or num_requests == 0:
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    limits = device_limits(index)
    if callable(kernel):
        kernel = kernel(limits)
    kernel = kernel or KernelResources(limits.max_threads_per_sm, 0, 0)
    return split_plan(limits, kernel, num_requests, num_kv_heads, rows, block_m, prefix_keys, traffic).splits


@dataclass
class SplitWorkspace:
    """A planned split of the KV prefixes, made once for a batch and reused by every layer's
    launch: `splits` per request (1 = none), the smallest prefix share of a split (`min_chunk`:
    MIN_SPLIT_KEYS for a planned count, 0 for a forced one, so results equal the one-call
    functions'), and the fp32 partial outputs [splits, T, H, Dv] and their base-2 log-sum-exp
    [splits, T, H] (None with one split). The buffers stay the same tensors across CUDA-graph
    replays."""

    splits: int
    min_chunk: int
    o_partial: Optional[torch.Tensor] = None
    lse_partial: Optional[torch.Tensor] = None

    @staticmethod
    def make(splits: int, forced: bool, num_tokens: int, num_heads: int, v_head_dim: int,
             device: torch.device) -> "SplitWorkspace":
        o = lse = None
        if splits > 1:
            o = torch.empty((splits, num_tokens, num_heads, v_head_dim), dtype=torch.float32, device=device)
            lse = torch.empty((splits, num_tokens, num_heads), dtype=torch.float32, device=device)
        return SplitWorkspace(splits, 0 if forced else MIN_SPLIT_KEYS, o, lse)

    @staticmethod
    def plan(num_kv_splits: Optional[int], auto: Callable[[], int], num_tokens: int, num_heads: int,
             v_head_dim: int, device: torch.device) -> "SplitWorkspace":
        """The split of a batch: `num_kv_splits` when given (forced: the prefix divided evenly),
        else `auto()`, the implementation's planner (every split keeps >= MIN_SPLIT_KEYS keys).
        The plans and the one-call functions both split through here, so they split alike."""
        forced = bool(num_kv_splits)
        splits = int(num_kv_splits) if forced else auto()
        return SplitWorkspace.make(splits, forced, num_tokens, num_heads, v_head_dim, device)

