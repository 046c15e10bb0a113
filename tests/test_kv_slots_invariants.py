"""Invariants of draft-token KV slot allocation over long random sequences of steps.

A `Sim` drives one allocator state per implementation in lockstep through random steps:
requests arrive (their prompt gets slots), speculative steps run (alloc drafts for a random
batch with per-request counts including 0, write each draft's KV, commit a random root path of a
random tree), requests finish (their pages go back to the stack). After every operation all
implementations must hold identical state (exact integer logic), and the reference's state must
satisfy:

* no slot (page) is held by two positions (requests); a position sits at offset pos % P of its page;
* held pages plus the free stack are exactly the pool: nothing leaked, nothing freed twice;
* page_state gives every held page its holder's owner value (row + 1) and exactly the stack's
  pages PAGE_FREE;
* every held position reads back the KV of the token the truth says is there.

Adversarial sequences (the end of this file) replay commits, commit slots never allocated or
already released, commit into or continue another request's pages (a req_to_token row pointing
into them), and corrupt the stack or req_to_token: every such call must be refused as a whole,
leaving every tensor byte for byte as it was, and the invariants must still hold.

The other kv_slots tests reuse Sim (tests/test_kv_slots.py).
"""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from typing import Optional
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spec_kernels
from spec_kernels.kv_slots import api as kv_api
from spec_kernels.kv_slots import reference
from spec_kernels.kv_slots.reference import pages_spanned

PAGE_SIZES = (1, 16, 64)


class Draw:
    """Random choices from hypothesis (shrinkable) or from a seeded random.Random."""

    def __init__(self, data=None, seed: int = 0):
        self.data = data
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi)) if self.data is not None else self.rng.randint(lo, hi)

    def coin(self, p_true: float = 0.5) -> bool:
        return self.int(0, 999) < p_true * 1000

    def permutation(self, items: list) -> list:
        if self.data is not None:
            return self.data.draw(st.permutations(items))
        items = list(items)
        self.rng.shuffle(items)
        return items


def random_path(draw: Draw, n: int) -> list[int]:
    """Drafts on the path from the root to a random node of a random tree of n drafts (node 0 is
    the root, parents precede children), in path order; sometimes a chain, sometimes empty."""
    if n == 0 or draw.coin(0.1):
        return []
    chain = draw.coin(0.3)
    parents = [-1] + [i - 1 if chain else draw.int(0, i - 1) for i in range(1, n)]
    node, path = draw.int(0, n - 1), []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def kv_rows(token_ids: torch.Tensor, kv: list[torch.Tensor]) -> list[torch.Tensor]:
    """The KV rows a token writes: distinguishable per token and per column."""
    t = token_ids.to(torch.float32)
    k = t[:, None, None] + torch.tensor([[0.0, 0.25], [0.5, 0.75]], device=t.device)
    v = torch.stack([token_ids % 30011, token_ids // 30011, torch.full_like(token_ids, 7)], 1).to(torch.int16)
    return [k.to(kv[0].device), v.to(kv[1].device)]


@dataclass
class State:
    """The tensors one implementation works on."""

    impl: str
    req_to_token: torch.Tensor
    free_pages: torch.Tensor
    num_free: torch.Tensor
    page_state: torch.Tensor
    kv: list[torch.Tensor]

    def snapshot(self) -> list[torch.Tensor]:
        return [t.detach().cpu().clone()
                for t in (self.req_to_token, self.free_pages, self.num_free, self.page_state, *self.kv)]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        x, y = x.cpu(), y.cpu()
        assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: tensor {i} differs:\n{x}\n{y}"


@dataclass
class Pending:
    """An alloc whose drafts are not committed yet: its arguments and out_cache_loc."""

    rows: list[int]
    lens: list[int]
    counts: list[int]
    loc: torch.Tensor


@dataclass
class Sim:
    """One allocator state per (impl, device), driven in lockstep; `tokens` is the truth."""

    impls: list[tuple[str, str]]
    num_pages: int
    page_size: int
    rows: int = 8
    max_context: int = 320
    max_draft: int = 16
    rtt_dtype: torch.dtype = torch.int32
    index_dtype: torch.dtype = torch.int64
    draw: Draw = field(default_factory=Draw)
    states: list[State] = field(init=False)
    tokens: dict[int, list[int]] = field(init=False, default_factory=dict)  # row -> token at each position
    pending: dict[int, list[int]] = field(init=False, default_factory=dict)  # row -> drafts not committed
    next_token: int = field(init=False, default=1)

    def __post_init__(self):
        order = self.draw.permutation(list(range(self.num_pages)))  # the stack's initial order
        slots = self.num_pages * self.page_size
        self.states = [
            State(impl,
                  torch.full((self.rows, self.max_context), -1, dtype=self.rtt_dtype, device=dev),
                  torch.tensor(order, dtype=torch.int64, device=dev),
                  torch.tensor([self.num_pages], dtype=torch.int64, device=dev),
                  torch.full((self.num_pages,), reference.PAGE_FREE, dtype=torch.int32, device=dev),
                  [torch.zeros(slots, 2, 2, dtype=torch.float32, device=dev),
                   torch.zeros(slots, 3, dtype=torch.int16, device=dev)])
            for impl, dev in self.impls
        ]

    # ------------------------------------------------------------------ helpers
    def _index(self, values: list[int], st_: State) -> torch.Tensor:
        return torch.tensor(values, dtype=self.index_dtype, device=st_.req_to_token.device)

    def _new_tokens(self, count: int) -> list[int]:
        ids = list(range(self.next_token, self.next_token + count))
        self.next_token += count
        return ids

    def _write_kv(self, st_: State, slots: torch.Tensor, token_ids: list[int]) -> None:
        for buf, rows in zip(st_.kv, kv_rows(torch.tensor(token_ids, dtype=torch.int64), st_.kv)):
            buf[slots.long()] = rows

    def free_page_count(self) -> int:
        return int(self.states[0].num_free.item())

    def pages_needed(self, rows: list[int], counts: list[int]) -> int:
        return sum(pages_spanned(len(self.tokens[r]), len(self.tokens[r]) + n, self.page_size)
                   for r, n in zip(rows, counts))

    def assert_lockstep(self, what: str) -> None:
        ref = self.states[0].snapshot()
        for st_ in self.states[1:]:
            assert_same(ref, st_.snapshot(), f"{what}: {st_.impl} != {self.states[0].impl}")

    # ------------------------------------------------------------------ requests arrive and finish
    def admit(self, rows: list[int], lengths: list[int]) -> bool:
        """New requests: their prompts' positions get slots (the reference allocator, any count,
        run on CPU copies), then the prompts' KV is written."""
        if sum(pages_spanned(0, n, self.page_size) for n in lengths) > self.free_page_count():
            return False
        ids = self._new_tokens(sum(lengths))
        for st_ in self.states:
            rtt, free, num_free, state = (t.cpu() for t in (st_.req_to_token, st_.free_pages, st_.num_free,
                                                             st_.page_state))
            out = torch.empty(sum(lengths), dtype=torch.int64)
            status = torch.empty(reference.STATUS_LEN, dtype=torch.int64)
            reference.alloc_draft_slots(rtt, torch.tensor(rows), torch.zeros(len(rows), dtype=torch.int64),
                                        torch.tensor(lengths), free, num_free, state, self.page_size,
                                        self.max_context, out, status)
            assert status[0].item() == reference.STATUS_OK
            for dst, src in ((st_.req_to_token, rtt), (st_.free_pages, free), (st_.num_free, num_free),
                             (st_.page_state, state)):
                dst.copy_(src)
            self._write_kv(st_, out.to(st_.req_to_token.device), ids)
        at = 0
        for row, n in zip(rows, lengths):
            self.tokens[row] = ids[at:at + n]
            at += n
        return True

    def add_kv_buffers(self, make) -> None:
        """Append the buffers make(num_slots, device) returns (same random contents) to every state's kv."""
        slots = self.num_pages * self.page_size
        for st_ in self.states:
            torch.manual_seed(0)
            st_.kv += make(slots, st_.req_to_token.device)

    def finish(self, row: int) -> None:
        """The request ends: push its pages (in position order) back onto the stack, and mark
        them free (the caller keeps page_state when it moves pages itself)."""
        length = len(self.tokens.pop(row))
        for st_ in self.states:
            pages = (st_.req_to_token[row, :length:self.page_size].long() // self.page_size).tolist()
            top = int(st_.num_free.item())
            st_.free_pages[top:top + len(pages)] = torch.tensor(pages, dtype=torch.int64)
            st_.num_free += len(pages)
            st_.page_state[torch.tensor(pages, dtype=torch.int64, device=st_.page_state.device)] = reference.PAGE_FREE

    # ------------------------------------------------------------------ one speculative step
    def alloc_args(self, st_: State, rows: list[int], lens: list[int], counts: list[int]) -> tuple:
        return (st_.req_to_token, self._index(rows, st_), self._index(lens, st_), self._index(counts, st_),
                st_.free_pages, st_.num_free, st_.page_state, self.page_size)

    def commit_call(self, st_: State, pending: "Pending", paths: list[list[int]], kv_buffers: bool = True,
                    **kw) -> torch.Tensor:
        width = max([len(p) for p in paths] + [1])
        rows = pending.rows
        acc = self._index([p + [-1] * (width - len(p)) for p in paths], st_).reshape(len(rows), width)
        return spec_kernels.commit_draft_slots(
            st_.req_to_token, self._index(rows, st_), self._index(pending.lens, st_),
            self._index(pending.counts, st_), acc, self._index([len(p) for p in paths], st_), st_.free_pages,
            st_.num_free, st_.page_state, self.page_size, kv_buffers=st_.kv if kv_buffers else None, impl=st_.impl,
            max_draft=self.max_draft, **kw)

    def held(self) -> dict[int, list[int]]:
        """row -> the token at each position it holds now: committed, then drafts not yet committed."""
        return {r: toks + self.pending.get(r, []) for r, toks in self.tokens.items()}

    def alloc(self, rows: list[int], counts: list[int], check: bool = True) -> Optional["Pending"]:
        """alloc -> write the drafts' KV. Returns None if the pool was out of pages (then every
        implementation must have refused and changed nothing). Rows must have no pending drafts."""
        assert not set(rows) & set(self.pending), "rows with drafts not yet committed"
        lens = [len(self.tokens[r]) for r in rows]
        enough = self.pages_needed(rows, counts) <= self.free_page_count()
        before = [st_.snapshot() for st_ in self.states]
        locs = []
        for st_ in self.states:
            args = self.alloc_args(st_, rows, lens, counts)
            if not enough:
                with pytest.raises(RuntimeError, match="out of KV pages"):
                    spec_kernels.alloc_draft_slots(*args, impl=st_.impl, max_draft=self.max_draft)
                continue
            locs.append(spec_kernels.alloc_draft_slots(*args, impl=st_.impl, max_draft=self.max_draft))
        if not enough:
            for st_, snap in zip(self.states, before):
                assert_same(snap, st_.snapshot(), f"{st_.impl} changed state when out of pages")
            return None
        for loc in locs[1:]:
            assert_same([locs[0]], [loc], "out_cache_loc")
        self.assert_lockstep("after alloc")

        drafts = self._new_tokens(sum(counts))
        for st_, loc in zip(self.states, locs):
            self._write_kv(st_, loc, drafts)
        at = 0
        for r, n in zip(rows, counts):
            self.pending[r] = drafts[at:at + n]
            at += n
        if check:
            self.check_invariants()
        return Pending(list(rows), lens, list(counts), locs[0].cpu())

    def commit(self, pending: "Pending", paths: list[list[int]], kv_buffers: bool = True, check: bool = True) -> None:
        """Commit the drafts of an alloc (every implementation must accept it)."""
        for st_ in self.states:
            new_lens = self.commit_call(st_, pending, paths, kv_buffers)
            assert new_lens.tolist() == [L + len(p) for L, p in zip(pending.lens, paths)]
            assert new_lens.dtype == self.index_dtype
        self.assert_lockstep("after commit")
        for r, p in zip(pending.rows, paths):
            d = self.pending.pop(r)
            self.tokens[r] += [d[i] for i in p]
        if check:
            self.check_invariants()

    def step(self, rows: list[int], counts: list[int], paths: list[list[int]],
             kv_buffers: bool = True, check: bool = True) -> bool:
        """alloc -> write the drafts' KV -> commit. Returns False if the pool was out of pages
        (then every implementation must have refused and changed nothing)."""
        pending = self.alloc(rows, counts, check)
        if pending is None:
            return False
        self.commit(pending, paths, kv_buffers, check)
        return True

    def expect_refused(self, call, exc=ValueError, match: str = "") -> None:
        """call(state) must raise exc (matching) for every implementation and leave every tensor
        of its state byte for byte as it was."""
        for st_ in self.states:
            before = st_.snapshot()
            with pytest.raises(exc, match=match):
                call(st_)
            assert_same(before, st_.snapshot(), f"{st_.impl}: a refused call changed the state")

    def random_step(self) -> bool:
        """A random batch (random order, distinct rows) with random draft counts and paths."""
        live = self.draw.permutation(sorted(self.tokens))
        rows = live[:self.draw.int(0, len(live))]
        counts = [self.draw.int(0, min(self.max_draft, self.max_context - len(self.tokens[r]))) for r in rows]
        counts = [0 if self.draw.coin(0.15) else n for n in counts]
        return self.step(rows, counts, [random_path(self.draw, n) for n in counts])

    def random_arrivals_and_departures(self) -> None:
        for row in sorted(self.tokens):
            if self.draw.coin(0.15) or len(self.tokens[row]) > self.max_context - self.max_draft:
                self.finish(row)
        free_rows = [r for r in range(self.rows) if r not in self.tokens]
        for row in free_rows[:self.draw.int(0, min(2, len(free_rows)))]:
            self.admit([row], [self.draw.int(0, self.max_context // 4)])

    # ------------------------------------------------------------------ the invariants
    def check_invariants(self, held: Optional[dict[int, list[int]]] = None) -> None:
        """held: row -> the token at each position it holds now (default: the truth, drafts not
        committed yet included)."""
        held = self.held() if held is None else held
        st_ = self.states[0]
        P, C = self.page_size, self.num_pages
        rtt = st_.req_to_token.cpu()
        owner: dict[int, int] = {}
        for row, toks in held.items():
            slots = rtt[row, :len(toks)].long()
            assert bool(((slots >= 0) & (slots < C * P)).all()), f"row {row} holds slots outside the pool: {slots}"
            pos = torch.arange(len(toks))
            assert torch.equal(slots % P, pos % P), f"row {row}: a position is not at offset pos % {P} of its page"
            pages = slots // P
            first = pages[::P]  # page of each page-index of the request
            assert torch.equal(pages, first.repeat_interleave(P)[:len(toks)]), f"row {row}: a page is split"
            for page in first.tolist():
                assert page not in owner, f"page {page} is held by rows {owner[page]} and {row}"
                owner[page] = row
            # committed (and draft) positions read back their tokens' KV
            expect = kv_rows(torch.tensor(toks, dtype=torch.int64), st_.kv)
            for buf, rows_ in zip(st_.kv, expect):
                got = buf[slots.to(buf.device)].cpu()
                assert torch.equal(got, rows_.cpu()), f"row {row}: KV read back wrong tokens"
        top = int(st_.num_free.item())
        free = st_.free_pages[:top].tolist()
        assert len(set(free)) == len(free), f"a page is on the free stack twice: {sorted(free)}"
        assert not set(free) & set(owner), f"pages both held and free: {set(free) & set(owner)}"
        assert set(free) | set(owner) == set(range(C)), f"pages leaked: {set(range(C)) - set(free) - set(owner)}"
        state = st_.page_state.cpu()
        want = torch.full((C,), reference.PAGE_SHARED, dtype=torch.int32)  # (every page is held or free)
        for page, row in owner.items():
            want[page] = reference.page_owner(row)
        want[torch.tensor(free, dtype=torch.int64)] = reference.PAGE_FREE
        wrong = (state != want).nonzero().flatten().tolist()
        assert not wrong, (f"page_state disagrees with the stack and the holders at pages {wrong}: "
                           f"{state[wrong].tolist()} instead of {want[wrong].tolist()}")


# --------------------------------------------------------------------------- the tests
POOL_PAGES = {1: 420, 16: 30, 64: 9}  # small pools: running out of pages happens too


def run_random_sequence(draw: Draw, impls: list[tuple[str, str]], page_size: int, steps: int, **kw) -> Sim:
    sim = Sim(impls, POOL_PAGES[page_size], page_size, draw=draw, **kw)
    for _ in range(steps):
        sim.random_arrivals_and_departures()
        sim.random_step()
    sim.check_invariants()
    return sim


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_steps_triton_equals_reference_and_invariants_hold(page_size, data):
    rtt_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    index_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    max_draft = data.draw(st.sampled_from([4, 16, 64]))
    run_random_sequence(Draw(data), [("reference", "cpu"), ("triton", "cpu")], page_size, steps=12,
                        rtt_dtype=rtt_dtype, index_dtype=index_dtype, max_draft=max_draft)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_long_random_sequences_reference(page_size, data):
    run_random_sequence(Draw(data), [("reference", "cpu")], page_size, steps=40,
                        max_draft=data.draw(st.sampled_from([8, 64])))


# --------------------------------------------------------------------------- adversarial sequences
# Calls a correct caller never makes. Each must be refused as a whole (every tensor of every
# implementation byte for byte as before), after which the pool works on. Refusals are checked
# twice: by the public functions' host checks, and with those off (kernel_only), where the
# kernels refuse by themselves and the status read back raises (the path of CUDA tensors).

@contextlib.contextmanager
def host_checks(enabled: bool):
    if enabled:
        yield
        return
    with mock.patch.object(kv_api, "values_checkable", lambda *tensors: False):
        yield


def released_by(sim: Sim, pending: Pending, paths: list[list[int]]) -> int:
    """Pages (slots when P = 1) a commit of these paths releases."""
    P = sim.page_size
    return sum((n - len(p)) if P == 1 else pages_spanned(L + len(p), L + n, P)
               for L, n, p in zip(pending.lens, pending.counts, paths))


def replay_commit(sim: Sim, pending: Pending, paths: list[list[int]]) -> None:
    """The commit just made, again (the reported bug: its rejected slots would be pushed twice)."""
    sim.expect_refused(lambda st_: sim.commit_call(st_, pending, paths, check_status=True),
                       match="does not own|cannot be freed or kept twice")


def release_request(sim: Sim, row: int) -> None:
    """A request with drafts not yet committed is dropped: every page of its committed positions and
    drafts goes back onto the stack (the caller keeps page_state when it moves pages itself)."""
    length = len(sim.tokens.pop(row)) + len(sim.pending.pop(row))
    for st_ in sim.states:
        pages = st_.req_to_token[row, :length:sim.page_size].long() // sim.page_size
        top = int(st_.num_free.item())
        st_.free_pages[top:top + pages.numel()] = pages.to(st_.free_pages.device)
        st_.num_free += pages.numel()
        st_.page_state[pages.to(st_.page_state.device)] = reference.PAGE_FREE


def commit_never_allocated(sim: Sim) -> bool:
    """A commit for drafts that were never allocated: req_to_token beyond a live request's length
    points at slots of pages still on the free stack (at their right offsets)."""
    P, draw = sim.page_size, sim.draw
    live = [r for r in sorted(sim.tokens) if r not in sim.pending]
    if not live:
        return False
    row = live[draw.int(0, len(live) - 1)]
    L = len(sim.tokens[row])
    first_fresh = -(-L // P) * P
    most = min(sim.max_draft, sim.max_context - L)
    if first_fresh >= L + most or sim.free_page_count() == 0:
        return False  # no draft position can lie beyond the request's own last page
    n = draw.int(first_fresh - L + 1, most)
    fresh_pages = pages_spanned(L, L + n, P)
    top = sim.free_page_count()
    if fresh_pages > top:
        return False
    pages = sim.states[0].free_pages[top - fresh_pages:top].tolist()
    slots = []
    for pos in range(L, L + n):
        own = int(sim.states[0].req_to_token[row, L - 1]) // P if L % P else -1  # its partially filled page
        page = pages[(pos - first_fresh) // P] if pos >= first_fresh else own
        slots.append(page * P + pos % P)
    for st_ in sim.states:
        st_.req_to_token[row, L:L + n] = torch.tensor(slots, dtype=st_.req_to_token.dtype)
    fake = Pending([row], [L], [n], torch.tensor(slots))
    path = random_path(draw, n)
    sim.expect_refused(lambda st_: sim.commit_call(st_, fake, [path], check_status=True),
                       match=r"does not own \(page_state\[\d+\] = 0, free")
    return True


def _pages_of(sim: Sim, row: int) -> list[int]:
    """The pages row holds now (committed positions and drafts not yet committed)."""
    length = len(sim.held()[row])
    rtt = sim.states[0].req_to_token
    return sorted({int(rtt[row, pos]) // sim.page_size for pos in range(length)})


def _intruder_and_victim(sim: Sim, need_partial: bool = False):
    """Two distinct live rows: an intruder without drafts in flight (with its last page partially
    filled if need_partial) and a victim holding pages; None if there are none."""
    P = sim.page_size
    intruders = [r for r in sorted(sim.tokens) if r not in sim.pending and len(sim.tokens[r]) < sim.max_context
                 and (not need_partial or len(sim.tokens[r]) % P)]
    if not intruders:
        return None
    intruder = intruders[sim.draw.int(0, len(intruders) - 1)]
    victims = [r for r in sorted(sim.tokens) if r != intruder and _pages_of(sim, r)]
    if not victims:
        return None
    return intruder, victims[sim.draw.int(0, len(victims) - 1)]


def commit_into_another_request(sim: Sim) -> bool:
    """A commit for one request whose req_to_token row points its draft positions into another
    live request's pages (at the right offsets): it would free or keep the other's pages (the
    reported bug: their slots handed out again by the next alloc). Refused as a whole, naming the
    owner; req_to_token beyond the intruder's length is restored afterwards."""
    pair = _intruder_and_victim(sim)
    if pair is None:
        return False
    intruder, victim = pair
    P, draw = sim.page_size, sim.draw
    L = len(sim.tokens[intruder])
    n = draw.int(1, min(sim.max_draft, sim.max_context - L))
    pages = _pages_of(sim, victim)
    slots = [pages[draw.int(0, len(pages) - 1)] * P + pos % P for pos in range(L, L + n)]
    saved = [st_.req_to_token[intruder, L:L + n].clone() for st_ in sim.states]
    for st_ in sim.states:
        st_.req_to_token[intruder, L:L + n] = torch.tensor(slots, dtype=st_.req_to_token.dtype)
    fake = Pending([intruder], [L], [n], torch.tensor(slots))
    path = random_path(draw, n)
    sim.expect_refused(lambda st_: sim.commit_call(st_, fake, [path], check_status=True),
                       match=rf"\(draft 0 of request 0\) is on page \d+, which request 0 \(row {intruder}\) does not "
                             rf"own \(page_state\[\d+\] = {victim + 1}, owned by row {victim}\)")
    for st_, old in zip(sim.states, saved):
        st_.req_to_token[intruder, L:L + n] = old
    return True


def continue_another_requests_page(sim: Sim) -> bool:
    """An alloc for a request whose last slot (its page partially filled) points into another
    live request's page: its drafts would land on the other's page. Refused as a whole, naming the
    owner; the intruder's last slot is restored afterwards."""
    if sim.page_size == 1:
        return False
    pair = _intruder_and_victim(sim, need_partial=True)
    if pair is None:
        return False
    intruder, victim = pair
    P, draw = sim.page_size, sim.draw
    L = len(sim.tokens[intruder])
    pages = _pages_of(sim, victim)
    slot = pages[draw.int(0, len(pages) - 1)] * P + (L - 1) % P
    saved = [int(st_.req_to_token[intruder, L - 1]) for st_ in sim.states]
    for st_ in sim.states:
        st_.req_to_token[intruder, L - 1] = slot
    n = draw.int(1, min(sim.max_draft, sim.max_context - L))
    sim.expect_refused(lambda st_: spec_kernels.alloc_draft_slots(*sim.alloc_args(st_, [intruder], [L], [n]),
                                                                   impl=st_.impl, max_draft=sim.max_draft),
                       match=rf"\(the last slot of request 0\) is on page \d+, which request 0 \(row {intruder}\) "
                             rf"does not own \(page_state\[\d+\] = {victim + 1}, owned by row {victim}\)")
    for st_, old in zip(sim.states, saved):
        st_.req_to_token[intruder, L - 1] = old
    return True


def alloc_from_corrupt_stack(sim: Sim) -> bool:
    """The stack gets a page pushed that is held (or a free page a second time); an alloc that
    would pop it is refused (the stack and page_state disagree), then the stack is repaired."""
    draw, C = sim.draw, sim.num_pages
    top = sim.free_page_count()
    st0 = sim.states[0]
    held = (st0.page_state.cpu() != reference.PAGE_FREE).nonzero().flatten().tolist()
    if top >= C or not held:
        return False
    twice = top > 0 and draw.coin()
    page = int(st0.free_pages[top - 1]) if twice else held[draw.int(0, len(held) - 1)]
    live = [r for r in sorted(sim.tokens) if r not in sim.pending]
    rows, counts = [], []
    for r in draw.permutation(live):  # a batch that pops the bad page (and, if twice, its twin)
        L = len(sim.tokens[r])
        n = min(sim.max_draft, sim.max_context - L)
        rows.append(r)
        counts.append(n)
        if sim.pages_needed(rows, counts) >= 2:
            break
    need = sim.pages_needed(rows, counts)
    if need < (2 if twice else 1) or need > top + 1:
        return False
    saved = []
    for st_ in sim.states:
        saved.append(int(st_.free_pages[top]))
        st_.free_pages[top] = page
        st_.num_free += 1
    lens = [len(sim.tokens[r]) for r in rows]
    sim.expect_refused(lambda st_: spec_kernels.alloc_draft_slots(*sim.alloc_args(st_, rows, lens, counts),
                                                                   impl=st_.impl, max_draft=sim.max_draft),
                       match="twice in the part of the free stack" if twice else "would pop, is not free")
    for st_, old in zip(sim.states, saved):
        st_.free_pages[top] = old
        st_.num_free -= 1
    return True


def random_batch(sim: Sim, rows: list[int]) -> tuple[list[int], list[int]]:
    counts = [sim.draw.int(0, min(sim.max_draft, sim.max_context - len(sim.tokens[r]))) for r in rows]
    return rows, counts


def adversarial_round(sim: Sim) -> None:
    """One random round: two interleaved batches (alloc A, alloc B, commits in a random order),
    replays of each commit that released something, a request dropped before its commit (whose
    stale commit must be refused), a commit into another request's pages (with drafts in flight
    or not), an alloc continuing another request's page, a commit of slots never allocated, an
    alloc from a corrupt stack."""
    draw = sim.draw
    live = draw.permutation(sorted(sim.tokens))
    cut = draw.int(0, len(live))
    batches = []
    for rows in (live[:cut], live[cut:draw.int(cut, len(live))]):
        rows, counts = random_batch(sim, rows)
        pending = sim.alloc(rows, counts)
        if pending is not None:
            batches.append((pending, [random_path(draw, n) for n in counts]))
    if batches and draw.coin(0.4):  # drop a request with drafts: its stale commit is refused
        which = draw.int(0, len(batches) - 1)
        pending, paths = batches[which]
        with_drafts = [i for i, n in enumerate(pending.counts) if n > 0]
        if with_drafts:
            i = with_drafts[draw.int(0, len(with_drafts) - 1)]
            release_request(sim, pending.rows[i])
            sim.check_invariants()
            sim.expect_refused(lambda st_: sim.commit_call(st_, pending, paths, check_status=True),
                               match="does not own")
            keep = [j for j in range(len(pending.rows)) if j != i]
            batches[which] = (Pending([pending.rows[j] for j in keep], [pending.lens[j] for j in keep],
                                      [pending.counts[j] for j in keep], pending.loc), [paths[j] for j in keep])
    if draw.coin(0.4):  # victims may have drafts in flight
        commit_into_another_request(sim)
        sim.check_invariants()
    for pending, paths in draw.permutation(batches):
        sim.commit(pending, paths)
        if released_by(sim, pending, paths) > 0 and draw.coin(0.7):
            replay_commit(sim, pending, paths)
            sim.check_invariants()
    if draw.coin(0.3):
        commit_never_allocated(sim)
        sim.check_invariants()
    if draw.coin(0.3):
        commit_into_another_request(sim)
        sim.check_invariants()
    if draw.coin(0.3):
        continue_another_requests_page(sim)
        sim.check_invariants()
    if draw.coin(0.3):
        alloc_from_corrupt_stack(sim)
        sim.check_invariants()


def run_adversarial_sequence(draw: Draw, impls, page_size: int, rounds: int, kernel_only: bool, **kw) -> Sim:
    sim = Sim(impls, POOL_PAGES[page_size], page_size, draw=draw, **kw)
    with host_checks(not kernel_only):
        for _ in range(rounds):
            sim.random_arrivals_and_departures()
            adversarial_round(sim)
    sim.check_invariants()
    return sim


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_adversarial_sequences_triton_equals_reference_and_invariants_hold(page_size, data):
    run_adversarial_sequence(Draw(data), [("reference", "cpu"), ("triton", "cpu")], page_size, rounds=6,
                             kernel_only=data.draw(st.booleans()), max_draft=data.draw(st.sampled_from([4, 16, 64])),
                             rtt_dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_long_adversarial_sequences_reference(page_size, data):
    run_adversarial_sequence(Draw(data), [("reference", "cpu")], page_size, rounds=25,
                             kernel_only=data.draw(st.booleans()), max_draft=data.draw(st.sampled_from([8, 64])))


def _double_commit_sim(impls, page_size: int):
    """Requests 0 and 1 with drafts: 0's commit releases slots (P = 1) or its last draft page."""
    sim = Sim(impls, POOL_PAGES[page_size], page_size, draw=Draw(seed=7))
    lens = [max(page_size - 2, 3), 2 * page_size]
    assert sim.admit([0, 1], lens)
    pending = sim.alloc([0, 1], [6, 4])
    paths = [[0, 2], [1]]
    sim.commit(pending, paths)
    assert released_by(sim, pending, paths) > 0
    return sim, pending, paths


@pytest.mark.parametrize("kernel_only", [False, True])
@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_double_commit_is_refused_and_changes_nothing(impl, page_size, kernel_only):
    """The same commit twice (as reported: num_free 13 -> 16, three slots twice on the stack and
    handed out again by the next alloc) is refused as a whole, and the pool works on."""
    sim, pending, paths = _double_commit_sim([(impl, "cpu")], page_size)
    with host_checks(not kernel_only):
        sim.expect_refused(lambda st_: sim.commit_call(st_, pending, paths, check_status=True),
                           match="does not own")
        sim.check_invariants()
        assert sim.step([0, 1], [5, 3], [[0, 1], [0, 2]])
    sim.check_invariants()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_commit_after_release_and_of_never_allocated_slots(page_size):
    """Interleaved requests: A and B allocate in one call, C in another; A is dropped before its
    commit; the stale commit of A and B is refused, B's and C's commits go through; a commit of
    slots still on the free stack is refused."""
    sim = Sim(CPU_LOCKSTEP, POOL_PAGES[page_size], page_size, max_draft=64, draw=Draw(seed=3))
    assert sim.admit([0, 1, 2], [page_size + 1, 2, 3 * page_size])
    ab = sim.alloc([0, 1], [5, 7])
    c = sim.alloc([2], [9])
    release_request(sim, 0)
    sim.check_invariants()
    for kernel_only in (False, True):
        with host_checks(not kernel_only):
            sim.expect_refused(lambda st_: sim.commit_call(st_, ab, [[0, 1], [0, 3]], check_status=True),
                               match=r"\(draft 0 of request 0\) is on page \d+, which request 0 \(row 0\) does not "
                                     r"own \(page_state\[\d+\] = 0, free")
    sim.commit(c, [[0, 2, 3]])
    sim.commit(Pending([1], ab.lens[1:], ab.counts[1:], ab.loc), [[0, 3]])
    for kernel_only in (False, True):
        with host_checks(not kernel_only):
            assert commit_never_allocated(sim)
    sim.check_invariants()


CPU_LOCKSTEP = [("reference", "cpu"), ("triton", "cpu")]


def _foreign_sim(impls, page_size: int) -> Sim:
    """Rows 0..2 live, their last pages partially filled (page size > 1); row 2 has drafts in flight."""
    sim = Sim(impls, POOL_PAGES[page_size], page_size, max_draft=8, draw=Draw(seed=5))
    assert sim.admit([0, 1, 2], [page_size + 3, 2 * page_size + 1, 5])
    assert sim.alloc([2], [6]) is not None
    return sim


@pytest.mark.parametrize("kernel_only", [False, True])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_foreign_commit_and_continuation_are_refused_and_change_nothing(page_size, kernel_only):
    """Commits whose req_to_token row points into another request's pages (one with drafts in
    flight, one without) and allocs continuing another request's last page: refused as a whole
    by the host checks and by the kernels alone, naming the owner; nothing changes, the invariants
    hold, and the pool works on."""
    sim = _foreign_sim(CPU_LOCKSTEP, page_size)
    with host_checks(not kernel_only):
        for _ in range(3):
            assert commit_into_another_request(sim)
            sim.check_invariants()
            assert continue_another_requests_page(sim) == (page_size > 1)
            sim.check_invariants()
    sim.commit(Pending([2], [5], [6], torch.empty(0)), [[0, 1]])
    assert sim.step([0, 1, 2], [3, 2, 4], [[0], [0, 1], [1, 3]])


@pytest.mark.gpu
@pytest.mark.parametrize("kernel_only", [False, True])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("seed", range(2))
def test_gpu_adversarial_sequences_match_reference(page_size, seed, kernel_only):
    run_adversarial_sequence(Draw(seed=seed), [("reference", "cpu"), ("triton", "cuda"), ("cuda", "cuda")],
                             page_size, rounds=12, kernel_only=kernel_only, max_draft=64 if seed else 16)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_gpu_double_commit_is_refused_and_changes_nothing(impl, page_size):
    sim, pending, paths = _double_commit_sim([("reference", "cpu"), (impl, "cuda")], page_size)
    with host_checks(False):
        sim.expect_refused(lambda st_: sim.commit_call(st_, pending, paths, check_status=True),
                           match="does not own")
    sim.check_invariants()
