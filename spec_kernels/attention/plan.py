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

    python -m spec_kernels.bench plan --gpu h200 [--impl triton]   # the plan of the benchmark shapes
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from .._limits import MAX_DRAFT_TOKENS
from .._ops import sm_count

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

