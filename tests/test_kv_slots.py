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


@pytest.mark.parametrize("impl", IMPLS)
def test_alloc_worked_example(impl):
    rtt, free, num_free, state = _fresh(4)
    rtt[2, :6] = torch.tensor([8, 9, 10, 11, 20, 21], dtype=torch.int32)  # row 2 holds pages 2 and 5, page 5 half full
    free[:] = t64([7, 6, 4, 3, 1, 0, 2, 5])
    num_free[0] = 6  # free pages: 7 6 4 3 1 [0 on top]
    state = spec_kernels.kv_slots.page_state_from_free_stack(free, num_free)
    assert state.tolist() == [0, 0, 1, 0, 0, 1, 0, 0]  # pages 2 and 5 are held
    loc = spec_kernels.alloc_draft_slots(rtt, t64([2, 0]), t64([6, 0]), t64([3, 5]), free, num_free, state, 4,
                                         impl=impl)
    # row 2: positions 6, 7 fill page 5, position 8 starts a page from the top (0); row 0: pages 1 then 3.
    assert loc.tolist() == [22, 23, 0, 4, 5, 6, 7, 12]
    assert rtt[2, 6:9].tolist() == [22, 23, 0] and rtt[0, :5].tolist() == [4, 5, 6, 7, 12]
    assert num_free.item() == 3 and free.tolist() == [7, 6, 4, 3, 1, 0, 2, 5]  # popped pages stay in place
    assert state.tolist() == [1, 1, 1, 1, 0, 1, 0, 0]  # popped 0, 1, 3: held


@pytest.mark.parametrize("impl", IMPLS)
def test_commit_worked_example_page_size_1_remaps_and_copies_no_kv(impl):
    rtt, free, num_free, state = _fresh(1)
    L, n = t64([2, 0]), t64([4, 3])
    loc = spec_kernels.alloc_draft_slots(rtt, t64([0, 1]), L, n, free, num_free, state, 1, impl=impl)
    assert loc.tolist() == [0, 1, 2, 3, 4, 5, 6] and num_free.item() == 1
    assert state.tolist() == [1] * 7 + [0]
    kv = torch.arange(8.0)[:, None].repeat(1, 2)
    new = spec_kernels.commit_draft_slots(rtt, t64([0, 1]), L, n, t64([[1, 3, -1], [0, -1, -1]]), t64([2, 1]),
                                          free, num_free, state, 1, kv_buffers=[kv], impl=impl)
    assert new.tolist() == [4, 1]
    assert rtt[0, 2:4].tolist() == [1, 3] and rtt[1, :1].tolist() == [4]  # remapped, in path order
    assert num_free.item() == 5 and free[1:5].tolist() == [0, 2, 5, 6]  # rejected: drafts 0, 2 of row 0, 1, 2 of row 1
    assert state.tolist() == [0, 1, 0, 1, 1, 0, 0, 0]  # slots 1, 3, 4 stay held, the rejected ones are free
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
    assert state.tolist() == [1, 1, 0, 0, 0, 0, 0, 0]  # pages 0 and 1 hold positions 0..5


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


def _top_page_held(a):
    a["page_state"][int(a["free_pages"][int(a["num_free"]) - 1])] = reference.PAGE_HELD


def _top_page_twice(a):  # the batch pops 2 pages: the same one twice
    top = int(a["num_free"])
    a["free_pages"][top - 2] = a["free_pages"][top - 1]


def _top_page_outside(a):
    a["free_pages"][int(a["num_free"]) - 1] = a["free_pages"].numel()


def _two_continue_one_page(a):  # request 1 (row 1, length 5) gets a draft, on request 0's last page
    a["num_draft"][1] = 1
    a["req_to_token"][1, 4] = a["req_to_token"][4, 8]


def _draft_page_free(a):  # request 2 (row 3, drafts at positions 0..4): its second page
    a["page_state"][_page_of(a, 3, 4)] = reference.PAGE_FREE


def _draft_pages_shared(a):  # request 2's position 4 on request 0's page: released by 2, kept by 0
    a["req_to_token"][3, 4] = a["req_to_token"][4, 8]


def _draft_slot_twice(a):  # page size 1: drafts 0 and 2 of request 2 on one slot
    a["req_to_token"][3, 2] = a["req_to_token"][3, 0]


# (op, page size, spoil the args in place, exception, message, status code)
PAGE_STATE_REFUSALS = [
    ("alloc", 4, _last_page_free, ValueError, r"the last slot of request 0\) is on page \d+, which is not held",
     reference.STATUS_BAD_REQUEST),
    ("alloc", 4, _top_page_held, ValueError, r"a page this call would pop, is not free",
     reference.STATUS_PAGE_CONFLICT),
    ("alloc", 1, _top_page_held, ValueError, r"a page this call would pop, is not free",
     reference.STATUS_PAGE_CONFLICT),
    ("alloc", 4, _top_page_twice, ValueError, r"page \d+ is twice in the part of the free stack this call pops",
     reference.STATUS_PAGE_CONFLICT),
    ("alloc", 4, _top_page_outside, ValueError, r"a page this call would pop, is not a page of the pool",
     reference.STATUS_PAGE_CONFLICT),
    ("alloc", 4, _two_continue_one_page, ValueError, r"requests 0 and 1 both continue page",
     reference.STATUS_PAGE_CONFLICT),
    ("commit", 4, _draft_page_free, ValueError, r"\(draft 4 of request 2\) is on page \d+, which is not held",
     reference.STATUS_BAD_REQUEST),
    ("commit", 1, _draft_page_free, ValueError, r"\(draft 4 of request 2\) is on page \d+, which is not held",
     reference.STATUS_BAD_REQUEST),
    ("commit", 4, _draft_pages_shared, ValueError,
     r"holds the drafts of position 9 of request 0 and position 4 of request 2", reference.STATUS_PAGE_CONFLICT),
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
    assert state.dtype == torch.int32 and state.tolist() == [0, 0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="holds page 1 2 times"):
        spec_kernels.kv_slots.page_state_from_free_stack(t64([1, 1, 0]), t64([3]))
    with pytest.raises(ValueError, match=r"must be page ids in \[0, 3\), got range \[1, 3\]"):
        spec_kernels.kv_slots.page_state_from_free_stack(t64([3, 2, 1]), t64([3]))
    with pytest.raises(ValueError, match="num_free = 4 must be in"):
        spec_kernels.kv_slots.page_state_from_free_stack(t64([0, 1, 2]), t64([4]))


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


def _hand_off_commit(move_sync, tag, device="cpu", impl="triton", num_shares=1, make_bad=None):
    """The commit of make_args (page size 4, rows move; make_bad = (name, fn) spoils an argument)
    through one kernel with the given scratch and tag; returns (status, new_seq_lens, the args
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
        triton_kernel.commit_draft_slots(*common, table, new, status, num_shares, move_sync, tag)
    else:
        api.cuda_ops().commit_draft_slots(*common, table.table, table.num_rows, table.unit_bytes, num_shares,
                                          move_sync, tag, new, status)
    return status.cpu(), new.cpu(), a


def _expected_commit():
    a = make_args(after_alloc=True)
    status = torch.full((reference.STATUS_LEN,), -9, dtype=torch.int64)
    new = torch.full_like(a["seq_lens"], -9)
    reference.commit_draft_slots(a["req_to_token"], a["req_pool_indices"], a["seq_lens"], a["num_draft"],
                                 a["accept_index"], a["accept_len"], a["free_pages"], a["num_free"], a["page_state"],
                                 a["page_size"], 8, a["kv_buffers"], new, status)
    return status, new, a


def check_hand_off_scratch(device, impl):
    """Commits that move KV rows hand the verdict from the bookkeeping block to the move blocks
    through scratch words tagged per call: any contents under other tags (stale scratch of earlier
    calls, zeros, garbage) are ignored, the result is the reference's, and the scratch is zeroed
    afterwards (so that a CUDA-graph replay, which reuses its tag, starts clean)."""
    from spec_kernels.kv_slots.api import move_sync

    want_status, want_new, want = _expected_commit()
    _, tag = move_sync(device)
    old_tag = tag - 1
    for fill in ([0, 0, 0], [(old_tag << 25) | 5, (old_tag << 25) | 3, (old_tag << 25) | 9], [-1, 7, 1 << 62]):
        for shares in (1, 3):
            scratch = torch.tensor(fill, dtype=torch.int64, device=device)
            status, new, got = _hand_off_commit(scratch, tag, device, impl, shares)
            assert status.tolist() == want_status.tolist() and new.tolist() == want_new.tolist()
            for name in ("req_to_token", "free_pages", "num_free", "page_state"):
                assert torch.equal(got[name].cpu(), want[name]), name
            for x, y in zip(got["kv_buffers"], want["kv_buffers"]):
                assert torch.equal(x.cpu(), y)
            assert scratch.tolist() == [0, 0, 0], f"scratch left {scratch.tolist()} (fill {fill}, shares {shares})"
            tag += 1


def test_hand_off_scratch_needs_no_initialisation_and_is_zeroed_after():
    check_hand_off_scratch("cpu", "triton")


def check_refused_then_accepted_with_one_scratch_and_tag(device, impl):
    """A CUDA-graph replay reuses its tag and scratch: a refused launch must leave nothing that
    the next launch with the same tag could mistake for its own (e.g. a stale verdict)."""
    from spec_kernels.kv_slots.api import move_sync

    want_status, want_new, want = _expected_commit()
    scratch, tag = move_sync(device)
    bad = _set(0, 4)  # accept_len 4 > 3 drafts: refused
    status, new, got = _hand_off_commit(scratch, tag, device, impl, 2, make_bad=("accept_len", bad))
    assert status[0].item() == reference.STATUS_BAD_REQUEST and scratch.tolist() == [0, 0, 0]
    status, new, got = _hand_off_commit(scratch, tag, device, impl, 2)
    assert status.tolist() == want_status.tolist() and new.tolist() == want_new.tolist()
    for x, y in zip(got["kv_buffers"], want["kv_buffers"]):
        assert torch.equal(x.cpu(), y)
    assert scratch.tolist() == [0, 0, 0]


def test_refused_then_accepted_with_one_scratch_and_tag():
    check_refused_then_accepted_with_one_scratch_and_tag("cpu", "triton")


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


def test_move_sync_tags_are_new_and_in_range():
    from spec_kernels.kv_slots.api import move_sync

    tags = [move_sync("cpu")[1] for _ in range(3)]
    assert len(set(tags)) == 3 and all(1 << 32 <= t < 1 << triton_kernel.MOVE_TAG_BITS for t in tags)
    with pytest.raises(ValueError, match="needs move_sync"):
        _hand_off_commit(None, tags[0])


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
def test_gpu_hand_off_scratch_needs_no_initialisation_and_is_zeroed_after(impl):
    check_hand_off_scratch("cuda", impl)
    check_refused_then_accepted_with_one_scratch_and_tag("cuda", impl)


@pytest.mark.gpu
def test_gpu_empty_batch_with_kv_buffers():
    check_empty_batch_with_kv_buffers("cuda", ["cuda", "triton"])


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_alloc_and_commit_capture_in_a_cuda_graph(impl, page_size):
    """One step (alloc, write the drafts' KV, commit) captured in a CUDA graph and replayed twice
    equals the reference doing the step twice: no host sync, no allocation outside the graph's
    pool, and the commit's hand-off scratch (page size 16) is clean again for the second replay,
    which reuses the captured tag."""
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
