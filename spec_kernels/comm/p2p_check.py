"""A P2P self-test over CUDA IPC, run before FusedAllReduce trusts its IPC algorithms and by
``python -m spec_kernels.comm.topo`` (both use :func:`run_self_test`, so they agree).

A driver that reports P2P access is not proof that it works: GPUs on different sockets, or
behind an IOMMU / PCIe ACS, can lack P2P or deliver wrong data. So every rank maps every peer's
test buffer (the same CUDA IPC mapping the allreduce uses) and, with kernels doing SM loads and
stores through the mapping as the allreduce kernels do:

1. zeroes its own buffer and writes its own pattern into its "own" slot;
2. (handle exchange) writes a pattern into its slot of every peer's buffer;
3. (barrier) checks what every peer wrote into its buffer, reads back what it wrote into each
   peer's buffer, and reads each peer's own slot;
4. (one all_gather) every rank gets every result and computes the same verdict per ordered pair.

Patterns depend on a per-run nonce, the writer, the owner, the slot kind and the word position
(never zero), so a write that never arrived (zeros), data from another slot or rank, a shifted
copy or a single flipped byte all fail. Every wait is bounded by ``timeout_s``; a timeout fails
the pair. Ranks always make the same collectives, whatever failed locally.
"""
from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

WORDS = 2048  # int32 words per slot (8 KiB): a few ms at most, even interpreted
GatherInts = Callable[[list[int]], list[list[int]]]

# Outcome codes of one step (a record is 5 ints: code, then up to 4 details).
OK, STALE, SHIFTED, CORRUPT, NO_SETUP, NO_MAP, ERROR, TIMEOUT, SKIPPED = range(9)
_RECORD = 5
_MAX_SHIFT = 64
_PUSHED, _OWN = 0, 1
_M32 = 0xFFFFFFFF


# --------------------------------------------------------------------------- patterns
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32 without overflowing int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def pattern(nonce: int, writer: int, owner: int, kind: int, words: int = WORDS) -> torch.Tensor:
    """int32 words a writer puts into an owner's buffer (kind 0: the writer's slot in a peer's
    buffer, kind 1: the owner's own slot). Odd, hence never zero; mixed, so shifts show."""
    seed = ((nonce & _M32) ^ (writer * 0x3C6EF372 + owner * 0x1B873593 + kind * 0x27D4EB2F + 0x165667B1)) & _M32
    x = (torch.arange(words, dtype=torch.int64) * 0x9E3779B1 + seed) & _M32
    for c in (0x7FEB352D, 0x846CA68B):  # lowbias32 finaliser
        x = _mul32(x ^ (x >> 16), c)
    x = (x ^ (x >> 16)) | 1
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def compare(got: torch.Tensor, expected: torch.Tensor) -> list[int]:
    """A record: [OK] or what is wrong (STALE: all zero; SHIFTED by k words; CORRUPT: first bad
    word, got, expected, number of bad words), padded to 5 ints."""
    got, expected = got.to(torch.int32).flatten(), expected.to(torch.int32).flatten()
    if got.shape != expected.shape:
        raise ValueError(f"got has {got.numel()} words, expected {expected.numel()}")
    bad = (got != expected).nonzero().flatten()
    if bad.numel() == 0:
        return _rec(OK)
    if not got.any():
        return _rec(STALE)
    n = got.numel()
    for k in range(1, min(_MAX_SHIFT, n // 2) + 1):  # got[i] == expected[i - k]: moved k words up
        if torch.equal(got[k:], expected[:-k]):
            return _rec(SHIFTED, k)
        if torch.equal(got[:-k], expected[k:]):
            return _rec(SHIFTED, -k)
    i = int(bad[0])
    return _rec(CORRUPT, i, int(got[i]) & _M32, int(expected[i]) & _M32, bad.numel())


def _rec(code: int, *details: int) -> list[int]:
    return [code, *details, *[0] * (_RECORD - 1 - len(details))]


def describe(record: list[int], words: int = WORDS) -> str:
    code, a, b, c, d = record
    if code == STALE:
        return "nothing arrived (all words still zero)"
    if code == SHIFTED:
        return f"the data arrived shifted by {a:+d} words"
    if code == CORRUPT:
        return f"word {a} is {b:#010x}, expected {c:#010x} ({d} of {words} words wrong)"
    if code == NO_SETUP:
        return f"rank {a} could not allocate or export its test buffer"
    if code == NO_MAP:
        return "mapping the peer's buffer (cudaIpcOpenMemHandle) failed"
    if code == ERROR:
        return "the kernel failed to launch or run"
    if code == TIMEOUT:
        return "timed out"
    if code == SKIPPED:
        return "not run (an earlier step failed)"
    return "ok" if code == OK else f"error code {code}"


# --------------------------------------------------------------------------- transports
def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def p2p_copy_words(src_addr, dst_addr, n, BLOCK: tl.constexpr):
        # Raw addresses: one of them is a peer's buffer mapped through CUDA IPC.
        src = src_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
        dst = dst_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)

    return p2p_copy_words


_KERNEL = None


class MappedTransport:
    """Moves words between local memory and any rank's test buffer, addressed by raw pointers
    (``self.addrs[rank]``, valid in this process), with the Triton kernel above: SM loads and
    stores through the mapping. Subclasses allocate, export and map the buffers.

    On CUDA the kernels run on a side stream and are waited for by polling an event until a
    deadline, so a hung P2P access fails the test instead of blocking the process group."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.addrs: dict[int, int] = {}
        self.hung = False
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # subclass API
    def allocate(self, nbytes: int) -> int:
        """Allocate this rank's buffer; return its address."""
        raise NotImplementedError

    def export(self) -> bytes:
        raise NotImplementedError

    def open(self, handle: bytes) -> int:
        """Map a peer's buffer from its exported handle; return its address here."""
        raise NotImplementedError

    def close(self) -> None:
        """Unmap the peers' buffers."""

    def free(self) -> None:
        """Free this rank's buffer (after every peer unmapped it)."""

    # data movement
    def store(self, rank: int, offset: int, values: torch.Tensor, timeout_s: float) -> None:
        src = values.to(self.device, torch.int32).contiguous()
        self._run(src.data_ptr(), self.addrs[rank] + 4 * offset, src.numel(), timeout_s, keep=src)

    def load(self, rank: int, offset: int, words: int, timeout_s: float) -> torch.Tensor:
        dst = torch.full((words,), -1, dtype=torch.int32, device=self.device)
        self._run(self.addrs[rank] + 4 * offset, dst.data_ptr(), words, timeout_s, keep=dst)
        return dst.cpu()

    def _run(self, src: int, dst: int, n: int, timeout_s: float, keep: torch.Tensor) -> None:
        global _KERNEL
        if self.hung:
            raise TimeoutError("an earlier kernel never finished")
        if _KERNEL is None:
            _KERNEL = _copy_kernel()
        grid, done = (-(-n // 1024),), None
        if self._stream is None:  # CPU memory: the Triton interpreter
            _KERNEL[grid](src, dst, n, BLOCK=1024)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # `keep` was written there
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                _KERNEL[grid](src, dst, n, BLOCK=1024)
                done = torch.cuda.Event()
                done.record(self._stream)
            keep.record_stream(self._stream)
        deadline = time.monotonic() + timeout_s
        while not self._done(done):
            if time.monotonic() > deadline:
                self.hung = True
                raise TimeoutError(f"a P2P copy kernel did not finish within {timeout_s:g} s")
            time.sleep(20e-6)

    def _done(self, event) -> bool:
        return event is None or event.query()


class ExtensionIpcTransport(MappedTransport):
    """cudaMalloc + cudaIpcGetMemHandle / cudaIpcOpenMemHandle through the extension's ops:
    exactly how spec_kernels.comm.ipc maps the allreduce buffers."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        from .._ops import cuda_ops

        self._ops = cuda_ops()
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.base = 0
        self.opened: list[int] = []

    def allocate(self, nbytes: int) -> int:
        self.base = self._ops.allreduce_ipc_alloc(nbytes, self.index)
        return self.base

    def export(self) -> bytes:
        return bytes(self._ops.allreduce_ipc_handle(self.base, self.index).tolist())

    def open(self, handle: bytes) -> int:
        ptr = self._ops.allreduce_ipc_open(torch.tensor(list(handle), dtype=torch.uint8), self.index)
        self.opened.append(ptr)
        return ptr

    def close(self) -> None:
        if self.hung:  # unmapping waits for the hung kernel: leak the mappings instead
            return
        for ptr in self.opened:
            self._ops.allreduce_ipc_close(ptr, self.index)
        self.opened = []

    def free(self) -> None:
        if self.base and not self.hung:
            self._ops.allreduce_ipc_free(self.base, self.index)
        self.base = 0


class TorchIpcTransport(MappedTransport):
    """Buffers from torch's allocator shared with torch's CUDA IPC (topo without the extension)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.buffer: Optional[torch.Tensor] = None
        self.peers: list[torch.Tensor] = []

    def allocate(self, nbytes: int) -> int:
        self.buffer = torch.empty(-(-nbytes // 4), dtype=torch.int32, device=self.device)
        return self.buffer.data_ptr()

    def export(self) -> bytes:
        from torch.multiprocessing.reductions import reduce_tensor

        return pickle.dumps(reduce_tensor(self.buffer)[1])

    def open(self, handle: bytes) -> int:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        self.peers.append(rebuild_cuda_tensor(*pickle.loads(handle)))
        return self.peers[-1].data_ptr()

    def close(self) -> None:
        if not self.hung:
            self.peers = []

    def free(self) -> None:
        if not self.hung:
            self.buffer = None


# --------------------------------------------------------------------------- the test
@dataclass
class SelfTestResult:
    """Verdict per ordered pair (a, b): None if rank a's kernels wrote and read rank b's memory
    correctly (and b saw a's writes), else why not. Identical on every rank."""

    world: int
    pairs: dict[tuple[int, int], Optional[str]] = field(default_factory=dict)
    local_error: Optional[str] = None  # an exception seen on this rank (for messages only)

    @property
    def passed(self) -> bool:
        return all(v is None for v in self.pairs.values())

    def failed_pairs(self) -> list[tuple[int, int]]:
        return [p for p, v in sorted(self.pairs.items()) if v is not None]

    def verdict(self, a: int, b: int) -> str:
        """'pass' or 'FAIL (why)' for the ordered pair a -> b."""
        why = self.pairs[(a, b)]
        return "pass" if why is None else f"FAIL ({why})"

    def reason(self) -> Optional[str]:
        """None when every pair passed, else one line naming the failing pairs."""
        bad = self.failed_pairs()
        if not bad:
            return None
        names = ", ".join(f"{a}->{b}" for a, b in bad)
        details = "; ".join(f"{a}->{b}: {self.pairs[(a, b)]}" for a, b in bad[:4])
        more = f"; and {len(bad) - 4} more" if len(bad) > 4 else ""
        local = f" [this rank: {self.local_error}]" if self.local_error else ""
        return f"the P2P self-test over CUDA IPC failed for rank pair(s) {names} ({details}{more}){local}"


def _bytes_to_words(data: bytes, words: int) -> list[int]:
    padded = data + bytes(8 * words - len(data))
    return [int.from_bytes(padded[i:i + 8], "little", signed=True) for i in range(0, 8 * words, 8)]


def _words_to_bytes(words: list[int], length: int) -> bytes:
    return b"".join(int(w).to_bytes(8, "little", signed=True) for w in words)[:length]


def run_self_test(rank: int, world: int, gather: GatherInts, transport: MappedTransport, *,
                  timeout_s: float = 10.0, words: int = WORDS) -> SelfTestResult:
    """Run the self-test on this rank (collective: every rank of the group calls it with the same
    world and words). ``gather(ints)`` must all_gather one equal-length int list per rank over the
    group and return the rows by rank. Four gathers in all, made whatever fails locally."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world={world}), got {rank}")
    if words < 2 or not timeout_s > 0:
        raise ValueError(f"words must be >= 2 and timeout_s > 0, got words={words}, timeout_s={timeout_s}")
    nonce = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    own = world * words  # slots 0..world-1: written by that rank; slot `world`: the owner's own
    errors: list[str] = []

    def note(what: str, exc: BaseException) -> None:
        errors.append(f"{what}: {type(exc).__name__}: {exc}")

    # 1. own buffer: zeroed, own slot filled; then the handle exchange (also a barrier: no peer
    # writes before the owner zeroed its buffer).
    handle, ready = b"", False
    try:
        transport.addrs[rank] = transport.allocate(4 * (world + 1) * words)
        transport.store(rank, 0, torch.zeros(own, dtype=torch.int32), timeout_s)
        transport.store(rank, own, pattern(nonce, rank, rank, _OWN, words), timeout_s)
        handle, ready = transport.export(), True
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        note("setting up the buffer", exc)
    rows = gather([int(ready), nonce, len(handle)])
    ready_of, nonce_of = [bool(r[0]) for r in rows], [r[1] for r in rows]
    hwords = max(1, -(-max(r[2] for r in rows) // 8))
    handles = gather(_bytes_to_words(handle, hwords))

    # 2. map every peer's buffer and write this rank's slot into it.
    writes = []
    for q in range(world):
        if q == rank:
            rec = _rec(OK)
        elif not (ready and ready_of[q]):
            rec = _rec(NO_SETUP, rank if not ready else q)
        else:
            try:
                transport.addrs[q] = transport.open(_words_to_bytes(handles[q], rows[q][2]))
            except Exception as exc:  # noqa: BLE001
                note(f"mapping rank {q}'s buffer", exc)
                rec = _rec(NO_MAP)
            else:
                rec = _step(lambda: transport.store(q, rank * words, pattern(nonce, rank, q, _PUSHED, words),
                                                    timeout_s), f"writing into rank {q}", note)
        writes.extend(rec)
    write_rows = gather(writes)  # barrier: every write is done (or failed) before anyone checks

    # 3. check: what each peer wrote here, what this rank wrote there, each peer's own slot.
    checks = []
    for q in range(world):
        if q == rank:
            checks.extend(_rec(OK) * 3)
            continue
        peer_write = write_rows[q][_RECORD * rank:_RECORD * (rank + 1)]
        if peer_write[0] != OK:
            arrived = _rec(SKIPPED)
        else:
            arrived = _step(lambda: compare(transport.load(rank, q * words, words, timeout_s),
                                            pattern(nonce_of[q], q, rank, _PUSHED, words)),
                            f"reading rank {q}'s write here", note)
        my_write = writes[_RECORD * q:_RECORD * (q + 1)]
        if my_write[0] != OK:
            back = own_slot = _rec(SKIPPED)
        else:
            back = _step(lambda: compare(transport.load(q, rank * words, words, timeout_s),
                                         pattern(nonce, rank, q, _PUSHED, words)),
                         f"reading back from rank {q}", note)
            own_slot = _step(lambda: compare(transport.load(q, own, words, timeout_s),
                                             pattern(nonce_of[q], q, q, _OWN, words)),
                             f"reading rank {q}'s own slot", note)
        checks.extend(arrived + back + own_slot)
    try:
        transport.close()  # before the last gather: after it, owners free their buffers
    except Exception as exc:  # noqa: BLE001
        note("unmapping the peers' buffers", exc)
    check_rows = gather(checks)
    try:
        transport.free()
    except Exception as exc:  # noqa: BLE001
        note("freeing the buffer", exc)

    # 4. the verdicts, from gathered data only: the same on every rank.
    result = SelfTestResult(world, local_error="; ".join(errors) or None)
    for a in range(world):
        for b in range(world):
            if a != b:
                result.pairs[(a, b)] = _pair_verdict(a, b, write_rows, check_rows, words)
    return result


def _step(fn, what: str, note) -> list[int]:
    try:
        out = fn()
    except TimeoutError as exc:
        note(what, exc)
        return _rec(TIMEOUT)
    except Exception as exc:  # noqa: BLE001
        note(what, exc)
        return _rec(ERROR)
    return out if out is not None else _rec(OK)


def _pair_verdict(a: int, b: int, write_rows, check_rows, words: int) -> Optional[str]:
    """Why rank a's SM accesses to rank b's buffer are not proved, or None."""
    def rec(rows, rank, index):
        return rows[rank][_RECORD * index:_RECORD * (index + 1)]

    write = rec(write_rows, a, b)
    if write[0] in (NO_SETUP, NO_MAP):
        return describe(write, words)
    parts = []
    if write[0] != OK:
        parts.append(f"rank {a} writing into rank {b}: {describe(write, words)}")
    steps = ((rec(check_rows, b, 3 * a), f"rank {b} checking what rank {a} wrote there"),
             (rec(check_rows, a, 3 * b + 1), f"rank {a} reading back what it wrote into rank {b}"),
             (rec(check_rows, a, 3 * b + 2), f"rank {a} reading rank {b}'s own data"))
    for record, what in steps:
        if record[0] not in (OK, SKIPPED):
            parts.append(f"{what}: {describe(record, words)}")
    return "; ".join(parts) or None


# --------------------------------------------------------------------------- entry points
def communicator_reason(comm, transport: Optional[MappedTransport] = None) -> Optional[str]:
    """For FusedAllReduce: None when every ordered pair of its group passed, else a reason naming
    the failing pairs, the same on every rank (collective)."""
    if transport is None:
        try:
            transport = ExtensionIpcTransport(comm.device)
        except Exception:  # noqa: BLE001 - stays collective: the ranks then report NO_SETUP
            transport = _Unusable(comm.device)
    gather = lambda ints: comm._all_gather_ints(ints, "the P2P self-test")  # noqa: E731
    return run_self_test(comm.rank, comm.world_size, gather, transport, timeout_s=min(comm.timeout_s, 10.0)).reason()


def group_gather(group=None) -> GatherInts:
    """all_gather of int lists over a torch.distributed group with a CPU backend (gloo)."""
    import torch.distributed as dist

    def gather(ints: list[int]) -> list[list[int]]:
        mine = torch.tensor(ints, dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, mine, group=group)
        return torch.stack(rows).tolist()

    return gather


class _Unusable(MappedTransport):
    def allocate(self, nbytes: int) -> int:
        raise RuntimeError("the CUDA extension's IPC ops are unavailable")
