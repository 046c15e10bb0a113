"""Emulation of csrc/allreduce/fused_allreduce.cu: oneshot_push_kernel, oneshot_pull_kernel and
twoshot_kernel as launch() launches them, on W = 2, 4 or 8 ranks, with the residual add +
RMSNorm epilogue of csrc/norm/rmsnorm_row.cuh (norm.py's transliteration), checked against a sum
over ranks in rank order (fp32, rounded once) followed by spec_kernels/norm/reference.py.

Model
* Every rank's IPC buffer is one array of 32-bit words with the kernel's layout (make_layout,
  struct Signals: flags[2][2][kMaxBlocks][kMaxRanks], push_headers[3][kMaxBlocks][kMaxRanks],
  BlockState per block, first_error), initialised as init_buffer does (zeros, then the -0.0
  sentinel pairs over the push slots). Every rank "maps" every buffer: peers read and write them
  directly, with bounds checks per region (a staging access must stay in that staging area, a
  push-slot access in its sender's part of the slot).
* Every block of every rank is a generator running the transliterated kernel, vectorised over
  its threads (the thread -> vector mapping `threadIdx.x + i * blockDim.x` and blockDim / ITEMS
  from row_launch are the kernel's). A seeded scheduler interleaves the blocks of all ranks;
  ranks get random, changing speeds, so a rank runs ahead of another as far as the protocol
  lets it. A rank's next call starts when all blocks of its current call have finished (stream
  order). Spin-waits yield after every poll.
* Weak memory: a block's stores to any buffer are queued and land later, in any order, 4-byte
  words of one 16-byte vector possibly at different times (torn vectors); __threadfence_system
  (fence at system scope) makes every earlier store of the block land; st.release.sys does too
  before its own store (which then lands later); ld.acquire / ld.volatile read what has landed.
  Scopes: every peer is another GPU, so a GPU-scope fence (__threadfence) - and the end of a
  kernel, which orders at GPU scope too - orders nothing the peers observe: the block's stores
  in flight then are "held": they land only when something forces them (the block reads those
  addresses, a later system-scope fence of the block, or no block can progress otherwise), i.e.
  as late as the hardware may make them visible to another GPU. A store to an address the same
  block has a store pending for lands after it, and a block's load of such an address makes its
  own stores land first (a thread reads its own writes).
* Loads run early too: a block's data loads that only its last ld.acquire or system-scope fence
  orders (the staging and gather rows read after a flag wait) may be performed as early as that
  point, so a word that landed since may still read as the value it replaced (the model takes
  that value whenever it is allowed: the adversarial choice). Polling loads (the flag words, the
  push data checked for the sentinel) read what has landed. Without an acquire after the flag
  poll, a peer's rows that landed after the block's previous ordering point read as stale.
* Every word carries a shadow: which rank wrote it for which call (call = position in the
  emulated call sequence, the same on every rank), data or sentinel, and which ranks still have
  to read it. Reading a word that does not hold the expected rank's data of the reader's call is
  a stale read; landing a store on data a rank still has to read is an overwrite before read.
  Both raise at once, naming the kernel statement (the emulator line).
* %globaltimer is the scheduler's turn counter: Deadline checks it every 256 polls, and
  timeout_ns is given in turns. A run in which every block waits and no store is in flight is
  a deadlock and raises (unless a case expects the timeouts to fire); a run that exceeds its
  turn budget is a hang.

Checks: the non-fused result is bit-identical to the fp32 rank-order sum rounded once;
residual_out bit-identical to the reference, out within one rounding step (bf16 1.6e-2 + 8e-3
rel, fp16 2e-3 + 1e-3 rel, fp8 2e-3 + 6.25% rel after dequantising) and bit-identical on all
ranks; each output element written exactly once; the host error words stay 0 - or, in the
timeout / size-mismatch cases, carry the kernel's report on every surviving rank.

repro_after_failure() and repro_seq_wrap() (python allreduce.py repro) are the scenarios of the
two problems this emulator found in the kernel at 7e748f8 (README.md, "Findings"); both are fixed
in the kernel and transliterated here (rank_failed(), next_seq()), and both are cases.
Update this file together with the kernel (see README.md).
"""
from __future__ import annotations

import bisect
import random
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (str(HERE), str(REPO)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from norm import F32, FP8, Storage, add_rmsnorm_row, round_to, row_launch, thread_vectors  # noqa: E402
from ptx import HazardError, SharedMemory, fail  # noqa: E402

KERNEL = "csrc/allreduce/fused_allreduce.cu (epilogue: csrc/norm/rmsnorm_row.cuh, via norm.py)"
K_MAX_RANKS, K_MAX_BLOCKS = 8, 64  # norm_allreduce.h
K_ALIGN = 256
K_SENTINEL_PAIR = 0x80008000  # two 16-bit -0.0
K_PUSH_SLOTS = 3
PUSH, PULL, TWOSHOT = 0, 1, 2  # kOneShotPush, kOneShotPull, kTwoShot
ALGOS = {PUSH: "oneshot_push", PULL: "oneshot_pull", TWOSHOT: "twoshot"}
K_OK, K_TIMEOUT, K_SIZE_MISMATCH = 0, 1, 2
M32 = 0xFFFFFFFF
VEC = 8  # 16 / sizeof(T): x is fp16 or bf16
NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}

# struct Signals (byte offsets)
PUSH_HEADERS = 2 * 2 * K_MAX_BLOCKS * K_MAX_RANKS * 8
STATE = PUSH_HEADERS + K_PUSH_SLOTS * K_MAX_BLOCKS * K_MAX_RANKS * 8
FIRST_ERROR = STATE + K_MAX_BLOCKS * 8  # ErrorWord: code first
SIGNALS_BYTES = FIRST_ERROR + 32 + 8  # + num_blocks, padded to 8 bytes


def flag_at(parity, rnd, b, frm):  # &flags[parity][rnd][b][frm]
    return (((parity * 2 + rnd) * K_MAX_BLOCKS + b) * K_MAX_RANKS + frm) * 8


def push_header_at(slot, b, frm):  # &push_headers[slot][b][frm]
    return PUSH_HEADERS + ((slot * K_MAX_BLOCKS + b) * K_MAX_RANKS + frm) * 8


def align_up(v):
    return (v + K_ALIGN - 1) // K_ALIGN * K_ALIGN


class Layout:
    """make_layout(world, max_bytes, push_bytes)."""

    def __init__(self, world, max_bytes, push_bytes):
        off = align_up(SIGNALS_BYTES)
        msg = align_up(max_bytes)
        self.staging, self.gather, self.push = [], [], []
        for _ in range(2):
            self.staging.append(off)
            off += msg
        for _ in range(2):
            self.gather.append(off)
            off += msg
        push_slot = align_up(push_bytes) * world
        for _ in range(K_PUSH_SLOTS):
            self.push.append(off)
            off += push_slot
        self.total = off
        self.regions = ([("flags", 0, PUSH_HEADERS), ("push_headers", PUSH_HEADERS, STATE),
                         ("state", STATE, FIRST_ERROR), ("first_error", FIRST_ERROR, SIGNALS_BYTES)]
                        + [(f"staging{i}", s, s + msg) for i, s in enumerate(self.staging)]
                        + [(f"gather{i}", s, s + msg) for i, s in enumerate(self.gather)]
                        + [(f"push{i}", s, s + push_slot) for i, s in enumerate(self.push)])
        self.region = {name: (lo, hi) for name, lo, hi in self.regions}


# ================================================================================ memory
class Buffer:
    """One rank's IPC buffer (32-bit words) and the shadow of every word."""

    def __init__(self, rank, layout):
        n = layout.total // 4
        self.rank, self.layout = rank, layout
        self.mem = np.zeros(n, np.uint32)  # init_buffer: cudaMemsetAsync(0) up to push[0] ...
        self.mem[layout.push[0] // 4:] = K_SENTINEL_PAIR  # ... then fill_kernel(kSentinelPair)
        self.w_call = np.zeros(n, np.int32)  # emulated call whose store wrote it (0: init_buffer)
        self.w_rank = np.full(n, -1, np.int8)
        self.w_data = np.zeros(n, bool)  # data or a flag word (not the init value or a sentinel)
        self.need = np.zeros(n, np.uint8)  # ranks that must read it before it may be overwritten
        self.got = np.zeros(n, np.uint8)
        self.pend = np.zeros(n, np.int16)  # stores in flight to the word
        # Loads that run early: when (in Emu.landings) the current value landed, and the value
        # (with its shadow) it replaced, which a load performed before that landing returns.
        self.landed_at = np.zeros(n, np.int64)
        self.prev = self.mem.copy()
        self.p_call, self.p_rank, self.p_data = self.w_call.copy(), self.w_rank.copy(), self.w_data.copy()
        self._starts = [lo // 4 for _, lo, _ in layout.regions]

    def where(self, word):
        i = bisect.bisect_right(self._starts, word) - 1
        name, lo, hi = self.layout.regions[max(i, 0)]
        if lo <= word * 4 < hi:
            return f"rank {self.rank}'s {name} +{word * 4 - lo}"
        return f"rank {self.rank} byte {word * 4}"

    def holds(self, w):
        if not self.w_data[w]:
            return "the init_buffer value" if self.w_call[w] == 0 else \
                f"the sentinel (re-armed by rank {self.w_rank[w]} in call {self.w_call[w]})"
        return f"rank {self.w_rank[w]}'s word of call {self.w_call[w]}"


class Entry:
    """Stores of one block in flight to one buffer."""
    __slots__ = ("dst", "words", "vals", "left", "writer", "call", "data", "need", "tear", "what", "held")

    def __init__(self, dst, words, vals, writer, call, data, need, tear, what):
        self.dst, self.words, self.vals = dst, words, vals
        self.left = np.ones(words.size, bool)
        self.held = False  # only a GPU-scope fence was passed since: lands only when forced
        self.writer, self.call, self.data, self.need, self.tear, self.what = writer, call, data, need, tear, what


class ErrorWord:
    def __init__(self):
        self.code = self.seq = self.rank = self.peer = self.block = self.algorithm = self.mine = self.theirs = 0

    def __repr__(self):
        return (f"ErrorWord(code={self.code}, seq={self.seq}, rank={self.rank}, peer={self.peer}, block={self.block}, "
                f"algorithm={self.algorithm}, mine={self.mine:#x}, theirs={self.theirs:#x})")


# ================================================================================ the kernel, transliterated
class Params:
    """struct Params, as launch() fills it."""

    def __init__(self, call, layout, push_bytes, timeout, num_blocks):
        self.layout = layout
        self.push_stride = align_up(push_bytes)
        self.rows, self.hidden, self.world, self.rank = call.rows, call.hidden, call.world, call.rank
        self.algorithm = call.algorithm
        op = (2 if call.fp8_out else 1) if call.fused else 0
        self.header = op << 30 | call.algorithm << 28 | (num_blocks - 1) << 22 | call.rows  # message_header()
        self.fused = call.fused
        self.eps = call.eps
        self.inv_scale = call.inv_scale if call.fp8_out else 1.0
        self.timeout_ns = timeout


class Block:
    """One thread block of one rank's launch: its ids, thread layout, memory operations."""

    def __init__(self, emu, call, b, grid):
        self.emu, self.call, self.b, self.grid = emu, call, b, grid
        self.p = call.params
        self.rank = self.p.rank
        self.key = (self.rank, b)
        self.threads, self.items = row_launch(self.p.hidden // 8, 2)  # launch_typed: norm::row_launch(hidden / 8, 2)
        self.V, self.mask = thread_vectors(self.threads, self.items, self.p.hidden // VEC)
        self.smem = SharedMemory(64, "warp_sums")
        self.waiting = ""
        # Emu.landings at the block's last acquire or system-scope fence: a later load that no
        # acquire orders may be performed as early as this, so it may return what a word held then.
        self.horizon = 0

    # ------------------------------------------------------------------ addresses
    def vec_words(self, dst, region, offs, sender=None):
        """Word indices of 16-byte vectors at byte offsets `offs` of rank dst's buffer, which
        must lie in `region` (and, in a push slot, in the part of `sender`: an int or one per
        offset)."""
        offs = np.asarray(offs, np.int64).reshape(-1)
        if offs.size == 0:
            return offs
        lo, hi = self.p.layout.region[region]
        if sender is not None:
            sender = np.asarray(sender, np.int64)
            lo, hi = lo + sender * self.p.push_stride, lo + (sender + 1) * self.p.push_stride
        bad = (offs < lo) | (offs + 16 > hi) | (offs % 16 != 0)
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            fail(f"rank {self.rank} block {self.b}: 16-byte access at byte {offs[j]} of rank {dst}'s buffer outside "
                 f"{region}" + (f" (sender {int(np.broadcast_to(sender, offs.shape)[j])}'s part)" if sender is not None
                                else "") + f" [{int(np.broadcast_to(lo, offs.shape)[j])}, "
                 f"{int(np.broadcast_to(hi, offs.shape)[j])}), or misaligned")
        return ((offs // 4)[:, None] + np.arange(4)[None, :]).reshape(-1)

    # ------------------------------------------------------------------ memory operations
    def peek(self, dst, words):
        """ld.volatile / ld.acquire: whatever has landed (the block's own stores included)."""
        self.emu.own_stores_land(self.key, dst, words)
        return self.emu.bufs[dst].mem[words]

    def consume(self, dst, words, writer, what, early=False):
        """A load whose value the kernel uses as call data: it must be `writer`'s (per word) store
        of this call; marks the words read by this rank. early: nothing but the block's last
        acquire / system fence orders the load (data read after a flag wait), so it may be
        performed as early as that: a word that landed since returns the value it replaced (the
        adversarial choice among the allowed ones; the polled push data, whose value is the one
        its poll saw, is not early)."""
        self.emu.own_stores_land(self.key, dst, words)
        buf = self.emu.bufs[dst]
        writer = np.broadcast_to(np.asarray(writer), words.shape)
        late = buf.landed_at[words] > self.horizon if early else np.zeros(words.shape, bool)
        w_data = np.where(late, buf.p_data[words], buf.w_data[words])
        w_rank = np.where(late, buf.p_rank[words], buf.w_rank[words])
        w_call = np.where(late, buf.p_call[words], buf.w_call[words])
        bad = ~w_data | (w_rank != writer) | (w_call != self.call.idx)
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            w = int(words[j])
            before = f"rank {buf.p_rank[w]}'s word of call {buf.p_call[w]}" if buf.p_data[w] else "no data"
            held = (f"a load performed before the block's last acquire may see what it held then ({before})"
                    if late[j] else f"it holds {buf.holds(w)}")
            self.emu.hazard(f"stale read: rank {self.rank} block {self.b} ({what}, call {self.call.idx}) reads "
                            f"{buf.where(w)}: {held}, not rank {int(writer[j])}'s word of call {self.call.idx}")
        buf.got[words] |= np.uint8(1 << self.rank)
        return np.where(late, buf.prev[words], buf.mem[words])

    def store(self, dst, words, vals, data, need, tear, what):
        if words.size:
            self.emu.enqueue(self.key, Entry(dst, words, np.asarray(vals, np.uint32).reshape(-1).copy(), self.rank,
                                             self.call.idx, data, need, tear, what))

    def fence(self, scope="sys"):
        """__threadfence_system() ("sys"): every earlier store of the block lands. __threadfence()
        ("gpu"): orders nothing another GPU observes; the stores in flight are held."""
        if scope == "sys":
            self.emu.drain_block(self.key)
            self.horizon = self.emu.landings
        else:
            self.emu.hold_block(self.key)

    def store_relaxed(self, dst, off, value, need, what):
        """A 64-bit volatile (relaxed) store: lands later, in any order with the block's others."""
        self.store(dst, np.array([off // 4, off // 4 + 1]), [value & M32, value >> 32], True, need, False, what)

    def store_release_sys(self, dst, off, value, need, what):
        """st.release.sys: the block's earlier stores land first; this one lands later."""
        self.fence()
        self.store_relaxed(dst, off, value, need, what)

    def load_relaxed_sys(self, off):
        """ld.relaxed.sys of a 64-bit word of this rank's buffer: what has landed; it orders no
        later load."""
        self.emu.own_stores_land(self.key, self.rank, np.array([off // 4, off // 4 + 1]))
        m = self.emu.bufs[self.rank].mem
        return int(m[off // 4]) | int(m[off // 4 + 1]) << 32

    def load_acquire_sys(self, off):
        """ld.acquire.sys: the same value, and the block's later loads are performed after it."""
        v = self.load_relaxed_sys(off)
        self.horizon = self.emu.landings
        return v

    def state(self, field):  # BlockState of this block: seq, push_slot
        return int(self.emu.bufs[self.rank].mem[(STATE + self.b * 8) // 4 + field])

    def set_state(self, field, value):
        self.emu.bufs[self.rank].mem[(STATE + self.b * 8) // 4 + field] = value & M32

    def first_error_code(self):
        return int(self.emu.bufs[self.rank].mem[FIRST_ERROR // 4])

    # ------------------------------------------------------------------ the rank's tensors
    def x_vectors(self, row, vs):
        """uint4 loads of x's row `row`: [len(vs), 4] words."""
        self.call.x_reader.setdefault(row, self.b)
        return self.call.x.load(row * self.p.hidden + vs * VEC, VEC).view(np.uint32).reshape(-1, 4)

    def to_float(self, bits):
        return bits_to_f32(bits, self.call.dtype)

    def round_t(self, v):
        return round_to(v, self.call.dtype)


class Bits:
    """x in global memory as raw 16-bit patterns (bounds and alignment checked like Storage)."""

    def __init__(self, bits, name):
        self.b = np.ascontiguousarray(bits, np.uint16).reshape(-1)
        self.name = name

    def load(self, first, n):
        first = np.asarray(first, np.int64).reshape(-1)
        if first.size and (first.min() < 0 or first.max() + n > self.b.size or (first % n).any()):
            fail(f"load out of bounds (or misaligned) of {self.name}: elements {first.min()}..{first.max() + n - 1}, "
                 f"size {self.b.size}")
        return np.ascontiguousarray(self.b[first[:, None] + np.arange(n)[None, :]])


def bits_to_f32(bits, dtype):
    bits = np.ascontiguousarray(bits).view(np.uint16)
    if dtype == torch.bfloat16:
        return (bits.astype(np.uint32) << 16).view(F32)
    return bits.view(np.float16).astype(F32)


def f32_to_bits(v, dtype):
    v = np.ascontiguousarray(v, F32)
    if dtype == torch.bfloat16:
        return torch.from_numpy(v).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return v.astype(np.float16).view(np.uint16)


# ------------------------------------------------------------------------------------ error reporting, waits
def report(k, code, seq, peer, theirs):
    """report(): claim first_error by atomicCAS, the winner fills the host error word."""
    mem = k.emu.bufs[k.rank].mem
    if mem[FIRST_ERROR // 4] != 0:
        return
    mem[FIRST_ERROR // 4] = code
    e = k.emu.host_error[k.rank]
    e.seq, e.rank, e.peer, e.block, e.algorithm = seq, k.rank, peer, k.b, k.p.algorithm
    e.mine, e.theirs = k.p.header, theirs
    e.code = code


class Deadline:
    """struct Deadline for a set of threads (one per thread; reset = a new Deadline)."""

    def __init__(self, n):
        self.start = np.zeros(n, np.int64)
        self.polls = np.zeros(n, np.int64)

    def reset(self, ts):
        self.start[ts] = 0
        self.polls[ts] = 0

    def expired(self, k, ts, seq, peers):
        """One call of expired() by each thread in ts (peer each waits for): bool per thread."""
        self.polls[ts] = (self.polls[ts] + 1) & M32
        chk = (self.polls[ts] & 255) == 0
        out = np.zeros(ts.size, bool)
        if not chk.any():
            return out
        now = k.emu.clock  # %globaltimer
        c = ts[chk]
        self.start[c] = np.where(self.start[c] == 0, now, self.start[c])
        if k.first_error_code() != 0:
            out[chk] = True
            return out
        out[chk] = now - self.start[c] > k.p.timeout_ns
        for j in np.flatnonzero(out):
            report(k, K_TIMEOUT, seq, int(peers[j]), 0)
        return out


def wait_words(k, offs, seq, peers, what, acquire=True):
    """wait_word() by threads 0..len(peers)-1, each on its word in this rank's buffer: a
    generator (yields after every poll round) returning each thread's result. acquire=False:
    the word is read again relaxed instead of with ld.acquire (the weak-memory mutants). The
    look-up of a peer of the other family (a push rank against a pull rank) is not
    transliterated: no case here mixes algorithms (tests/ptx covers it)."""
    n = len(peers)
    res = [None] * n
    dl = Deadline(n)
    while True:
        moved = False
        for j in range(n):
            if res[j] is not None:
                continue
            w = k.load_relaxed_sys(offs[j])
            if (w >> 32) == seq:
                # once the word is there (it cannot change meanwhile)
                w = k.load_acquire_sys(offs[j]) if acquire else k.load_relaxed_sys(offs[j])
                if (w & M32) == k.p.header:
                    k.consume(k.rank, np.array([offs[j] // 4, offs[j] // 4 + 1]), peers[j], what)
                    res[j] = True
                else:
                    report(k, K_SIZE_MISMATCH, seq, peers[j], w & M32)
                    res[j] = False
                moved = True
            elif dl.expired(k, np.array([j]), seq, [peers[j]])[0]:
                res[j] = False
                moved = True
        if all(r is not None for r in res):
            return res
        k.waiting = f"{what} (seq {seq}) from rank(s) {[peers[j] for j in range(n) if res[j] is None]}"
        yield "step" if moved else "wait"


def block_barrier(k, seq, rnd, acquire=True):
    """block_barrier(): after __syncthreads thread 0 fences once and raises this rank's flag in
    every peer's buffer (relaxed stores); threads t < world wait for peer t's flag in ours;
    __syncthreads_and of the results."""
    p = k.p
    word = (seq << 32) | p.header
    k.fence()  # __threadfence_system(), thread 0
    for peer in range(p.world):
        k.store_relaxed(peer, flag_at(seq & 1, rnd, k.b, p.rank), word, 1 << peer, f"flag round {rnd}")
    ok = yield from wait_words(k, [flag_at(seq & 1, rnd, k.b, peer) for peer in range(p.world)], seq,
                               list(range(p.world)), f"flag round {rnd}", acquire)
    return all(ok)


def share_start(p, owner):
    return p.rows * owner // p.world


def copy_row(k, region, dst, row, nvec, need):
    vs = np.arange(nvec)  # for (v = threadIdx.x; v < nvec; v += blockDim.x)
    vals = k.x_vectors(row, vs)
    k.store(k.rank, k.vec_words(k.rank, region, dst + vs * 16), vals, True, need, True, f"copy_row row {row}")


def sum_ranks(k, region, offset, what):
    """sum_ranks(): acc[i][t][:] = sum over ranks 0..W-1 of the vector, rounded to T once."""
    p = k.p
    acc = np.zeros((k.items, k.threads, VEC), F32)
    vs = k.V[k.mask]
    for q in range(K_MAX_RANKS):
        if q >= p.world:
            break
        words = k.vec_words(q, region, offset + vs * 16)
        part = k.to_float(k.consume(q, words, q, what, early=True)).reshape(-1, VEC)
        acc[k.mask] = (acc[k.mask] + part).astype(F32)
        yield "step"
    acc[k.mask] = k.round_t(acc[k.mask])
    return acc


def finish_row(k, row, acc):
    p, c = k.p, k.call
    if c.x_reader.get(row, k.b) != k.b:
        fail(f"rank {k.rank}: row {row} of x was read by block {c.x_reader[row]} but its out is written by block {k.b} "
             f"(out = x in place would be unsafe)")
    start = row * p.hidden
    nvec = p.hidden // VEC
    if p.fused:
        add_rmsnorm_row(acc, k.V, k.mask, c.residual, c.weight, c.out, c.residual_out, start, nvec, p.hidden, p.eps,
                        p.inv_scale, VEC, k.threads, k.smem)
        return
    for i in range(k.items):
        m = k.mask[i]
        if m.any():
            c.out.store(start + k.V[i, m] * VEC, acc[i, m], VEC)


def commit_state(k, seq):
    k.set_state(0, seq)  # __syncthreads(); thread 0: state[blockIdx.x].seq = seq


def next_seq(seq):  # skips 0 and 1 at the wrap (keeps the parity)
    return 2 if seq == M32 else seq + 1


def rank_failed(k):  # thread 0 reads this rank's first_error.code; __syncthreads_or
    return k.first_error_code() != 0


# ------------------------------------------------------------------------------------ one-shot pull
def oneshot_pull_kernel(k):
    p = k.p
    if rank_failed(k):
        return
    nvec = p.hidden // VEC
    rb = p.hidden * 2
    seq = next_seq(k.state(0))
    par = seq & 1  # staging[seq & 1]
    staging = p.layout.staging[par]
    for row in range(k.b, p.rows, k.grid):
        copy_row(k, f"staging{par}", staging + row * rb, row, nvec, (1 << p.world) - 1)
        yield "step"
    ok = yield from block_barrier(k, seq, 0)
    if not ok:
        return
    for row in range(k.b, p.rows, k.grid):  # the rows this block copied
        acc = yield from sum_ranks(k, f"staging{par}", staging + row * rb, f"pull: staging row {row}")
        finish_row(k, row, acc)
        yield "step"
    commit_state(k, seq)


# ------------------------------------------------------------------------------------ two-shot
def twoshot_kernel(k):
    p = k.p
    if rank_failed(k):
        return
    nvec = p.hidden // VEC
    rb = p.hidden * 2
    seq = next_seq(k.state(0))
    par = seq & 1  # staging / gather [seq & 1]
    staging, gather = p.layout.staging[par], p.layout.gather[par]
    for o in range(p.world):
        for row in range(share_start(p, o) + k.b, share_start(p, o + 1), k.grid):
            copy_row(k, f"staging{par}", staging + row * rb, row, nvec, 1 << o)
            yield "step"
    ok = yield from block_barrier(k, seq, 0)
    if not ok:
        return
    for row in range(share_start(p, p.rank) + k.b, share_start(p, p.rank + 1), k.grid):
        acc = yield from sum_ranks(k, f"staging{par}", staging + row * rb, f"twoshot reduce: staging row {row}")
        vs = k.V[k.mask]
        k.store(k.rank, k.vec_words(k.rank, f"gather{par}", gather + row * rb + vs * 16),
                f32_to_bits(acc[k.mask], k.call.dtype).view(np.uint32), True, (1 << p.world) - 1, True,
                f"gather row {row}")
    ok = yield from block_barrier(k, seq, 1)
    if not ok:
        return
    for o in range(p.world):
        for row in range(share_start(p, o) + k.b, share_start(p, o + 1), k.grid):
            acc = np.zeros((k.items, k.threads, VEC), F32)
            vs = k.V[k.mask]
            words = k.vec_words(o, f"gather{par}", gather + row * rb + vs * 16)
            acc[k.mask] = k.to_float(k.consume(o, words, o, f"twoshot gather: row {row}", early=True)).reshape(-1, VEC)
            finish_row(k, row, acc)
            yield "step"
    commit_state(k, seq)


# ------------------------------------------------------------------------------------ one-shot push
def has_sentinel(u):
    """[n, 4] words -> [n]: some 16-bit half is 0x8000."""
    found = np.zeros(u.shape[0], bool)
    for w in range(4):
        found |= ((u[:, w] & 0xFFFF) == 0x8000) | ((u[:, w] >> 16) == 0x8000)
    return found


def no_negative_zero(u):
    u = np.where((u & 0xFFFF) == 0x8000, u & 0xFFFF0000, u)
    return np.where((u >> 16) == 0x8000, u & 0x0000FFFF, u).astype(np.uint32)


def poll_row(k, slot, row, seq):
    """The receive loop of one row: thread t, item i, sender q = 0..W-1 in order; each polls its
    16-byte vector of q's part of this rank's slot until no half is the sentinel (a new Deadline
    per q). A generator (yields after every poll round) returning (acc, row_ok per thread)."""
    p = k.p
    W, items, threads = p.world, k.items, k.threads
    nvec = p.hidden // VEC
    base = p.layout.push[slot] + row * p.hidden * 2
    acc = np.zeros((items, threads, VEC), F32)
    pos = np.zeros(threads, np.int64)  # (item, q) = divmod(pos, W)
    end = items * W
    row_ok = np.ones(threads, bool)
    dl = Deadline(threads)
    tix = np.arange(threads)
    while True:
        moved = False
        cand = (pos < end) & row_ok
        while cand.any():
            i, q = pos // W, pos % W
            v = tix + np.minimum(i, items - 1) * threads
            skip = cand & (v >= nvec)  # `continue`: no vector here, nor in the later items
            pos[skip] = end
            cand &= ~skip
            ts = np.flatnonzero(cand)
            if ts.size == 0:
                break
            words = k.vec_words(k.rank, f"push{slot}", base + q[ts] * p.push_stride + v[ts] * 16, sender=q[ts])
            u = k.peek(k.rank, words).reshape(-1, 4)
            ready = ~has_sentinel(u)
            rt = ts[ready]
            if rt.size:
                w = words.reshape(-1, 4)[ready].reshape(-1)
                got = k.consume(k.rank, w, np.repeat(q[rt], 4), f"push: slot {slot} row {row}")
                acc[i[rt], rt] = (acc[i[rt], rt] + k.to_float(got).reshape(-1, VEC)).astype(F32)
                pos[rt] += 1
                dl.reset(rt)
                moved = True
            nt = ts[~ready]
            if nt.size:
                k.emu.stats["polls"] += 1
                if (u[~ready] != K_SENTINEL_PAIR).any():
                    k.emu.stats["torn"] += 1  # a vector seen partly landed
                gone = dl.expired(k, nt, seq, q[nt])
                et = nt[gone]
                if et.size:  # the kernel adds what it loaded last, then leaves the q loop
                    acc[i[et], et] = (acc[i[et], et] + k.to_float(u[~ready][gone]).reshape(-1, VEC)).astype(F32)
                    row_ok[et] = False
                    moved = True
            cand = np.zeros(threads, bool)
            cand[rt] = True
            cand &= pos < end
        if not ((pos < end) & row_ok).any():
            break
        senders = sorted(set((pos[(pos < end) & row_ok] % W).tolist()))
        k.waiting = f"push data of row {row} (slot {slot}, seq {seq}) from rank(s) {senders}"
        yield "step" if moved else "wait"
    acc[k.mask] = k.round_t(acc[k.mask])
    return acc, row_ok


def oneshot_push_kernel(k):
    p = k.p
    if rank_failed(k):
        return
    nvec = p.hidden // VEC
    rb = p.hidden * 2
    seq = next_seq(k.state(0))
    slot = (k.state(1) + 1) % K_PUSH_SLOTS
    mine = p.rank
    vs = np.arange(nvec)
    # Header first (threads t < world, volatile stores), then the rows.
    for t in range(p.world):
        k.store_relaxed(t, push_header_at(slot, k.b, p.rank), (seq << 32) | p.header, 1 << t, "push header")
    for row in range(k.b, p.rows, k.grid):
        u = no_negative_zero(k.x_vectors(row, vs))
        for q in range(K_MAX_RANKS):
            if q >= p.world:
                break
            words = k.vec_words(q, f"push{slot}", p.layout.push[slot] + p.rank * p.push_stride + row * rb + vs * 16,
                                sender=p.rank)
            k.store(q, words, u, True, 1 << q, True, f"push row {row}")
        yield "step"
    ok = yield from wait_words(k, [push_header_at(slot, k.b, t) for t in range(p.world)], seq, list(range(p.world)),
                               "push header")
    if not all(ok):
        return
    for row in range(k.b, p.rows, k.grid):
        acc, row_ok = yield from poll_row(k, slot, row, seq)
        if not row_ok.all():  # __syncthreads_and(row_ok)
            return
        finish_row(k, row, acc)
        yield "step"
    # Re-arm the rows this block just read with the sentinel, then a system-scope fence: the peers
    # write this slot again three push calls later, from other GPUs.
    for row in range(k.b, p.rows, k.grid):
        for q in range(p.world):
            words = k.vec_words(mine, f"push{slot}", p.layout.push[slot] + q * p.push_stride + row * rb + vs * 16,
                                sender=q)
            k.store(mine, words, np.full(words.size, K_SENTINEL_PAIR, np.uint32), False, 0, True, f"re-arm row {row}")
        yield "step"
    k.fence("sys")  # __threadfence_system() after the re-arm
    k.set_state(0, seq)  # __syncthreads(); thread 0
    k.set_state(1, slot)


KERNELS = {PUSH: oneshot_push_kernel, PULL: oneshot_pull_kernel, TWOSHOT: twoshot_kernel}


# ================================================================================ host side
class RankCall:
    """One rank's launch of one call: the arguments of allreduce::launch (Call) and its tensors."""

    def __init__(self, spec, rank, world, x_bits, residual, weight, dtype):
        self.idx, self.algorithm, self.rank, self.world = spec.idx, spec.algorithm, rank, world
        self.rows, self.hidden = x_bits.shape
        self.dtype, self.fused, self.fp8_out = dtype, spec.fused, spec.fp8_out
        self.eps = spec.eps
        self.inv_scale = float(np.float32(1.0 / spec.out_scale)) if spec.fp8_out else 1.0  # norm_checks.h inv_out_scale
        self.x = Bits(x_bits, f"rank {rank} x")
        n = self.rows * self.hidden
        out_t = FP8 if spec.fp8_out else dtype
        self.residual = Storage(residual.float().numpy(), dtype, 0, f"rank {rank} residual") if self.fused else None
        self.weight = Storage(weight.float().numpy(), dtype, 0, f"rank {rank} weight") if self.fused else None
        self.out = Storage(np.full(n, np.nan), out_t, 0, f"rank {rank} out (call {spec.idx})")
        self.residual_out = Storage(np.full(n, np.nan), dtype, 0, f"rank {rank} residual_out") if self.fused else None
        self.x_reader = {}
        self.params = None
        self.status = None


def launch(call, num_blocks, max_bytes, push_bytes):
    """allreduce::launch's checks (what it refuses); Params."""
    sizes_ok = (2 <= call.world <= K_MAX_RANKS and 0 <= call.rank < call.world and 1 <= num_blocks <= K_MAX_BLOCKS
                and call.hidden >= 8 and call.hidden <= 16384 and call.hidden % 8 == 0 and call.rows >= 0
                and PUSH <= call.algorithm <= TWOSHOT)
    if not sizes_ok:
        return "cudaErrorInvalidValue"
    nbytes = call.rows * call.hidden * 2
    if nbytes > max_bytes or (call.algorithm == PUSH and nbytes > push_bytes) or nbytes >= 1 << 28 or \
            call.rows > (1 << 22) - 1:  # kMaxMessageBytes, kMaxHeaderRows
        return "cudaErrorInvalidValue"
    return "cudaSuccess"


class Emu:
    """The ranks, their buffers, the stores in flight and the scheduler."""

    def __init__(self, world, num_blocks, max_bytes, push_bytes, seed, timeout=1 << 60, deadlock_check=True,
                 max_turns=2_000_000):
        self.world, self.num_blocks, self.max_bytes, self.push_bytes = world, num_blocks, max_bytes, push_bytes
        self.layout = Layout(world, max_bytes, push_bytes)
        self.bufs = [Buffer(r, self.layout) for r in range(world)]
        self.host_error = [ErrorWord() for _ in range(world)]
        self.rng = random.Random(seed)
        self.timeout, self.deadlock_check, self.max_turns = timeout, deadlock_check, max_turns
        self.clock = 1
        self.pending = {}  # (rank, block) -> [Entry]
        self.landings = 0  # stores landed so far (the clock of Buffer.landed_at and Block.horizon)
        self.n_pending = 0
        self.stalled = set()
        self.stats = dict(turns=0, polls=0, torn=0, skew=0, waits=0)
        self.p_drain = self.rng.choice([0.1, 0.4, 0.8])
        self.speed = [1.0] * world
        self.hold = {}  # rank -> clock until which it does not run (a late peer)
        self.delays = {}  # (rank, call idx) -> turns that rank stalls when it launches that call
        self.collect = None  # a list: hazards are collected instead of raised

    # ------------------------------------------------------------------ stores in flight
    def enqueue(self, key, e):
        buf = self.bufs[e.dst]
        if buf.pend[e.words].any():  # same address as an earlier store of this block: that one lands first
            for o in list(self.pending.get(key, ())):
                if o.dst == e.dst and np.isin(o.words[o.left], e.words).any():
                    self.apply(key, o, None)
        buf.pend[e.words] += 1
        self.pending.setdefault(key, []).append(e)
        self.n_pending += 1

    def apply(self, key, e, sel):
        m = e.left if sel is None else (e.left & sel)
        w = e.words[m]
        buf = self.bufs[e.dst]
        unread = buf.w_data[w] & ((buf.need[w] & ~buf.got[w]) != 0)
        if unread.any():
            j = int(w[np.flatnonzero(unread)[0]])
            who = [r for r in range(self.world) if (buf.need[j] & ~buf.got[j]) >> r & 1]
            self.hazard(f"overwrite before read: rank {e.writer} ({e.what}, call {e.call}) overwrites {buf.where(j)}, "
                        f"which holds {buf.holds(j)} that rank(s) {who} have not read yet")
        buf.prev[w], buf.p_call[w], buf.p_rank[w], buf.p_data[w] = buf.mem[w], buf.w_call[w], buf.w_rank[w], buf.w_data[w]
        self.landings += 1
        buf.landed_at[w] = self.landings
        buf.mem[w] = e.vals[m]
        buf.w_call[w], buf.w_rank[w], buf.w_data[w], buf.need[w], buf.got[w] = e.call, e.writer, e.data, e.need, 0
        buf.pend[w] -= 1
        e.left &= ~m
        if not e.left.any():
            self.pending[key].remove(e)
            self.n_pending -= 1
        self.stalled.clear()

    def hazard(self, msg):
        """A stale read or an overwrite before read: raise (or, for the repro_* functions, note it)."""
        if self.collect is None:
            fail(msg)
        self.collect.append(msg)

    def own_stores_land(self, key, dst, words):
        """A thread reads its own earlier stores: the block's stores in flight to these words land
        first (a store may become visible at any time, so this is one of the allowed orders)."""
        if self.bufs[dst].pend[words].any():
            for e in list(self.pending.get(key, ())):
                if e.dst == dst and np.isin(e.words[e.left], words).any():
                    self.apply(key, e, None)

    def drain_block(self, key):
        for e in list(self.pending.get(key, ())):
            self.apply(key, e, None)

    def hold_block(self, key):
        for e in self.pending.get(key, ()):
            e.held = True

    def drain_some(self, forced=False):
        """Land some store: any not held; a held one only when `forced` (nothing else can move),
        then the newest of a random block."""
        free = [(k, e) for k, lst in self.pending.items() for e in lst if not e.held]
        if free:
            key, e = self.rng.choice(free)
        elif forced:  # the newest first: a held store stays in flight as long as anything else can move
            key = self.rng.choice([k for k, lst in self.pending.items() if lst])
            e = self.pending[key][-1]
            self.apply(key, e, None)
            return
        else:
            return
        if e.tear and self.rng.random() < 0.5:  # part of it lands: any words, torn vectors included
            self.apply(key, e, np.array([self.rng.random() < 0.5 for _ in range(e.words.size)]))
        else:
            self.apply(key, e, None)

    # ------------------------------------------------------------------ the ranks
    def run(self, programs):
        """programs[r]: rank r's calls (RankCall), launched one after the other."""
        W = self.world
        nxt = [0] * W
        live = [[] for _ in range(W)]
        gid = 0
        while True:
            for r in range(W):
                if not live[r] and nxt[r] < len(programs[r]):
                    call = programs[r][nxt[r]]
                    nxt[r] += 1
                    call.params = Params(call, self.layout, self.push_bytes, self.timeout, self.num_blocks)
                    call.status = launch(call, self.num_blocks, self.max_bytes, self.push_bytes)
                    if call.status != "cudaSuccess":
                        continue
                    for s in (call.out, call.residual_out):
                        if s is not None:
                            s.begin_launch()
                    for b in range(self.num_blocks):
                        blk = Block(self, call, b, self.num_blocks)
                        live[r].append([KERNELS[call.algorithm](blk), blk, gid])
                        gid += 1
                    if (r, call.idx) in self.delays:
                        self.hold[r] = self.clock + self.delays[(r, call.idx)]
                    self.stalled.clear()
                    self.stats["skew"] = max(self.stats["skew"], max(nxt) - min(nxt))
            runnable = [r for r in range(W) if live[r] and self.hold.get(r, 0) < self.clock]
            if not any(live):
                if all(nxt[r] >= len(programs[r]) for r in range(W)):
                    break
            self.clock += 1
            if self.clock > self.max_turns:
                fail(f"hang: {self.max_turns} scheduler turns; waiting: " + self.describe(live))
            if self.clock % 256 == 0 and self.rng.random() < 0.5:
                self.speed = [self.rng.choice([1.0, 1.0, 0.25, 0.03]) for _ in range(W)]
            n_live = sum(len(lv) for lv in live)
            all_stalled = n_live > 0 and len(self.stalled) >= n_live
            if self.n_pending and (all_stalled or self.rng.random() < self.p_drain):
                self.drain_some(forced=all_stalled)
                continue
            if all_stalled and self.deadlock_check and not self.hold:
                fail("deadlock: every block waits and no store is in flight: " + self.describe(live))
            if not runnable:
                continue
            weights = [self.speed[r] for r in runnable]
            r = self.rng.choices(runnable, weights)[0]
            item = self.rng.choice(live[r])
            gen, blk, g = item
            try:
                what = next(gen)
            except StopIteration:
                live[r].remove(item)
                self.stalled.clear()
                if not live[r]:  # the kernel ends: a GPU-scope ordering, the peers may not see it yet
                    for b in range(self.num_blocks):
                        self.hold_block((r, b))
                continue
            if what == "wait":
                self.stalled.add(g)
                self.stats["waits"] += 1
            else:
                self.stalled.clear()
        self.stats["turns"] = self.clock

    def describe(self, live):
        return "; ".join(f"rank {blk.rank} block {blk.b} (call {blk.call.idx}, {ALGOS[blk.call.algorithm]}) waits for "
                         f"{blk.waiting}" for lv in live for _, blk, _ in lv)


# ================================================================================ cases
class Spec:
    def __init__(self, idx, algorithm, rows, fused, fp8_out, eps=1e-6, out_scale=0.05):
        self.idx, self.algorithm, self.rows, self.fused, self.fp8_out = idx, algorithm, rows, fused, fp8_out
        self.eps, self.out_scale = eps, out_scale

    def __repr__(self):
        return (f"{self.idx}:{ALGOS[self.algorithm]}/{self.rows}{'+norm' if self.fused else ''}"
                f"{'/fp8' if self.fp8_out else ''}")


def make_x(gen, rows, hidden, dtype):
    """randn, with some -0.0 and +0.0 (the push path must send -0.0 as +0.0)."""
    x = torch.randn(rows, hidden, generator=gen)
    z = torch.rand(rows, hidden, generator=gen)
    x[z < 0.03] = -0.0
    x[(z >= 0.03) & (z < 0.05)] = 0.0
    return x.to(dtype)


def random_specs(rng, n, max_tokens, hidden, push_bytes, algos=(PUSH, PULL, TWOSHOT)):
    out = []
    for i in range(n):
        rows = 0 if rng.random() < 0.04 else rng.randint(1, max_tokens)
        allowed = [a for a in algos if a != PUSH or rows * hidden * 2 <= push_bytes] or [PULL]
        fused = rng.random() < 0.6
        out.append(Spec(i + 1, rng.choice(allowed), rows, fused, fused and rng.random() < 0.25))
    return out


TOL = {torch.float16: (2e-3, 1e-3), torch.bfloat16: (1.6e-2, 8e-3)}
FP8_TOL = (2e-3, 0.0625)


def build(specs, world, hidden, dtype, seed, rows_override=None):
    """Per-rank RankCalls and the data of every call."""
    gen = torch.Generator().manual_seed(seed)
    data = []
    programs = [[] for _ in range(world)]
    for s in specs:
        xs = [make_x(gen, s.rows if rows_override is None else rows_override(s, r), hidden, dtype)
              for r in range(world)]
        residual = (torch.randn(s.rows, hidden, generator=gen) * 3).to(dtype)
        weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
        data.append((xs, residual, weight))
        for r in range(world):
            bits = xs[r].view(torch.int16).numpy().view(np.uint16)
            res_r = residual if xs[r].shape[0] == s.rows else \
                (torch.randn(xs[r].shape[0], hidden, generator=gen) * 3).to(dtype)
            programs[r].append(RankCall(s, r, world, bits, res_r, weight, dtype))
    return programs, data


def check_results(specs, programs, data, dtype, errs):
    """Every call on every rank against the reference; returns the first problem or None."""
    from spec_kernels.norm.reference import fused_add_rmsnorm

    world = len(programs)
    for s, (xs, residual, weight) in zip(specs, data):
        acc = torch.zeros(xs[0].shape, dtype=torch.float32)
        for q in range(world):  # rank order, fp32, rounded once
            acc = acc + xs[q].float()
        summed = acc.to(dtype)
        want_out = want_res = None
        if s.fused:
            want_out = torch.empty(summed.shape, dtype=FP8 if s.fp8_out else dtype)
            want_res = torch.empty_like(summed)
            fused_add_rmsnorm(summed, residual, weight, s.eps, want_out, want_res, s.out_scale if s.fp8_out else None)
        first = None
        for r in range(world):
            c = programs[r][s.idx - 1]
            if c.status != "cudaSuccess":
                return f"call {s!r} rank {r}: launch refused ({c.status})"
            for st in (c.out, c.residual_out):
                if st is not None and not st.written.all():
                    return f"call {s!r} rank {r}: {int((~st.written).sum())} elements of {st.name} never written"
            out = torch.from_numpy(c.out.v.reshape(xs[r].shape).copy())
            if not s.fused:
                if not torch.equal(out.to(dtype).view(torch.int16), summed.view(torch.int16)):
                    bad = (out.to(dtype).float() != summed.float()).nonzero()[0].tolist()
                    return (f"call {s!r} rank {r}: sum {out[tuple(bad)].item()} at {bad}, want "
                            f"{summed[tuple(bad)].item()} (fp32 rank-order sum rounded once)")
            else:
                res = torch.from_numpy(c.residual_out.v.reshape(xs[r].shape).copy()).to(dtype)
                if not torch.equal(res.view(torch.int16), want_res.view(torch.int16)):
                    bad = (res.float() != want_res.float()).nonzero()[0].tolist()
                    return (f"call {s!r} rank {r}: residual_out {res[tuple(bad)].item()} at {bad}, want "
                            f"{want_res[tuple(bad)].item()}")
                if s.fp8_out:
                    g, w = out.double() * s.out_scale, want_out.double() * s.out_scale
                    (atol, rtol), key = FP8_TOL, "fp8"
                else:
                    g, w, (atol, rtol), key = out.double(), want_out.double(), TOL[dtype], NAMES[dtype]
                err = (g - w).abs()
                if err.numel():
                    errs[key] = max(errs.get(key, 0.0), float(err.max()))
                    if not bool((err <= atol + rtol * w.abs()).all()):
                        return f"call {s!r} rank {r}: out error {float(err.max()):.2e} over the tolerance"
            if first is None:
                first = c
            elif not all(np.array_equal(a.v.view(np.uint32), b.v.view(np.uint32)) for a, b in
                         ((c.out, first.out), (c.residual_out, first.residual_out)) if a is not None):
                return f"call {s!r}: ranks 0 and {r} got different bits"
    return None


def run_sequence(world, hidden, dtype, num_blocks, ncalls, max_tokens, seed, push_frac=1.0, algos=(PUSH, PULL, TWOSHOT),
                 start_seq=0, specs=None, late_rank=None):
    """Many consecutive calls of random algorithms / token counts / epilogues on `world` ranks;
    late_rank: that rank stalls a while at the start of every call (the others run ahead)."""
    rng = random.Random(seed)
    max_bytes = max_tokens * hidden * 2
    row = hidden * 2
    push_bytes = min(max_bytes, max(row, int(max_bytes * push_frac) // row * row))  # ipc.py's rule, scaled
    specs = specs or random_specs(rng, ncalls, max_tokens, hidden, push_bytes, algos)
    programs, data = build(specs, world, hidden, dtype, seed)
    emu = Emu(world, num_blocks, max_bytes, push_bytes, seed)
    if late_rank is not None:
        emu.delays = {(late_rank, s.idx): 400 for s in specs}
    if start_seq:
        for buf in emu.bufs:
            for b in range(num_blocks):
                buf.mem[(STATE + b * 8) // 4] = start_seq & M32
    emu.run(programs)
    errs = {}
    problem = check_results(specs, programs, data, dtype, errs)
    for r in range(world):
        if emu.host_error[r].code or emu.bufs[r].mem[FIRST_ERROR // 4]:
            problem = problem or f"rank {r} reported {emu.host_error[r]}"
    used = {ALGOS[a]: sum(s.algorithm == a for s in specs) for a in ALGOS}
    st = emu.stats
    note = (f"{len(specs)} calls {used}, {st['turns']} turns, {st['waits']} waiting polls, {st['torn']} torn vectors "
            f"seen, max skew {st['skew']} call(s)")
    return dict(ok=problem is None, note=problem or note, errs=errs, launches=len(specs) * world,
                tally=dict(calls=len(specs), rank_calls=len(specs) * world, torn=st["torn"], max_skew=st["skew"],
                           turns=st["turns"]))


def run_failure(world, algorithm, kind, seed, hidden=64, num_blocks=2, timeout=3000):
    """kind "missing": the last rank never makes call 3; the others must report kTimeout (peer =
    that rank, seq 3) and every block must give up. kind "mismatch": rank 1 sends one row more in
    call 3; every rank must report kSizeMismatch. Calls 1-2 are normal."""
    max_tokens = 4
    specs = [Spec(1, algorithm, 3, False, False), Spec(2, algorithm, 2, True, False),
             Spec(3, algorithm, 3, True, False)]
    override = (lambda s, r: s.rows + 1 if s.idx == 3 and r == 1 else s.rows) if kind == "mismatch" else None
    programs, data = build(specs, world, hidden, torch.bfloat16, seed, override)
    missing = world - 1
    if kind == "missing":
        programs[missing] = programs[missing][:2]
    emu = Emu(world, num_blocks, max_tokens * hidden * 2, max_tokens * hidden * 2, seed, timeout=timeout,
              deadlock_check=False, max_turns=timeout + 400_000)
    emu.run(programs)  # returns only once every block of every launch has returned (else: a hang)
    first_two = check_results(specs[:2], [p_[:2] for p_ in programs], data[:2], torch.bfloat16, {})
    problems = [first_two] if first_two else []
    for r in range(world):
        e = emu.host_error[r]
        if kind == "missing":
            want = dict(code=K_TIMEOUT, seq=3, peer=missing) if r != missing else dict(code=0)
        else:
            want = dict(code=K_SIZE_MISMATCH, seq=3)
        if any(getattr(e, f) != v for f, v in want.items()):
            problems.append(f"rank {r}: {e}, want {want}")
        elif kind == "mismatch":
            hdr = lambda rows: 1 << 30 | algorithm << 28 | (num_blocks - 1) << 22 | rows  # noqa: E731
            mine, theirs = hdr(4 if r == 1 else 3), hdr(4 if e.peer == 1 else 3)
            if (e.mine, e.theirs) != (mine, theirs) or (r != 1 and e.peer != 1):
                problems.append(f"rank {r}: {e}: wrong headers or peer")
    note = f"{kind} peer, {ALGOS[algorithm]}: calls 1-2 correct, every block returned within " \
        f"{emu.stats['turns']} turns (timeout {timeout}): " + \
        ", ".join(f"r{r} code {emu.host_error[r].code} peer {emu.host_error[r].peer}" for r in range(world))
    return dict(ok=not problems, note="; ".join(problems) or note, launches=sum(len(p) for p in programs),
                tally={f"failure_{kind}": 1})


def emulate(xs, residual=None, weight=None, eps=1e-6, out_scale=None, algorithm=PULL, num_blocks=2, max_bytes=None,
            push_bytes=None, seed=0, calls_before=0):
    """One call of FusedAllReduce's CUDA path on len(xs) emulated ranks (xs: every rank's x, CPU
    fp16 / bf16 [rows, hidden]); residual / weight given: the fused epilogue. calls_before: the
    device call counter before this call (push slot = calls_before % 3 + 1 if every earlier call
    was a push, as the kernel computes it from BlockState). Returns [(out, residual_out)] per rank;
    raises ptx.HazardError on a stale read, an overwrite, a deadlock or an out-of-bounds access."""
    world = len(xs)
    rows, hidden = xs[0].shape
    dtype = xs[0].dtype
    max_bytes = max_bytes or max(rows, 1) * hidden * 2
    push_bytes = push_bytes or max_bytes
    spec = Spec(1, algorithm, rows, residual is not None, out_scale is not None, eps, out_scale or 0.05)
    w = weight if weight is not None else torch.ones(hidden, dtype=dtype)
    res = residual if residual is not None else torch.zeros(rows, hidden, dtype=dtype)
    programs = [[RankCall(spec, r, world, xs[r].contiguous().view(torch.int16).numpy().view(np.uint16), res, w, dtype)]
                for r in range(world)]
    emu = Emu(world, num_blocks, max_bytes, push_bytes, seed)
    for buf in emu.bufs:
        for b in range(num_blocks):
            buf.mem[(STATE + b * 16) // 4] = calls_before & M32
            buf.mem[(STATE + b * 16) // 4 + 1] = calls_before % K_PUSH_SLOTS
    emu.run(programs)
    out_t = FP8 if out_scale is not None else dtype
    result = []
    for r in range(world):
        c = programs[r][0]
        out = torch.from_numpy(c.out.v.reshape(rows, hidden).copy()).to(out_t)
        ro = torch.from_numpy(c.residual_out.v.reshape(rows, hidden).copy()).to(dtype) if c.residual_out else None
        result.append((out, ro))
    return result


def summary_note(tally, errs):
    """The runner's summary line."""
    e = f"{errs['fp8']:.1e}" if "fp8" in errs else ""
    return (f"{tally.get('calls', 0)} calls ({tally.get('rank_calls', 0)} rank launches), plain sums bit-exact, "
            f"residual_out bit-exact; fp8 out err {e or '-'}; {tally.get('torn', 0)} torn vectors polled, max skew "
            f"{tally.get('max_skew', 0)} call; {tally.get('failure_missing', 0)} missing-peer + "
            f"{tally.get('failure_mismatch', 0)} mismatch cases reported")


def cases(quick):
    """(name, thunk). Long random call sequences (push / pull / two-shot mixed, 0..max_tokens
    rows, fused or not, fp8 out) on 2, 4 and 8 ranks with 1-5 blocks, hidden sizes with 1..2048
    vectors per row (ITEMS 1 and 2), a sequence across the uint32 call-counter wrap, and the
    failure paths: a missing peer (kTimeout, no hang) and a size mismatch, per algorithm."""
    bf16, f16 = torch.bfloat16, torch.float16
    seqs = [  # (world, hidden, dtype, blocks, calls, max_tokens, seed, push_frac, quick)
        (2, 1032, bf16, 2, 30, 6, 1, 1.0, True),  # 129 vectors: 160 threads
        (4, 24, f16, 3, 36, 9, 2, 0.5, True),  # 3 vectors per row, rows > blocks
        (8, 136, bf16, 2, 24, 5, 3, 1.0, True),
        (2, 8200, bf16, 1, 8, 2, 4, 1.0, True),  # 1025 vectors: ITEMS 2, 544 threads
        (4, 512, bf16, 4, 40, 7, 5, 1.0, False),
        (8, 8, f16, 3, 40, 11, 6, 0.3, False),
        (2, 16384, f16, 2, 6, 3, 7, 1.0, False),  # 2048 vectors: ITEMS 2, 1024 threads
        (4, 2056, f16, 1, 20, 4, 8, 1.0, False),
        (8, 1000, bf16, 4, 20, 6, 9, 1.0, False),
        (2, 40, bf16, 4, 60, 3, 10, 1.0, False),  # fewer rows than blocks
        (4, 136, bf16, 2, 40, 5, 11, 1.0, False),
        (4, 264, f16, 5, 50, 10, 13, 0.5, False),
        (8, 40, bf16, 4, 30, 8, 14, 1.0, False),
        (2, 8, bf16, 3, 80, 5, 15, 0.2, False),
        (8, 1032, f16, 1, 16, 4, 16, 1.0, False),
    ]
    out = []
    for world, hidden, dt, blocks, calls, mt, seed, pf, q in seqs:
        if quick and not q:
            continue
        label = f"W={world} hidden={hidden} {NAMES[dt]} blocks={blocks}: {calls} calls, <= {mt} rows, seed {seed}"
        out.append((label, lambda a=(world, hidden, dt, blocks, calls, mt, seed, pf):
                    run_sequence(*a[:7], push_frac=a[7])))
    # across the uint32 wrap of BlockState::seq (next_seq: 2^32 - 1 -> 2): every slot written before it
    wrap = [Spec(1, TWOSHOT, 3, False, False), Spec(2, TWOSHOT, 2, True, False)] + \
        [Spec(i, PUSH, 2, i % 2 == 0, False) for i in (3, 4, 5)]
    rng = random.Random(12)
    wrap += [Spec(i, rng.choice([PUSH, PULL, TWOSHOT]), rng.randint(0, 4), rng.random() < 0.5, False)
             for i in range(6, 21)]
    out.append(("W=4 hidden=64 bf16 blocks=2: 20 calls across the uint32 call-counter wrap (seq 2^32-7 .. 2^32-1, 2 .. 14)",
                lambda: run_sequence(4, 64, bf16, 2, 20, 4, 12, start_seq=(1 << 32) - 8, specs=wrap)))
    # push only (no system fence of a flag round in between), rank 0 late at every call: a slot's
    # re-arm must land before rank 1 writes the slot again three calls later
    pushes = [Spec(i, PUSH, 1 + i % 3, False, False) for i in range(1, 13)]
    out.append(("W=2 hidden=64 bf16 blocks=1: 12 push calls, rank 0 late at every call (re-arm vs the peers' next writes)",
                lambda: run_sequence(2, 64, bf16, 1, 12, 3, 17, specs=pushes, late_rank=0)))
    fails = [(2, PUSH, "missing"), (4, PULL, "missing"), (8, TWOSHOT, "missing"), (4, PUSH, "mismatch"),
             (2, TWOSHOT, "mismatch")]
    if not quick:
        fails += [(w, a, "missing") for w in (2, 4, 8) for a in ALGOS if (w, a, "missing") not in fails]
        fails += [(8, PULL, "mismatch")]
    for world, alg, kind in fails:
        out.append((f"W={world} {ALGOS[alg]}: {kind} peer in call 3",
                    lambda a=(world, alg, kind): run_failure(*a, seed=world * 10 + a[1])))
    queued = [("late", PULL, 2, 5), ("mismatch", PUSH, 4, 6)]
    if not quick:
        queued = [(kind, alg, w, sd) for kind in ("late", "mismatch") for alg in ALGOS
                  for w, sd in ((2, 5), (4, 6), (2, 7))]
    for kind, alg, world, sd in queued:
        out.append((f"W={world} {ALGOS[alg]}: calls 4-6 queued behind a {kind} call 3",
                    lambda a=(alg, kind, world, sd): _queued_after_failure(*a)))
    for rows in (3, 0):
        out.append((f"W=2: the first pull ({rows} rows) comes right after the call-counter wrap",
                    lambda rows=rows: _first_pull_after_wrap(rows)))
    return out


def _queued_after_failure(algorithm, kind, world, seed):
    lines = repro_after_failure(algorithm, kind, world, seed, verbose=False)
    wrong, hazards = int(lines[-1].split()[0]), int(lines[0].split(": ")[1].split()[0])
    ok = wrong == 0 and hazards == 0
    note = f"{wrong} complete but wrong outputs, {hazards} hazards; " + "; ".join(lines[3:-1])
    return dict(ok=ok, note=note, launches=6 * world, tally={"queued_after_failure": 1})


def _first_pull_after_wrap(rows):
    lines = repro_seq_wrap(rows, verbose=False)
    ok = lines[0].endswith(": 0 hazards") and lines[-1] == "results: all correct" and \
        all("code=0," in line for line in lines[1:3])
    return dict(ok=ok, note="; ".join(lines), launches=6, tally={"first_pull_after_wrap": 1})


# ================================================================================ findings (not in cases())
def repro_after_failure(algorithm=PULL, kind="late", world=2, seed=5, timeout=3000, verbose=True):
    """Calls already queued behind a failed call (the host learns of a failure only at its next
    call, so a rank's stream holds more calls). Every call has the same shape and op (as every
    layer's allreduce in a decode step: the same header). kind "late": the last rank stalls for
    2 * timeout turns when it launches call 3 (the others time out in call 3), then carries on;
    kind "mismatch": rank 1 sends one row more in call 3 (every rank reports kSizeMismatch).
    Every rank has calls 1-6 queued. Before the kernels' rank_failed() check (fused_allreduce.cu
    at 7e748f8), the calls after the failed one ran on stale data (60 complete but wrong outputs
    and 1486 hazards over the 18 configurations of `python allreduce.py repro`); now none may.
    Returns (and prints) what each call produced; the last line counts the complete wrong ones."""
    from spec_kernels.norm.reference import fused_add_rmsnorm

    hidden, max_tokens = 64, 4
    specs = [Spec(i, algorithm, 3, True, False) for i in range(1, 7)]
    override = (lambda s, r: s.rows + 1 if s.idx == 3 and r == 1 else s.rows) if kind == "mismatch" else None
    programs, data = build(specs, world, hidden, torch.bfloat16, seed, override)
    emu = Emu(world, 2, max_tokens * hidden * 2, max_tokens * hidden * 2, seed, timeout=timeout, deadlock_check=False,
              max_turns=timeout * 4 + 400_000)
    if kind == "late":
        emu.delays[(world - 1, 3)] = 2 * timeout
    emu.collect = []
    emu.run(programs)
    lines = [f"{kind} peer, {ALGOS[algorithm]}, W={world}: {len(emu.collect)} hazards"
             + "".join(f"\n    {h}" for h in emu.collect[:3])]
    for r in range(world):
        lines.append(f"rank {r}: host {emu.host_error[r]}; BlockState.seq per block "
                     f"{[int(emu.bufs[r].mem[(STATE + b * 16) // 4]) for b in range(2)]}")
    silent = 0
    for s in specs:
        xs, residual, weight = data[s.idx - 1]
        summed = sum((x.float() for x in xs), torch.zeros(xs[0].shape)).to(torch.bfloat16) \
            if len({x.shape for x in xs}) == 1 else None
        verdict = []
        for r in range(world):
            c = programs[r][s.idx - 1]
            n, w = c.out.written.size, int(c.out.written.sum())
            if w == 0:
                verdict.append(f"r{r} no output")
                continue
            if summed is None:
                verdict.append(f"r{r} {w}/{n} written (shapes differ)")
                continue
            want_out, want_res = torch.empty_like(summed), torch.empty_like(summed)
            fused_add_rmsnorm(summed, residual, weight, s.eps, want_out, want_res)
            got = c.residual_out.v[c.residual_out.written]
            ok = np.array_equal(got, want_res.float().numpy().reshape(-1)[c.residual_out.written])
            if not ok and w == n:
                silent += 1
            verdict.append(f"r{r} {w}/{n} written, {'correct' if ok else 'WRONG'}")
        lines.append(f"call {s.idx}: " + "; ".join(verdict))
    lines.append(f"{silent} (rank, call) outputs complete but wrong")
    if verbose:
        print("\n".join(lines))
    return lines


def repro_seq_wrap(last_rows=3, verbose=True):
    """BlockState.seq wraps after 2^32 - 1. A flag word never written since init_buffer (0) reads
    as "seq 0, header 0": here every call before the wrap is a push (so the pull's flag slots are
    still 0) and the first pull is the first call after the wrap. Before next_seq() (at 7e748f8)
    that call had seq 0 and took the stale flags for its peers' (a false kSizeMismatch, or with a
    0-row plain all_reduce, header 0, no rendezvous at all); now it has seq 2. The call is
    last_rows x 64 (fused for last_rows > 0)."""
    specs = [Spec(1, PUSH, 2, True, False), Spec(2, PUSH, 2, True, False),
             Spec(3, PULL, last_rows, last_rows > 0, False)]
    programs, data = build(specs, 2, 64, torch.bfloat16, 3)
    emu = Emu(2, 2, 4 * 64 * 2, 4 * 64 * 2, 3, timeout=3000, deadlock_check=False, max_turns=400_000)
    for buf in emu.bufs:
        for b in range(2):
            buf.mem[(STATE + b * 16) // 4] = (1 << 32) - 3  # the next calls get seq 2^32-2, 2^32-1, 2
    emu.collect = []
    emu.run(programs)
    errs = {}
    lines = [f"first pull after the wrap, {last_rows} rows: {len(emu.collect)} hazards"
             + "".join(f"\n    {h}" for h in emu.collect[:2])]
    lines += [f"rank {r}: host {emu.host_error[r]}" for r in range(2)]
    lines.append("results: " + (check_results(specs, programs, data, torch.bfloat16, errs) or "all correct"))
    if verbose:
        print("\n".join(lines))
    return lines


if __name__ == "__main__" and "repro" in sys.argv:
    print("=== calls queued behind a failed call (README: Findings 1); details of the W=2 runs")
    totals = [0, 0]
    for kind in ("late", "mismatch"):
        for alg in ALGOS:
            for world, seed in ((2, 5), (4, 6), (2, 7)):
                show = world == 2 and seed == 5
                if show:
                    print(f"--- {kind}, {ALGOS[alg]}")
                lines = repro_after_failure(alg, kind, world, seed, verbose=show)
                totals[0] += int(lines[-1].split()[0])
                totals[1] += int(lines[0].split(": ")[1].split()[0])
    print(f"18 configurations: {totals[0]} (rank, call) outputs complete but wrong, {totals[1]} hazards")
    for rows in (3, 0):
        print(f"--- seq wrap, {rows} rows")
        repro_seq_wrap(rows)
    sys.exit(0)


if __name__ == "__main__":
    import time

    for name, fn in cases(quick="--quick" in sys.argv):
        t0 = time.time()
        try:
            r = fn()
        except HazardError as e:
            r = dict(ok=False, note=f"{type(e).__name__}: {e}")
        print(("ok  " if r["ok"] else "FAIL") + f" {name} ({time.time() - t0:.1f}s): {r['note']} {r.get('errs', '')}",
              flush=True)
