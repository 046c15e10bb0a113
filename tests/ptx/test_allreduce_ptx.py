"""The compiled sm_120a allreduce kernels (csrc/allreduce/fused_allreduce.cu) on 2 and 4 simulated
GPUs sharing their IPC buffers (tools/ptx_harness/allreduce_glue.py), against the reference: the sum over
ranks in rank order in fp32, rounded once, then spec_kernels.fused_add_rmsnorm(impl="reference").

What these tests show, and what only tools/kernel_emulators/allreduce.py shows. Here the PTX that
nvcc emits runs instruction by instruction, every CTA of every rank interleaved in one machine,
with the host's exact parameter struct (its ctypes mirror is checked against the PTX .param size),
buffer layout, init_buffer() sentinel fill and launch geometry: so the tests check the compiled
code itself (address arithmetic into the Signals / staging / gather / push areas, the 16-byte
vector paths, the -0.0 sentinel filter, the ITEMS=1/2 kernel instances, fp8 output, grid-stride
loops with rows above and below the block count, bounds of every access) and the protocol logic
under one sequentially consistent interleaving: flag words carry the right sequence number and
header, staging / flag parity and the three push slots rotate over consecutive calls on the same
buffers (stale data of the previous call would give a wrong sum), used push slots are re-armed
with the sentinel, headers that differ between ranks give kSizeMismatch on every rank, a rank that
never arrives makes the others report kTimeout through the %globaltimer deadline instead of
hanging, and calls after a failure do nothing. The interpreter's memory is sequentially
consistent and fences are only counted, so these tests cannot show that the kernel's fences,
st.release / ld.acquire and volatile accesses are sufficient on real hardware (torn 16-byte push
vectors, a flag landing before the data it publishes, stores landing out of order), and each
call's launches start together, so no rank runs a whole call ahead of another; both are what the
emulator's store-buffer model with randomised rank speeds explores.

Two tests pin a fixed bug of the push path: it re-armed the previous push call's rows with the
current call's row size, wrong when hidden changes between calls on the same buffers
(FusedAllReduce keeps hidden fixed; the raw op does not): stale rows were taken as fresh, or the
sentinel was written past the slot. The kernel now keeps the previous call's row size.
"""
from __future__ import annotations

import ctypes

import pytest
import torch

import spec_kernels


from tools.ptx_harness.allreduce_glue import (ALGORITHMS, K_BLOCKS_MISMATCH, K_MAX_BLOCKS, K_SIZE_MISMATCH, K_TIMEOUT, PUSH_ALGORITHMS,
                             SENTINEL_PAIR, ErrorWord, Params, RankInput, SimRanks, check_params_match_ptx,
                             message_header)

TOL = {torch.float16: dict(atol=2e-3, rtol=1e-3), torch.bfloat16: dict(atol=1.6e-2, rtol=8e-3)}
FP8_TOL = dict(atol=2e-3, rtol=0.0625)  # one e4m3 step, after dequantising
EPS = 1e-6
OUT_SCALE = 0.02
ALGOS = list(ALGORITHMS)
NO_ERROR = {name: 0 for name, _ in ErrorWord._fields_}


def _bits(t):
    return t.view(torch.int16) if t.dtype in (torch.float16, torch.bfloat16) else t.view(torch.uint8)


# The NaN a failed or refused call writes (nan_of<T> in the kernel file); the glue's initial fill
# 0x7E7E is another NaN in fp16, so the bits are compared, not isnan.
_NAN_BITS = {torch.float16: 0x7E00, torch.bfloat16: 0x7FC0, torch.float8_e4m3fn: 0x7F}


def _poisoned(t):
    """Every element the kernel's NaN: what a failed or refused call leaves in its outputs."""
    return bool((_bits(t) == _NAN_BITS[t.dtype]).all())


def _grid(algorithm, num_blocks):
    """The grid launch() launches for `algorithm` on buffers created for num_blocks."""
    return 1 if algorithm == "oneshot_push_1block" else num_blocks


def _make(world, rows, hidden, dtype, mode, gen):
    """Per-rank inputs for one call. mode: "sum" (plain allreduce), "fused" or "fp8". residual and
    weight are the same on every rank (tensor parallelism). A few -0.0 entries on every rank: the
    push path must not mistake them for its sentinel."""
    xs = [torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(world)]
    if rows:
        for x in xs:
            x[0, :3] = -0.0
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    if mode == "sum":
        return [RankInput(x) for x in xs]
    scale = OUT_SCALE if mode == "fp8" else None
    return [RankInput(x, residual.clone(), weight.clone(), EPS, scale) for x in xs]


def _check(results, inputs, dtype):
    """Every rank's outputs against the reference; all ranks bit-identical; no error reported."""
    summed = sum(inp.x.float() for inp in inputs).to(dtype)  # rank order, fp32, rounded once
    first = inputs[0]
    for rank, res in enumerate(results):
        assert res.error == NO_ERROR, f"rank {rank} reported {res.error}"
        if first.residual is None:
            assert torch.equal(_bits(res.out), _bits(summed)), f"rank {rank}: sum differs from the reference"
            continue
        want_out, want_res = spec_kernels.fused_add_rmsnorm(summed, first.residual, first.weight, EPS,
                                                            impl="reference", out_scale=first.out_scale)
        assert torch.equal(_bits(res.residual_out), _bits(want_res)), f"rank {rank}: residual_out"
        if first.out_scale is None:
            torch.testing.assert_close(res.out, want_out, **TOL[dtype])
        else:
            torch.testing.assert_close(res.out.float() * OUT_SCALE, want_out.float() * OUT_SCALE, **FP8_TOL)
        assert torch.equal(_bits(res.out), _bits(results[0].out)), f"rank {rank}: out differs from rank 0's"
        assert torch.equal(_bits(res.residual_out), _bits(results[0].residual_out))


def _check_push_rearmed(sim, slot):
    """After a push call, the slot of the push call before it holds only the sentinel again."""
    for rank in range(sim.world):
        words = sim.push_slot_bytes(rank, slot)
        assert (words == SENTINEL_PAIR).all(), f"rank {rank}: push slot {slot} not re-armed"


def test_params_struct_matches_ptx():
    sim = SimRanks(2, 64, torch.float16, max_tokens=1)
    assert ctypes.sizeof(Params) == 232
    check_params_match_ptx(sim)
    # every kernel instance launch_typed() can pick exists in the PTX
    for algo in ALGORITHMS.values():
        for fp8 in (False, True):
            for items in (1, 2):
                assert sim.entry(algo, fp8, items) is not None


# (rows, mode) of consecutive calls on the same buffers, hidden fixed per communicator as
# FusedAllReduce fixes it. hidden 264: 33 vectors, two warps with a 1-vector tail; 72: 9 vectors,
# one warp with a tail. Rows 5 > num_blocks (grid-stride loop), 1 < num_blocks (an idle block that
# still meets its peers).
CALLS = {2: (264, [(5, "sum"), (3, "fused"), (1, "fp8")]),
         4: (72, [(5, "fused"), (1, "fp8"), (3, "sum")])}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("algorithm", ALGOS)
def test_consecutive_calls_match_reference(algorithm, world, dtype):
    gen = torch.Generator().manual_seed(1000 * world + 10 * ALGORITHMS[algorithm] + (dtype == torch.bfloat16))
    hidden, calls = CALLS[world]
    sim = SimRanks(world, hidden, dtype, max_tokens=5, num_blocks=2)
    for n, (rows, mode) in enumerate(calls, start=1):
        inputs = _make(world, rows, hidden, dtype, mode, gen)
        _check(sim.call(algorithm, inputs), inputs, dtype)
        for rank in range(world):
            state = sim.block_state(rank)
            assert (state[:, 0] == n).all(), f"rank {rank}: device call counter {state[:, 0]} after call {n}"
            if ALGORITHMS[algorithm] in PUSH_ALGORITHMS:
                assert (state[:, 1] == n % 3).all()
        if ALGORITHMS[algorithm] in PUSH_ALGORITHMS:
            _check_push_rearmed(sim, n % 3)


# System-scope fences a call runs per block (fence warp-instructions): one per flag round of a
# barrier (pull 1, two-shot 2) or one after the push re-arm, by one thread each.
FENCES_PER_BLOCK = {"oneshot_push": 1, "oneshot_push_1block": 1, "oneshot_pull": 1, "twoshot": 2}


@pytest.mark.parametrize("algorithm", ALGOS)
def test_one_fence_per_block_and_round(algorithm):
    """The interpreter counts fences per warp that runs one and st/atom.release separately (a
    release is a fence too). Blocks of 2 warps (hidden 264): a fence in every thread, or one per
    flag of a barrier, counts more than one per block and round."""
    world, hidden, blocks = 4, 264, 2
    gen = torch.Generator().manual_seed(7)
    sim = SimRanks(world, hidden, torch.float16, max_tokens=5, num_blocks=blocks)
    for _ in range(2):
        inputs = [RankInput(torch.randn(3, hidden, generator=gen).to(torch.float16)) for _ in range(world)]
        results = sim.call(algorithm, inputs)
        _check(results, inputs, torch.float16)
        for rank, res in enumerate(results):
            st = res.stats.as_dict()
            assert (st["fences"], st["releases"]) == (_grid(algorithm, blocks) * FENCES_PER_BLOCK[algorithm], 0), \
                (algorithm, rank, st["fences"], st["releases"])


def test_mixed_algorithms_share_counters():
    """The algorithms share the device call counter (flag / staging parity); only push calls move
    the push slot. Empty calls (0 rows) still count. A one-block push call advances the counters of
    every block, so the full-grid calls after it pair up."""
    dtype, world = torch.float16, 2
    gen = torch.Generator().manual_seed(7)
    sim = SimRanks(world, 64, dtype, max_tokens=6, num_blocks=2)
    seq = [("oneshot_push", 5), ("oneshot_pull", 3), ("oneshot_push", 0), ("twoshot", 6), ("oneshot_push", 2),
           ("oneshot_push_1block", 1), ("oneshot_push", 6), ("oneshot_push_1block", 3), ("twoshot", 0),
           ("oneshot_push_1block", 0), ("oneshot_pull", 4), ("oneshot_push", 1)]
    pushes = 0
    for n, (algorithm, rows) in enumerate(seq, start=1):
        inputs = _make(world, rows, 64, dtype, "sum", gen)
        _check(sim.call(algorithm, inputs), inputs, dtype)
        pushes += ALGORITHMS[algorithm] in PUSH_ALGORITHMS
        if ALGORITHMS[algorithm] in PUSH_ALGORITHMS:
            _check_push_rearmed(sim, pushes % 3)
        for rank in range(world):
            state = sim.block_state(rank)
            assert (state[:, 0] == n).all() and (state[:, 1] == pushes % 3).all()


@pytest.mark.parametrize("algorithm", ALGOS)
def test_two_items_per_thread(algorithm):
    """hidden 8200: 1025 vectors, the ITEMS=2 kernel instance (513 threads -> 544)."""
    dtype, world = torch.bfloat16, 2
    gen = torch.Generator().manual_seed(11 + ALGORITHMS[algorithm])
    sim = SimRanks(world, 8200, dtype, max_tokens=1, num_blocks=1)
    inputs = _make(world, 1, 8200, dtype, "fused", gen)
    _check(sim.call(algorithm, inputs), inputs, dtype)


@pytest.mark.parametrize("algorithm", ALGOS)
def test_call_counter_wrap(algorithm):
    """Across the uint32 wrap of the device call counter (days of decoding): next_seq() goes
    0xfffffffe -> 0xffffffff -> 2 -> 3, keeping the flag / staging parity; results stay right."""
    dtype, world, hidden = torch.bfloat16, 2, 64
    gen = torch.Generator().manual_seed(61 + ALGORITHMS[algorithm])
    sim = SimRanks(world, hidden, dtype, max_tokens=4, num_blocks=2)
    sim.set_call_counter(0xFFFFFFFD)
    for rows, want in ((3, 0xFFFFFFFE), (4, 0xFFFFFFFF), (2, 2), (3, 3)):
        inputs = _make(world, rows, hidden, dtype, "sum", gen)
        _check(sim.call(algorithm, inputs), inputs, dtype)
        for rank in range(world):
            assert (sim.block_state(rank)[:, 0] == want).all()


@pytest.mark.parametrize("algorithm", ["oneshot_push", "twoshot"])
def test_in_place(algorithm):
    """out = x and residual_out = residual (FusedAllReduce allows both)."""
    dtype, world, hidden, rows = torch.float16, 2, 64, 3
    gen = torch.Generator().manual_seed(71)
    sim = SimRanks(world, hidden, dtype, max_tokens=4, num_blocks=2)
    inputs = _make(world, rows, hidden, dtype, "fused", gen)
    copies = [RankInput(i.x.clone(), i.residual.clone(), i.weight, i.eps, None, True) for i in inputs]
    results = sim.call(algorithm, copies)
    _check(results, inputs, dtype)


def _assert_failed_and_inert(sim, algorithm, inputs, words, gen):
    """A call after a failure does nothing on the failed ranks but poison its output (every element
    NaN, so a graph replay nobody checks cannot compute on stale data): no counter change, the first
    error word kept."""
    before = [sim.block_state(r) for r in range(sim.world)]
    again = [None if inp is None else RankInput(torch.randn(inp.x.shape, generator=gen).to(inp.x.dtype))
             for inp in inputs]
    results = sim.call(algorithm, again)
    for rank, res in enumerate(results):
        if res is None:
            continue
        assert res.error == words[rank], f"rank {rank}: the error word changed to {res.error}"
        assert _poisoned(res.out), f"rank {rank}: a call after a failure left its output unpoisoned"
        assert (sim.block_state(rank) == before[rank]).all()


@pytest.mark.parametrize("algorithm", ALGOS)
def test_size_mismatch_is_reported_on_every_rank(algorithm):
    dtype, world, hidden = torch.float16, 2, 64
    gen = torch.Generator().manual_seed(21)
    sim = SimRanks(world, hidden, dtype, max_tokens=6, num_blocks=2)
    inputs = [RankInput(torch.randn(5, hidden, generator=gen).to(dtype)),
              RankInput(torch.randn(4, hidden, generator=gen).to(dtype))]
    results = sim.call(algorithm, inputs)
    headers = [message_header(0, ALGORITHMS[algorithm], _grid(algorithm, 2), rows) for rows in (5, 4)]
    words = []
    for rank, res in enumerate(results):
        e = res.error
        assert (e["code"], e["seq"], e["rank"], e["peer"], e["algorithm"]) == \
            (K_SIZE_MISMATCH, 1, rank, 1 - rank, ALGORITHMS[algorithm]), e
        assert (e["mine"], e["theirs"]) == (headers[rank], headers[1 - rank]), e
        assert 0 <= e["block"] < 2
        assert _poisoned(res.out), f"rank {rank}: the refused call left its output unpoisoned"
        words.append(e)
    _assert_failed_and_inert(sim, algorithm, [RankInput(torch.zeros(5, hidden, dtype=dtype))] * 2, words, gen)


def test_operation_mismatch_on_four_ranks():
    """Rank 2 calls the fused operation, the others the plain allreduce of the same bytes: the op
    field of the header differs, every rank reports it."""
    dtype, world, hidden, rows = torch.bfloat16, 4, 64, 3
    gen = torch.Generator().manual_seed(31)
    sim = SimRanks(world, hidden, dtype, max_tokens=4, num_blocks=2)
    inputs = _make(world, rows, hidden, dtype, "sum", gen)
    fused = _make(world, rows, hidden, dtype, "fused", gen)[2]
    inputs[2] = fused
    results = sim.call("oneshot_pull", inputs)
    plain, op1 = message_header(0, ALGORITHMS["oneshot_pull"], 2, rows), message_header(1, ALGORITHMS["oneshot_pull"], 2, rows)
    for rank, res in enumerate(results):
        e = res.error
        assert e["code"] == K_SIZE_MISMATCH and e["rank"] == rank and e["seq"] == 1, e
        if rank == 2:
            assert e["mine"] == op1 and e["theirs"] == plain and e["peer"] != 2, e
        else:
            assert e["mine"] == plain and e["theirs"] == op1 and e["peer"] == 2, e


@pytest.mark.parametrize("first,second", [(a, b) for a in ALGOS for b in ALGOS if a != b])
def test_algorithm_mismatch_is_refused_at_once_on_every_rank(first, second):
    """Rank 0 runs `first`, rank 1 `second`, on the same message: both report kSizeMismatch on
    call 1, naming each other's header (the algorithm is in it), long before the timeout, and
    poison their outputs. Pull and two-shot meet in the same flag word; the push family is found
    in its own words (push headers / the round-0 flag) by the other side's wait."""
    dtype, world, hidden, rows = torch.float16, 2, 64, 3
    gen = torch.Generator().manual_seed(23)
    sim = SimRanks(world, hidden, dtype, max_tokens=4, num_blocks=2, timeout_ns=10 ** 7)
    inputs = _make(world, rows, hidden, dtype, "sum", gen)
    results = sim.call([first, second], inputs)
    headers = [message_header(0, ALGORITHMS[a], _grid(a, 2), rows) for a in (first, second)]
    words = []
    for rank, res in enumerate(results):
        e = res.error
        assert (e["code"], e["seq"], e["rank"], e["peer"], e["mine"], e["theirs"]) == \
            (K_SIZE_MISMATCH, 1, rank, 1 - rank, headers[rank], headers[1 - rank]), e
        assert _poisoned(res.out), f"rank {rank}: the refused call left its output unpoisoned"
        words.append(e)
    _assert_failed_and_inert(sim, first, inputs, words, gen)


@pytest.mark.parametrize("world,algorithm,timeout_ns", [(2, "oneshot_push", 1), (2, "oneshot_pull", 1),
                                                        (2, "twoshot", 1), (4, "twoshot", 3000),
                                                        (2, "oneshot_push_1block", 1)])
def test_missing_rank_times_out(world, algorithm, timeout_ns):
    """The last rank never arrives: the others give up after timeout_ns of %globaltimer (the
    interpreter's clock: 1 ns per warp-instruction) and report it instead of hanging."""
    dtype, hidden = torch.float16, 64
    gen = torch.Generator().manual_seed(41)
    sim = SimRanks(world, hidden, dtype, max_tokens=4, num_blocks=2, timeout_ns=timeout_ns)
    inputs = _make(world, 3, hidden, dtype, "sum", gen)
    inputs[-1] = None
    results = sim.call(algorithm, inputs)
    words = [None] * world
    for rank, res in enumerate(results[:-1]):
        e = res.error
        assert (e["code"], e["seq"], e["rank"], e["peer"], e["algorithm"], e["mine"], e["theirs"]) == \
            (K_TIMEOUT, 1, rank, world - 1, ALGORITHMS[algorithm], message_header(0, ALGORITHMS[algorithm], _grid(algorithm, 2), 3),
             0), e
        assert _poisoned(res.out), f"rank {rank} wrote output without its peer, or did not poison it"
        words[rank] = e
    _assert_failed_and_inert(sim, algorithm, inputs, words, gen)
    # The missing rank was only late: it finds every peer's flags / data of call 1 still there.
    # The one-shot algorithms complete call 1 correctly on it (its failure shows at its next
    # call); two-shot needs the peers' second round, which never comes: it times out too.
    late = sim.call(algorithm, [None] * (world - 1) + [RankInput(inputs[-2].x.clone())])[-1]
    inputs[-1] = RankInput(inputs[-2].x.clone())
    if algorithm == "twoshot":
        assert late.error["code"] == K_TIMEOUT and late.error["peer"] != world - 1, late.error
        assert _poisoned(late.out)
    else:
        _check([late], inputs, dtype)




# struct Signals: flags[2][2][kMaxBlocks][8] (u64) come first, then push_headers[3][kMaxBlocks][8].
_PUSH_HEADERS = 2 * 2 * K_MAX_BLOCKS * 8 * 8


def _send_push_header(sim, to, sender, seq, rows, slot, block=0):
    """Store `sender`'s push header word of call `seq` into rank `to`'s buffer (what the sender's
    first store of a push call does)."""
    word = torch.tensor([(seq << 32) | message_header(0, ALGORITHMS["oneshot_push"], sim.num_blocks, rows)],
                        dtype=torch.int64)
    sim.m.write(sim.bases[to] + _PUSH_HEADERS + ((slot * K_MAX_BLOCKS + block) * 8 + sender) * 8, word.numpy())


def test_push_data_poll_times_out():
    """Rank 1 sent its header but none of its rows: rank 0 passes the header wait, polls the
    sentinel of rank 1's rows and gives up after timeout_ns instead of hanging."""
    dtype, world, hidden, rows = torch.float16, 2, 64, 3
    gen = torch.Generator().manual_seed(91)
    sim = SimRanks(world, hidden, dtype, max_tokens=4, num_blocks=1, timeout_ns=1)
    _send_push_header(sim, 0, 1, 1, rows, 1)
    res = sim.call("oneshot_push", [RankInput(torch.randn(rows, hidden, generator=gen).to(dtype)), None])[0]
    e = res.error
    assert (e["code"], e["seq"], e["rank"], e["peer"], e["algorithm"]) == (K_TIMEOUT, 1, 0, 1, 0), e
    assert _poisoned(res.out)
    assert (sim.block_state(0)[:, 0] == 0).all()  # the failed call is not counted


def test_push_rearm_after_hidden_change():
    """The push slot of call 1 (3 rows of hidden 264) must be re-armed over call 1's row size (a
    re-arm at call 2's size, hidden 72, as an earlier version did, covered only 3 x 144 bytes per
    sender and left bytes 432..1584 with call 1's data). Call 4 uses that slot again
    with call 1's shape. Rank 1 has sent its header and its row 0 so far (done here by hand: a
    state the hardware reaches whenever rank 1's later stores are still in flight); rank 0 must
    not take rows 1-2 of call 1 as rank 1's rows of call 4: it has to keep polling (and here,
    where rank 1 never sends more, time out) instead of returning a sum with stale data."""
    dtype, world = torch.float16, 2
    gen = torch.Generator().manual_seed(51)
    sim = SimRanks(world, 264, dtype, max_tokens=4, num_blocks=1, timeout_ns=1)
    for rows, hidden in ((3, 264), (4, 72), (1, 72)):
        inputs = _make(world, rows, hidden, dtype, "sum", gen)
        _check(sim.call("oneshot_push", inputs), inputs, dtype)
    x0, x1 = (torch.randn(3, 264, generator=gen).to(dtype) for _ in range(2))
    seq, slot = 4, 4 % 3
    _send_push_header(sim, 0, 1, seq, 3, slot)
    base0 = sim.bases[0]
    row0 = x1[0].clone()
    row0[row0.view(torch.int16) == -32768] = 0.0  # what the sender sends for -0.0
    sim.m.write(base0 + sim.layout.push[slot] + 1 * sim.push_stride, row0.view(torch.int16).numpy())
    res = sim.call("oneshot_push", [RankInput(x0), None])[0]
    assert res.error["code"] == K_TIMEOUT and res.error["peer"] == 1, \
        f"rank 0 finished call 4 without rank 1's rows 1-2 (error word {res.error})"
    assert _poisoned(res.out)  # the block failed: every row it owns is NaN


def test_push_rearm_stays_in_its_slot():
    dtype, world = torch.float16, 2
    gen = torch.Generator().manual_seed(81)
    sim = SimRanks(world, 64, dtype, max_tokens=16, num_blocks=2)
    for rows, hidden in ((16, 64), (1, 1024)):
        inputs = _make(world, rows, hidden, dtype, "sum", gen)
        _check(sim.call("oneshot_push", inputs), inputs, dtype)


def test_grid_other_than_creation_is_refused():
    """The buffers were created for 2 blocks: a call launched with 1 block on rank 1 is refused there
    (kBlocksMismatch, the grid in `theirs`, output NaN) before it touches a flag; rank 0 waits for
    it and times out. Every later call on both ranks is refused and poisoned too."""
    dtype, world, hidden = torch.float16, 2, 64
    gen = torch.Generator().manual_seed(101)
    sim = SimRanks(world, hidden, dtype, max_tokens=4, num_blocks=2, timeout_ns=1)
    inputs = _make(world, 3, hidden, dtype, "sum", gen)
    _check(sim.call("oneshot_pull", inputs), inputs, dtype)
    inputs = _make(world, 3, hidden, dtype, "sum", gen)
    results = sim.call("oneshot_pull", inputs, launch_blocks=[2, 1])
    e0, e1 = results[0].error, results[1].error
    assert (e1["code"], e1["rank"], e1["peer"], e1["theirs"]) == (K_BLOCKS_MISMATCH, 1, -1, 1), e1
    assert (e0["code"], e0["peer"]) == (K_TIMEOUT, 1), e0
    assert _poisoned(results[0].out) and _poisoned(results[1].out)
    _assert_failed_and_inert(sim, "oneshot_pull", inputs, [e0, e1], gen)


@pytest.mark.parametrize("algorithm", ["oneshot_push", "twoshot"])
def test_replays_after_an_injected_timeout_are_poisoned(algorithm):
    """A CUDA-graph replay sequence: the same fused call replayed on the same buffers. In replay 3
    rank 1 does not arrive: rank 0 times out there; replays 4-5 on rank 0 (nobody on the host has
    looked at the error word yet) must not leave the previous replay's values in out and
    residual_out: both are NaN, the counters stand still and the error word names call 3."""
    dtype, world, hidden, rows = torch.bfloat16, 2, 64, 3
    gen = torch.Generator().manual_seed(111)
    sim = SimRanks(world, hidden, dtype, max_tokens=4, num_blocks=2, timeout_ns=1)
    inputs = _make(world, rows, hidden, dtype, "fused", gen)
    for _ in range(2):
        _check(sim.call(algorithm, inputs), inputs, dtype)
    failed = sim.call(algorithm, [inputs[0], None])[0]
    word = failed.error
    assert (word["code"], word["seq"], word["peer"], word["algorithm"]) == (K_TIMEOUT, 3, 1, ALGORITHMS[algorithm])
    for replay in (4, 5):
        res = sim.call(algorithm, [inputs[0], None])[0]
        assert res.error == word, f"replay {replay}: the error word changed to {res.error}"
        assert _poisoned(res.out) and _poisoned(res.residual_out), f"replay {replay}: outputs not poisoned"
        assert (sim.block_state(0)[:, 0] == 2).all()


@pytest.mark.parametrize("algorithm", ALGOS)
def test_reset_after_an_injected_timeout_gives_correct_sums(algorithm):
    """FusedAllReduce.reset() on simulated GPUs: call 2 times out on rank 0 (rank 1 is stalled),
    rank 1 runs call 2 late and alone, call 3 is refused and poisoned on the failed ranks; then
    every buffer is re-armed in place (IpcBuffers.reset: init_buffer over the same addresses, the
    error words cleared) and the next calls on both ranks give correct sums, the device call
    counters restarting at 1."""
    dtype, world, hidden = torch.bfloat16, 2, 64
    gen = torch.Generator().manual_seed(121 + ALGORITHMS[algorithm])
    sim = SimRanks(world, hidden, dtype, max_tokens=4, num_blocks=2, timeout_ns=1)
    bases = list(sim.bases)
    inputs = _make(world, 3, hidden, dtype, "fused", gen)
    _check(sim.call(algorithm, inputs), inputs, dtype)
    failed = sim.call(algorithm, [inputs[0], None])[0]
    assert failed.error["code"] == K_TIMEOUT and _poisoned(failed.out), failed.error
    sim.call(algorithm, [None, inputs[1]])  # the stalled rank's call 2, after the others gave up
    for res in sim.call(algorithm, inputs):
        if res.error["code"] != 0:
            assert _poisoned(res.out)
    sim.reset()
    assert sim.bases == bases
    for n, (rows, mode) in enumerate([(3, "fused"), (4, "sum"), (1, "fp8")], start=1):
        inputs = _make(world, rows, hidden, dtype, mode, gen)
        _check(sim.call(algorithm, inputs), inputs, dtype)
        for rank in range(world):
            assert (sim.block_state(rank)[:, 0] == n).all()
