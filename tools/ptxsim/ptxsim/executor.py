"""Execute parsed PTX entries on NumPy, vectorised over the threads that run in lock-step.

Execution model
- Registers live in one array per register over all threads of a launch. A *group* is a set of
  whole warps that run together; its SIMT stack (frames of pc, reconvergence pc and lane mask)
  handles divergence inside a warp, with reconvergence at the branch block's immediate
  post-dominator. A branch that sends some warps of the group one way whole splits those warps
  off (only warps that diverge inside themselves share a SIMT stack), so warps (and CTAs)
  progress independently: one CTA may spin on a flag that another CTA sets later, as the
  kv_slots commit hand-off and the allreduce do, and no warp waits at a reconvergence point for
  another warp.
- The scheduler interleaves every group of every launch on the Machine (several launches = several
  simulated GPUs sharing memory). It runs the group with the lowest pc first (so split groups meet
  again and merge) and demotes groups that spin (nanosleep, long runs of back edges) so others
  progress. Nothing runnable with threads still waiting is a deadlock; a run that stores nothing
  for `spin_limit` warp-instructions is reported as a livelock. Both reports list every waiting
  group's source line.
- Warp collectives (`.sync.aligned` mma / ldmatrix / stmatrix, shfl.sync / redux.sync with a full
  mask, bar.sync, bar.warp.sync) require every live lane of each warp to be there; a diverged
  collective is an error, not a guess.
- Memory is sequentially consistent (every load and store is performed when its instruction runs);
  fences are counted, not modelled. cp.async is asynchronous: the data lands at the wait_group that
  retires its group and the destination bytes are pending (touching them is a Hazard) until then.
"""
from __future__ import annotations

import collections
import dataclasses
import gc
import math
import struct
from typing import Optional

import numpy as np

from . import ops
from .memory import (GENERIC_SHARED_BASE, GLOBAL_BASE, PARAM_BASE, REGION_SHIFT, SHARED_BASE, GlobalMemory, Hazard,
                     SharedMemory, SimError)
from .numerics import (_NP, _SIGNED, _TYPES, _UNS, _f32, _size, bf16_to_f32, f16_to_f32,  # noqa: F401
                       f32_to_bf16, f32_to_e4m3_satfinite, f32_to_f16, ftz)
from .parser import Entry, Instr, Operand
from .state import EXIT, Frame, Group

__all__ = ["Machine", "Launch", "SimError", "Hazard", "Deadlock", "Stats"]


class Deadlock(SimError):
    pass


# ----------------------------------------------------------------------------------------- stats
class Stats:
    """Counters of one launch (the performance evidence available without a GPU)."""

    CLASSES = ("mma", "ldmatrix", "stmatrix", "cp.async", "ld.global", "st.global", "ld.shared", "st.shared",
               "atom", "barrier", "sfu", "shfl", "branch", "other")

    def __init__(self):
        self.warp_instr = collections.Counter()
        self.thread_instr = 0
        self.global_read = 0
        self.global_written = 0
        self.bank_conflicts = collections.Counter()
        # what a throughput model needs (tools that predict time read these, see docs/ of the users)
        self.shared_bytes = collections.Counter()       # class -> bytes moved through shared memory
        self.shared_wavefronts = collections.Counter()  # class -> 128-byte shared-memory wavefronts
        self.mma = collections.Counter()                # full mma form -> warp-instructions
        self.l2_sectors = 0          # 32-byte sectors requested from L2: per warp-instruction, distinct
        self.sector_bytes = 32
        self._sectors = ({}, {})     # (read, written): region id -> arrays of sector numbers touched
        self.unique_read_by_buffer = {}     # allocation name -> distinct bytes read (32-byte sectors)
        self.unique_written_by_buffer = {}  # allocation name -> distinct bytes written (32-byte sectors)
        self.written_by_buffer = {}  # allocation name -> bytes written by this launch (requests)
        self.cp_inflight_max = 0     # most cp.async bytes one CTA had in flight at once
        self.per_warp = None         # warp-instructions issued by each warp of the launch
        self.warps_per_cta = 0
        self.fences = 0              # warp-instructions of fence / membar (each warp that runs one waits on it)
        self.releases = 0            # warp-instructions of st / atom / red with release semantics (a fence each)
        self.load_chain = 0          # longest chain of dependent global loads seen by one thread
        # with Machine(latencies=...): each warp's dependent-latency critical path in cycles: an
        # instruction starts when its source registers are ready (in any order a scheduler could
        # pick: the issue count is a separate bound) and not before the warp's last barrier or
        # cp.async wait; barriers align the clocks of a CTA's warps
        self.warp_cycles = None
        self.warp_cycles_in_order = None  # the same, issuing in PTX order (no reordering): the upper bound
        self.region_read = {}        # allocation name -> bytes read (all launches of the run)
        self.groups_max = 0

    # ---- throughput counters, filled while the launch runs
    def note_global(self, warps, addrs, width, write, names):
        """One global access of `width` bytes per lane at `addrs` by lanes of the global warps
        `warps`: the L2 sector requests (distinct per warp) and the sectors touched (per buffer)."""
        if addrs.size == 0:
            return
        a = addrs.astype(np.int64) - GLOBAL_BASE
        first = a >> 5
        w = warps.astype(np.int64) << 43
        last = (a + width - 1) >> 5  # aligned accesses of <= 16 bytes never cross a sector: skip the join
        if np.array_equal(first, last):
            self.l2_sectors += int(np.unique(w | first).size)
            sec = np.unique(first)
        else:
            self.l2_sectors += int(np.unique(np.concatenate((w | first, w | last))).size)
            sec = np.unique(np.concatenate((first, last)))
        rid = sec >> (REGION_SHIFT - 5)
        store = self._sectors[1 if write else 0]
        for r in np.unique(rid):
            store.setdefault(int(r), []).append(sec[rid == r])
        if write:
            rel = a >> REGION_SHIFT
            for r in np.unique(rel):
                name = names(int(r))
                self.written_by_buffer[name] = self.written_by_buffer.get(name, 0) + int((rel == r).sum()) * width

    def note_shared(self, klass, lanes, width, wavefronts):
        self.shared_bytes[klass] += int(lanes) * width
        self.shared_wavefronts[klass] += int(wavefronts)

    def finish(self, names):
        """Turn the raw records into per-buffer figures once the launch has ended."""
        for store, out in zip(self._sectors, (self.unique_read_by_buffer, self.unique_written_by_buffer)):
            for r, parts in store.items():
                n = np.unique(np.concatenate(parts)).size * self.sector_bytes
                out[names(r)] = out.get(names(r), 0) + int(n)
        self._sectors = ({}, {})

    def issue_per_scheduler(self, schedulers: int = 4):
        """Warp-instructions per (CTA, warp scheduler): warp w of a CTA issues from scheduler
        w % schedulers, as on sm_80 and later (4 SM sub-partitions)."""
        if self.per_warp is None or not self.warps_per_cta:
            return np.zeros((0, schedulers), np.int64)
        pw = self.per_warp.reshape(-1, self.warps_per_cta)
        out = np.zeros((pw.shape[0], schedulers), np.int64)
        for w in range(self.warps_per_cta):
            out[:, w % schedulers] += pw[:, w]
        return out

    def as_dict(self):
        sched = self.issue_per_scheduler()
        return {"warp_instructions": dict(self.warp_instr), "thread_instructions": self.thread_instr,
                "global_bytes_read": self.global_read, "global_bytes_written": self.global_written,
                "bank_conflicts": dict(self.bank_conflicts), "fences": self.fences, "releases": self.releases,
                "longest_dependent_global_load_chain": self.load_chain,
                "bytes_read_by_buffer": dict(self.region_read),
                "shared_bytes": dict(self.shared_bytes), "shared_wavefronts": dict(self.shared_wavefronts),
                "mma": dict(self.mma), "l2_sector_requests": self.l2_sectors,
                "unique_bytes_read_by_buffer": dict(self.unique_read_by_buffer),
                "unique_bytes_written_by_buffer": dict(self.unique_written_by_buffer),
                "bytes_written_by_buffer": dict(self.written_by_buffer),
                "cp_async_bytes_in_flight_max": self.cp_inflight_max,
                "issue_per_scheduler_max": int(sched.max()) if sched.size else 0,
                "warp_latency_cycles_max": _max(self.warp_cycles),
                "warp_latency_cycles_in_order_max": _max(self.warp_cycles_in_order)}


def _max(a) -> int:
    return int(a.max()) if a is not None and a.size else 0


def _klass(op):
    if op.startswith("mma"):
        return "mma"
    for p in ("ldmatrix", "stmatrix", "cp.async", "atom", "shfl", "redux"):
        if op.startswith(p):
            return "shfl" if p == "redux" else p
    if op.startswith("bar") or op.startswith("membar") or op.startswith("fence"):
        return "barrier"
    if op.startswith("ld.") or op.startswith("st."):
        sp = "shared" if ".shared" in op else "global"
        return f"{op[:2]}.{sp}"
    if op.split(".")[0] in ("ex2", "rsqrt", "rcp", "lg2", "sqrt", "sin", "cos", "div"):
        return "sfu"
    if op.startswith("bra"):
        return "branch"
    return "other"


def _cfg_ipdom(instrs, labels):
    """Immediate post-dominator (as an instruction index, EXIT for the exit) of each branch."""
    n = len(instrs)
    leaders = {0} | set(labels.values())
    for i, ins in enumerate(instrs):
        op = ins.opcode.split(".")[0]
        if op in ("bra", "ret", "exit", "trap", "brx"):
            leaders.add(i + 1)
    leaders = sorted(x for x in leaders if x < n)
    start_of = {s: k for k, s in enumerate(leaders)}
    ends = leaders[1:] + [n]
    block_of = np.zeros(n, np.int64)
    succ = []
    for k, (s, e) in enumerate(zip(leaders, ends)):
        block_of[s:e] = k
        last = instrs[e - 1]
        op = last.opcode.split(".")[0]
        out = []
        if op == "bra":
            out.append(start_of[labels[last.operands[0].name]])
            if last.guard is not None and e < n:
                out.append(start_of[e])
        elif op == "trap" and last.guard is None:
            pass  # aborts the launch: no successor, so it constrains no reconvergence point
        elif op in ("ret", "exit", "trap"):
            if last.guard is not None and e < n:
                out.append(start_of[e])
            else:
                out.append(-1)
        else:
            out.append(start_of[e] if e < n else -1)
        succ.append(out)
    nb = len(leaders)
    # post-dominator sets by iteration over reverse post-order of the reverse graph (small CFGs)
    EXITB = nb
    pdom = [set(range(nb + 1)) for _ in range(nb)] + [{EXITB}]
    changed = True
    order = list(range(nb - 1, -1, -1))
    while changed:
        changed = False
        for b in order:
            ss = [EXITB if x == -1 else x for x in succ[b]]
            if not ss:
                continue  # a trap block: post-dominated by everything (it never reaches the exit)
            new = set.intersection(*(pdom[x] for x in ss)) | {b}
            if new != pdom[b]:
                pdom[b] = new
                changed = True
    ipdom = {}
    for b in range(nb):
        cands = pdom[b] - {b}
        # the immediate one is the candidate post-dominated by all others (largest set)
        best = max(cands, key=lambda c: len(pdom[c]) if c != EXITB else 0)
        ipdom[b] = EXIT if best == EXITB else leaders[best]
    return {i: ipdom[int(block_of[i])] for i in range(n)}, set(leaders)


# ----------------------------------------------------------------------------------------- launch
@dataclasses.dataclass
class Launch:
    entry: Entry
    grid: tuple
    block: tuple
    params: bytes
    dynamic_smem: int = 0
    name: str = ""
    gpu: int = 0
    # programmatic dependent launch: indexes, among the launches run together, of the grids this
    # one depends on. Its CTAs start with them (the earliest a GPU may schedule them) and each
    # griddepcontrol.wait holds until those grids have exited; with none, the wait returns at once.
    after: tuple = ()


class _Run:
    """One launch in flight: registers, shared memory, decoded program, groups."""

    def __init__(self, machine, spec: Launch, module_vars):
        self.m = machine
        self.spec = spec
        machine._runs_started = getattr(machine, "_runs_started", 0) + 1
        self.run_id = machine._runs_started
        e = spec.entry
        self.entry = e
        gx, gy, gz = (tuple(spec.grid) + (1, 1, 1))[:3]
        bx, by, bz = (tuple(spec.block) + (1, 1, 1))[:3]
        self.grid, self.block = (gx, gy, gz), (bx, by, bz)
        self.n_cta = gx * gy * gz
        self.tpc = bx * by * bz
        if self.tpc > 1024 or self.tpc < 1:
            raise SimError(f"block of {self.tpc} threads")
        self.N = self.n_cta * self.tpc
        self.wpc = (self.tpc + 31) // 32
        t = np.arange(self.N, dtype=np.int64)
        self.cta_of = t // self.tpc
        self.tid_lin = t % self.tpc
        self.lane = self.tid_lin % 32
        self.warp_of = self.cta_of * self.wpc + self.tid_lin // 32
        self.alive = np.ones(self.N, bool)
        if len(spec.params) != e.param_bytes:
            raise SimError(f"{e.name}: {len(spec.params)} parameter bytes given, the PTX .param list "
                           f"takes {e.param_bytes}")
        self.params = np.frombuffer(bytes(spec.params), np.uint8)
        # shared memory layout: static variables first, then the extern (dynamic) array
        self.sym_addr = {}
        off = 0
        dyn_align = 16
        for v in list(module_vars.get("shared", [])) + list(e.shared):
            if v.extern:
                dyn_align = max(dyn_align, v.align)
                continue
            off = (off + v.align - 1) // v.align * v.align
            self.sym_addr[v.name] = ("shared", SHARED_BASE + off)
            off += v.size
        off = (off + dyn_align - 1) // dyn_align * dyn_align
        for v in list(module_vars.get("shared", [])) + list(e.shared):
            if v.extern:
                self.sym_addr[v.name] = ("shared", SHARED_BASE + off)
        self.static_smem = off
        smem = off + spec.dynamic_smem
        if smem > machine.max_smem:
            raise SimError(f"{e.name}: {smem} bytes of shared memory per CTA, above the {machine.max_smem} "
                           f"the device allows")
        self.smem = SharedMemory(self.n_cta, max(smem, 1), self.tpc, check=machine.check_races)
        self.smem.warp_epoch = np.zeros(self.n_cta * self.wpc, np.int64)
        for name, addr in machine.global_syms.items():
            self.sym_addr[name] = ("global", addr)
        for p in e.params:
            self.sym_addr[p.name] = ("param", PARAM_BASE + p.offset)
        self.R = {}
        self.defined = {}
        self.undefined_from = {}      # register -> the read its undefined lanes' value came from
        self.stats = Stats()
        self.stats.per_warp = np.zeros(self.n_cta * self.wpc, np.int64)
        self.stats.warps_per_cta = self.wpc
        if machine.latencies is not None:
            self.stats.warp_cycles = np.zeros(self.n_cta * self.wpc, np.int64)
            self.ready = {}  # register -> per-warp cycle its last write is readable
            self.warp_floor = np.zeros(self.n_cta * self.wpc, np.int64)  # no instruction starts before it
            # the same clock for a warp that issues in PTX order (what no reordering would give)
            self.stats.warp_cycles_in_order = np.zeros(self.n_cta * self.wpc, np.int64)
            self.ready_in_order, self.warp_floor_in_order = {}, np.zeros(self.n_cta * self.wpc, np.int64)
            self.deps = [None] * len(e.instrs)  # per pc: (source registers, destination registers, latency)
        self.cp_inflight = np.zeros(self.n_cta, np.int64)  # cp.async bytes issued, not yet waited for
        cfg = e.__dict__.get("_cfg")  # per entry (the parse is cached): the analysis takes seconds on big kernels
        if cfg is None:
            cfg = e.__dict__["_cfg"] = _cfg_ipdom(e.instrs, e.labels)
        self.ipdom, self.leaders = cfg
        self.backward = {}
        self.cp_pending = []          # records of in-flight cp.async
        self.cp_group = np.zeros(self.N, np.int64)
        self.bar_vals = np.zeros(self.N, bool)
        self.load_depth = {}          # register -> per-thread depth of dependent global loads
        self.prog = [None] * len(e.instrs)  # decoded on first execution (big kernels run a fraction)
        g = Group(self, t.copy(), [Frame(0, EXIT, np.ones(self.N, bool))])
        self.groups = [g]
        self.done = False
        self.prerequisites = []       # the runs this one's griddepcontrol.wait waits for (Launch.after)

    # registers ---------------------------------------------------------------------------------
    def reg(self, name):
        a = self.R.get(name)
        if a is None:
            typ = self.entry.regs.get(name)
            if typ is None:
                raise SimError(f"unknown register {name}")
            a = np.zeros(self.N, _NP[typ] if typ in _NP else np.uint32)
            if typ in ("f32", "f64", "f16", "bf16"):
                a = np.zeros(self.N, _UNS[_size(typ)])
            self.R[name] = a
            self.defined[name] = np.zeros(self.N, bool)
        return a

    def where(self, ins):
        f, line = ins.loc
        path = self.entry.files.get(f, f"file{f}") if isinstance(f, int) else f
        return f"{path}:{line}"


# Lane-wise value instructions. Compiled code computes on values it then discards: Triton 3.6's
# cross-warp reduction loads the partials on the first lanes only, then shuffles and combines all
# 32 lanes, and stores lane 0's. So these instructions carry undefinedness to their destination;
# the read that uses an undefined value (a stored value, an address, a guard or branch condition,
# an atomic, mma or redux operand) is the error. selp has its own rule (ops.h_selp); div and rem
# stay strict (an undefined divisor would otherwise report a division by zero).
_PROPAGATES_UNDEFINED = frozenset({
    "mov", "add", "sub", "mul", "mad", "fma", "and", "or", "xor", "not", "shl", "shr", "shf", "bfe",
    "bfi", "prmt", "popc", "clz", "brev", "neg", "abs", "min", "max", "setp", "cvt", "ex2", "rsqrt",
    "rcp", "sqrt", "lg2", "shfl"})


class _DefinednessRecorder:
    """Stands in for the Machine while a lane-wise instruction reads its operands: notes on which
    lanes every source is defined, and where the first undefined value came from, without raising."""

    def __init__(self, machine):
        self._machine = machine
        self.ok, self.origin = None, None

    def __getattr__(self, name):
        return getattr(self._machine, name)

    def _check_def(self, r, name, sel, ins):
        d = r.defined.get(name)
        ok = (d if d is not None else np.zeros(r.N, bool))[sel]
        if self.origin is None and not ok.all():
            self.origin = r.undefined_from.get(name) or f"{name}, read at {r.where(ins)} ({ins.text.strip()})"
        self.ok = ok if self.ok is None else self.ok & ok


class Machine:
    """Global memory plus the launches run on it. Options:
    mma: "fast" (fp64 sum, ~1 ulp from hardware) or "exact" (the hardware's fused sum model);
    check_races: shared-memory race / never-written checks; max_smem: per-CTA limit (99 KB, sm_120)."""

    def __init__(self, mma: str = "fast", check_races: bool = True, max_smem: int = 99 * 1024,
                 spin_limit: int = 2_000_000, max_instructions: int = 200_000_000, arch: str = "sm_120",
                 latencies: Optional[dict] = None):
        self.mem = GlobalMemory()
        # instruction class (Stats.warp_instr's keys) -> cycles until its result can be read;
        # None: the per-warp latency clock is not kept (it costs run time)
        self.latencies = dict(latencies) if latencies else None
        self.mma_mode = mma
        self.check_races = check_races
        self.max_smem = max_smem
        self.spin_limit = spin_limit
        self.max_instructions = max_instructions
        self.arch = arch
        self.global_syms = {}
        self.clock_ns = 1_000_000
        self._module_vars = {}

    # memory helpers ---------------------------------------------------------------------------
    def alloc(self, nbytes, name="buffer", data=None):
        return self.mem.alloc(nbytes, name, data)

    def upload(self, array: np.ndarray, name="tensor") -> int:
        a = np.ascontiguousarray(array)
        return self.mem.alloc(a.nbytes, name, a.view(np.uint8).ravel())

    def download(self, addr, dtype, shape):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.mem.view(addr)[:n].copy().view(dtype).reshape(shape)

    def write(self, addr, array):
        raw = np.ascontiguousarray(array).view(np.uint8).ravel()
        self.mem.view(addr)[:raw.size] = raw

    def load_module_globals(self, module):
        for v in module.variables:
            if v.space in ("global", "const") and v.name not in self.global_syms:
                self.global_syms[v.name] = self.mem.alloc(max(v.size, 1), v.name, v.init)
        self._module_vars = {"shared": [v for v in module.variables if v.space == "shared"]}

    # running ----------------------------------------------------------------------------------
    def run(self, *launches: Launch, module=None):
        """Run launches concurrently (e.g. one per simulated GPU) to completion; return Stats
        per launch."""
        if module is not None:
            self.load_module_globals(module)
        # The interpreter allocates many small objects (closures, frames) per launch; the cyclic
        # GC's full passes over them cost more than the run itself, and it creates no cycles.
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            runs = [_Run(self, spec, self._module_vars) for spec in launches]
            for i, spec in enumerate(launches):
                if any(not 0 <= j < len(launches) or j == i for j in spec.after):
                    raise SimError(f"launch {i}: after={spec.after} must name other launches of the same run")
            for r in runs:
                r.prerequisites = [runs[j] for j in r.spec.after]
            before = dict(self.mem.region_read)
            self._schedule(runs)
        finally:
            if gc_was_on:
                gc.enable()
        region_read = {k: v - before.get(k, 0) for k, v in self.mem.region_read.items() if v != before.get(k, 0)}
        names = lambda rid: self.mem.regions[rid][1]  # noqa: E731
        for r in runs:
            r.stats.region_read = region_read   # of all launches run together
            r.stats.finish(names)
        for r in runs:
            r.stats.groups_max = max(r.stats.groups_max, 1)
        return [r.stats for r in runs]

    def _schedule(self, runs):
        total = 0
        last_store, last_store_at = self.mem.stores, 0
        while True:
            live = [g for r in runs for g in r.groups]
            if not live:
                return
            for r in runs:
                self._release_barriers(r)
                self._release_grid_dependency(r)
                self._merge(r)
            runnable = [g for r in runs for g in r.groups if g.state == "run"]
            if not runnable:
                raise Deadlock("deadlock: every thread waits at a barrier that cannot complete\n" +
                               self._report(runs))
            # a programmatic dependent's groups first: what it does before its griddepcontrol.wait
            # then happens before any instruction of the grids it depends on (the earliest a GPU
            # may run it), so a read that belongs after the wait sees their memory as it was
            g = min(runnable, key=lambda g: (g.penalty, not g.launch.prerequisites, g.stack[-1].pc))
            n = self._run_group(g)
            total += n
            if self.mem.stores != last_store:
                last_store, last_store_at = self.mem.stores, total
            if total - last_store_at > self.spin_limit:
                raise Deadlock(f"livelock: {self.spin_limit} warp-instructions without a global store\n" +
                               self._report(runs))
            if total > self.max_instructions:
                raise Deadlock(f"instruction budget of {self.max_instructions} exhausted\n" + self._report(runs))

    def _report(self, runs):
        lines = []
        for r in runs:
            for g in r.groups:
                pc = g.stack[-1].pc
                ctas = np.unique(r.cta_of[g.threads])
                where = r.where(r.entry.instrs[pc]) if 0 <= pc < len(r.entry.instrs) else "exit"
                txt = r.entry.instrs[pc].text if 0 <= pc < len(r.entry.instrs) else ""
                lines.append(f"  launch {r.spec.name or r.entry.name[:40]} gpu {r.spec.gpu} CTAs {ctas[:8].tolist()}"
                             f"{'...' if ctas.size > 8 else ''} ({g.threads.size} threads, {g.state}) at {where}: {txt}")
        return "\n".join(lines)

    def _merge(self, r):
        if len(r.groups) < 2:
            return
        by = collections.defaultdict(list)
        for g in r.groups:
            by[g.signature()].append(g)
        if len(by) == len(r.groups):
            return
        out = []
        for sig, gs in by.items():
            if len(gs) == 1 or gs[0].state == "done":
                out.extend(gs)
                continue
            threads = np.concatenate([g.threads for g in gs])
            order = np.argsort(threads, kind="stable")
            stack = []
            for lvl in range(len(gs[0].stack)):
                mask = np.concatenate([g.stack[lvl].mask for g in gs])[order]
                stack.append(Frame(gs[0].stack[lvl].pc, gs[0].stack[lvl].rpc, mask))
            ng = Group(r, threads[order], stack)
            ng.state, ng.bar_pc = gs[0].state, gs[0].bar_pc
            ng.penalty = min(g.penalty for g in gs)
            out.append(ng)
        r.groups = out

    @staticmethod
    def _release_grid_dependency(r):
        """griddepcontrol.wait returns once every prerequisite grid has exited (its memory is the
        machine's at once: stores are not buffered)."""
        if any(p.groups for p in r.prerequisites):
            return
        for g in r.groups:
            if g.state == "gdwait":
                g.state = "run"

    def _release_barriers(self, r):
        waiting = [g for g in r.groups if g.state == "bar"]
        if not waiting:
            return
        arrived = np.zeros(r.N, bool)
        for g in waiting:
            arrived[g.threads[g.stack[-1].mask]] = True
        live_per = np.bincount(r.cta_of[r.alive], minlength=r.n_cta)
        arr_per = np.bincount(r.cta_of[arrived & r.alive], minlength=r.n_cta)
        complete = live_per == arr_per
        if not complete.any():
            return
        for cta in np.nonzero(complete & (arr_per > 0))[0]:
            r.smem.cta_epoch[cta] += 1
            if r.stats.warp_cycles is not None:  # every warp leaves the barrier when the last arrives
                for wc, floor in ((r.stats.warp_cycles, r.warp_floor),
                                  (r.stats.warp_cycles_in_order, r.warp_floor_in_order)):
                    wc = wc[cta * r.wpc:(cta + 1) * r.wpc]
                    wc[:] = wc.max()
                    floor[cta * r.wpc:(cta + 1) * r.wpc] = wc
        new = []
        for g in r.groups:
            if g.state != "bar":
                new.append(g)
                continue
            ctas = r.cta_of[g.threads]
            ok = complete[ctas]
            if not ok.any():
                new.append(g)
                continue
            if not ok.all():     # split off the CTAs that may go on
                rest = Group(r, g.threads[~ok], [Frame(f.pc, f.rpc, f.mask[~ok]) for f in g.stack])
                rest.state, rest.bar_pc, rest.penalty = "bar", g.bar_pc, g.penalty
                new.append(rest)
                g.threads = g.threads[ok]
                for f in g.stack:
                    f.mask = f.mask[ok]
            ins = r.entry.instrs[g.bar_pc]
            if ins.opcode.startswith("bar.red") or ins.opcode.startswith("barrier.red"):
                self._finish_bar_red(r, g, ins)
            g.state = "run"
            g.stack[-1].pc = g.bar_pc + 1
            g.bar_pc = None
            new.append(g)
        r.groups = new

    def _finish_bar_red(self, r, g, ins):
        kind = ins.opcode.split(".")[2]
        live = r.alive
        vals = r.bar_vals
        ctas = np.unique(r.cta_of[g.threads])
        res = {}
        for c in ctas:
            m = (r.cta_of == c) & live
            v = vals[m]
            res[c] = bool(v.all()) if kind == "and" else bool(v.any())
        t = g.threads[g.stack[-1].mask]
        out = np.array([res[c] for c in r.cta_of[t]], bool)
        dst = ins.operands[0].name
        a = r.reg(dst)
        a[t] = out
        r.defined[dst][t] = True

    def _run_group(self, g):
        """Run g until it reaches a block boundary, a barrier, or exits. Returns warp-instrs."""
        r = g.launch
        prog = r.prog
        instrs = r.entry.instrs
        leaders = r.leaders
        count = 0
        st = r.stats
        while True:
            if not g.stack:
                g.state = "done"
                r.groups.remove(g)
                return count
            f = g.stack[-1]
            if not f.mask.any():
                g.stack.pop()
                continue
            if f.pc == EXIT or f.pc >= len(prog):
                # reconverging at the exit, or falling off the end: the threads exit
                self._exit(r, g, g.threads[f.mask])
                continue
            if f.pc == f.rpc:
                g.stack.pop()
                continue
            pc = f.pc
            ins = instrs[pc]
            sel0, tids0 = sel, tids = g.sel()
            gv = None
            if ins.guard is not None:
                gv = r.reg(ins.guard)[sel]
                self._check_def(r, ins.guard, sel, ins)
                if ins.guard_neg:
                    gv = ~gv
                if not gv.all():
                    tids = tids[gv]
                    sel = tids
            if isinstance(sel, slice):
                nw = (tids.size + 31) // 32
                if tids.size:
                    st.per_warp[r.warp_of[tids[0]]:r.warp_of[tids[-1]] + 1] += 1
            else:
                ws = np.unique(r.warp_of[tids]) if tids.size else tids
                nw = ws.size
                st.per_warp[ws] += 1
            count += max(nw, 1)
            st.thread_instr += tids.size
            klass = _klass(ins.opcode)
            if st.warp_cycles is not None and tids.size:
                self._tick(r, pc, ins, klass, slice(r.warp_of[tids[0]], r.warp_of[tids[-1]] + 1)
                           if isinstance(sel, slice) else ws)
            st.warp_instr[klass] += nw
            if klass == "mma":
                st.mma[ins.opcode] += nw
            elif klass == "barrier" and not ins.opcode.startswith("bar"):
                st.fences += nw
            elif ".release" in ins.opcode or ".acq_rel" in ins.opcode:
                st.releases += nw
            self.clock_ns += 1
            try:
                dec = prog[pc]
                if dec is None:
                    dec = prog[pc] = self.decode(r, ins, pc)
                kind, fn = dec
                if kind == "op":
                    if tids.size:
                        fn(sel, tids)
                    f.pc = pc + 1
                else:
                    res = fn(g, f, sel0, tids0, gv, pc)
                    if res == "yield":
                        return count
            except SimError as e:
                if getattr(e, "_located", False):
                    raise
                e.args = (f"{e.args[0]}\n  at {r.where(ins)}: {ins.text}  [{r.entry.name[:60]}]",)
                e._located = True
                raise
            if g.state != "run":
                return count
            if g.stack and g.stack[-1].pc in leaders:
                return count

    _NO_DEST = ("st", "red", "cp", "bar", "barrier", "fence", "membar", "bra", "ret", "exit", "prefetch", "trap",
                "griddepcontrol")

    def _tick(self, r, pc, ins, klass, warps):
        """Advance the clocks of `warps` over one instruction: it starts when its last source
        register is ready (not before the warp's floor: its last barrier or cp.async wait) and
        its destinations are ready `latency` cycles later; the warp's clock is the latest start
        + 1. A cp.async wait raises the floor to the clock: what follows it waits for it."""
        dep = r.deps[pc]
        if dep is None:
            srcs, dsts = [], []
            writes = ins.opcode.split(".")[0] not in self._NO_DEST
            for i, o in enumerate(ins.operands):
                items = o.items if o.kind == "vec" else (o,)
                names = [x.name for x in items if x.kind in ("reg", "negpred") or (x.kind == "mem" and x.base_kind == "reg")]
                (dsts if i == 0 and writes and o.kind != "mem" else srcs).extend(names)
            if ins.guard is not None:
                srcs.append(ins.guard)
            dep = r.deps[pc] = (tuple(srcs), tuple(dsts), int(self.latencies.get(klass, self.latencies.get("other", 1))))
        srcs, dsts, lat = dep
        for clock, floor, ready_of, in_order in ((r.stats.warp_cycles, r.warp_floor, r.ready, False),
                                                 (r.stats.warp_cycles_in_order, r.warp_floor_in_order,
                                                  r.ready_in_order, True)):
            start = floor[warps]
            if in_order:  # and after the instruction before it in PTX order: no reordering at all
                start = np.maximum(start, clock[warps])
            for x in srcs:
                ready = ready_of.get(x)
                if ready is not None:
                    start = np.maximum(start, ready[warps])
            clock[warps] = np.maximum(clock[warps], start + 1)
            if ins.opcode.startswith("cp.async.wait"):
                floor[warps] = clock[warps]
            for x in dsts:
                ready = ready_of.get(x)
                if ready is None:
                    ready = ready_of[x] = np.zeros(clock.size, np.int64)
                ready[warps] = start + lat

    def _exit(self, r, g, tids):
        r.alive[tids] = False
        gone = np.isin(g.threads, tids)
        keep = ~gone
        g.threads = g.threads[keep]
        for fr in g.stack:
            fr.mask = fr.mask[keep]
        g.stack = [fr for fr in g.stack if fr.mask.any()]
        if not g.stack or g.threads.size == 0:
            g.state = "done"
            if g in r.groups:
                r.groups.remove(g)

    def _check_def(self, r, name, sel, ins):
        d = r.defined.get(name)
        if d is None:
            raise SimError(f"read of register {name} that was never written")
        if not d[sel].all():
            origin = r.undefined_from.get(name)
            raise SimError(f"read of register {name} that is not written on every active thread"
                           + (f" (its value on those threads comes from {origin})" if origin else ""))

    # decoding ---------------------------------------------------------------------------------
    def decode(self, r, ins: Instr, pc):
        base = ins.opcode.split(".")[0]
        if base in _PROPAGATES_UNDEFINED:
            kind, fn = self._decode_propagating(r, ins, pc)
        else:
            kind, fn = ops.decode(self, r, ins, pc)
        if kind != "op" or base in ("ld", "cp", "atom", "st", "red"):
            return kind, fn
        # dependent-load depth flows through arithmetic: dst depth = max(source depths)
        srcs, dsts = [], []
        for i, o in enumerate(ins.operands):
            names = [x.name for x in (o.items if o.kind == "vec" else (o,)) if x.kind in ("reg", "negpred")]
            (dsts if i == 0 else srcs).extend(names)
        depth = r.load_depth

        def tracked(sel, tids):
            fn(sel, tids)
            d = max((depth.get(x, 0) for x in srcs), default=0)
            for x in dsts:
                if d:
                    depth[x] = d
                elif x in depth:
                    del depth[x]
        return kind, tracked

    def _decode_propagating(self, r, ins, pc):
        """A lane-wise instruction whose destination is undefined on the lanes where a source is
        (for shfl: the source lane's), instead of an error at once."""
        rec = _DefinednessRecorder(self)
        kind, fn = ops.decode(rec, r, ins, pc)
        d = ins.operands[0]
        dsts = [x.name for x in (d.items if d.kind == "vec" else (d,)) if x.kind == "reg"]

        def propagating(sel, tids):
            rec.ok, rec.origin = None, None
            fn(sel, tids)
            if rec.ok is not None and not rec.ok.all():
                for x in dsts:
                    r.reg(x)
                    r.defined[x][tids] = rec.ok
                    r.undefined_from[x] = rec.origin
        return kind, propagating
