"""Triton draft-token KV slot allocation and commit: one launch each, no host sync.

Program 0 keeps the books for the whole batch. It first validates every request and totals
what the batch needs (so a failed call changes nothing: it only writes the status), then walks
the batch in chunks of BLOCK_B requests with a running prefix sum, which gives every request its
offset into the free-page stack and into out_cache_loc. Integer logic only: results equal the
reference exactly.

Page state (an owner per page: 0 free, row + 1, PAGE_SHARED): once everything else is valid,
the bookkeeping claims the call's pages (alloc: the pages it pops and the last pages requests
continue; commit: the draft pages) with atomic exchanges to PAGE_MARK. Every claimed page was
checked before to be in the state the call needs (popped: free; continued and draft pages: the
request's row + 1), so an exchange that returns PAGE_MARK is a page claimed twice: the call is
refused and every claimed page is set back to that state. Otherwise the writes set each claimed
page to its final state (popped: the owner of the request it goes to; continued: its owner
again; commit: released pages free, kept pages their owner), again by atomic exchange.

Commit with page_size > 1 and KV buffers also moves the accepted drafts' KV rows in the same
launch, with the hand-off of csrc/kv_slots/kv_slots.cu: program (b, s) moves request b's rows in
a share s of the buffers; the first program to arrive is elected to keep the books first and
publishes the verdict once the whole batch is validated; every program waits for it, and nothing
moves if the call was refused. The election and the verdict are tagged with the launch's
generation, read from the scratch, which the last program to finish advances (after clearing the
other words). The moves touch nothing the bookkeeping reads or writes.

Same rules, codes and precedence as spec_kernels/kv_slots/reference.py (see there).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import _ops
from .reference import (
    PAGE_FREE,
    PAGE_MARK,
    STATUS_BAD_REQUEST,
    STATUS_BAD_STACK,
    STATUS_OK,
    STATUS_OUT_OF_PAGES,
    STATUS_OUT_TOO_SMALL,
    STATUS_PAGE_CONFLICT,
)

_OK = tl.constexpr(STATUS_OK)
_OUT_OF_PAGES = tl.constexpr(STATUS_OUT_OF_PAGES)
_BAD_REQUEST = tl.constexpr(STATUS_BAD_REQUEST)
_BAD_STACK = tl.constexpr(STATUS_BAD_STACK)
_OUT_TOO_SMALL = tl.constexpr(STATUS_OUT_TOO_SMALL)
_PAGE_CONFLICT = tl.constexpr(STATUS_PAGE_CONFLICT)
_FREE = tl.constexpr(PAGE_FREE)
_MARK = tl.constexpr(PAGE_MARK)

# The launch-wide hand-off (kv_slots.cu, "launch-wide hand-off"; launchers.h has the constants):
# scratch [generation, election, verdict, programs finished]; the election and verdict words are
# (tag << MOVE_TAG_SHIFT) | value with tag = generation + 1, below 2^63 (a non-negative int64).
MOVE_SYNC_WORDS = 4
MOVE_TAG_SHIFT = 8
MOVE_GENERATIONS = (1 << (63 - MOVE_TAG_SHIFT)) - 1  # generations 0 .. MOVE_GENERATIONS - 1
MOVE_MAX_PROGRAMS = (1 << 24) - 1  # num_requests x shares
_TAG_SHIFT = tl.constexpr(MOVE_TAG_SHIFT)
_VALUE_MASK = tl.constexpr((1 << MOVE_TAG_SHIFT) - 1)
_GENERATIONS = tl.constexpr(MOVE_GENERATIONS)
_GENERATION = tl.constexpr(0)  # the scratch's words
_ELECTION = tl.constexpr(1)
_VERDICT = tl.constexpr(2)
_FINISHED = tl.constexpr(3)
_MAX_POLLS = tl.constexpr(1 << 27)  # minutes of polling with the back-off; the bookkeeper needs microseconds


@triton.jit
def _requests(rows, max_ctx, RPI, SEQ, ND, max_draft, B, start, BLOCK_B: tl.constexpr):
    """Chunk [start, start + BLOCK_B) of the batch: indices, liveness, (row, length, drafts), and
    whether those scalars are valid."""
    b = start + tl.arange(0, BLOCK_B)
    live = b < B
    r = tl.load(RPI + b, mask=live, other=0).to(tl.int64)
    L = tl.load(SEQ + b, mask=live, other=0).to(tl.int64)
    n = tl.load(ND + b, mask=live, other=0).to(tl.int64)
    ok = (r >= 0) & (r < rows) & (L >= 0) & (n >= 0) & (n <= max_draft) & (L + n <= max_ctx)
    return b, live, r, L, n, ok


@triton.jit
def _pages_spanned(begin, end, LOG2P: tl.constexpr):
    P: tl.constexpr = 1 << LOG2P
    return ((end + P - 1) >> LOG2P) - ((begin + P - 1) >> LOG2P)


@triton.jit
def _first_bad(bad, b, live, ok, B):
    return tl.minimum(bad, tl.min(tl.where(live & (ok == 0), b, B), 0))


@triton.jit
def _verdict(top, capacity, bad, B, totals_code):
    """The code before the page state is looked at (precedence as in reference._verdict)."""
    code = tl.where(bad < B, _BAD_REQUEST, totals_code)
    return tl.where((top < 0) | (top > capacity), _BAD_STACK, code)


@triton.jit
def _write_status(STATUS, code, top, bad, B, pages, tokens):
    found = bad < B
    tl.store(STATUS + 0, code.to(tl.int64))
    tl.store(STATUS + 1, tl.where(found, 0, pages).to(tl.int64))
    tl.store(STATUS + 2, top.to(tl.int64))
    tl.store(STATUS + 3, tl.where(found, bad, -1).to(tl.int64))
    tl.store(STATUS + 4, tl.where(found, 0, tokens).to(tl.int64))


@triton.jit
def _set_pages(STATE, pages, mask, value):
    """page_state[pages] = value (a scalar or like pages; atomic exchange); returns whether any of
    them was PAGE_MARK."""
    old = tl.atomic_xchg(STATE + pages, (tl.zeros(pages.shape, tl.int32) + value).to(tl.int32), mask=mask)
    return tl.max(tl.ravel(tl.where(mask & (old == _MARK), 1, 0)), 0)


# --------------------------------------------------------------------------- alloc
@triton.jit
def _alloc_chunk(RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, STATE, capacity, max_draft, B, start,
                 LOG2P: tl.constexpr, BLOCK_B: tl.constexpr, CHECK_STATE: tl.constexpr):
    """A chunk of requests: validity, and the last page each continues (`partial`). The owner of
    the continued pages is checked only while nothing is claimed (CHECK_STATE, pass 1)."""
    b, live, r, L, n, ok = _requests(rows, max_ctx, RPI, SEQ, ND, max_draft, B, start, BLOCK_B)
    P: tl.constexpr = 1 << LOG2P
    partial = ok & (n > 0) & ((L & (P - 1)) != 0)  # continues its last, partially filled page
    last_page = tl.load(RTT + r * stride_rtt + L - 1, mask=live & partial, other=0).to(tl.int64) >> LOG2P
    in_pool = (last_page >= 0) & (last_page < capacity)
    if CHECK_STATE:  # a request continues only a page it owns (row + 1)
        owner = tl.load(STATE + last_page, mask=live & partial & in_pool, other=0).to(tl.int64)
        in_pool = in_pool & (owner == r + 1)
    ok = ok & ((partial == 0) | in_pool)
    partial = live & partial & ok
    need = tl.where(live & ok, _pages_spanned(L, L + n, LOG2P), 0)
    n = tl.where(live & ok, n, 0)
    return b, live, r, L, n, ok, last_page, need, partial


@triton.jit
def _alloc_claim(RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, FREE, STATE, capacity, max_draft, B, top, pages,
                 LOG2P: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_OUT: tl.constexpr):
    """Claim the pages the call pops (free_pages[top - pages : top]) and the last pages requests
    continue; returns 1 (and leaves page_state as it was) on a page conflict."""
    # Read first: every page to pop must be a free page of the pool.
    bad = tl.full([], 0, tl.int32)
    for j0 in range(top - pages, top, BLOCK_OUT):
        j = j0 + tl.arange(0, BLOCK_OUT)
        m = j < top
        page = tl.load(FREE + j, mask=m, other=0)
        in_pool = (page >= 0) & (page < capacity)
        state = tl.load(STATE + page, mask=m & in_pool, other=_FREE)
        bad = tl.maximum(bad, tl.max(tl.where(m & ((in_pool == 0) | (state != _FREE)), 1, 0), 0))
    if bad == 0:
        # Claim: a popped page is free and a continued one owned, so PAGE_MARK means claimed twice.
        for j0 in range(top - pages, top, BLOCK_OUT):
            j = j0 + tl.arange(0, BLOCK_OUT)
            m = j < top
            bad = tl.maximum(bad, _set_pages(STATE, tl.load(FREE + j, mask=m, other=0), m, _MARK))
        for start in range(0, B, BLOCK_B):
            b, live, r, L, n, ok, last_page, need, partial = _alloc_chunk(
                RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, STATE, capacity, max_draft, B, start, LOG2P, BLOCK_B,
                False)
            bad = tl.maximum(bad, _set_pages(STATE, last_page, partial, _MARK))
        if bad != 0:  # refused: every claimed page back to the state it was checked to have
            tl.debug_barrier()
            for j0 in range(top - pages, top, BLOCK_OUT):
                j = j0 + tl.arange(0, BLOCK_OUT)
                m = j < top
                _set_pages(STATE, tl.load(FREE + j, mask=m, other=0), m, _FREE)
            _alloc_restore_continued(RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, STATE, capacity, max_draft, B,
                                     LOG2P, BLOCK_B)
    return bad


@triton.jit
def _alloc_restore_continued(RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, STATE, capacity, max_draft, B,
                             LOG2P: tl.constexpr, BLOCK_B: tl.constexpr):
    """The continued pages' final state, accepted or refused: their owner (row + 1) again."""
    for start in range(0, B, BLOCK_B):
        b, live, r, L, n, ok, last_page, need, partial = _alloc_chunk(
            RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, STATE, capacity, max_draft, B, start, LOG2P, BLOCK_B, False)
        _set_pages(STATE, last_page, partial, (r + 1).to(tl.int32))


@triton.jit
def _alloc_kernel(
    RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, FREE, NUM_FREE, STATE, capacity, OUT, out_capacity, STATUS,
    B, max_draft,
    LOG2P: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_OUT: tl.constexpr,
):
    P: tl.constexpr = 1 << LOG2P
    top = tl.load(NUM_FREE)
    # Pass 1: validate every request and total the pages and tokens, before changing anything.
    bad = tl.full([], 0, tl.int32) + B  # (B == 1 arrives as a constexpr; loop-carried values need a type)
    pages = tl.full([], 0, tl.int64)
    tokens = tl.full([], 0, tl.int64)
    for start in range(0, B, BLOCK_B):
        b, live, r, L, n, ok, last_page, need, partial = _alloc_chunk(
            RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, STATE, capacity, max_draft, B, start, LOG2P, BLOCK_B, True)
        bad = _first_bad(bad, b, live, ok, B)
        pages += tl.sum(need, 0)
        tokens += tl.sum(n, 0)
    totals_code = tl.where(tokens > out_capacity, _OUT_TOO_SMALL, tl.where(pages > top, _OUT_OF_PAGES, _OK))
    code = _verdict(top, capacity, bad, B, totals_code)
    if code == _OK:
        if _alloc_claim(RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, FREE, STATE, capacity, max_draft, B, top, pages,
                        LOG2P, BLOCK_B, BLOCK_OUT) != 0:
            code = tl.full([], _PAGE_CONFLICT, tl.int32)
    _write_status(STATUS, code, top, bad, B, pages, tokens)

    # out_cache_loc beyond the slots written below (all of it on failure) reads -1.
    filled = tl.where(code == _OK, tokens, 0)
    for start in range(0, out_capacity, BLOCK_OUT):
        offs = start + tl.arange(0, BLOCK_OUT)
        tl.store(OUT + offs, tl.full([BLOCK_OUT], -1, tl.int64), mask=(offs < out_capacity) & (offs >= filled))

    # Pass 2: the pages of request b are popped after those of requests 0..b-1.
    if code == _OK:
        page_carry = tl.full([], 0, tl.int64)
        token_carry = tl.full([], 0, tl.int64)
        for start in range(0, B, BLOCK_B):
            b, live, r, L, n, ok, last_page, need, partial = _alloc_chunk(
                RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, STATE, capacity, max_draft, B, start, LOG2P, BLOCK_B,
                False)
            page_off = page_carry + tl.cumsum(need, 0) - need
            token_off = token_carry + tl.cumsum(n, 0) - n
            i = tl.arange(0, BLOCK_N)[None, :].to(tl.int64)
            item = live[:, None] & (i < n[:, None])
            pos = L[:, None] + i
            first_fresh = ((L + P - 1) >> LOG2P) << LOG2P  # first position on a page from the stack
            fresh = pos >= first_fresh[:, None]
            k = (pos - first_fresh[:, None]) >> LOG2P  # which of the request's new pages
            page = tl.load(FREE + (top - 1 - page_off[:, None] - k), mask=item & fresh, other=0)
            page = tl.where(fresh, page, last_page[:, None])
            slot = (page << LOG2P) + (pos & (P - 1))
            tl.store(RTT + r[:, None] * stride_rtt + pos, slot, mask=item)
            tl.store(OUT + token_off[:, None] + i, slot, mask=item)
            # A popped page (claimed) gets its owner at its first position, which starts the page.
            first_of_page = item & fresh & ((pos & (P - 1)) == 0)
            _set_pages(STATE, page, first_of_page, (r[:, None] + 1 + tl.zeros_like(pos)).to(tl.int32))
            page_carry += tl.sum(need, 0)
            token_carry += tl.sum(n, 0)
        tl.debug_barrier()
        _alloc_restore_continued(RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, STATE, capacity, max_draft, B,
                                 LOG2P, BLOCK_B)
        tl.store(NUM_FREE, top - pages)


# --------------------------------------------------------------------------- hand-off
@triton.jit
def _elect_bookkeeper(WORD, tag):
    """Whether this program keeps the books: exactly one of the launch wins, with at most one
    compare-and-swap each (seeing this launch's tag means another program has won; a word of any
    other generation is taken over)."""
    seen = tl.atomic_add(WORD, 0)
    won = (seen >> _TAG_SHIFT) != tag
    if won:
        won = tl.atomic_cas(WORD, seen, tag << _TAG_SHIFT) == seen
    return won


@triton.jit
def _wait_for_verdict(WORD, tag, ON_GPU: tl.constexpr):
    """The published verdict. The bookkeeping program was running when this one arrived, so the
    wait ends; after _MAX_POLLS polls (cannot happen) trap. The interpreter runs the programs one
    by one in order, so the first (the bookkeeper) has always finished: a verdict not there at the
    first poll never comes (a bug), and reads as "refused"."""
    v = tl.atomic_add(WORD, 0)
    if ON_GPU:
        polls = 0
        while ((v >> _TAG_SHIFT) != tag) & (polls < _MAX_POLLS):
            polls = tl.inline_asm_elementwise("nanosleep.u32 512;\n\tadd.s32 $0, $1, 1;", "=r,r", [polls],
                                              dtype=tl.int32, is_pure=False, pack=1)
            v = tl.atomic_add(WORD, 0)
        if (v >> _TAG_SHIFT) != tag:
            tl.inline_asm_elementwise("trap; mov.u32 $0, $1;", "=r,r", [polls], dtype=tl.int32, is_pure=False,
                                      pack=1)
    return tl.where((v >> _TAG_SHIFT) == tag, v & _VALUE_MASK, -1)


# --------------------------------------------------------------------------- commit
@triton.jit
def _commit_chunk(
    RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, ACC, stride_acc, width, ACC_LEN, slot_bound, STATE, max_draft, B,
    start, LOG2P: tl.constexpr, PREFIX_ONLY: tl.constexpr, CHECK_STATE: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr,
):
    """Validate a chunk of requests; also returns each one's accepted-draft bit mask, its draft
    slots [BLOCK_B, BLOCK_N] and how many pages (slots when P = 1) it releases. CHECK_STATE: also
    check that every draft slot is on a page the request owns (only while nothing is claimed:
    pass 1)."""
    b, live, r, L, n, ok = _requests(rows, max_ctx, RPI, SEQ, ND, max_draft, B, start, BLOCK_B)
    k = tl.load(ACC_LEN + b, mask=live, other=0).to(tl.int64)
    ok = ok & (k >= 0) & (k <= n) & (k <= width)

    j = tl.arange(0, BLOCK_A)[None, :].to(tl.int64)
    in_row = live[:, None] & (j < width)
    a = tl.load(ACC + b[:, None] * stride_acc + j, mask=in_row, other=-1).to(tl.int64)
    prev = tl.load(ACC + b[:, None] * stride_acc + j - 1, mask=in_row & (j > 0), other=-1).to(tl.int64)
    on_path = j < k[:, None]
    good = tl.where(on_path, (a >= 0) & (a < n[:, None]) & (a > prev), a == -1)
    if PREFIX_ONLY:
        good = good & ((on_path == 0) | (a == j))
    ok = ok & (tl.min(tl.where(in_row, good, 1).to(tl.int32), 1) > 0)
    one = tl.full([BLOCK_B, BLOCK_A], 1, tl.int64)
    mask = tl.sum(tl.where(on_path & good, one << tl.where(good, a, 0), 0), 1)  # distinct bits: sum == or

    i = tl.arange(0, BLOCK_N)[None, :].to(tl.int64)
    is_draft = (live & ok)[:, None] & (i < n[:, None])
    slots = tl.load(RTT + r[:, None] * stride_rtt + L[:, None] + i, mask=is_draft, other=0).to(tl.int64)
    in_pool = (slots >= 0) & (slots < slot_bound)
    if CHECK_STATE:  # every draft slot on a page the request owns (row + 1)
        owner = tl.load(STATE + (slots >> LOG2P), mask=is_draft & in_pool, other=0).to(tl.int64)
        in_pool = in_pool & (owner == (r + 1)[:, None])
    ok = ok & (tl.min(tl.where(is_draft, in_pool, 1).to(tl.int32), 1) > 0)
    if LOG2P == 0:
        released = n - k
    else:
        released = _pages_spanned(L + k, L + n, LOG2P)
    released = tl.where(live & ok, released, 0)
    k = tl.where(live & ok, k, 0)
    return b, live, r, L, n, k, ok, mask, slots, released


@triton.jit
def _set_draft_pages(RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, ACC_LEN, STATE, max_draft, B, start,
                     MODE: tl.constexpr, LOG2P: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_Q: tl.constexpr):
    """The draft pages of a chunk of (valid) requests (reference.draft_pages): MODE 0 claims them
    (PAGE_MARK), 1 gives them back to their owner (row + 1); MODE 2, after the writes, gives the
    kept ones back to their owner (the released ones are those pushed: _release_pushed). Returns
    whether a claim found a page claimed already. Loads only what it needs (no pass-1 tile is
    live here)."""
    P: tl.constexpr = 1 << LOG2P
    b, live, r, L, n, ok = _requests(rows, max_ctx, RPI, SEQ, ND, max_draft, B, start, BLOCK_B)
    live = live & ok
    end = L + n  # the draft positions [L, end) whose pages are set
    if MODE == 2:
        k = tl.load(ACC_LEN + b, mask=live, other=0).to(tl.int64)
        end = tl.minimum(end, ((L + k + P - 1) >> LOG2P) << LOG2P)  # kept: P = 1 the remapped L .. L+k-1
    if LOG2P == 0:
        i = tl.arange(0, BLOCK_N)[None, :].to(tl.int64)
        is_draft = live[:, None] & (L[:, None] + i < end[:, None])
        pages = tl.load(RTT + r[:, None] * stride_rtt + L[:, None] + i, mask=is_draft, other=0).to(tl.int64)
    else:
        q = tl.arange(0, BLOCK_Q)[None, :].to(tl.int64)
        block = ((L >> LOG2P) << LOG2P)[:, None] + q * P  # first position of each page-block
        first = tl.maximum(block, L[:, None])  # its first draft position
        is_draft = live[:, None] & (first < end[:, None])
        pages = tl.load(RTT + r[:, None] * stride_rtt + first, mask=is_draft, other=0).to(tl.int64) >> LOG2P
    if MODE == 0:
        value = tl.full(pages.shape, _MARK, tl.int32)
    else:
        value = (r[:, None] + 1 + tl.zeros_like(pages)).to(tl.int32)
    old = tl.atomic_xchg(STATE + pages, value, mask=is_draft)
    return tl.max(tl.max(tl.where(is_draft & (old == _MARK), 1, 0), 1), 0)


@triton.jit
def _release_pushed(FREE, STATE, top, released, BLOCK: tl.constexpr):
    """The pages a commit pushed (free_pages[top : top + released]) become free."""
    for j0 in range(top, top + released, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < top + released
        _set_pages(STATE, tl.load(FREE + j, mask=m, other=0), m, _FREE)


@triton.jit
def _commit_books(
    RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, ACC, stride_acc, width, ACC_LEN, slot_bound,
    FREE, NUM_FREE, STATE, capacity, NEW_SEQ, STATUS, B, max_draft, SYNC, tag,
    LOG2P: tl.constexpr, PREFIX_ONLY: tl.constexpr, MOVES: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    P: tl.constexpr = 1 << LOG2P
    top = tl.load(NUM_FREE)
    bad = tl.full([], 0, tl.int32) + B
    released = tl.full([], 0, tl.int64)
    accepted = tl.full([], 0, tl.int64)
    for start in range(0, B, BLOCK_B):
        b, live, r, L, n, k, ok, mask, slots, rel = _commit_chunk(
            RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, ACC, stride_acc, width, ACC_LEN, slot_bound, STATE,
            max_draft, B, start, LOG2P, PREFIX_ONLY, True, BLOCK_B, BLOCK_N, BLOCK_A)
        bad = _first_bad(bad, b, live, ok, B)
        released += tl.sum(rel, 0)
        accepted += tl.sum(k, 0)
    code = _verdict(top, capacity, bad, B, tl.where(top + released > capacity, _BAD_STACK, _OK))
    if code == _OK:
        # Claim the draft pages (all checked owned): PAGE_MARK back means a page claimed twice.
        twice = tl.full([], 0, tl.int32)
        for start in range(0, B, BLOCK_B):
            twice = tl.maximum(twice, _set_draft_pages(RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, ACC_LEN, STATE,
                                                       max_draft, B, start, 0, LOG2P, BLOCK_B, BLOCK_N, BLOCK_Q))
        if twice != 0:  # refused: every claimed page back to its owner
            for start in range(0, B, BLOCK_B):
                _set_draft_pages(RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, ACC_LEN, STATE, max_draft, B, start, 1,
                                 LOG2P, BLOCK_B, BLOCK_N, BLOCK_Q)
            code = tl.full([], _PAGE_CONFLICT, tl.int32)
    _write_status(STATUS, code, top, bad, B, released, accepted)
    if MOVES:  # every program waits for this; it also publishes the zeroed count of finished ones
        tl.atomic_xchg(SYNC + _FINISHED, 0)
        tl.atomic_xchg(SYNC + _VERDICT, (tag << _TAG_SHIFT) + code.to(tl.int64))

    carry = tl.full([], 0, tl.int64)
    for start in range(0, B, BLOCK_B):
        if code == _OK:
            b, live, r, L, n, k, ok, mask, slots, rel = _commit_chunk(
                RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, ACC, stride_acc, width, ACC_LEN, slot_bound, STATE,
                max_draft, B, start, LOG2P, PREFIX_ONLY, False, BLOCK_B, BLOCK_N, BLOCK_A)
            push_at = top + carry + tl.cumsum(rel, 0) - rel  # request b pushes after requests 0..b-1
            row = r[:, None] * stride_rtt
            if LOG2P == 0:
                # Accepted draft i moves to position L + (accepted drafts before it); rejected ones
                # are pushed in draft order. All slots were read above, before any is overwritten.
                i = tl.arange(0, BLOCK_N)[None, :].to(tl.int64)
                is_draft = live[:, None] & (i < n[:, None])
                keep = is_draft & (((mask[:, None] >> i) & 1) != 0)
                drop = is_draft & (((mask[:, None] >> i) & 1) == 0)
                dest = tl.cumsum(keep.to(tl.int64), 1) - 1
                rank = tl.cumsum(drop.to(tl.int64), 1) - 1
                tl.debug_barrier()
                tl.store(RTT + row + L[:, None] + dest, slots, mask=keep)
                tl.store(FREE + push_at[:, None] + rank, slots, mask=drop)
            else:
                q = tl.arange(0, BLOCK_Q)[None, :].to(tl.int64)
                pos = (((L + k + P - 1) >> LOG2P) << LOG2P)[:, None] + q * P  # first slot of each freed page
                freed = live[:, None] & (pos < (L + n)[:, None])
                page = tl.load(RTT + row + pos, mask=freed, other=0).to(tl.int64) >> LOG2P
                tl.store(FREE + push_at[:, None] + q, page, mask=freed)
            tl.store(NEW_SEQ + b, L + k, mask=live)
            carry += tl.sum(rel, 0)
        else:
            b = start + tl.arange(0, BLOCK_B)
            tl.store(NEW_SEQ + b, tl.load(SEQ + b, mask=b < B), mask=b < B)
    if code == _OK:
        # The claimed pages' final state: pushed ones free, kept ones their owner's.
        tl.debug_barrier()
        _release_pushed(FREE, STATE, top, released, BLOCK_A * 4)
        for start in range(0, B, BLOCK_B):
            _set_draft_pages(RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, ACC_LEN, STATE, max_draft, B, start, 2,
                             LOG2P, BLOCK_B, BLOCK_N, BLOCK_Q)
        tl.store(NUM_FREE, top + released)


@triton.jit
def _move_kv_rows(
    RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, ACC, stride_acc, width, ACC_LEN, slot_bound, B, max_draft,
    KV_TABLE, num_buffers, req, share, num_shares, SYNC, tag,
    LOG2P: tl.constexpr, UNIT_BYTES: tl.constexpr, ON_GPU: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_U: tl.constexpr,
):
    """Move the accepted drafts' KV rows of request `req` in buffers share, share + num_shares, ...
    once the bookkeeping has accepted the whole call (waits for its verdict in any case: the count
    of finished programs is valid only after it)."""
    b, live, r, L, n, k, ok, mask, slots, rel = _commit_chunk(
        RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, ACC, stride_acc, width, ACC_LEN, slot_bound, KV_TABLE, max_draft,
        B, req, LOG2P, False, False, 1, BLOCK_N, BLOCK_A)  # (the page state is the bookkeeper's: not read here)
    k = tl.sum(k, 0)  # 0 when the request is invalid: nothing moves
    r = tl.sum(r, 0)
    L = tl.sum(L, 0)
    if _wait_for_verdict(SYNC + _VERDICT, tag, ON_GPU) != _OK:
        k = tl.zeros_like(k)
    # Path order: draft path[j] >= j, so row j is overwritten only after every read of it.
    for j in range(0, k):
        a = tl.load(ACC + req * stride_acc + j).to(tl.int64)
        if a != j:
            src = tl.load(RTT + r * stride_rtt + L + a).to(tl.int64)
            dst = tl.load(RTT + r * stride_rtt + L + j).to(tl.int64)
            for buf in range(share, num_buffers, num_shares):
                base = tl.load(KV_TABLE + buf)
                row_stride = tl.load(KV_TABLE + num_buffers + buf) // UNIT_BYTES
                row_units = tl.load(KV_TABLE + 2 * num_buffers + buf) // UNIT_BYTES
                if UNIT_BYTES == 8:
                    ptr = base.to(tl.pointer_type(tl.int64))
                elif UNIT_BYTES == 4:
                    ptr = base.to(tl.pointer_type(tl.int32))
                elif UNIT_BYTES == 2:
                    ptr = base.to(tl.pointer_type(tl.int16))
                else:
                    ptr = base.to(tl.pointer_type(tl.int8))
                for c in range(0, row_units, BLOCK_U):
                    offs = c + tl.arange(0, BLOCK_U)
                    x = tl.load(ptr + src * row_stride + offs, mask=offs < row_units)
                    tl.store(ptr + dst * row_stride + offs, x, mask=offs < row_units)
        tl.debug_barrier()


@triton.jit
def _commit_kernel(
    RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, ACC, stride_acc, width, ACC_LEN, slot_bound,
    FREE, NUM_FREE, STATE, capacity, NEW_SEQ, STATUS, B, max_draft,
    KV_TABLE, num_buffers, num_shares, SYNC,
    LOG2P: tl.constexpr, PREFIX_ONLY: tl.constexpr, UNIT_BYTES: tl.constexpr, MOVES: tl.constexpr,
    ON_GPU: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_U: tl.constexpr,
):
    if MOVES:
        # The generation cannot change during the launch: only the last program to finish
        # advances it, after every program has read it here. tag = generation + 1 is never 0 (a
        # cleared word) and differs from the previous launch's.
        generation = tl.atomic_add(SYNC + _GENERATION, 0)
        tag = generation + 1
        if _elect_bookkeeper(SYNC + _ELECTION, tag):  # see the module docstring
            _commit_books(RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, ACC, stride_acc, width, ACC_LEN, slot_bound,
                          FREE, NUM_FREE, STATE, capacity, NEW_SEQ, STATUS, B, max_draft, SYNC, tag,
                          LOG2P, PREFIX_ONLY, MOVES, BLOCK_B, BLOCK_N, BLOCK_A, BLOCK_Q)
        pid = tl.program_id(0)
        _move_kv_rows(RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, ACC, stride_acc, width, ACC_LEN, slot_bound,
                      B, max_draft, KV_TABLE, num_buffers, pid // num_shares, pid % num_shares, num_shares, SYNC, tag,
                      LOG2P, UNIT_BYTES, ON_GPU, BLOCK_N, BLOCK_A, BLOCK_U)
        # The last program to finish (every other one has counted itself, after its last access to
        # the scratch) clears the words and advances the generation, for the next launch.
        if tl.atomic_add(SYNC + _FINISHED, 1) + 1 == tl.num_programs(0):
            tl.atomic_xchg(SYNC + _ELECTION, 0)
            tl.atomic_xchg(SYNC + _VERDICT, 0)
            tl.atomic_xchg(SYNC + _FINISHED, 0)
            tl.atomic_xchg(SYNC + _GENERATION, tl.where(generation + 1 < _GENERATIONS, generation + 1, 0))
    else:
        _commit_books(RTT, stride_rtt, rows, max_ctx, RPI, SEQ, ND, ACC, stride_acc, width, ACC_LEN, slot_bound,
                      FREE, NUM_FREE, STATE, capacity, NEW_SEQ, STATUS, B, max_draft, SYNC, 0,
                      LOG2P, PREFIX_ONLY, MOVES, BLOCK_B, BLOCK_N, BLOCK_A, BLOCK_Q)


# --------------------------------------------------------------------------- launchers
# 8 warps: the [BLOCK_B, 64] tiles of one bookkeeping program spill registers at 4 (up to 1 KB
# at max_draft 64: tools/triton_compile_report.py); the programs are few, so warps cost nothing.
_WARPS = 8


def _chunk(num_requests: int) -> int:
    return min(triton.next_power_of_2(max(num_requests, 1)), 64)


def alloc_draft_slots(req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free, page_state,
                      page_size: int, max_draft: int, out_cache_loc, status) -> None:
    """Arguments as reference.alloc_draft_slots (already checked for metadata)."""
    B = req_pool_indices.numel()
    _alloc_kernel[(1,)](
        req_to_token, req_to_token.stride(0), req_to_token.shape[0], req_to_token.shape[1],
        req_pool_indices, seq_lens, num_draft, free_pages, num_free, page_state, free_pages.numel(),
        out_cache_loc, out_cache_loc.numel(), status, B, max_draft,
        LOG2P=page_size.bit_length() - 1, BLOCK_B=_chunk(B), BLOCK_N=triton.next_power_of_2(max_draft),
        BLOCK_OUT=256, num_warps=_WARPS,
    )


def commit_draft_slots(req_to_token, req_pool_indices, seq_lens, num_draft, accept_index, accept_len,
                       free_pages, num_free, page_state, page_size: int, max_draft: int, kv_table, new_seq_lens, status,
                       num_shares: int = 1, move_sync=None) -> None:
    """Arguments as reference.commit_draft_slots, except the KV buffers: kv_table is the
    KvTable of api.py (or None); num_shares splits each request's buffers over that many programs;
    move_sync is the hand-off's scratch when rows move (int64 [MOVE_SYNC_WORDS], zero or left by
    the previous launch on it, never shared with a concurrent launch: api.move_sync)."""
    B = req_pool_indices.numel()
    log2p = page_size.bit_length() - 1
    moves = page_size > 1 and kv_table is not None and B > 0
    if moves and (move_sync is None or move_sync.numel() != MOVE_SYNC_WORDS
                  or not 1 <= B * num_shares <= MOVE_MAX_PROGRAMS):
        raise ValueError(f"commit_draft_slots: moving KV rows needs move_sync (int64 [{MOVE_SYNC_WORDS}]) and "
                         f"1 <= B x num_shares <= {MOVE_MAX_PROGRAMS}")
    capacity = free_pages.numel()
    slot_bound = min(capacity * page_size, kv_table.num_rows) if moves else capacity * page_size
    width = accept_index.shape[1]
    grid = (B * num_shares if moves else 1,)
    _commit_kernel[grid](
        req_to_token, req_to_token.stride(0), req_to_token.shape[0], req_to_token.shape[1],
        req_pool_indices, seq_lens, num_draft, accept_index, accept_index.stride(0), width, accept_len, slot_bound,
        free_pages, num_free, page_state, capacity, new_seq_lens, status, B, max_draft,
        kv_table.table if moves else free_pages, kv_table.num_buffers if moves else 0, num_shares,
        move_sync if moves else free_pages,
        LOG2P=log2p, PREFIX_ONLY=page_size > 1 and not moves, UNIT_BYTES=min(kv_table.unit_bytes, 8) if moves else 1,
        MOVES=moves, ON_GPU=not _ops.triton_interpreting(),
        BLOCK_B=_chunk(B), BLOCK_N=triton.next_power_of_2(max_draft), BLOCK_A=triton.next_power_of_2(max(width, 1)),
        BLOCK_Q=triton.next_power_of_2(max_draft // page_size + 2), BLOCK_U=128, num_warps=_WARPS,
    )
