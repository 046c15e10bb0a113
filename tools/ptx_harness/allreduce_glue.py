"""The IPC allreduce (csrc/allreduce/fused_allreduce.cu) on several simulated GPUs.

`SimRanks` plays the host side of every rank of one communicator on one tools/ptxsim Machine:
it allocates each rank's IPC buffer once (the kernel file's make_layout, sized from max_tokens /
hidden as spec_kernels/comm/ipc.py sizes it), initialises it as init_buffer() does (zeros over
the signals, then the compiled fill_kernel writing num_blocks into the signals and the -0.0
sentinel pairs over the push slots), and gives every rank the same list of buffer addresses (the peers' "IPC mappings": the
simulated GPUs share one global memory). `SimRanks.call()` is one collective call: per rank it
fills the kernel's `Params` struct exactly as launch() does from the `Call` that csrc/allreduce/allreduce_binding.cpp
builds, picks the kernel instance launch_typed() picks (element type, fp8 out, ITEMS from
row_launch), and runs the launches of all participating ranks together in ONE Machine.run, so
the flag and sentinel spin-waits of one rank see the other ranks' stores. It returns each
rank's outputs and its host error word.

The buffers persist across calls, so consecutive calls exercise the device sequence numbers,
the flag / staging parity and the push-slot rotation exactly as on the GPU. Ranks can be left
out of a call (a rank that never arrives) or given different shapes (a size mismatch).
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
from typing import Optional, Sequence

import numpy as np
import torch

from spec_kernels.comm import ipc
from tools.ptx_harness.build import cuda_ptx
from ptxsim.executor import Launch, Machine
from ptxsim.launch import module_of, pack_params

from tools.ptx_harness.shipped import header_struct, source_constant

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARCH = os.environ.get("PTXSIM_ARCH", "sm_120a")
_SOURCE = "allreduce/fused_allreduce.cu"
KERNEL_FILE = os.path.join(REPO, "csrc", _SOURCE)

# From the shipped code (checked against the extension by tests/test_limits.py), then the
# kernel file's own layout constants (csrc/allreduce/fused_allreduce.cu).
K_MAX_RANKS = ipc.MAX_RANKS
K_MAX_BLOCKS = ipc.MAX_BLOCKS
K_PUSH_SLOTS = source_constant("kPushSlots", _SOURCE)
K_ALIGN = source_constant("kAlign", _SOURCE)
ALGORITHMS = ipc.ALGORITHM_CODES
_KERNEL = {0: "19oneshot_push_kernel", 1: "19oneshot_pull_kernel", 2: "14twoshot_kernel", 3: "19oneshot_push_kernel"}
PUSH_ALGORITHMS = (0, 3)
K_OK, K_TIMEOUT, K_SIZE_MISMATCH, K_BLOCKS_MISMATCH = (ipc.ERROR_OK, ipc.ERROR_TIMEOUT, ipc.ERROR_SIZE_MISMATCH,
                                                       ipc.ERROR_BLOCKS_MISMATCH)
SENTINEL_PAIR = source_constant("kSentinelPair", _SOURCE)
PUSH_CAPACITY = ipc.PUSH_CAPACITY



# The structs as the kernel file and norm_allreduce.h declare them (parsed; pack_params refuses a
# struct whose size differs from the kernel's .param).
Layout = header_struct("Layout", _SOURCE)
Params = header_struct("Params", _SOURCE)
Signals = header_struct("Signals", _SOURCE)


class ErrorWord(header_struct("ErrorWord")):
    """struct ErrorWord (norm_allreduce.h): what a failed call leaves in host-mapped memory."""

    def as_dict(self):
        return {name: getattr(self, name) for name, _ in self._fields_}


# struct Signals: the offsets of its fields in a rank's buffer.
STATE_OFFSET = Signals.state.offset
STATE_WORDS = ctypes.sizeof(header_struct("BlockState", _SOURCE)) // 4  # uint32 words per block
FIRST_ERROR_OFFSET = Signals.first_error.offset
NUM_BLOCKS_OFFSET = Signals.num_blocks.offset
SIGNALS_BYTES = ctypes.sizeof(Signals)


message_header = ipc.message_header


def _align_up(v: int) -> int:
    return (v + K_ALIGN - 1) // K_ALIGN * K_ALIGN


def make_layout(world: int, max_bytes: int, push_bytes: int) -> Layout:
    """make_layout() of the kernel file."""
    lay = Layout()
    off = _align_up(SIGNALS_BYTES)
    msg = _align_up(max_bytes)
    for i in range(2):
        lay.staging[i] = off
        off += msg
    for i in range(2):
        lay.gather[i] = off
        off += msg
    slot = _align_up(push_bytes) * world
    for i in range(K_PUSH_SLOTS):
        lay.push[i] = off
        off += slot
    lay.total = off
    return lay


def row_launch(nvec: int, max_items: int = 2):
    """norm::row_launch (csrc/norm/rmsnorm_row.cuh): (threads, items)."""
    items = 1
    while items < max_items and nvec > items * 1024:
        items *= 2
    threads = (nvec + items - 1) // items
    threads = (threads + 31) // 32 * 32
    return min(threads, 1024), items


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy()
    return t.numpy()


def _from_np(a: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a).copy())
    if dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).view(dtype).reshape(shape)
    if dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).view(dtype).reshape(shape)
    return t.view(dtype).reshape(shape)


@dataclasses.dataclass
class RankInput:
    """One rank's arguments of a call (residual / weight / out_scale: the fused epilogue)."""
    x: torch.Tensor
    residual: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    eps: float = 1e-6
    out_scale: Optional[float] = None
    in_place: bool = False  # out is x and residual_out is residual (what FusedAllReduce allows)


@dataclasses.dataclass
class RankResult:
    out: torch.Tensor
    residual_out: Optional[torch.Tensor]
    error: dict
    stats: object


# A value no kernel writes: outputs start as this so a missing store shows.
_POISON16 = 0x7E7E
_POISON8 = 0x7E


class SimRanks:
    """One communicator of `world` simulated GPUs on one Machine (one IPC buffer per rank)."""

    def __init__(self, world: int, hidden: int, dtype: torch.dtype, max_tokens: int, *, num_blocks: int = 2,
                 timeout_ns: int = 200_000, spin_limit: int = 2_000_000, check_races: bool = True,
                 ptx: Optional[str] = None):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float16 or bfloat16, got {dtype}")
        self.world, self.hidden, self.dtype = world, hidden, dtype
        self.num_blocks = num_blocks
        self.timeout_ns = timeout_ns
        row = hidden * 2
        # spec_kernels/comm/ipc.py IpcBuffers
        self.max_bytes = max_tokens * row
        self.push_bytes = min(self.max_bytes, max(row, PUSH_CAPACITY // row * row))
        self.layout = make_layout(world, self.max_bytes, self.push_bytes)
        self.push_stride = _align_up(self.push_bytes)
        self.m = Machine(check_races=check_races, spin_limit=spin_limit,
                         arch="sm_120" if "120" in ARCH else "sm_90")
        # ptx: the PTX of an edited kernel file (a mutant or a candidate fix), default the checkout's
        self.mod = module_of(ptx if ptx is not None else cuda_ptx(KERNEL_FILE, ARCH))
        self.bases = [self.m.alloc(self.layout.total, f"ipc_buffer_rank{r}") for r in range(world)]
        self.errors = [self.m.alloc(ctypes.sizeof(ErrorWord), f"host_error_rank{r}") for r in range(world)]
        self.launches = []
        self._init_buffers()

    # ---------------------------------------------------------------- set-up
    def entry(self, algorithm: int, fp8_out: bool, items: int):
        t = "13__nv_bfloat16" if self.dtype == torch.bfloat16 else "6__half"
        out = "13__nv_fp8_e4m3" if fp8_out else "S3_"
        suffix = f"{_KERNEL[algorithm]}I{t}{out}Li{items}EEEvNS1_6ParamsE"
        names = [n for n in self.mod.entries if n.endswith(suffix)]
        if len(names) != 1:
            raise LookupError(f"no unique kernel instance *{suffix} in the PTX ({len(names)} found)")
        return self.mod.entry(names[0])

    def _init_buffers(self):
        """init_buffer(): memset 0 over [0, push[0]) (the buffer starts zeroed here), fill_kernel
        writing num_blocks into the signals, then fill_kernel with the sentinel over the push slots
        (a smaller grid than the host's <<<256, 256>>>: the kernel's loop is grid-strided, so the
        result is the same)."""
        names = [n for n in self.mod.entries if "11fill_kernelEPjmj" in n]
        e = self.mod.entry(names[0])
        words = (self.layout.total - self.layout.push[0]) // 4
        launches = [Launch(e, (1,), (32,), pack_params(e, [b + NUM_BLOCKS_OFFSET, 1, self.num_blocks]),
                           name=f"fill_kernel num_blocks rank {r}", gpu=r) for r, b in enumerate(self.bases)]
        launches += [Launch(e, (4,), (256,), pack_params(e, [b + self.layout.push[0], words, SENTINEL_PAIR]),
                            name=f"fill_kernel rank {r}", gpu=r) for r, b in enumerate(self.bases)]
        self.m.run(*launches, module=self.mod)

    def reset(self):
        """IpcBuffers.reset() on every rank: init_buffer() again over the same buffers (memset 0
        over [0, push[0]), then the fill kernels) and the host error words cleared."""
        for base, err in zip(self.bases, self.errors):
            self.m.write(base, np.zeros(self.layout.push[0], np.uint8))
            self.m.write(err, np.zeros(ctypes.sizeof(ErrorWord), np.uint8))
        self._init_buffers()

    # ---------------------------------------------------------------- inspection
    def block_state(self, rank: int):
        """BlockState per block of `rank`: (seq, push_slot) rows."""
        a = self.m.download(self.bases[rank] + STATE_OFFSET, np.uint32, (K_MAX_BLOCKS, STATE_WORDS))
        return a[: self.num_blocks].copy()

    def set_call_counter(self, seq: int) -> None:
        """Set every block's device call counter on every rank (as after `seq` calls)."""
        for base in self.bases:
            state = self.m.download(base + STATE_OFFSET, np.uint32, (K_MAX_BLOCKS, STATE_WORDS))
            state[:, 0] = seq
            self.m.write(base + STATE_OFFSET, state)

    def error_word(self, rank: int) -> dict:
        raw = self.m.download(self.errors[rank], np.uint8, (ctypes.sizeof(ErrorWord),))
        return ErrorWord.from_buffer_copy(raw.tobytes()).as_dict()

    def push_slot_bytes(self, rank: int, slot: int) -> np.ndarray:
        n = self.push_stride * self.world
        return self.m.download(self.bases[rank] + self.layout.push[slot], np.uint32, (n // 4,))

    # ---------------------------------------------------------------- one call
    def params(self, algorithm: int, rank: int, inp: RankInput, ptrs: dict, timeout_ns: int, blocks: int) -> bytes:
        """What launch() makes of the Call csrc/allreduce/allreduce_binding.cpp fills for this rank; refuses what launch()
        and the binding refuse (so a test cannot feed the kernel a call the host would not make)."""
        x = inp.x
        rows, hidden = x.shape
        fused = inp.residual is not None
        fp8 = fused and inp.out_scale is not None
        nbytes = rows * hidden * x.element_size()
        if hidden % 8 or hidden < 8 or hidden > 16384:
            raise ValueError(f"hidden must be a multiple of 8 in [8, 16384], got {hidden}")
        if nbytes > self.max_bytes or (algorithm in PUSH_ALGORITHMS and nbytes > self.push_bytes) or \
                rows > ipc.MAX_HEADER_ROWS:
            raise ValueError(f"{nbytes} bytes do not fit the buffers")
        p = Params()
        for r in range(K_MAX_RANKS):
            p.bases[r] = self.bases[r] if r < self.world else 0
        ctypes.memmove(ctypes.addressof(p.layout), ctypes.addressof(self.layout), ctypes.sizeof(Layout))
        p.push_stride = self.push_stride
        p.x, p.out = ptrs["x"], ptrs["out"]
        p.residual, p.weight, p.residual_out = (ptrs["residual"], ptrs["weight"], ptrs["residual_out"]) if fused \
            else (0, 0, 0)
        p.host_error = self.errors[rank]
        p.rows, p.hidden, p.world, p.rank, p.algorithm = rows, hidden, self.world, rank, algorithm
        op = (2 if fp8 else 1) if fused else 0
        p.header = message_header(op, algorithm, blocks, rows)
        p.fused = fused
        p.eps = inp.eps
        p.inv_scale = float(np.float32(1.0 / inp.out_scale)) if fp8 else 1.0
        p.timeout_ns = timeout_ns
        return bytes(p)

    def call(self, algorithm, inputs: Sequence[Optional[RankInput]], *, timeout_ns: Optional[int] = None,
             launch_blocks: Optional[Sequence[int]] = None):
        """One collective call. algorithm: a name or code, or one per rank (ranks that disagree);
        inputs[r] is rank r's arguments, or None for a rank that does not take part (it never
        arrives); launch_blocks[r] replaces rank r's grid (launch() launches num_blocks, or 1 for
        oneshot_push_1block). Returns a list (per rank) of RankResult or None."""
        if len(inputs) != self.world:
            raise ValueError(f"{len(inputs)} inputs for {self.world} ranks")
        per_rank = list(algorithm) if isinstance(algorithm, (list, tuple)) else [algorithm] * self.world
        if len(per_rank) != self.world:
            raise ValueError(f"{len(per_rank)} algorithms for {self.world} ranks")
        timeout_ns = self.timeout_ns if timeout_ns is None else timeout_ns
        launches, keep = [], []
        for rank, inp in enumerate(inputs):
            if inp is None:
                continue
            algorithm = per_rank[rank]
            algo = ALGORITHMS[algorithm] if isinstance(algorithm, str) else int(algorithm)
            x = inp.x
            if x.dtype != self.dtype or x.dim() != 2:
                raise ValueError(f"x must be a 2-D {self.dtype} tensor")
            fused = inp.residual is not None
            fp8 = fused and inp.out_scale is not None
            m = self.m
            ptrs = {"x": m.upload(_np(x), f"x rank{rank}")}
            out_dtype = torch.float8_e4m3fn if fp8 else self.dtype
            if inp.in_place and fp8:
                raise ValueError("an fp8 out cannot be x")
            if inp.in_place:
                ptrs["out"] = ptrs["x"]
            elif fp8:
                ptrs["out"] = m.upload(np.full(x.numel(), _POISON8, np.uint8), f"out rank{rank}")
            else:
                ptrs["out"] = m.upload(np.full(x.numel(), _POISON16, np.uint16), f"out rank{rank}")
            if fused:
                ptrs["residual"] = m.upload(_np(inp.residual), f"residual rank{rank}")
                ptrs["weight"] = m.upload(_np(inp.weight), f"weight rank{rank}")
                ptrs["residual_out"] = ptrs["residual"] if inp.in_place else \
                    m.upload(np.full(x.numel(), _POISON16, np.uint16), f"residual_out rank{rank}")
            threads, items = row_launch(x.shape[1] // 8, 2)
            e = self.entry(algo, fp8, items)
            blocks = 1 if algo == ALGORITHMS["oneshot_push_1block"] else self.num_blocks
            if launch_blocks is not None:
                blocks = launch_blocks[rank]
            raw = self.params(algo, rank, inp, ptrs, timeout_ns, blocks)
            launches.append(Launch(e, (blocks,), (threads,), pack_params(e, [raw]),
                                   name=f"{algorithm} rank {rank}", gpu=rank))
            keep.append((rank, x.shape, out_dtype, fused, ptrs))
        stats = self.m.run(*launches, module=self.mod)
        results: list = [None] * self.world
        for (rank, shape, out_dtype, fused, ptrs), st in zip(keep, stats):
            self.launches.append((per_rank[rank], rank, st))
            n = int(np.prod(shape))
            if out_dtype == torch.float8_e4m3fn:
                out = _from_np(self.m.download(ptrs["out"], np.uint8, (n,)), out_dtype, shape)
            else:
                out = _from_np(self.m.download(ptrs["out"], np.uint16, (n,)), out_dtype, shape)
            res = _from_np(self.m.download(ptrs["residual_out"], np.uint16, (n,)), self.dtype, shape) if fused \
                else None
            results[rank] = RankResult(out, res, self.error_word(rank), st)
        return results


def check_params_match_ptx(sim: SimRanks) -> None:
    """The ctypes Params is exactly the size of every kernel's .param struct."""
    for name in sim.mod.entries:
        if "fill_kernel" in name:
            continue
        e = sim.mod.entry(name)
        if len(e.params) != 1 or e.params[0].size != ctypes.sizeof(Params):
            raise AssertionError(f"{name}: .param of {[p.size for p in e.params]} bytes, ctypes Params "
                                 f"{ctypes.sizeof(Params)}")
