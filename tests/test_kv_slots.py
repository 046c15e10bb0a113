"""Draft-token KV slot allocation and commit: worked examples, Triton == reference, bad input
(clear errors, state unchanged), the kernels' own refusals, fake tensors / torch.compile, and
the GPU checks (CUDA and Triton vs the reference; CUDA graph capture).

The random-sequence invariants are in tests/test_kv_slots_invariants.py (Sim comes from there).
"""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import spec_kernels
from spec_kernels.kv_slots import reference
from spec_kernels.kv_slots import triton_kernel
from spec_kernels.kv_slots.api import kv_table
from test_kv_slots_invariants import PAGE_SIZES, Draw, Sim, random_path, run_random_sequence

IMPLS = ["reference", "triton"]


def t64(values):
    return torch.tensor(values, dtype=torch.int64)


# --------------------------------------------------------------------------- worked examples
def _fresh(page_size, pages=8, rows=3, context=16):
    """Stack [7, 6, ..., 0] (page 0 on top), req_to_token all -1, every page free."""
    free, num_free = t64(list(range(pages - 1, -1, -1))), t64([pages])
    return (torch.full((rows, context), -1, dtype=torch.int32), free, num_free,
            spec_kernels.kv_slots.page_state_from_free_stack(free, num_free))


def _taken_over_pool():
    """Page size 4, 8 pages: row 2 holds pages 2 and 5 (page 5 half full), the stack holds the rest."""
    rtt, free, num_free, _ = _fresh(4)
    rtt[2, :6] = torch.tensor([8, 9, 10, 11, 20, 21], dtype=torch.int32)
    free[:] = t64([7, 6, 4, 3, 1, 0, 2, 5])
    num_free[0] = 6  # free pages: 7 6 4 3 1 [0 on top]
    return rtt, free, num_free


@pytest.mark.parametrize("impl", IMPLS)
def test_alloc_worked_example(impl):
    rtt, free, num_free = _taken_over_pool()
    state = spec_kernels.kv_slots.page_state_from_free_stack(free, num_free, req_to_token=rtt,
                                                             req_pool_indices=t64([2]), seq_lens=t64([6]), page_size=4)
    assert state.tolist() == [0, 0, 3, 0, 0, 3, 0, 0]  # pages 2 and 5 are row 2's (row + 1)
    loc = spec_kernels.alloc_draft_slots(rtt, t64([2, 0]), t64([6, 0]), t64([3, 5]), free, num_free, state, 4,
                                         impl=impl)
    # row 2: positions 6, 7 fill page 5, position 8 starts a page from the top (0); row 0: pages 1 then 3.
    assert loc.tolist() == [22, 23, 0, 4, 5, 6, 7, 12]
    assert rtt[2, 6:9].tolist() == [22, 23, 0] and rtt[0, :5].tolist() == [4, 5, 6, 7, 12]
    assert num_free.item() == 3 and free.tolist() == [7, 6, 4, 3, 1, 0, 2, 5]  # popped pages stay in place
    assert state.tolist() == [3, 1, 3, 1, 0, 3, 0, 0]  # popped 0 to row 2, 1 and 3 to row 0


@pytest.mark.parametrize("impl", IMPLS)
def test_alloc_continues_only_a_last_page_the_request_owns(impl):
    """A pool taken over without its requests: the pages off the stack are PAGE_SHARED, so row 2
    cannot continue its half-full page 5; with row 2 given, it can, and row 1 pointing its last
    slot at page 5 cannot (another row's page): refused as a whole, nothing changed."""
    rtt, free, num_free = _taken_over_pool()
    shared = spec_kernels.kv_slots.page_state_from_free_stack(free, num_free)
    assert shared.tolist() == [0, 0, -1, 0, 0, -1, 0, 0]
    cases = [(shared, [2], [6], r"request 0 \(row 2\) does not own \(page_state\[5\] = -1, held by no single request"),
             (None, [2, 1], [6, 2], r"req_to_token\[1, 1\] = 21 \(the last slot of request 1\) is on page 5, which "
                                    r"request 1 \(row 1\) does not own \(page_state\[5\] = 3, owned by row 2\)")]
    for state, rows, lens, match in cases:
        a = rtt.clone()
        a[1, :2] = torch.tensor([20, 21], dtype=torch.int32)  # row 1's slots on row 2's page
        if state is None:
            state = spec_kernels.kv_slots.page_state_from_free_stack(
                free, num_free, req_to_token=a[:, :], req_pool_indices=t64([2]), seq_lens=t64([6]), page_size=4)
        state = state.clone()
        args = (a, t64(rows), t64(lens), t64([1] * len(rows)), free.clone(), num_free.clone(), state, 4)
        before = [t.clone() for t in (a, args[4], args[5], state)]
        with pytest.raises(ValueError, match=match):
            spec_kernels.alloc_draft_slots(*args, impl=impl)
        assert all(torch.equal(x, y) for x, y in zip(before, (a, args[4], args[5], state)))
        status, out = run_op("alloc", dict(req_to_token=a, req_pool_indices=args[1], seq_lens=args[2],
                                           num_draft=args[3], free_pages=args[4], num_free=args[5], page_state=state,
                                           page_size=4), impl)
        assert status[0].item() == reference.STATUS_BAD_REQUEST and out.tolist() == [-1] * 8, status
        assert all(torch.equal(x, y) for x, y in zip(before, (a, args[4], args[5], state)))


@pytest.mark.parametrize("impl", IMPLS)
def test_commit_worked_example_page_size_1_remaps_and_copies_no_kv(impl):
    rtt, free, num_free, state = _fresh(1)
    L, n = t64([2, 0]), t64([4, 3])
    loc = spec_kernels.alloc_draft_slots(rtt, t64([0, 1]), L, n, free, num_free, state, 1, impl=impl)
    assert loc.tolist() == [0, 1, 2, 3, 4, 5, 6] and num_free.item() == 1
    assert state.tolist() == [1] * 4 + [2] * 3 + [0]  # row 0's slots, row 1's (row + 1), the free one
    kv = torch.arange(8.0)[:, None].repeat(1, 2)
    new = spec_kernels.commit_draft_slots(rtt, t64([0, 1]), L, n, t64([[1, 3, -1], [0, -1, -1]]), t64([2, 1]),
                                          free, num_free, state, 1, kv_buffers=[kv], impl=impl)
    assert new.tolist() == [4, 1]
    assert rtt[0, 2:4].tolist() == [1, 3] and rtt[1, :1].tolist() == [4]  # remapped, in path order
    assert num_free.item() == 5 and free[1:5].tolist() == [0, 2, 5, 6]  # rejected: drafts 0, 2 of row 0, 1, 2 of row 1
    assert state.tolist() == [0, 1, 0, 1, 2, 0, 0, 0]  # slots 1, 3 stay row 0's, 4 row 1's, the rejected are free
    assert torch.equal(kv, torch.arange(8.0)[:, None].repeat(1, 2))  # page size 1: no KV moves


@pytest.mark.parametrize("impl", IMPLS)
def test_commit_worked_example_page_size_4_moves_kv_rows(impl):
    rtt, free, num_free, state = _fresh(4)
    spec_kernels.alloc_draft_slots(rtt, t64([1]), t64([0]), t64([3]), free, num_free, state, 4, impl=impl)  # page 0
    loc = spec_kernels.alloc_draft_slots(rtt, t64([1]), t64([3]), t64([6]), free, num_free, state, 4, impl=impl)
    assert loc.tolist() == [3, 4, 5, 6, 7, 8]  # slot 3 on page 0, then pages 1 and 2
    k = torch.arange(32.0)[:, None] * torch.tensor([1.0, -1.0])
    v = torch.arange(32, dtype=torch.int16)[:, None].repeat(1, 3)
    new = spec_kernels.commit_draft_slots(rtt, t64([1]), t64([3]), t64([6]), t64([[0, 2, 3]]), t64([3]),
                                          free, num_free, state, 4, kv_buffers=[k, v], impl=impl)
    assert new.tolist() == [6]
    # drafts 0, 2, 3 (slots 3, 5, 6) now at positions 3, 4, 5 (slots 3, 4, 5); page 2 (positions 8+) is freed
    assert k[3:7, 0].tolist() == [3.0, 5.0, 6.0, 6.0] and v[3:7, 0].tolist() == [3, 5, 6, 6]
    assert rtt[1, :6].tolist() == [0, 1, 2, 3, 4, 5]
    assert num_free.item() == 6 and free[5].item() == 2
    assert state.tolist() == [2, 2, 0, 0, 0, 0, 0, 0]  # pages 0 and 1 hold positions 0..5 of row 1


@pytest.mark.parametrize("impl", IMPLS)
def test_commit_into_another_requests_slots_is_refused(impl):
    """Request row 0 is given draft slots 15, 14, 13, 12; a commit for row 2 whose req_to_token row
    points at 15, 14, 13 (accepting 1) would release 14 and 13, which row 0 still holds, and the
    next alloc would hand them out again. It is refused as a whole, naming the request, position,
    slot, page and owner, and changes nothing; row 0's own commit then goes through."""
    rtt, free, num_free, state = _fresh(1, pages=16)
    free[:] = torch.arange(16)
    loc = spec_kernels.alloc_draft_slots(rtt, t64([0]), t64([0]), t64([4]), free, num_free, state, 1, impl=impl)
    assert loc.tolist() == [15, 14, 13, 12] and state[12:].tolist() == [1, 1, 1, 1]
    rtt[2, :3] = torch.tensor([15, 14, 13], dtype=torch.int32)
    foreign = dict(req_to_token=rtt, req_pool_indices=t64([2]), seq_lens=t64([0]), num_draft=t64([3]),
                   accept_index=t64([[0]]), accept_len=t64([1]), free_pages=free, num_free=num_free,
                   page_state=state, page_size=1, kv_buffers=None)
    before = _state(foreign)
    match = (r"req_to_token\[2, 0\] = 15 \(draft 0 of request 0\) is on page 15, which request 0 \(row 2\) does "
             r"not own \(page_state\[15\] = 1, owned by row 0\)")
    with pytest.raises(ValueError, match=match):
        _call("commit", foreign, impl)
    assert all(torch.equal(x, y) for x, y in zip(before, _state(foreign)))
    status, out = run_op("commit", dict(foreign, kv_buffers=[]), impl)  # the kernel alone (no host checks)
    assert status.tolist() == [reference.STATUS_BAD_REQUEST, 0, 12, 0, 0] and out.tolist() == [0]
    assert all(torch.equal(x, y) for x, y in zip(before, _state(foreign)))
    new = spec_kernels.commit_draft_slots(rtt, t64([0]), t64([0]), t64([4]), t64([[0, 1]]), t64([2]), free, num_free,
                                          state, 1, impl=impl)
    assert new.tolist() == [2] and num_free.item() == 14 and free[12:14].tolist() == [13, 12]
    assert spec_kernels.alloc_draft_slots(rtt, t64([1]), t64([0]), t64([2]), free, num_free, state, 1,
                                          impl=impl).tolist() == [12, 13]  # not 14 or 15: row 0 keeps them


CPU_LOCKSTEP = [("reference", "cpu"), ("triton", "cpu")]


def test_chunked_batch_triton_equals_reference():
    """More requests than one Triton chunk (64): the running prefix sums carry across chunks."""
    sim = Sim(CPU_LOCKSTEP, num_pages=600, page_size=4, rows=150, max_context=24,
              max_draft=8, draw=Draw(seed=3))
    assert sim.admit(list(range(150)), [i % 7 for i in range(150)])
    for _ in range(2):
        rows = sim.draw.permutation(list(range(150)))[:140]
        counts = [sim.draw.int(0, 8) for _ in rows]
        assert sim.step(rows, counts, [random_path(sim.draw, n) for n in counts])


def test_prefix_paths_need_no_kv_buffers():
    sim = Sim(CPU_LOCKSTEP, num_pages=30, page_size=16, draw=Draw(seed=5))
    assert sim.admit([0, 1, 2], [5, 16, 0])
    for _ in range(3):
        counts = [sim.draw.int(0, 16) for _ in range(3)]
        assert sim.step([0, 1, 2], counts, [list(range(sim.draw.int(0, n))) for n in counts], kv_buffers=False)


def test_more_kv_buffers_of_any_layout():
    """Row moves in buffers of other dtypes, odd row sizes and strided (combined K/V) layouts."""
    def make(slots, device):
        kv = torch.randn(slots, 2, 3, 8).to(device)  # [S, K/V, heads, dim]: K and V are strided views
        return [kv[:, 0], kv[:, 1], torch.randint(0, 100, (slots, 5), dtype=torch.uint8).to(device),
                torch.randn(slots, dtype=torch.float64).to(device)]

    sim = Sim(CPU_LOCKSTEP, num_pages=30, page_size=16, draw=Draw(seed=6))
    sim.add_kv_buffers(make)
    sim.admit([0, 1, 2], [5, 30, 0])
    before = [t.clone() for t in sim.states[0].kv[2:]]
    assert sim.step([1, 0, 2], [9, 6, 3], [[0, 1, 4, 8], [0, 2, 5], [1]])
    assert all(not torch.equal(x, y) for x, y in zip(before, sim.states[0].kv[2:]))  # rows moved everywhere


def test_total_draft():
    rtt, free, num_free, state = _fresh(1)
    loc = spec_kernels.alloc_draft_slots(rtt, t64([0]), t64([0]), t64([2]), free, num_free, state, 1, total_draft=5,
                                         check_free=False)
    assert loc.tolist() == [0, 1, -1, -1, -1]  # a padded batch's tail


# --------------------------------------------------------------------------- bad input
def make_args(page_size=4, after_alloc=False, impl="reference"):
    """A small valid batch: rows [4, 1, 3] with lengths [9, 5, 0], drafts [3, 0, 5]. After alloc,
    the commit arguments: paths [0, 2], [], [1, 3, 4]."""
    sim = Sim([(impl, "cpu")], num_pages=40, page_size=page_size, rows=6, max_context=64, max_draft=8,
              draw=Draw(seed=1))
    sim.admit([1, 3, 4], [5, 0, 9])
    st_ = sim.states[0]
    args = dict(req_to_token=st_.req_to_token, req_pool_indices=t64([4, 1, 3]), seq_lens=t64([9, 5, 0]),
                num_draft=t64([3, 0, 5]), free_pages=st_.free_pages, num_free=st_.num_free, page_state=st_.page_state,
                page_size=page_size)
    if after_alloc:
        spec_kernels.alloc_draft_slots(**args, max_draft=8)
        for t in st_.kv:  # every row different, so that any KV row moved shows
            t.copy_((torch.arange(t.numel()) % 251).reshape(t.shape).to(t.dtype))
        args.update(accept_index=t64([[0, 2, -1], [-1, -1, -1], [1, 3, 4]]), accept_len=t64([2, 0, 3]),
                    kv_buffers=st_.kv)
    return args


def _with(args, name, fn):
    """A copy of args where args[name] is replaced by fn(a clone of it)."""
    out = dict(args)
    out[name] = fn(args[name].clone() if isinstance(args[name], torch.Tensor) else args[name])
    return out


def _set(idx, value):
    def fn(t):
        t[idx] = value
        return t
    return fn


def _on(device, args):
    """A copy of make_args' dict with its tensors (and lists of tensors) on device."""
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else [t.to(device) for t in v] if isinstance(v, list)
                else v) for k, v in args.items()}


def _state(args):
    kv = args.get("kv_buffers")
    tensors = ([args[k] for k in ("req_to_token", "free_pages", "num_free", "page_state")]
               + (kv if isinstance(kv, list) else []))
    return [t.clone() for t in tensors if isinstance(t, torch.Tensor)]


ALLOC_BAD = [
    # types, dtypes, ranks, shapes, devices, contiguity
    ("req_to_token", lambda t: t.tolist(), TypeError, "req_to_token must be a torch.Tensor"),
    ("req_to_token", lambda t: t.float(), ValueError, "req_to_token must have dtype int32, int64"),
    ("req_to_token", lambda t: t[0], ValueError, "req_to_token must be 2-D"),
    ("req_to_token", lambda t: t.t().contiguous().t(), ValueError, "req_to_token must be contiguous"),
    # req_to_token alone elsewhere (meta stands in for another device): it is the one named
    ("req_to_token", lambda t: t.to("meta"), ValueError, "req_to_token must be on cpu like the other inputs, got meta"),
    ("req_pool_indices", lambda t: t.to("meta"), ValueError, "req_pool_indices must be on cpu"),
    ("req_pool_indices", lambda t: t.float(), ValueError, "req_pool_indices must have dtype int32, int64"),
    ("seq_lens", lambda t: t[:2], ValueError, r"seq_lens must have shape \(3,\)"),
    ("num_draft", lambda t: t.to(torch.int16), ValueError, "num_draft must have dtype int32, int64"),
    ("free_pages", lambda t: t.int(), ValueError, "free_pages must have dtype int64"),
    ("num_free", lambda t: t.repeat(2), ValueError, r"num_free must have shape \(1,\)"),
    ("page_state", lambda t: t.tolist(), TypeError, "page_state must be a torch.Tensor"),
    ("page_state", lambda t: t.long(), ValueError, "page_state must have dtype int32"),
    ("page_state", lambda t: t[:-1], ValueError, r"page_state must have shape \(40,\) \(one entry per page"),
    ("page_state", lambda t: t.to("meta"), ValueError, "page_state must be on cpu"),
    ("page_size", lambda p: 3, ValueError, "page_size must be a power of two >= 1, got 3"),
    ("page_size", lambda p: 0, ValueError, "page_size must be a power of two >= 1, got 0"),
    ("page_size", lambda p: 4.0, TypeError, "page_size must be an int"),
    ("max_draft", lambda m: 65, ValueError, r"max_draft must be an int in \[1, 64\]"),
    # values
    ("num_draft", _set(0, -1), ValueError, r"num_draft\[0\] = -1 must be in \[0, max_draft=8\]"),
    ("num_draft", _set(2, 9), ValueError, r"num_draft\[2\] = 9 must be in \[0, max_draft=8\]"),
    ("req_pool_indices", _set(1, 6), ValueError, r"req_pool_indices\[1\] = 6 is not a row of req_to_token"),
    ("req_pool_indices", _set(1, -1), ValueError, r"req_pool_indices\[1\] = -1 is not a row"),
    ("req_pool_indices", _set(1, 4), ValueError, "req_pool_indices must be distinct"),
    ("seq_lens", _set(0, -2), ValueError, r"seq_lens\[0\] = -2 is negative"),
    ("seq_lens", _set(2, 60), ValueError, r"seq_lens\[2\] \+ num_draft\[2\] = 65 exceeds the context"),
    ("num_free", _set(0, 41), ValueError, r"num_free = 41 must be in \[0, free_pages.numel\(\)=40\]"),
    ("num_free", _set(0, -1), ValueError, r"num_free = -1 must be in"),
    ("req_to_token", _set((4, 8), -5), ValueError, r"req_to_token\[4, 8\] = -5 \(the last slot of request 0\)"),
    ("total_draft", lambda _: 7, ValueError, "total_draft = 7 is less than sum"),
    ("total_draft", lambda _: -1, ValueError, "total_draft must be an int >= 0"),
    ("num_free", _set(0, 1), RuntimeError, "out of KV pages: the batch needs 2 pages of 4 slots, 1 are free"),
    ("status", lambda _: torch.empty(4, dtype=torch.int64), ValueError, r"status must have shape \(5,\)"),
]

COMMIT_BAD = [
    ("accept_index", lambda t: t[0], ValueError, "accept_index must be 2-D"),
    ("accept_index", lambda t: t[:2], ValueError, r"accept_index must have shape \(3, A\) with A <= 64"),
    ("accept_index", lambda t: torch.full((3, 65), -1), ValueError, r"accept_index must have shape \(3, A\)"),
    ("accept_index", lambda t: t.float(), ValueError, "accept_index must have dtype int32, int64"),
    ("accept_len", lambda t: t.float(), ValueError, "accept_len must have dtype int32, int64"),
    ("accept_len", lambda t: t[:1], ValueError, r"accept_len must have shape \(3,\)"),
    ("accept_len", _set(0, 4), ValueError, r"accept_len\[0\] = 4 must be in \[0, min\(num_draft\[0\]=3"),
    ("accept_len", _set(1, -1), ValueError, r"accept_len\[1\] = -1 must be in"),
    ("accept_index", _set((2, 2), 5), ValueError, r"accept_index\[2, 2\] = 5 is not a draft of request 2"),
    ("accept_index", _set((2, 0), -3), ValueError, r"accept_index\[2, 0\] = -3 is not a draft"),
    ("accept_index", _set((2, 1), 1), ValueError, r"accept_index\[2\] must be increasing, got 1 then 1"),
    ("accept_index", _set((0, 2), 2), ValueError, r"accept_index\[0, 2\] = 2 must be -1 \(padding"),
    ("kv_buffers", lambda kv: None, ValueError, r"accept_index\[0, 1\] = 2: with page_size > 1 and no kv_buffers"),
    ("kv_buffers", lambda kv: kv[0], TypeError, "kv_buffers must be a list or tuple of tensors"),
    ("kv_buffers", lambda kv: [kv[0], kv[1][:-1]], ValueError, r"kv_buffers\[1\] must have shape \[num_slots, ...\]"),
    ("kv_buffers", lambda kv: [kv[0][:, :, ::2]], ValueError, r"kv_buffers\[0\] must have contiguous"),
    ("kv_buffers", lambda kv: [kv[0].to("meta")], ValueError, r"kv_buffers\[0\] must be on cpu"),
    ("kv_buffers", lambda kv: [kv[0], kv[1], kv[0]], ValueError, "kv_buffers must be distinct tensors"),
    ("kv_buffers", lambda kv: [kv[0][:20]], ValueError, r"is not a slot of the pool and kv_buffers \(0..19\)"),
    ("num_free", _set(0, 40), ValueError, "the commit releases 1 pages but the stack has room for 0"),
    ("req_to_token", _set((3, 2), 999), ValueError,
     r"req_to_token\[3, 2\] = 999 \(draft 2 of request 2\) is not a slot"),
    ("req_pool_indices", _set(2, 4), ValueError, "req_pool_indices must be distinct"),
    ("num_draft", _set(1, 65), ValueError, r"num_draft\[1\] = 65 must be in \[0, max_draft=64\]"),
]


def _call(op, args, impl, **kw):
    args = {k: v for k, v in args.items() if k not in ("max_draft", "total_draft", "status")}
    fn = spec_kernels.alloc_draft_slots if op == "alloc" else spec_kernels.commit_draft_slots
    return fn(**args, impl=impl, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op,name,make_bad,exc,match",
                         [("alloc", *case) for case in ALLOC_BAD] + [("commit", *case) for case in COMMIT_BAD])
def test_bad_input_raises_and_changes_nothing(impl, op, name, make_bad, exc, match):
    args = make_args(after_alloc=op == "commit", impl=impl)
    extra = {"max_draft": 8} if op == "alloc" else {}
    if name in ("max_draft", "total_draft", "status"):
        extra[name] = make_bad({"max_draft": 8, "total_draft": None, "status": None}[name])
        bad = args
    else:
        bad = _with(args, name, make_bad)
    before = _state(bad)
    with pytest.raises(exc, match=match):
        _call(op, bad, impl, **extra)
    for x, y in zip(before, _state(bad)):
        if x.device.type != "meta":
            assert torch.equal(x, y), "the state changed on bad input"


# Values only the kernels can see on a GPU without debug checks: call the custom ops directly
# (no host checks). Each implementation must refuse with the reference's status, change nothing,
# and fill its outputs as documented (out_cache_loc = -1, new_seq_lens = seq_lens).
KERNEL_REFUSALS = [
    ("alloc", "num_draft", _set(0, -1)), ("alloc", "num_draft", _set(2, 9)), ("alloc", "req_pool_indices", _set(1, 6)),
    ("alloc", "seq_lens", _set(0, -2)), ("alloc", "seq_lens", _set(2, 60)), ("alloc", "num_free", _set(0, 41)),
    ("alloc", "req_to_token", _set((4, 8), -5)), ("alloc", "num_free", _set(0, 1)),
    ("alloc", "total_draft", lambda _: 7),
    ("commit", "accept_len", _set(0, 4)), ("commit", "accept_index", _set((2, 2), 5)),
    ("commit", "accept_index", _set((2, 1), 1)), ("commit", "accept_index", _set((0, 2), 2)),
    ("commit", "kv_buffers", lambda kv: []), ("commit", "kv_buffers", lambda kv: [kv[0][:20]]),
    ("commit", "num_free", _set(0, 40)), ("commit", "req_to_token", _set((3, 2), 999)),
    ("commit", "num_free", _set(0, -1)),
    # two problems: num_free wins, status[3] still names the first bad request
    ("commit", "num_free", _set(0, 41)),
]


# --------------------------------------------------------------------------- page state
def _page_of(a, row, pos):
    return int(a["req_to_token"][row, pos]) // a["page_size"]


def _last_page_free(a):  # request 0 (row 4, length 9) continues the page of its position 8
    a["page_state"][_page_of(a, 4, 8)] = reference.PAGE_FREE


def _last_page_foreign(a):  # ... which row 1 owns
    a["page_state"][_page_of(a, 4, 8)] = reference.page_owner(1)


def _last_page_shared(a):  # ... which no single request owns
    a["page_state"][_page_of(a, 4, 8)] = reference.PAGE_SHARED


def _top_page_owned(a):
    a["page_state"][int(a["free_pages"][int(a["num_free"]) - 1])] = reference.page_owner(1)


def _top_page_twice(a):  # the batch pops 2 pages: the same one twice
    top = int(a["num_free"])
    a["free_pages"][top - 2] = a["free_pages"][top - 1]


def _top_page_outside(a):
    a["free_pages"][int(a["num_free"]) - 1] = a["free_pages"].numel()


def _continue_foreign_page(a):  # request 1 (row 1, length 5) gets a draft, on request 0's last page
    a["num_draft"][1] = 1
    a["req_to_token"][1, 4] = a["req_to_token"][4, 8]


def _one_row_continued_twice(a):  # request 1 is row 4 too (the kernels do not check distinct rows)
    a["req_pool_indices"][1], a["seq_lens"][1], a["num_draft"][1] = 4, 9, 1


def _draft_page_free(a):  # request 2 (row 3, drafts at positions 0..4): its second page
    a["page_state"][_page_of(a, 3, 4)] = reference.PAGE_FREE


def _draft_page_foreign(a):  # ... which row 1 owns
    a["page_state"][_page_of(a, 3, 4)] = reference.page_owner(1)


def _draft_page_shared(a):
    a["page_state"][_page_of(a, 3, 4)] = reference.PAGE_SHARED


def _draft_on_foreign_page(a):  # request 2's position 4 on request 0's page (page size 1: its draft slot)
    a["req_to_token"][3, 4] = a["req_to_token"][4, 9]


def _draft_slot_twice(a):  # page size 1: drafts 0 and 2 of request 2 on one slot
    a["req_to_token"][3, 2] = a["req_to_token"][3, 0]


def _two_blocks_one_page(a):  # page size 4: request 2's positions 0 and 4 (two page-blocks) on one page
    a["req_to_token"][3, 4] = a["req_to_token"][3, 0]


NOT_OWNED = r"is on page \d+, which request {b} \(row {r}\) does not own \(page_state\[\d+\] = {v}"
# (op, page size, spoil the args in place, exception, message, status code)
PAGE_STATE_REFUSALS = [
    ("alloc", 4, _last_page_free, ValueError,
     r"the last slot of request 0\) " + NOT_OWNED.format(b=0, r=4, v=0) + r", free: was the request released",
     reference.STATUS_BAD_REQUEST),
    ("alloc", 4, _last_page_foreign, ValueError,
     r"the last slot of request 0\) " + NOT_OWNED.format(b=0, r=4, v=2) + r", owned by row 1\)",
     reference.STATUS_BAD_REQUEST),
    ("alloc", 4, _last_page_shared, ValueError, NOT_OWNED.format(b=0, r=4, v=-1) + ", held by no single request",
     reference.STATUS_BAD_REQUEST),
    ("alloc", 4, _continue_foreign_page, ValueError,
     r"req_to_token\[1, 4\] = \d+ \(the last slot of request 1\) " + NOT_OWNED.format(b=1, r=1, v=5)
     + r", owned by row 4\)", reference.STATUS_BAD_REQUEST),
    ("alloc", 4, _top_page_owned, ValueError, r"a page this call would pop, is not free \(page_state\[\d+\] = 2, "
     r"owned by row 1\)", reference.STATUS_PAGE_CONFLICT),
    ("alloc", 1, _top_page_owned, ValueError, r"a page this call would pop, is not free",
     reference.STATUS_PAGE_CONFLICT),
    ("alloc", 4, _top_page_twice, ValueError, r"page \d+ is twice in the part of the free stack this call pops",
     reference.STATUS_PAGE_CONFLICT),
    ("alloc", 4, _top_page_outside, ValueError, r"a page this call would pop, is not a page of the pool",
     reference.STATUS_PAGE_CONFLICT),
    # the public function refuses the repeated row first; the kernels find the page claimed twice
    ("alloc", 4, _one_row_continued_twice, ValueError, "req_pool_indices must be distinct",
     reference.STATUS_PAGE_CONFLICT),
    ("commit", 4, _draft_page_free, ValueError,
     r"\(draft 4 of request 2\) " + NOT_OWNED.format(b=2, r=3, v=0) + ", free: were these drafts already committed",
     reference.STATUS_BAD_REQUEST),
    ("commit", 1, _draft_page_free, ValueError, r"\(draft 4 of request 2\) " + NOT_OWNED.format(b=2, r=3, v=0),
     reference.STATUS_BAD_REQUEST),
    ("commit", 4, _draft_page_foreign, ValueError,
     r"\(draft 4 of request 2\) " + NOT_OWNED.format(b=2, r=3, v=2) + r", owned by row 1\)",
     reference.STATUS_BAD_REQUEST),
    ("commit", 1, _draft_page_foreign, ValueError, r"\(draft 4 of request 2\) " + NOT_OWNED.format(b=2, r=3, v=2),
     reference.STATUS_BAD_REQUEST),
    ("commit", 4, _draft_page_shared, ValueError,
     r"\(draft 4 of request 2\) " + NOT_OWNED.format(b=2, r=3, v=-1) + ", held by no single request",
     reference.STATUS_BAD_REQUEST),
    ("commit", 4, _draft_on_foreign_page, ValueError,
     r"\(draft 4 of request 2\) " + NOT_OWNED.format(b=2, r=3, v=5) + r", owned by row 4\)",
     reference.STATUS_BAD_REQUEST),
    ("commit", 1, _draft_on_foreign_page, ValueError,
     r"\(draft 4 of request 2\) " + NOT_OWNED.format(b=2, r=3, v=5) + r", owned by row 4\)",
     reference.STATUS_BAD_REQUEST),
    ("commit", 4, _two_blocks_one_page, ValueError,
     r"holds the drafts of positions 0 and 4 of request 2", reference.STATUS_PAGE_CONFLICT),
    ("commit", 1, _draft_slot_twice, ValueError, r"holds the drafts of positions 0 and 2 of request 2",
     reference.STATUS_PAGE_CONFLICT),
]
PAGE_STATE_IDS = [f"{op}-page{p}-{fn.__name__[1:]}" for op, p, fn, *_ in PAGE_STATE_REFUSALS]


def _page_state_case(op, page_size, spoil, device="cpu"):
    args = make_args(page_size=page_size, after_alloc=op == "commit")
    args = {k: v.clone() if isinstance(v, torch.Tensor) else [t.clone() for t in v] if isinstance(v, list) else v
            for k, v in args.items()}
    spoil(args)
    return _on(device, args)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op,page_size,spoil,exc,match,code", PAGE_STATE_REFUSALS, ids=PAGE_STATE_IDS)
def test_page_state_refusals_change_nothing(impl, op, page_size, spoil, exc, match, code):
    """The public functions (host checks) raise; the kernels alone (custom op, no host checks)
    refuse with the reference's status; either way every tensor is left byte for byte as it was."""
    args = _page_state_case(op, page_size, spoil)
    before = _state(args)
    with pytest.raises(exc, match=match):
        _call(op, args, impl, **({"max_draft": 8} if op == "alloc" else {}))
    assert all(torch.equal(x, y) for x, y in zip(before, _state(args)))
    check_page_state_refusal(op, page_size, spoil, code, impl, "cpu")


def check_page_state_refusal(op, page_size, spoil, code, impl, device):
    args = _page_state_case(op, page_size, spoil, device)
    verdict = _expected_refusal(op, args, 16)
    assert verdict.code == code, verdict
    before = _state(args)
    status, out = run_op(op, args, impl, total_draft=16)
    assert status.tolist() == verdict.as_list(), f"{impl}: status {status.tolist()} != {verdict}"
    for x, y in zip(before, _state(args)):
        assert torch.equal(x.cpu(), y.cpu()), f"{impl} changed the state when refusing"
    expect = torch.full_like(out, -1) if op == "alloc" else args["seq_lens"].cpu()
    assert torch.equal(out, expect)


def test_page_state_from_free_stack():
    free, num_free = t64([5, 0, 3, 1, 9, 9]), t64([4])  # entries beyond num_free are ignored
    state = spec_kernels.kv_slots.page_state_from_free_stack(free, num_free)
    assert state.dtype == torch.int32 and state.tolist() == [0, 0, -1, 0, -1, 0]  # off the stack: PAGE_SHARED
    with pytest.raises(ValueError, match="holds page 1 2 times"):
        spec_kernels.kv_slots.page_state_from_free_stack(t64([1, 1, 0]), t64([3]))
    with pytest.raises(ValueError, match=r"must be page ids in \[0, 3\), got range \[1, 3\]"):
        spec_kernels.kv_slots.page_state_from_free_stack(t64([3, 2, 1]), t64([3]))
    with pytest.raises(ValueError, match="num_free = 4 must be in"):
        spec_kernels.kv_slots.page_state_from_free_stack(t64([0, 1, 2]), t64([4]))


def _owned_pool():
    """Page size 2, 8 pages, stack [7, 6] free. Row 0 holds positions 0..2 on pages 0 and 1, row 1
    positions 0..3 on pages 0 (shared with row 0: a common prefix) and 2, row 3 positions 0..1 on
    page 3; pages 4, 5 are held by a request not given (row 2)."""
    rtt = torch.full((4, 6), -1, dtype=torch.int32)
    rtt[0, :3] = torch.tensor([0, 1, 2], dtype=torch.int32)
    rtt[1, :4] = torch.tensor([0, 1, 4, 5], dtype=torch.int32)
    rtt[2, :4] = torch.tensor([8, 9, 10, 11], dtype=torch.int32)
    rtt[3, :2] = torch.tensor([6, 7], dtype=torch.int32)
    return rtt, t64([7, 6, 0, 1, 2, 3, 4, 5]), t64([2])


def test_page_state_from_free_stack_with_requests():
    """The given requests' pages get their owner (row + 1); a page two of them hold (a shared
    prefix) and the pages of requests not given are PAGE_SHARED; row 0 may continue its own
    half-full page 1, and nobody may continue or commit into the shared page 0."""
    rtt, free, num_free = _owned_pool()
    requests = dict(req_to_token=rtt, req_pool_indices=t64([3, 0, 1]), seq_lens=t64([2, 3, 4]), page_size=2)
    state = spec_kernels.kv_slots.page_state_from_free_stack(free, num_free, **requests)
    assert state.tolist() == [-1, 1, 2, 4, -1, -1, 0, 0]
    for dtype in (torch.int32, torch.int64):  # index dtypes; a request with no positions holds nothing
        again = spec_kernels.kv_slots.page_state_from_free_stack(
            free, num_free, req_to_token=rtt.long(), req_pool_indices=t64([3, 0, 1, 2]).to(dtype),
            seq_lens=t64([2, 3, 4, 0]).to(dtype), page_size=2)
        assert torch.equal(again, state)
    loc = spec_kernels.alloc_draft_slots(rtt, t64([0]), t64([3]), t64([2]), free, num_free, state, 2)
    assert loc.tolist() == [3, 12] and state.tolist() == [-1, 1, 2, 4, -1, -1, 1, 0]
    rtt[3, 0] = 0  # row 3 of length 1 would continue page 0
    with pytest.raises(ValueError, match=r"request 0 \(row 3\) does not own \(page_state\[0\] = -1, held by no"):
        spec_kernels.alloc_draft_slots(rtt, t64([3]), t64([1]), t64([1]), free, num_free, state, 2)
    rtt[3, 2:4] = torch.tensor([0, 1], dtype=torch.int32)  # row 3's drafts on page 0
    with pytest.raises(ValueError, match=r"request 0 \(row 3\) does not own \(page_state\[0\] = -1, held by no"):
        spec_kernels.commit_draft_slots(rtt, t64([3]), t64([2]), t64([2]), t64([[0]]), t64([1]), free, num_free,
                                        state, 2, kv_buffers=[torch.zeros(16, 2)])


@pytest.mark.parametrize("name,value,match", [
    ("req_pool_indices", None, "req_pool_indices must be given with req_to_token and seq_lens"),
    ("page_size", None, "page_size must be given with the requests"),
    ("page_size", 3, "page_size must be a power of two >= 1, got 3"),
    ("page_size", 2.0, "page_size must be an int"),
    ("req_pool_indices", t64([3, 0, 4]), r"req_pool_indices\[2\] = 4 is not a row of req_to_token \(0..3\)"),
    ("req_pool_indices", t64([3, 0, 3]), "req_pool_indices must be distinct"),
    ("req_pool_indices", t64([3, 0]), r"seq_lens must have shape \(2,\)"),
    ("seq_lens", t64([2, 3, 7]), r"seq_lens\[2\] = 7 must be in \[0, 6\]"),
    ("seq_lens", t64([2, -1, 4]), r"seq_lens\[1\] = -1 must be in"),
    ("seq_lens", t64([2, 4, 4]), r"req_to_token\[0, 3\] = -1 \(position 3 of request 1\) is not a slot of the pool "
                                 r"\(free_pages.numel\(\) = 8 pages of 2: slots 0..15\)"),
    ("seq_lens", t64([3, 3, 4]), r"req_to_token\[3, 2\] = -1 \(position 2 of request 0\) is not a slot"),
    ("req_to_token", "free slot", r"req_to_token\[1, 3\] = 13 \(position 3 of request 2\) is on page 6, which is on "
                                  r"the free stack"),
    ("req_to_token", "float", "req_to_token must have dtype int32, int64"),
    ("req_to_token", "meta", "req_to_token must be on cpu"),
    ("seq_lens", "2-D", "seq_lens must be 1-D"),
])
def test_page_state_from_free_stack_refuses_bad_requests(name, value, match):
    rtt, free, num_free = _owned_pool()
    kw = dict(req_to_token=rtt, req_pool_indices=t64([3, 0, 1]), seq_lens=t64([2, 3, 4]), page_size=2)
    if value == "free slot":
        rtt[1, 3] = 13  # page 6 is on the stack
    elif value == "float":
        kw[name] = rtt.float()
    elif value == "meta":
        kw[name] = rtt.to("meta")
    elif value == "2-D":
        kw[name] = kw[name][None]
    else:
        kw[name] = value
    if kw[name] is None:
        del kw[name]
    before = [t.clone() for t in (rtt, free, num_free)]
    with pytest.raises((ValueError, TypeError), match=match):
        spec_kernels.kv_slots.page_state_from_free_stack(free, num_free, **kw)
    assert all(torch.equal(x, y) for x, y in zip(before, (rtt, free, num_free)))


def run_op(op, args, impl, total_draft=8, max_draft=8):
    """The custom op without host checks; returns (status, output)."""
    a = args
    dev = a["req_to_token"].device
    status = torch.full((reference.STATUS_LEN,), -9, dtype=torch.int64, device=dev)
    common = (a["req_to_token"], a["req_pool_indices"], a["seq_lens"], a["num_draft"])
    if op == "alloc":
        out = torch.full((total_draft,), -9, dtype=torch.int64, device=dev)
        torch.ops.spec_kernels.alloc_draft_slots(*common, a["free_pages"], a["num_free"], a["page_state"],
                                                 a["page_size"], max_draft, out, status, impl)
    else:
        out = torch.full_like(a["seq_lens"], -9)
        torch.ops.spec_kernels.commit_draft_slots(*common, a["accept_index"], a["accept_len"], a["free_pages"],
                                                  a["num_free"], a["page_state"], a["page_size"], max_draft,
                                                  a["kv_buffers"], out, status, impl)
    return status.cpu(), out.cpu()


def _refusal_case(op, name, make_bad, device="cpu"):
    args = make_args(after_alloc=op == "commit")
    total = 8
    if name == "total_draft":
        total = make_bad(None)
    else:
        args = _with(args, name, make_bad)
    if name == "num_free" and op == "commit" and args["num_free"].item() == 41:
        args["accept_index"][2, 2] = 7  # also a bad request
    return _on(device, args), total


def _expected_refusal(op, args, total):
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else [t.cpu() for t in v] if isinstance(v, list) else v)
           for k, v in args.items()}
    common = [cpu[k] for k in ("req_to_token", "req_pool_indices", "seq_lens", "num_draft")]
    if op == "alloc":
        return reference.alloc_verdict(*common, cpu["free_pages"], cpu["num_free"], cpu["page_state"],
                                       cpu["page_size"], 8, total)
    return reference.commit_verdict(*common, cpu["accept_index"], cpu["accept_len"], cpu["free_pages"],
                                    cpu["num_free"], cpu["page_state"], cpu["page_size"], 8, cpu["kv_buffers"])


def check_refusal(op, name, make_bad, impl, device):
    args, total = _refusal_case(op, name, make_bad, device)
    verdict = _expected_refusal(op, args, total)
    assert verdict.code != reference.STATUS_OK
    before = _state(args)
    status, out = run_op(op, args, impl, total)
    assert status.tolist() == verdict.as_list(), f"{impl}: status {status.tolist()} != {verdict}"
    for x, y in zip(before, _state(args)):
        assert torch.equal(x, y), f"{impl} changed the state when refusing"
    expect = torch.full_like(out, -1) if op == "alloc" else args["seq_lens"].cpu()
    assert torch.equal(out, expect)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op,name,make_bad", KERNEL_REFUSALS)
def test_kernels_refuse_bad_values_and_change_nothing(impl, op, name, make_bad):
    check_refusal(op, name, make_bad, impl, "cpu")


def test_kernel_statuses_on_success_agree():
    for impl in IMPLS:
        args = make_args(after_alloc=False)
        status, out = run_op("alloc", args, impl, total_draft=10)
        assert status.tolist() == [reference.STATUS_OK, 2, 35, -1, 8] and out[8:].tolist() == [-1, -1]


@pytest.mark.parametrize("impl", IMPLS)
def test_status_read_back_after_launch(monkeypatch, impl):
    """The path of CUDA tensors without debug checks (no host value checks before the launch; the
    kernel refuses, the status read back raises), run on CPU by turning the host checks off."""
    from spec_kernels.kv_slots import api

    monkeypatch.setattr(api, "values_checkable", lambda *tensors: False)
    args = make_args(impl=impl)
    assert spec_kernels.alloc_draft_slots(**args, impl=impl, max_draft=8).numel() == 8  # sized from the status
    for name, bad, exc, match in [("num_free", _set(0, 0), RuntimeError, "needs 2 pages of 4 slots, 0 are free"),
                                  ("num_draft", _set(2, 9), ValueError, r"num_draft\[2\] = 9 must be in")]:
        bad_args = _with(make_args(impl=impl), name, bad)
        before = _state(bad_args)
        with pytest.raises(exc, match=match):
            spec_kernels.alloc_draft_slots(**bad_args, impl=impl, max_draft=8)
        assert all(torch.equal(x, y) for x, y in zip(before, _state(bad_args)))
    with pytest.raises(ValueError, match="pass total_draft"):
        spec_kernels.alloc_draft_slots(**args, impl=impl, max_draft=8, check_free=False)

    bad_args = _with(make_args(after_alloc=True, impl=impl), "accept_index", _set((2, 1), 1))
    before = _state(bad_args)
    assert torch.equal(spec_kernels.commit_draft_slots(**bad_args, impl=impl), bad_args["seq_lens"])  # no sync
    with pytest.raises(ValueError, match=r"accept_index\[2\] must be increasing"):
        spec_kernels.commit_draft_slots(**bad_args, impl=impl, check_status=True)
    assert all(torch.equal(x, y) for x, y in zip(before, _state(bad_args)))


# --------------------------------------------------------------------------- op layer
def test_fake_tensors_give_shapes():
    args = make_args(after_alloc=True)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else [mode.from_tensor(t) for t in v]
                    if isinstance(v, list) else v) for k, v in args.items()}
        commit = dict(fake)
        alloc = {k: commit.pop(k) for k in list(commit) if k not in ("accept_index", "accept_len", "kv_buffers")}
        loc = spec_kernels.alloc_draft_slots(**alloc, total_draft=8, check_free=False)
        new = spec_kernels.commit_draft_slots(**fake)
    assert loc.shape == (8,) and loc.dtype == torch.int64
    assert new.shape == (3,) and new.dtype == torch.int64


def test_meta_tensors_and_compile_need_total_draft():
    args = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in make_args().items()}
    assert spec_kernels.alloc_draft_slots(**args, total_draft=8, check_free=False).shape == (8,)
    with pytest.raises(ValueError, match="pass total_draft"):
        spec_kernels.alloc_draft_slots(**args, check_free=False)


def test_torch_compile_fullgraph_matches_eager():
    def step(rtt, rpi, lens, counts, free, num_free, state, acc, acc_len, k, v):
        loc = spec_kernels.alloc_draft_slots(rtt, rpi, lens, counts, free, num_free, state, 4, total_draft=8,
                                             check_free=False, impl="reference")
        k[loc] = loc[:, None, None].float()
        return loc, spec_kernels.commit_draft_slots(rtt, rpi, lens, counts, acc, acc_len, free, num_free, state, 4,
                                                    kv_buffers=[k, v], impl="reference")

    def inputs():
        a = make_args()
        st_kv = make_args(after_alloc=True)["kv_buffers"]
        return [a["req_to_token"], a["req_pool_indices"], a["seq_lens"], a["num_draft"], a["free_pages"],
                a["num_free"], a["page_state"], t64([[0, 2, -1], [-1, -1, -1], [1, 3, 4]]), t64([2, 0, 3]), *st_kv]

    eager_in, compiled_in = inputs(), inputs()
    eager = step(*eager_in)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled_in)
    for x, y in zip(list(eager) + eager_in, list(compiled) + compiled_in):
        assert torch.equal(x, y)


def test_dispatch_errors():
    args = make_args()
    with pytest.raises(RuntimeError, match="impl='cuda' is not available"):
        spec_kernels.alloc_draft_slots(**args, impl="cuda", max_draft=8)
    with pytest.raises(ValueError, match="impl must be one of"):
        spec_kernels.alloc_draft_slots(**args, impl="fast", max_draft=8)


def test_kv_table_is_cached_and_aligned():
    kv = torch.zeros(10, 2, 8, dtype=torch.bfloat16)
    a, b = kv_table([kv, kv[:, 1]]), kv_table([kv, kv[:, 1]])
    assert a is b and a.unit_bytes == 16 and a.table[1:].tolist() == [[32, 32], [32, 16]]
    assert kv_table([torch.zeros(10, 3, dtype=torch.int16)]).unit_bytes == 2


def _hand_off_commit(move_sync, device="cpu", impl="triton", num_shares=1, make_bad=None):
    """The commit of make_args (page size 4, rows move; make_bad = (name, fn) spoils an argument)
    through one kernel with the given hand-off scratch; returns (status, new_seq_lens, the args
    after)."""
    from spec_kernels.kv_slots import api

    a = make_args(after_alloc=True)
    if make_bad is not None:
        a = _with(a, *make_bad)
    a = _on(device, a)
    status = torch.full((reference.STATUS_LEN,), -9, dtype=torch.int64, device=device)
    new = torch.full_like(a["seq_lens"], -9)
    common = (a["req_to_token"], a["req_pool_indices"], a["seq_lens"], a["num_draft"], a["accept_index"],
              a["accept_len"], a["free_pages"], a["num_free"], a["page_state"], a["page_size"], 8)
    table = kv_table(a["kv_buffers"])
    if impl == "triton":
        triton_kernel.commit_draft_slots(*common, table, new, status, num_shares, move_sync)
    else:
        api.cuda_ops().commit_draft_slots(*common, table.table, table.num_rows, table.unit_bytes, num_shares,
                                          move_sync, new, status)
    return status.cpu(), new.cpu(), a


def _expected_commit():
    a = make_args(after_alloc=True)
    status = torch.full((reference.STATUS_LEN,), -9, dtype=torch.int64)
    new = torch.full_like(a["seq_lens"], -9)
    reference.commit_draft_slots(a["req_to_token"], a["req_pool_indices"], a["seq_lens"], a["num_draft"],
                                 a["accept_index"], a["accept_len"], a["free_pages"], a["num_free"], a["page_state"],
                                 a["page_size"], 8, a["kv_buffers"], new, status)
    return status, new, a


GENERATIONS = triton_kernel.MOVE_GENERATIONS


def tag_word(generation, value=0):
    """An election / verdict word of the hand-off as the launch of `generation` writes it."""
    return ((generation + 1) << triton_kernel.MOVE_TAG_SHIFT) | value


def next_generation(generation):
    return generation + 1 if generation + 1 < GENERATIONS else 0


# Scratch contents [generation g, election, verdict, blocks finished] a launch may find: zeros;
# the previous generation's words (a launch that did not clear them; its verdict "accepted" or
# "refused", its count); words of other generations (what any other launch's tag would write);
# the last generation, whose successor is 0; words that are no tag at all. None may fool the
# election or the wait: the result is the reference's, and the launch leaves [next(g), 0, 0, 0].
STALE_SCRATCH = [
    [0, 0, 0, 0],
    [5, tag_word(4), tag_word(4, reference.STATUS_OK), 2],
    [5, tag_word(4), tag_word(4, reference.STATUS_BAD_REQUEST), 9],
    [5, tag_word(6), tag_word(6, reference.STATUS_OK), 1],
    [5, tag_word(GENERATIONS - 1), tag_word(0, reference.STATUS_OK), 0],
    [GENERATIONS - 1, tag_word(GENERATIONS - 2), tag_word(GENERATIONS - 2, reference.STATUS_OK), 3],
    [3, -1, 7, 1 << 62],
]


def check_hand_off_scratch(device, impl, fills=STALE_SCRATCH, shares_list=(1, 3)):
    """Commits that move KV rows hand the verdict from the bookkeeping block to the move blocks
    through scratch words tagged with the launch's generation: whatever the scratch holds besides
    the generation (STALE_SCRATCH), the result is the reference's, and the launch leaves the
    generation advanced and the other words zero."""
    want_status, want_new, want = _expected_commit()
    for fill in fills:
        for shares in shares_list:
            scratch = torch.tensor(fill, dtype=torch.int64, device=device)
            status, new, got = _hand_off_commit(scratch, device, impl, shares)
            assert status.tolist() == want_status.tolist() and new.tolist() == want_new.tolist(), (fill, shares)
            for name in ("req_to_token", "free_pages", "num_free", "page_state"):
                assert torch.equal(got[name].cpu(), want[name]), name
            for x, y in zip(got["kv_buffers"], want["kv_buffers"]):
                assert torch.equal(x.cpu(), y)
            left = scratch.tolist()
            assert left == [next_generation(fill[0]), 0, 0, 0], f"scratch left {left} (fill {fill}, shares {shares})"


def test_hand_off_scratch_is_not_fooled_by_stale_words_and_advances_its_generation():
    check_hand_off_scratch("cpu", "triton")


def check_refused_then_accepted_with_one_scratch(device, impl):
    """Consecutive launches on one scratch: a refused launch must leave nothing that the next
    launch could mistake for its own (e.g. a stale verdict), and it advances the generation too.
    A CUDA-graph replay starts from a zeroed scratch (the captured memset): zeros again, then the
    same step as the first."""
    want_status, want_new, want = _expected_commit()
    scratch = torch.zeros(triton_kernel.MOVE_SYNC_WORDS, dtype=torch.int64, device=device)
    bad = _set(0, 4)  # accept_len 4 > 3 drafts: refused
    status, new, got = _hand_off_commit(scratch, device, impl, 2, make_bad=("accept_len", bad))
    assert status[0].item() == reference.STATUS_BAD_REQUEST and scratch.tolist() == [1, 0, 0, 0]
    for generation in (1, 0):
        status, new, got = _hand_off_commit(scratch, device, impl, 2)
        assert status.tolist() == want_status.tolist() and new.tolist() == want_new.tolist()
        for x, y in zip(got["kv_buffers"], want["kv_buffers"]):
            assert torch.equal(x.cpu(), y)
        assert scratch.tolist() == [generation + 1, 0, 0, 0]
        scratch.zero_()


def test_refused_then_accepted_with_one_scratch():
    check_refused_then_accepted_with_one_scratch("cpu", "triton")


def check_empty_batch_with_kv_buffers(device, impls):
    """B = 0 with KV buffers and page size 4: nothing to do, no error, state unchanged."""
    for impl in impls:
        a = _on(device, make_args(after_alloc=True))
        before = _state(a)
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        new = spec_kernels.commit_draft_slots(a["req_to_token"], empty, empty, empty, empty.reshape(0, 3), empty,
                                              a["free_pages"], a["num_free"], a["page_state"], 4,
                                              kv_buffers=a["kv_buffers"],
                                              impl=impl, check_status=True)
        assert new.numel() == 0
        for x, y in zip(before, _state(a)):
            assert torch.equal(x, y), impl


def test_empty_batch_with_kv_buffers():
    check_empty_batch_with_kv_buffers("cpu", IMPLS)


def test_move_sync_is_zeroed_library_owned_and_one_per_thread():
    """CPU calls use one scratch per thread (launches of one thread never overlap), created
    zeroed; every commit that moves rows advances its generation by one."""
    import threading

    from spec_kernels.kv_slots import api

    mine = api.move_sync("cpu")
    assert api.move_sync(torch.device("cpu")) is mine and mine.dtype == torch.int64
    assert mine.shape == (triton_kernel.MOVE_SYNC_WORDS,) and mine[1:].tolist() == [0, 0, 0]
    other = []
    worker = threading.Thread(target=lambda: other.append(api.move_sync("cpu")))
    worker.start()
    worker.join()
    assert other[0] is not mine and other[0].tolist() == [0, 0, 0, 0]
    before = int(mine[0])
    sim = Sim(CPU_LOCKSTEP, num_pages=30, page_size=16, draw=Draw(seed=8))
    sim.admit([0, 1], [5, 20])
    assert sim.step([0, 1], [6, 4], [[0, 2, 5], [1]]) and sim.step([1, 0], [3, 0], [[0, 2], []])
    assert mine.tolist() == [next_generation(next_generation(before)), 0, 0, 0]
    with pytest.raises(ValueError, match="needs move_sync"):
        _hand_off_commit(None)
    with pytest.raises(ValueError, match="needs move_sync"):
        _hand_off_commit(torch.zeros(3, dtype=torch.int64))


# --------------------------------------------------------------------------- Triton mutants
# Deliberate bugs in spec_kernels/kv_slots/triton_kernel.py, the Triton twins of CUDA mutants of
# tests/ptx/test_mutants_kv_slots_ptx.py: each edit's text must occur exactly once; the patched
# module replaces the Triton implementation, and the named check (a test of this file) must fail.
# name: (old text, new text, check)
TRITON_MUTANTS = {
    "commit_owner_unchecked": (  # a draft page held by anyone passes, not only the request's own
        "in_pool = in_pool & (owner == (r + 1)[:, None])", "in_pool = in_pool & (owner > 0)", "foreign_commit"),
    "continuation_owner_unchecked": (  # a continued last page held by anyone passes
        "in_pool = in_pool & (owner == r + 1)", "in_pool = in_pool & (owner > 0)", "foreign_continuation"),
    "popped_owner_row0": (  # every popped page gets 1 (row 0; the former "held")
        "(r[:, None] + 1 + tl.zeros_like(pos)).to(tl.int32))", "(1 + tl.zeros_like(pos)).to(tl.int32))", "alloc"),
    "tag_ignored": (  # the election ignores the tag: a stale word makes every program lose
        "    won = (seen >> _TAG_SHIFT) != tag\n", "    won = seen == 0\n", "hand_off"),
    "tag_is_generation": (  # tag 0 in a fresh scratch: a cleared word passes for it
        "        tag = generation + 1\n", "        tag = generation\n", "hand_off"),
    "generation_not_advanced": (
        "            tl.atomic_xchg(SYNC + _GENERATION, tl.where(generation + 1 < _GENERATIONS, generation + 1, 0))\n",
        "", "hand_off"),
    "no_scratch_reset": ("            tl.atomic_xchg(SYNC + _ELECTION, 0)\n", "", "hand_off"),
}


def _triton_check(check):
    if check == "foreign_commit":
        test_commit_into_another_requests_slots_is_refused("triton")
    elif check == "foreign_continuation":
        check_page_state_refusal("alloc", 4, _last_page_foreign, reference.STATUS_BAD_REQUEST, "triton", "cpu")
    elif check == "alloc":
        test_alloc_worked_example("triton")
    else:  # a zeroed scratch, then the previous generation's words
        check_hand_off_scratch("cpu", "triton", fills=STALE_SCRATCH[:2], shares_list=(2,))


@pytest.mark.parametrize("check", sorted({c for *_, c in TRITON_MUTANTS.values()}))
def test_triton_mutant_checks_pass_unmutated(check):
    _triton_check(check)


@pytest.mark.parametrize("name", sorted(TRITON_MUTANTS))
def test_triton_mutant_is_caught(name, tmp_path, monkeypatch):
    import importlib.util
    import inspect

    from spec_kernels.kv_slots import api

    old, new, check = TRITON_MUTANTS[name]
    text = inspect.getsource(triton_kernel)
    assert text.count(old) == 1, f"mutant text found {text.count(old)} times in triton_kernel.py: {old!r}"
    path = tmp_path / f"triton_kernel_{name}.py"
    path.write_text(text.replace(old, new))
    spec = importlib.util.spec_from_file_location(f"spec_kernels.kv_slots._mutant_{name}", path)
    mutant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutant)
    monkeypatch.setattr(api, "triton_kernel", mutant)
    monkeypatch.setitem(api.ALLOC.impls, "triton", mutant.alloc_draft_slots)
    monkeypatch.setitem(globals(), "triton_kernel", mutant)
    with pytest.raises((AssertionError, pytest.fail.Exception)) as caught:
        _triton_check(check)
    print(f"{name} caught by {check}: {(str(caught.value).strip().splitlines() or [''])[0][:200]}")


# --------------------------------------------------------------------------- GPU
GPU_IMPLS = [("reference", "cpu"), ("triton", "cuda"), ("cuda", "cuda")]


@pytest.mark.gpu
@pytest.mark.parametrize("debug_checks", [False, True])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("seed", range(3))
def test_gpu_random_sequences_match_reference(page_size, seed, debug_checks):
    spec_kernels.set_debug_checks(debug_checks)
    try:
        run_random_sequence(Draw(seed=seed), GPU_IMPLS, page_size, steps=25, max_draft=64 if seed else 16,
                            rtt_dtype=torch.int32 if seed % 2 else torch.int64)
    finally:
        spec_kernels.set_debug_checks(None)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_gpu_many_requests_and_buffers(page_size):
    """Batches larger than a CUDA tile (1024 requests); more KV buffers than warps in a block."""
    def make(slots, device):
        # 66 distinct strided views (rows of 64 bytes: ~100k slots stay small) plus one odd-sized buffer.
        kv = torch.randn(slots, 66, 2, 16, dtype=torch.bfloat16).to(device)
        return [kv[:, i] for i in range(66)] + [torch.randn(slots, 3, dtype=torch.float16).to(device)]

    B = 2100
    sim = Sim(GPU_IMPLS, num_pages=B * -(-48 // page_size) + 64, page_size=page_size, rows=B, max_context=48,
              max_draft=8, draw=Draw(seed=11))
    sim.add_kv_buffers(make)
    assert sim.admit(list(range(B)), [i % 23 for i in range(B)])
    for _ in range(2):
        rows = sim.draw.permutation(list(range(B)))
        counts = [sim.draw.int(0, 8) for _ in rows]
        assert sim.step(rows, counts, [random_path(sim.draw, n) for n in counts], check=False)
    sim.check_invariants()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("op,name,make_bad", KERNEL_REFUSALS)
def test_gpu_kernels_refuse_bad_values_and_change_nothing(impl, op, name, make_bad):
    check_refusal(op, name, make_bad, impl, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("op,page_size,spoil,exc,match,code", PAGE_STATE_REFUSALS, ids=PAGE_STATE_IDS)
def test_gpu_page_state_refusals_change_nothing(impl, op, page_size, spoil, exc, match, code):
    check_page_state_refusal(op, page_size, spoil, code, impl, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
def test_gpu_hand_off_scratch_is_not_fooled_by_stale_words_and_advances_its_generation(impl):
    check_hand_off_scratch("cuda", impl)
    check_refused_then_accepted_with_one_scratch("cuda", impl)


@pytest.mark.gpu
def test_gpu_move_sync_one_per_stream_and_fresh_while_capturing():
    """Eager calls: one zeroed scratch per (device, stream), kept; during capture a new zeroed one
    per call (a memset node in the graph), never the eager ones."""
    from spec_kernels.kv_slots import api

    first = api.move_sync("cuda")
    assert api.move_sync(torch.device("cuda", torch.cuda.current_device())) is first
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        other = api.move_sync("cuda")
    assert other is not first and other.tolist() == [0, 0, 0, 0]
    torch.cuda.synchronize()
    graph, captured = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        captured += [api.move_sync("cuda"), api.move_sync("cuda")]
    assert len({t.data_ptr() for t in captured + [first, other]}) == 4
    graph.replay()
    torch.cuda.synchronize()
    assert all(t.tolist() == [0, 0, 0, 0] for t in captured)


@pytest.mark.gpu
def test_gpu_empty_batch_with_kv_buffers():
    check_empty_batch_with_kv_buffers("cuda", ["cuda", "triton"])


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_alloc_and_commit_capture_in_a_cuda_graph(impl, page_size):
    """One step (alloc, write the drafts' KV, commit) captured in a CUDA graph and replayed twice
    equals the reference doing the step twice: no host sync, no allocation outside the graph's
    pool, and the commit's hand-off scratch (page size 16, the graph's own, zeroed by a captured
    memset) starts from zeros in every replay."""
    sim = Sim([("reference", "cpu"), (impl, "cuda")], num_pages=400 // page_size + 8, page_size=page_size,
              draw=Draw(seed=2))
    sim.admit([0, 2, 5], [7, 0, 33])
    rows, counts, paths = [5, 0, 2], [4, 0, 6], [[0, 1, 3], [], [0, 2, 5]]
    ref, gpu = sim.states
    dev = torch.device("cuda")
    lens = [len(sim.tokens[r]) for r in rows]
    inputs = [t64(rows), t64(lens), t64(counts), t64([p + [-1] * (3 - len(p)) for p in paths]),
              t64([len(p) for p in paths])]
    g_in = [x.to(dev) for x in inputs]
    drafts = torch.arange(1000, 1000 + sum(counts), dtype=torch.float32)

    def step(state, rpi, seq, num, acc, acc_len, draft_values):
        loc = spec_kernels.alloc_draft_slots(state.req_to_token, rpi, seq, num, state.free_pages, state.num_free,
                                             state.page_state, page_size, impl=state.impl, total_draft=sum(counts),
                                             check_free=False)
        state.kv[0][loc] = draft_values[:, None, None]
        return loc, spec_kernels.commit_draft_slots(state.req_to_token, rpi, seq, num, acc, acc_len,
                                                    state.free_pages, state.num_free, state.page_state, page_size,
                                                    kv_buffers=state.kv, impl=state.impl)

    ref_outs = [[t.clone() for t in step(ref, *inputs, drafts)] for _ in range(2)]
    draft_values = drafts.to(dev)
    scratch = type(gpu)(impl, *(t.clone() for t in (gpu.req_to_token, gpu.free_pages, gpu.num_free, gpu.page_state)),
                        [t.clone() for t in gpu.kv])
    step(scratch, *g_in, draft_values)  # warm-up: Triton compiles on its first call
    kv_table(gpu.kv)  # cached before capture (building it copies to the device)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpu_out = step(gpu, *g_in, draft_values)
    for ref_out in ref_outs:
        graph.replay()
        torch.cuda.synchronize()
        for x, y in zip(ref_out, gpu_out):
            assert torch.equal(x, y.cpu())
    sim.assert_lockstep("two graph replays")


# --------------------------------------------------------------------------- Triton without a GPU
_COMPILE_FOR_SM90 = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from spec_kernels.kv_slots import triton_kernel

for kernel, constexprs in [
    ("_alloc_kernel", dict(LOG2P=4, BLOCK_B=64, BLOCK_N=64, BLOCK_OUT=256)),
    ("_commit_kernel", dict(LOG2P=0, PREFIX_ONLY=False, UNIT_BYTES=1, MOVES=False, ON_GPU=True, BLOCK_B=64,
                            BLOCK_N=64, BLOCK_A=64, BLOCK_Q=8, BLOCK_U=128)),
    ("_commit_kernel", dict(LOG2P=4, PREFIX_ONLY=False, UNIT_BYTES=2, MOVES=True, ON_GPU=True, BLOCK_B=64,
                            BLOCK_N=64, BLOCK_A=64, BLOCK_Q=8, BLOCK_U=128)),
]:
    fn = getattr(triton_kernel, kernel)
    pointers = {"RTT": "*i32", "ACC": "*i32", "STATE": "*i32", "tag": "i64"}  # int32 tensors; other pointers int64
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "*i64" if n.isupper() and n != "B" else "i32")
                 for n in fn.arg_names}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    assert "cubin" in compiled.asm, kernel
print("compiled")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels really run (tests above)")
def test_triton_kernels_compile_for_sm90():
    """The interpreter does not type-check like the compiler: compile for a real target (no GPU
    needed; a subprocess, since under TRITON_INTERPRET=1 the kernels cannot be compiled)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.compiler", reason="triton.compiler.ASTSource is needed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                          timeout=300)
    if "ImportError" in done.stderr and "ASTSource" in done.stderr:
        pytest.skip("this triton has no ASTSource/GPUTarget")
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
