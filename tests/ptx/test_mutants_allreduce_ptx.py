"""Deliberate bugs in the IPC allreduce kernels (csrc/allreduce/fused_allreduce.cu) must make their
PTX tests fail.

The mutants are those of the hand emulator (tools/kernel_emulators/check.py MUTANTS["allreduce"]),
plus a few for protocol parts the emulator does not model (poisoned outputs, the grid check), each
expressed as a one-expression edit of the .cu (the text must occur exactly once, so a
refactor that moves it fails here loudly instead of testing nothing). The edited source is
compiled to sm_120a PTX and runs on 2 simulated GPUs sharing their IPC buffers
(tools/ptx_harness/allreduce_glue.py). Each mutant names the check that must catch it: a wrong sum
("mismatch"), a wrong host error word ("error word": an error where the call must succeed, none
where it must report one) or a call after a failure that still runs ("inert"); so a case that stops
reaching the bug's path fails here too.

Some cases set up by hand a state that real hardware reaches but the interpreter does not by
itself (the calls of all ranks start together, the warps furthest behind run first, and memory is
sequentially consistent): a peer whose header arrived but whose rows are still in flight, a
16-byte push vector of which only the first word landed (vector stores are single-copy atomic per
element, not as a whole), a rank that runs one call ahead of a late peer, a block of a peer that
is late while its other block has met ours. They write exactly what the peer's kernel would have
written by then.

EMULATOR_ONLY lists the mutants a sequentially consistent interpreter cannot catch (a missing
fence, a relaxed instead of a release store: only the order in which other GPUs see stores
changes). The edited kernel must pass every case here (so the list stays honest: a mutant that
starts failing a case belongs in MUTANTS); tools/kernel_emulators/allreduce.py, whose store-buffer
model delays and reorders each rank's stores, keeps covering them.
"""
from __future__ import annotations

import ast
import concurrent.futures
import functools
import os

import numpy as np
import pytest
import torch

from tools.ptx_harness import build
from ptxsim.memory import SimError

from tools.ptx_harness.allreduce_glue import (ALGORITHMS, K_BLOCKS_MISMATCH, K_MAX_BLOCKS, KERNEL_FILE, K_TIMEOUT, REPO,
                                              RankInput, SimRanks, message_header)
import test_allreduce_ptx as ar

pytestmark = pytest.mark.skipif(build.find_nvcc() is None,
                                reason="nvcc not found (set CUDA_HOME): the kernels' PTX cannot be produced")

CU = "csrc/allreduce/fused_allreduce.cu"
F16 = torch.float16
HIDDEN = 64
PUSH, PULL, TWOSHOT = ALGORITHMS["oneshot_push"], ALGORITHMS["oneshot_pull"], ALGORITHMS["twoshot"]

# ---------------------------------------------------------------------------------- the cases
# Each case takes the PTX to run and raises AssertionError (or a SimError) when the kernel is wrong.

# struct Signals (fused_allreduce.cu): flags[2][2][kMaxBlocks][8] (u64), then push_headers[3][kMaxBlocks][8].
_FLAGS, _PUSH_HEADERS = 0, 2 * 2 * K_MAX_BLOCKS * 8 * 8


def _write_u64(sim, rank, offset, value):
    sim.m.write(sim.bases[rank] + offset, np.array([value], np.uint64))


def _push_rows(x):
    """What a sender stores into a push slot for rows x: -0.0 becomes +0.0."""
    bits = x.contiguous().view(torch.int16).clone()
    bits[bits == -32768] = 0
    return bits.numpy().view(np.uint32)


def case_push_peer_late(ptx, calls_before=3, torn=False):
    """One-shot push, 2 ranks, 1 block: `calls_before` complete calls (rows 2, 3, 1), then rank 1
    of the next call has sent only its header (to every slot: what it sends to the slot it uses)
    and, if `torn`, the first 32-bit word of its first row's first vector (hidden 8: one vector per
    row). Rank 0 must keep polling its sentinel-filled slot and, as rank 1 sends nothing more,
    report a timeout naming rank 1: a slot that still holds an older call's rows (not re-armed, or
    not rotated) or a half-arrived vector taken as complete gives a sum with no error instead."""
    hidden = 8 if torn else HIDDEN
    gen = torch.Generator().manual_seed(5)
    sim = SimRanks(2, hidden, F16, max_tokens=3, num_blocks=1, timeout_ns=1, ptx=ptx)
    for rows in (2, 3, 1)[:calls_before]:
        inputs = ar._make(2, rows, hidden, F16, "sum", gen)
        ar._check(sim.call("oneshot_push", inputs), inputs, F16)
    seq, rows = calls_before + 1, 1 if torn else 2
    for slot in range(3):
        _write_u64(sim, 0, _PUSH_HEADERS + ((slot * K_MAX_BLOCKS + 0) * 8 + 1) * 8,
                   (seq << 32) | message_header(0, PUSH, 1, rows))
    if torn:
        x1 = torch.randn(rows, hidden, generator=gen).to(F16)
        slot = seq % 3
        sim.m.write(sim.bases[0] + sim.layout.push[slot] + 1 * sim.push_stride, _push_rows(x1[0])[:1])
    x0 = torch.randn(rows, hidden, generator=gen).to(F16)
    res = sim.call("oneshot_push", [RankInput(x0), None])[0]
    assert (res.error["code"], res.error["peer"]) == (K_TIMEOUT, 1), \
        f"error word: rank 0 finished call {seq} without rank 1's rows (error word {res.error})"


def case_push_rank_ahead(ptx):
    """One-shot push, 2 ranks, 1 block. Call 1 runs on both; then rank 1 runs ahead: it has sent its
    header and rows of calls 2 and 3 (written here by hand into the slots it uses, 2 and 0) while
    rank 0 has not started call 2. Rank 0 then runs calls 2 and 3 and must sum each with rank 1's
    rows of that call: a push slot reused by consecutive calls would make it read the wrong call's
    rows, or wait for a header that is in another slot."""
    gen = torch.Generator().manual_seed(19)
    rows, hidden = 2, HIDDEN
    sim = SimRanks(2, hidden, F16, max_tokens=rows, num_blocks=1, timeout_ns=1, ptx=ptx)
    inputs = ar._make(2, rows, hidden, F16, "sum", gen)
    ar._check(sim.call("oneshot_push", inputs), inputs, F16)
    ahead = {seq: [torch.randn(rows, hidden, generator=gen).to(F16) for _ in range(2)] for seq in (2, 3)}
    for seq, (_, x1) in ahead.items():
        slot = seq % 3
        sim.m.write(sim.bases[0] + sim.layout.push[slot] + 1 * sim.push_stride, _push_rows(x1))
        _write_u64(sim, 0, _PUSH_HEADERS + ((slot * K_MAX_BLOCKS + 0) * 8 + 1) * 8,
                   (seq << 32) | message_header(0, PUSH, 1, rows))
    for seq, (x0, x1) in ahead.items():
        res = sim.call("oneshot_push", [RankInput(x0), None])[0]
        assert res.error["code"] == 0, f"error word: rank 0's call {seq} reported {res.error}"
        summed = (x0.float() + x1.float()).to(F16)
        assert torch.equal(ar._bits(res.out), ar._bits(summed)), f"mismatch: rank 0's call {seq}"


def case_twoshot(ptx):
    """Two-shot, 2 ranks, 1 block, 3 rows (rank 0 reduces row 0, rank 1 rows 1-2): uneven shares,
    both ranks together."""
    gen = torch.Generator().manual_seed(7)
    sim = SimRanks(2, HIDDEN, F16, max_tokens=3, num_blocks=1, ptx=ptx)
    inputs = ar._make(2, 3, HIDDEN, F16, "sum", gen)
    ar._check(sim.call("twoshot", inputs), inputs, F16)


def case_twoshot_peer_late(ptx):
    """Two-shot, 2 ranks, 1 block, 3 rows. Rank 1 has copied its rows into its staging buffer and
    raised its round-0 flag (written here by hand), then stalls before reducing its share (rows
    1-2) and raising its round-1 flag. Rank 0 reduces row 0 and must then wait for rank 1's
    round-1 flag and, as it never comes, report a timeout naming rank 1: without the second flag
    round it would read rank 1's share before rank 1 stored it (the interpreter runs the warps
    furthest behind first, so with both ranks running the late share is always there in time)."""
    gen = torch.Generator().manual_seed(23)
    rows = 3
    sim = SimRanks(2, HIDDEN, F16, max_tokens=rows, num_blocks=1, timeout_ns=1, ptx=ptx)
    x = [torch.randn(rows, HIDDEN, generator=gen).to(F16) for _ in range(2)]
    sim.m.write(sim.bases[1] + sim.layout.staging[1], x[1].contiguous().view(torch.int16).numpy())  # call 1
    _write_u64(sim, 0, _flag_offset(1, 0, 0, 1), (1 << 32) | message_header(0, TWOSHOT, 1, rows))
    res = sim.call("twoshot", [RankInput(x[0]), None])[0]
    assert (res.error["code"], res.error["peer"]) == (K_TIMEOUT, 1), \
        f"error word: rank 0 finished without rank 1's share (error word {res.error})"
    assert ar._poisoned(res.out), "mismatch: the failed call's output is not poisoned"


def _flag_offset(seq, round_, block, sender):
    """flags[seq & 1][round][block][sender] in struct Signals."""
    return _FLAGS + ((((seq & 1) * 2 + round_) * K_MAX_BLOCKS + block) * 8 + sender) * 8


def case_pull_block_late(ptx):
    """One-shot pull, 2 ranks, 2 blocks, 2 rows (row 0 block 0's, row 1 block 1's). Rank 1's block 1
    has copied row 1 into its staging buffer and raised its flag (written here by hand); its block 0
    is late: it has neither copied row 0 nor raised its flag. Rank 0's block 1 must sum row 1 (and
    leave row 0 alone); its block 0, as rank 1's block 0 never comes, reports a timeout and poisons
    row 0."""
    gen = torch.Generator().manual_seed(9)
    rows = 2
    sim = SimRanks(2, HIDDEN, F16, max_tokens=rows, num_blocks=2, timeout_ns=1, ptx=ptx)
    x = [torch.randn(rows, HIDDEN, generator=gen).to(F16) for _ in range(2)]
    staging = sim.layout.staging[1]  # call 1: staging[seq & 1]
    sim.m.write(sim.bases[1] + staging + HIDDEN * 2, x[1][1].contiguous().view(torch.int16).numpy())
    _write_u64(sim, 0, _flag_offset(1, 0, 1, 1), (1 << 32) | message_header(0, PULL, 2, rows))
    res = sim.call("oneshot_pull", [RankInput(x[0]), None])[0]
    summed = (x[0][1].float() + x[1][1].float()).to(F16)
    assert torch.equal(ar._bits(res.out[1]), ar._bits(summed)), "mismatch: row 1 is not the sum of its copies"
    assert (res.error["code"], res.error["peer"], res.error["block"]) == (K_TIMEOUT, 1, 0), \
        f"error word: {res.error}"
    assert ar._poisoned(res.out[0]), "mismatch: row 0 of the failed block is not poisoned"


def case_pull_rank_ahead(ptx):
    """One-shot pull, 2 ranks, 1 block. Rank 1 is late in call 1: it has copied its rows into its
    staging buffer and raised its flag (written here by hand, into both staging buffers), then
    stalls. Rank 0 completes call 1, starts call 2 (copies its rows, raises its flags, and gives up
    waiting: the tiny timeout). Then rank 1 runs call 1 and must still read rank 0's call-1 rows:
    consecutive calls stage their rows in different buffers."""
    gen = torch.Generator().manual_seed(11)
    rows = 2
    sim = SimRanks(2, HIDDEN, F16, max_tokens=rows, num_blocks=1, timeout_ns=1, ptx=ptx)
    call1 = ar._make(2, rows, HIDDEN, F16, "sum", gen)
    header = message_header(0, PULL, 1, rows)
    for staging in sim.layout.staging:
        sim.m.write(sim.bases[1] + staging, call1[1].x.contiguous().view(torch.int16).numpy())
    _write_u64(sim, 0, _flag_offset(1, 0, 0, 1), (1 << 32) | header)
    ar._check([sim.call("oneshot_pull", [call1[0], None])[0]], call1, F16)
    call2 = RankInput(torch.randn(rows, HIDDEN, generator=gen).to(F16))
    assert sim.call("oneshot_pull", [call2, None])[0].error["code"] == K_TIMEOUT
    late = sim.call("oneshot_pull", [None, call1[1]])[1]
    assert late.error["code"] == 0, f"error word: rank 1 reported {late.error}"
    summed = sum(inp.x.float() for inp in call1).to(F16)  # from +0.0, in rank order, as ar._check sums
    assert torch.equal(ar._bits(late.out), ar._bits(summed)), \
        "mismatch: rank 1's sum of call 1 differs from the reference"


def case_after_failure(ptx):
    """One-shot pull, 2 ranks: a size mismatch fails call 1 on both ranks; the next call must do
    nothing (no output, no counter change, the first error word kept)."""
    gen = torch.Generator().manual_seed(13)
    sim = SimRanks(2, HIDDEN, F16, max_tokens=3, num_blocks=1, ptx=ptx)
    first = [RankInput(torch.randn(3, HIDDEN, generator=gen).to(F16)),
             RankInput(torch.randn(2, HIDDEN, generator=gen).to(F16))]
    words = [r.error for r in sim.call("oneshot_pull", first)]
    assert all(w["code"] != 0 for w in words), f"error word: the size mismatch was not reported: {words}"
    try:
        ar._assert_failed_and_inert(sim, "oneshot_pull", [RankInput(torch.zeros(3, HIDDEN, dtype=F16))] * 2,
                                    words, gen)
    except AssertionError as e:
        raise AssertionError(f"inert: {e}") from None


def case_counter_wrap(ptx):
    """One-shot pull, 2 ranks, the device call counter at 0xffffffff: the next call is number 2
    (never 0: flag words never written since init_buffer read as call 0 with header 0)."""
    gen = torch.Generator().manual_seed(15)
    sim = SimRanks(2, HIDDEN, F16, max_tokens=2, num_blocks=1, ptx=ptx)
    sim.set_call_counter(0xFFFFFFFF)
    inputs = ar._make(2, 2, HIDDEN, F16, "sum", gen)
    results = sim.call("oneshot_pull", inputs)
    for rank, res in enumerate(results):
        assert res.error["code"] == 0, f"error word: rank {rank} reported {res.error}"
    ar._check(results, inputs, F16)
    for rank in range(2):
        assert (sim.block_state(rank)[:, 0] == 2).all(), f"rank {rank}: call counter {sim.block_state(rank)[:, 0]}"


def case_grid_change(ptx):
    """One-shot pull, 2 ranks, buffers made for 2 blocks; a call launched with 1 block on both ranks
    must be refused on both (kBlocksMismatch) with NaN outputs: with one block, block 0 would take
    over block 1's rows and pair with state block 1 left on the peers."""
    gen = torch.Generator().manual_seed(17)
    sim = SimRanks(2, HIDDEN, F16, max_tokens=3, num_blocks=2, ptx=ptx)
    inputs = ar._make(2, 3, HIDDEN, F16, "sum", gen)
    results = sim.call("oneshot_pull", inputs, launch_blocks=[1, 1])
    for rank, res in enumerate(results):
        assert res.error["code"] == K_BLOCKS_MISMATCH, f"error word: rank {rank} ran with the wrong grid: {res.error}"
        assert ar._poisoned(res.out), f"mismatch: rank {rank}'s refused call is not poisoned"


def case_algorithm_mismatch(ptx, first, second):
    """2 ranks, 2 blocks, the same message, rank 0 on `first`, rank 1 on `second`: both must
    report kSizeMismatch on call 1, long before the timeout (pull and two-shot meet in one flag
    word whose header carries the algorithm; a push rank is found in the push headers / round-0
    flags by the other side's wait)."""
    gen = torch.Generator().manual_seed(21)
    sim = SimRanks(2, HIDDEN, F16, max_tokens=3, num_blocks=2, timeout_ns=200_000, ptx=ptx)
    results = sim.call([first, second], ar._make(2, 3, HIDDEN, F16, "sum", gen))
    for rank, res in enumerate(results):
        assert res.error["code"] == ar.K_SIZE_MISMATCH, \
            f"error word: rank {rank} ({(first, second)[rank]}) reported {res.error}, not the algorithm mismatch"


CASES = {
    "grid_change": case_grid_change,
    "push_rank_ahead": case_push_rank_ahead,
    "push_peer_late": case_push_peer_late,
    "push_torn_vector": functools.partial(case_push_peer_late, calls_before=0, torn=True),
    "twoshot": case_twoshot,
    "twoshot_peer_late": case_twoshot_peer_late,
    "pull_block_late": case_pull_block_late,
    "pull_rank_ahead": case_pull_rank_ahead,
    "after_failure": case_after_failure,
    "counter_wrap": case_counter_wrap,
    "algorithm_pull_twoshot": functools.partial(case_algorithm_mismatch, first="oneshot_pull", second="twoshot"),
    "algorithm_push_pull": functools.partial(case_algorithm_mismatch, first="oneshot_push", second="oneshot_pull"),
}

# ---------------------------------------------------------------------------------- the mutants
# name: (what, old text, new text, case, caught by). "caught by": "mismatch" (a wrong sum) or a
# part of the failure's first line.
MUTANTS = {
    "push_slot_not_advanced": (
        "push: BlockState.push_slot keeps the previous slot (rotation stuck)",
        "    st[b].push_slot = static_cast<uint32_t>(slot);", "    st[b].push_slot = st[b].push_slot;",
        "push_rank_ahead", "error word"),
    "push_no_rearm": (
        "push: the used slot is never re-armed with the sentinel",
        "  for (int row = blockIdx.x; row < p.rows; row += gridDim.x)\n    for (int q = 0; q < p.world; ++q) {",
        "  for (int row = blockIdx.x; row < 0; row += gridDim.x)\n    for (int q = 0; q < p.world; ++q) {",
        "push_peer_late", "error word"),
    "refused_call_not_poisoned": (
        "a failed or refused call leaves out unwritten (stale data downstream) instead of NaN",
        "    fill_row_nan(static_cast<OutT*>(p.out) + start, p.hidden);\n", "", "after_failure", "inert"),
    "grid_unchecked": (
        "a launch with another grid than the buffers were made for runs",
        "  if (gridDim.x == want) return true;", "  if (gridDim.x == want || true) return true;",
        "grid_change", "error word"),
    "sentinel_first_word_only": (
        "push: has_sentinel checks only the first 32-bit word of the 16-byte vector",
        "  for (int k = 0; k < 4; ++k)\n    if ((w[k]", "  for (int k = 0; k < 1; ++k)\n    if ((w[k]",
        "push_torn_vector", "error word"),
    "no_allgather_wait": (
        "two-shot: no second flag round before reading the peers' gather buffers",
        "  if (!block_barrier(p, seq, 1)) return poison_outputs<T, OutT>(p);\n", "", "twoshot_peer_late",
        "error word"),
    "single_staging": (
        "one-shot pull: one staging buffer for every call (staging[0] instead of [seq & 1])",
        "const size_t staging = p.layout.staging[seq & 1];", "const size_t staging = p.layout.staging[0];",
        "pull_rank_ahead", "mismatch"),
    "pull_rows_of_next_block": (
        "one-shot pull: block b sums the rows block b+1 copied (block-to-row mapping)",
        "  for (int row = blockIdx.x; row < p.rows; row += gridDim.x) {\n    float acc[ITEMS][VEC];\n    sum_ranks",
        "  for (int row = (blockIdx.x + 1) % gridDim.x; row < p.rows; row += gridDim.x) {\n"
        "    float acc[ITEMS][VEC];\n    sum_ranks", "pull_block_late", "mismatch"),
    "runs_after_failure": (
        "calls queued behind a failure run (no rank_failed() check at kernel entry)",
        "  return __syncthreads_or(\n      threadIdx.x == 0 &&", "  return __syncthreads_or(\n      false &&",
        "after_failure", "inert"),
    "header_ignores_algorithm": (
        "the flag words' header comparison leaves out the algorithm (pull and two-shot ranks pair up)",
        "        if (static_cast<uint32_t>(w) == p.header) return true;",
        "        if (((static_cast<uint32_t>(w) ^ p.header) & ~(3u << 28)) == 0) return true;",
        "algorithm_pull_twoshot", "error word"),
    "other_family_unchecked": (
        "the waits do not look for a peer in the other family's words (push vs pull: both time out)",
        "    if ((polls & 255u) == 0 && peer_in_other_family(p, other, seq, peer)) return false;",
        "    if (false && peer_in_other_family(p, other, seq, peer)) return false;",
        "algorithm_push_pull", "error word"),
    "seq_wraps_to_zero": (
        "the call counter wraps to 0 (never-written flag words read as call 0, the counter left at 0)",
        "seq == 0xffffffffu ? 2u : seq + 1", "seq + 1", "counter_wrap", "mismatch"),
}

# Mutants only a weak-memory model catches: (what, old text, new text, why the interpreter cannot).
_LOADS_IN_ORDER = ("the interpreter performs every load when its instruction runs: a load after the flag poll "
                   "can never return what memory held before the poll saw the flag")
EMULATOR_ONLY = {
    "flag_without_fence": (
        "block_barrier: no __threadfence_system before the relaxed flag stores",
        "    __threadfence_system();\n    for (int peer = 0; peer < p.world; ++peer)\n",
        "    for (int peer = 0; peer < p.world; ++peer)\n",
        "the interpreter's memory is sequentially consistent: every store is visible to every GPU in "
        "program order, so the flag can never be seen before the staged rows it publishes; fences are "
        "only counted"),
    "pull_wait_relaxed": (
        "one-shot pull: the flag wait reads the word again relaxed, not with ld.acquire",
        "      const uint64_t w = load_acquire_sys(slot);",
        "      const uint64_t w = p.algorithm == kOneShotPull ? load_relaxed_sys(slot) : load_acquire_sys(slot);",
        _LOADS_IN_ORDER),
    "twoshot_wait0_relaxed": (
        "two-shot: the first flag wait (before the reduce) without ld.acquire",
        "      const uint64_t w = load_acquire_sys(slot);",
        "      const uint64_t w = p.algorithm == kTwoShot && slot == &signals_of(p, p.rank)->flags[seq & 1][0]"
        "[blockIdx.x][peer] ? load_relaxed_sys(slot) : load_acquire_sys(slot);",
        _LOADS_IN_ORDER),
    "twoshot_wait1_relaxed": (
        "two-shot: the second flag wait (before reading the gather buffers) without ld.acquire",
        "      const uint64_t w = load_acquire_sys(slot);",
        "      const uint64_t w = p.algorithm == kTwoShot && slot == &signals_of(p, p.rank)->flags[seq & 1][1]"
        "[blockIdx.x][peer] ? load_relaxed_sys(slot) : load_acquire_sys(slot);",
        _LOADS_IN_ORDER),
    "rearm_gpu_fence": (
        "push: the re-arm is fenced at GPU scope only (__threadfence), not at system scope",
        "        dst[v] = make_uint4(kSentinelPair, kSentinelPair, kSentinelPair, kSentinelPair);\n    }\n"
        "  __syncthreads();\n  if (threadIdx.x == 0) __threadfence_system();",
        "        dst[v] = make_uint4(kSentinelPair, kSentinelPair, kSentinelPair, kSentinelPair);\n    }\n"
        "  __syncthreads();\n  if (threadIdx.x == 0) __threadfence();",
        "the interpreter has one memory and no fence scopes: the sentinel lands before the peers' later "
        "writes whatever the fence's scope"),
}


def _source():
    with open(KERNEL_FILE, encoding="utf-8") as f:
        return f.read()


def patched(old, new):
    text = _source()
    assert text.count(old) == 1, f"mutant text found {text.count(old)} times in {CU}: {old!r}"
    return text.replace(old, new)


@functools.lru_cache(maxsize=None)
def _all_ptx():
    """The PTX of every mutant, compiled two at a time (cached by source hash across runs)."""
    edits = {name: (m[1], m[2]) for name, m in {**MUTANTS, **EMULATOR_ONLY}.items()}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(build.cuda_ptx_from_source, patched(old, new), "sm_120a", CU)
                   for name, (old, new) in edits.items()}
        return {name: f.result() for name, f in futures.items()}


def mutant_ptx(name):
    return _all_ptx()[name]


def test_every_emulator_mutant_is_here():
    """Every allreduce mutant of the hand emulator is re-expressed here (caught, or listed as
    emulator-only with the reason); the mutants here may cover more (parts the emulator leaves
    out), and every emulator-only one is one of the emulator's."""
    # read from the source: importing check.py would put the emulators' directory on sys.path
    with open(os.path.join(REPO, "tools", "kernel_emulators", "check.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    table = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "MUTANTS" for t in node.targets))
    allreduce = next(v for k, v in zip(table.keys, table.values) if ast.literal_eval(k) == "allreduce")
    emulator = {ast.literal_eval(k) for k in allreduce.keys}
    assert emulator <= set(MUTANTS) | set(EMULATOR_ONLY) and set(EMULATOR_ONLY) <= emulator
    assert not set(MUTANTS) & set(EMULATOR_ONLY)


@pytest.mark.parametrize("case", sorted(CASES))
def test_unmutated_case_passes(case):
    CASES[case](None)


def _caught_by(err, first):
    if isinstance(err, SimError):  # Hazard, Deadlock, an out-of-bounds access
        return type(err).__name__
    for tag in ("mismatch", "error word", "inert"):
        if first.startswith(tag):
            return tag
    if " reported " in first:  # _check: an error word where the call must succeed
        return "error word"
    return "mismatch"


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_caught(name):
    what, _, _, case, expect = MUTANTS[name]
    with pytest.raises((AssertionError, SimError)) as info:
        CASES[case](mutant_ptx(name))
    err = info.value
    first = (str(err).strip().splitlines() or [""])[0][:200]
    got = _caught_by(err, first)
    print(f"{name} ({what}) caught by case {case}, {got}: {first}")
    assert got == expect, f"{name}: expected to be caught by {expect!r}, got {got}: {first}"


@pytest.mark.parametrize("name", sorted(EMULATOR_ONLY))
def test_emulator_only_mutant_passes_every_case(name):
    """The limit of the sequentially consistent interpreter, checked: the edited kernel passes
    every case here (tools/kernel_emulators/allreduce.py catches it)."""
    what, _, _, why = EMULATOR_ONLY[name]
    ptx = mutant_ptx(name)
    for case in sorted(CASES):
        CASES[case](ptx)
    print(f"{name} ({what}) passes every case: {why}")
