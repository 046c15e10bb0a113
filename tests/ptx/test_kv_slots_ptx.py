"""The compiled KV-slot kernels (csrc/kv_slots/kv_slots.cu, sm_120a PTX: alloc, and commit with its
launch-wide hand-off of the verdict to the KV-move blocks) run by the PTX interpreter against the
reference, through the real Python binding (spec_kernels.kv_slots.api: _alloc_cuda / _commit_cuda,
kv_table, move_sync) with cuda_ops pointing at the interpreter.

The "cuda" implementation is made selectable for CPU tensors, so the random sequences of
tests/test_kv_slots_invariants.py (Sim: reference and cuda in lockstep, every tensor byte for
byte equal after every call, the invariants checked on top) and the refusal checks of
tests/test_kv_slots.py run unchanged on the compiled kernels. Every call's status words and
outputs (out_cache_loc, new_seq_lens) are compared with the reference's call as well.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from spec_kernels import _ops  # noqa: E402
from spec_kernels.kv_slots import api  # noqa: E402
from spec_kernels.kv_slots import reference  # noqa: E402
from test_kv_slots import (GENERATIONS, KERNEL_REFUSALS, PAGE_STATE_IDS, PAGE_STATE_REFUSALS,  # noqa: E402
                           check_hand_off_scratch, check_page_state_refusal, check_refusal,
                           check_refused_then_accepted_with_one_scratch, next_generation, tag_word)
from test_kv_slots_invariants import (Draw, Sim, _double_commit_sim, _foreign_sim,  # noqa: E402
                                      alloc_from_corrupt_stack, commit_into_another_request, commit_never_allocated,
                                      continue_another_requests_page, host_checks, random_path, release_request,
                                      replay_commit)

from tools.ptx_harness.cuda_glue import PtxCudaOps  # noqa: E402

IMPLS = [("reference", "cpu"), ("cuda", "cpu")]
KV_OPS = ("alloc_draft_slots", "commit_draft_slots")


@pytest.fixture(scope="module")
def ops():
    """cuda_ops() of the kv_slots binding is the interpreter, and impl="cuda" runs on CPU tensors."""
    glue = PtxCudaOps()
    unavailable = _ops.cuda_unavailable_reason
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "cuda_ops", lambda: glue)
        mp.setattr(_ops, "cuda_unavailable_reason",
                   lambda device, name: None if name in KV_OPS and device.type == "cpu" else unavailable(device, name))
        yield glue


@pytest.fixture
def calls(ops, monkeypatch):
    """Records (op, impl, status, output) of every reference / cuda call, for check_calls."""
    log = []
    for op, table in (("alloc", api.ALLOC), ("commit", api.COMMIT)):
        for impl in ("reference", "cuda"):
            def wrapped(*args, _fn=table.impls[impl], _op=op, _impl=impl):
                _fn(*args)
                log.append((_op, _impl, args[-1].clone(), args[-2].clone()))
            monkeypatch.setitem(table.impls, impl, wrapped)
    return log


def check_calls(log):
    """Every cuda call wrote the status words and output of the reference call before it."""
    assert log and len(log) % 2 == 0, [x[:2] for x in log]
    for ref, got in zip(log[::2], log[1::2]):
        assert ref[:2] == (ref[0], "reference") and got[:2] == (ref[0], "cuda"), (ref[:2], got[:2])
        assert got[2].tolist() == ref[2].tolist(), f"{ref[0]}: status {got[2].tolist()} != {ref[2].tolist()}"
        assert torch.equal(got[3], ref[3]), f"{ref[0]}: output {got[3].tolist()} != {ref[3].tolist()}"


def grids(ops, kernel):
    return [grid[0] for name, grid, *_ in ops.launches if kernel in name]


# --------------------------------------------------------------------------- random sequences
@pytest.mark.parametrize("page_size,seed,rtt_dtype,index_dtype", [
    (1, 0, torch.int64, torch.int32),
    (16, 1, torch.int32, torch.int64),
])
def test_steps_match_reference(ops, calls, page_size, seed, rtt_dtype, index_dtype):
    """alloc -> write the drafts' KV -> commit, reference and compiled kernels in lockstep: mixed
    draft counts with 0 (no speculation for that request), paths of every kind (rejected
    entirely, a chain accepted entirely, branches that move KV rows), then random steps with
    arrivals and departures."""
    P = page_size
    sim = Sim(IMPLS, 12 if P == 16 else 160, P, rows=4, max_context=64, max_draft=8, rtt_dtype=rtt_dtype,
              index_dtype=index_dtype, draw=Draw(seed=seed))
    assert sim.admit([0, 1, 2], [3, P + 5, 0])
    before = len(grids(ops, "commit"))
    assert sim.step([1, 0, 2], [7, 0, 5], [[0, 2, 5], [], []])
    assert sim.step([2, 1, 0], [8, 3, 6], [list(range(8)), [1], [0, 3, 4]])
    for _ in range(2):
        sim.random_arrivals_and_departures()
        sim.random_step()
    sim.check_invariants()
    check_calls(calls)
    commits = grids(ops, "commit")[before:]
    if P > 1:  # rows moved: one block per request, one of them keeps the books, the others wait
        assert commits[:2] == [3, 3], commits
    else:
        assert set(commits) == {1}, commits


def test_several_move_blocks_per_request_and_buffers(ops, calls, monkeypatch):
    """Page size 16 with 7 KV buffers split over 3 move blocks per request (block (b, s) moves
    buffers s, s + 3, s + 6): 9 blocks wait for one verdict; the binding's hand-off scratch (the
    thread's, left by the previous launch on it) gets the previous generation's words, which the
    launch must not take for its own; afterwards its generation is advanced and the rest zero.
    Buffers of several dtypes, row sizes and strides, two of them K and V interleaved in one tensor."""
    scratches = []
    make_sync = api.move_sync

    def move_sync(device):
        scratch = make_sync(device)
        g = int(scratch[0])
        previous = g - 1 if g else GENERATIONS - 1
        scratch[1:] = torch.tensor([tag_word(previous), tag_word(previous, reference.STATUS_OK), 5])
        scratches.append((scratch, g))
        return scratch

    monkeypatch.setattr(api, "move_sync", move_sync)
    monkeypatch.setattr(api, "_kv_shares", lambda device, B, num_buffers, per_share: 3)
    sim = Sim(IMPLS, 10, 16, rows=3, max_context=48, max_draft=8, draw=Draw(seed=4))

    def more(slots, device):  # other dtypes, row sizes and strides (a strided view: rows of 6 of 8)
        wide = torch.randn(slots, 8, device=device).to(torch.float16)
        kv = torch.randn(slots, 2, 3, device=device).to(torch.bfloat16)
        return [torch.randint(-100, 100, (slots, 5), dtype=torch.int8, device=device), wide[:, :6],
                torch.randn(slots, 3, 4, device=device), kv[:, 0], kv[:, 1]]

    sim.add_kv_buffers(more)
    assert sim.admit([0, 1, 2], [14, 0, 30])
    start = len(grids(ops, "commit"))
    assert sim.step([2, 0, 1], [8, 5, 3], [[1, 2, 4, 7], [0, 2, 3, 4], [2]])
    assert grids(ops, "commit")[start:] == [9]
    assert scratches and scratches[-1][0].tolist() == [next_generation(scratches[-1][1]), 0, 0, 0]
    sim.check_invariants()
    check_calls(calls)


@pytest.mark.parametrize("page_size", [1, 4])
def test_more_requests_than_one_tile(ops, calls, page_size):
    """1050 of 1100 requests in one call: more than the bookkeeping block's 1024 threads, so the
    prefix sums carry across two tiles and the page-state passes re-analyse each tile (page size
    4: prefix paths, no KV buffers, partially filled last pages continued)."""
    R = 1100
    sim = Sim(IMPLS, (R * 12) // page_size + 10, page_size, rows=R, max_context=12, max_draft=4, draw=Draw(seed=3))
    assert sim.admit(list(range(R)), [i % 5 for i in range(R)])
    with host_checks(False):
        rows = sim.draw.permutation(list(range(R)))[:1050]
        counts = [sim.draw.int(0, 4) for _ in rows]
        paths = [random_path(sim.draw, n) if page_size == 1 else list(range(sim.draw.int(0, n))) for n in counts]
        assert sim.step(rows, counts, paths, kv_buffers=page_size == 1, check=False)
    sim.check_invariants()
    check_calls(calls)


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("page_size", [1, 16])
def test_kernel_refusals_change_nothing(ops, calls, page_size):
    """With the host checks off (the path of CUDA tensors), the kernels alone refuse a double
    commit, a commit of slots on free pages (never allocated), a stale commit of a dropped
    request and an alloc from a corrupt stack; the binding reads the status back (CPU tensors)
    and raises; every tensor is byte for byte as before, and the pool works on."""
    sim, pending, paths = _double_commit_sim(IMPLS, page_size)
    with host_checks(False):
        replay_commit(sim, pending, paths)
        sim.check_invariants()
        assert commit_never_allocated(sim)
        sim.check_invariants()
        stale = sim.alloc([0, 1], [5, 3])
        release_request(sim, 1)
        sim.expect_refused(lambda st_: sim.commit_call(st_, stale, [[0, 1, 2], [0, 2]], check_status=True),
                           match="does not own")
        sim.check_invariants()
        sim.commit(type(stale)([0], stale.lens[:1], stale.counts[:1], stale.loc), [[0, 1, 2]])
        assert alloc_from_corrupt_stack(sim)
        sim.check_invariants()
    check_calls(calls)


@pytest.mark.parametrize("page_size", [1, 16])
def test_foreign_commit_and_continuation_refused(ops, calls, page_size):
    """The kernels alone (host checks off) refuse a commit whose req_to_token row points into
    another request's pages (page size 16: rows move, through the hand-off) and an alloc that
    would continue another request's last page (page size 16), naming the owner; every tensor is
    byte for byte as before, and the pool works on."""
    sim = _foreign_sim(IMPLS, page_size)
    with host_checks(False):
        assert commit_into_another_request(sim)
        sim.check_invariants()
        assert continue_another_requests_page(sim) == (page_size > 1)
        sim.check_invariants()
    assert sim.step([0, 1], [2, 3], [[0, 1], [0, 2]])
    check_calls(calls)
    assert sum(s[2][0].item() == reference.STATUS_BAD_REQUEST for s in calls if s[1] == "cuda") == 1 + (page_size > 1)


@pytest.mark.parametrize("page_size", [1, 16])
def test_pool_exhausted_changes_nothing(ops, calls, page_size):
    """An alloc that needs more pages than are free: refused as a whole by the kernel (status
    OUT_OF_PAGES read back, RuntimeError), then a smaller one goes through."""
    pages = 3 if page_size == 16 else 30
    sim = Sim(IMPLS, pages, page_size, rows=3, max_context=64, max_draft=16, draw=Draw(seed=2))
    assert sim.admit([0, 1], [10, 16])
    with host_checks(False):
        assert sim.alloc([0, 1], [16, 16] if page_size == 16 else [3, 3]) is None
        assert sim.step([1, 0], [2, 1], [[1], []])
    sim.check_invariants()
    check_calls(calls)
    assert any(s[2][0].item() == reference.STATUS_OUT_OF_PAGES for s in calls if s[1] == "cuda")


@pytest.mark.parametrize("op,name,make_bad", KERNEL_REFUSALS)
def test_bad_values_refused(ops, op, name, make_bad):
    """tests/test_kv_slots.py's kernel refusals (bad counts, rows, lengths, paths, stack height,
    KV buffers too small...): the reference's status, nothing changed, outputs as documented."""
    check_refusal(op, name, make_bad, "cuda", "cpu")


@pytest.mark.parametrize("op,page_size,spoil,exc,match,code", PAGE_STATE_REFUSALS, ids=PAGE_STATE_IDS)
def test_page_state_refusals(ops, op, page_size, spoil, exc, match, code):
    check_page_state_refusal(op, page_size, spoil, code, "cuda", "cpu")


def test_hand_off_scratch(ops):
    """tests/test_kv_slots.py's hand-off checks, fewer launches: a scratch holding the previous
    generation's words (its verdict "accepted"), words of another generation, and the last
    generation (whose successor is 0) fool neither the election nor the wait; the result is the
    reference's, the generation advances and the rest is zeroed; then a refused launch and two
    accepted ones on one scratch (the last after a zeroing, like a CUDA-graph replay)."""
    fills = [[5, tag_word(4), tag_word(4, reference.STATUS_OK), 2],
             [5, tag_word(6), tag_word(6, reference.STATUS_OK), 1],
             [GENERATIONS - 1, tag_word(GENERATIONS - 2), tag_word(GENERATIONS - 2, reference.STATUS_OK), 3]]
    start = len(grids(ops, "commit"))
    check_hand_off_scratch("cpu", "cuda", fills, shares_list=(1,))
    assert grids(ops, "commit")[start:] == [3] * len(fills)
    check_refused_then_accepted_with_one_scratch("cpu", "cuda")
