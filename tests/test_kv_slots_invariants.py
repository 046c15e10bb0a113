"""Invariants of draft-token KV slot allocation over long random sequences of steps.

A `Sim` drives one allocator state per implementation in lockstep through random steps:
requests arrive (their prompt gets slots), speculative steps run (alloc drafts for a random
batch with per-request counts including 0, write each draft's KV, commit a random root path of a
random tree), requests finish (their pages go back to the stack). After every operation all
implementations must hold identical state (exact integer logic), and the reference's state must
satisfy:

* no slot (page) is held by two positions (requests); a position sits at offset pos % P of its page;
* held pages plus the free stack are exactly the pool: nothing leaked, nothing freed twice;
* every held position reads back the KV of the token the truth says is there.

The other kv_slots tests reuse Sim (tests/test_kv_slots.py).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spec_kernels
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
    kv: list[torch.Tensor]

    def snapshot(self) -> list[torch.Tensor]:
        return [t.detach().cpu().clone() for t in (self.req_to_token, self.free_pages, self.num_free, *self.kv)]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        x, y = x.cpu(), y.cpu()
        assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: tensor {i} differs:\n{x}\n{y}"


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
    next_token: int = field(init=False, default=1)

    def __post_init__(self):
        order = self.draw.permutation(list(range(self.num_pages)))  # the stack's initial order
        slots = self.num_pages * self.page_size
        self.states = [
            State(impl,
                  torch.full((self.rows, self.max_context), -1, dtype=self.rtt_dtype, device=dev),
                  torch.tensor(order, dtype=torch.int64, device=dev),
                  torch.tensor([self.num_pages], dtype=torch.int64, device=dev),
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
            rtt, free, num_free = st_.req_to_token.cpu(), st_.free_pages.cpu(), st_.num_free.cpu()
            out = torch.empty(sum(lengths), dtype=torch.int64)
            status = torch.empty(reference.STATUS_LEN, dtype=torch.int64)
            reference.alloc_draft_slots(rtt, torch.tensor(rows), torch.zeros(len(rows), dtype=torch.int64),
                                        torch.tensor(lengths), free, num_free, self.page_size, self.max_context,
                                        out, status)
            assert status[0].item() == reference.STATUS_OK
            for dst, src in ((st_.req_to_token, rtt), (st_.free_pages, free), (st_.num_free, num_free)):
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
        """The request ends: push its pages (in position order) back onto the stack."""
        length = len(self.tokens.pop(row))
        for st_ in self.states:
            pages = (st_.req_to_token[row, :length:self.page_size].long() // self.page_size).tolist()
            top = int(st_.num_free.item())
            st_.free_pages[top:top + len(pages)] = torch.tensor(pages, dtype=torch.int64)
            st_.num_free += len(pages)

    # ------------------------------------------------------------------ one speculative step
    def step(self, rows: list[int], counts: list[int], paths: list[list[int]],
             kv_buffers: bool = True, check: bool = True) -> bool:
        """alloc -> write the drafts' KV -> commit. Returns False if the pool was out of pages
        (then every implementation must have refused and changed nothing)."""
        lens = [len(self.tokens[r]) for r in rows]
        enough = self.pages_needed(rows, counts) <= self.free_page_count()
        before = [st_.snapshot() for st_ in self.states]
        locs = []
        for st_ in self.states:
            args = (st_.req_to_token, self._index(rows, st_), self._index(lens, st_), self._index(counts, st_),
                    st_.free_pages, st_.num_free, self.page_size)
            if not enough:
                with pytest.raises(RuntimeError, match="out of KV pages"):
                    spec_kernels.alloc_draft_slots(*args, impl=st_.impl, max_draft=self.max_draft)
                continue
            locs.append(spec_kernels.alloc_draft_slots(*args, impl=st_.impl, max_draft=self.max_draft))
        if not enough:
            for st_, snap in zip(self.states, before):
                assert_same(snap, st_.snapshot(), f"{st_.impl} changed state when out of pages")
            return False
        for loc in locs[1:]:
            assert_same([locs[0]], [loc], "out_cache_loc")
        self.assert_lockstep("after alloc")

        drafts = self._new_tokens(sum(counts))
        for st_, loc in zip(self.states, locs):
            self._write_kv(st_, loc, drafts)
        per_request, at = [], 0
        for n in counts:
            per_request.append(drafts[at:at + n])
            at += n
        if check:
            self.check_invariants({**self.tokens, **{r: self.tokens[r] + d for r, d in zip(rows, per_request)}})

        width = max([len(p) for p in paths] + [1])
        for st_ in self.states:
            acc = self._index([p + [-1] * (width - len(p)) for p in paths], st_).reshape(len(rows), width)
            new_lens = spec_kernels.commit_draft_slots(
                st_.req_to_token, self._index(rows, st_), self._index(lens, st_), self._index(counts, st_), acc,
                self._index([len(p) for p in paths], st_), st_.free_pages, st_.num_free, self.page_size,
                kv_buffers=st_.kv if kv_buffers else None, impl=st_.impl, max_draft=self.max_draft)
            assert new_lens.tolist() == [L + len(p) for L, p in zip(lens, paths)]
            assert new_lens.dtype == self.index_dtype
        self.assert_lockstep("after commit")
        for r, d, p in zip(rows, per_request, paths):
            self.tokens[r] += [d[i] for i in p]
        if check:
            self.check_invariants(self.tokens)
        return True

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
        """held: row -> the token at each position it holds now (default: the truth)."""
        held = self.tokens if held is None else held
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
