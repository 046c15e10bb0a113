"""Readable PyTorch reference of the draft-token KV slot ops: the oracle the kernels are tested
against, and the definition of which inputs are valid (`alloc_verdict`, `commit_verdict`).

The model (SGLang's token-slot layout): slots 0..S-1 form pages of P = page_size consecutive
slots; ``req_to_token[r, pos]`` is the slot of position pos of request row r, and a position
always sits at offset ``pos % P`` of its page. Free pages are a stack ``free_pages[:num_free]``
whose capacity ``free_pages.numel()`` is the number of pages in the pool (page ids lie in
[0, capacity)). The page holding position seq_len-1 of a request, when not full, belongs to it.

Page state (``page_state``, int32 [capacity], part of the pool): every page has an owner.
PAGE_FREE (0) is a page on the free stack; ``row + 1`` a page that request row ``row`` of
req_to_token holds (it holds a slot of it: its positions [0, seq_len) and, between alloc and
commit, its draft positions; its partially filled last page stays its own while it holds one
slot of it); PAGE_SHARED (-1) a page held by no single request the ops know of (a radix cache's
shared prefix pages, pages another allocator manages): the ops never pop it, continue it, commit
into it or free it. So the free pages are exactly the stack, and a request may touch only its
own pages. The ops keep the state in step with the stack:

* alloc sets every page it pops to the owner of the request it gives the page to (row + 1).
  It refuses (changing nothing) when a request would continue a last page it does not own
  (free, another row's, or PAGE_SHARED), when a page it would pop is not a page of the pool, is
  not free, or sits twice in the popped part of the stack, or when two requests would continue
  the same last page (STATUS_PAGE_CONFLICT: the stack and the state disagree: corruption; with
  distinct rows the owner check refuses it first).
* commit sets every page it releases to free; the pages it keeps stay their owner's. Its draft
  pages are, per request, the page of each page-block that its draft positions seq_len ..
  seq_len + num_draft - 1 touch, read at the block's first draft position (page_size 1: every
  draft slot is its own page; a partially filled last page is the first block). Every draft slot
  must lie on a page the request owns (else the request is invalid: its drafts were already
  committed or released, or req_to_token points into another request's pages), and the draft
  pages must be pairwise distinct across the call (STATUS_PAGE_CONFLICT): so a commit never
  frees a page that is not its own, never frees one page twice, and never frees a page it also
  keeps.

What an owner per page cannot see: a commit that releases nothing cannot be told from a first
call (e.g. page_size 16 and every draft on the request's kept pages: a repeat only moves KV rows
again), and a stale commit whose draft pages were handed out again in between to the same row
looks valid; replaying a commit right after it, after its request was released, or after its
pages went to another row is refused. Callers that move pages themselves keep the state too:
pages pushed back onto the stack (a finished request's) become PAGE_FREE, pages given to request
row ``row`` by other means (its prompt's) ``row + 1``, pages several requests share (a prefix
cache's) PAGE_SHARED, and a page a request row gives up without freeing it (into a prefix cache)
PAGE_SHARED. ``api.page_state_from_free_stack`` builds the state of a pool from its free stack and
the requests that hold pages.

Everything here reads the tensors' values on the host (it syncs with a GPU); it is written to
be obviously right, not fast.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


# page_state values (csrc/include/spec_kernels/launchers.h); an owned page holds row + 1 (>= 1).
# PAGE_MARK is seen only inside a kernel launch: the kernels claim the call's pages with atomic
# exchanges to it, which finds a page claimed twice, and set every claimed page to its final
# state (or back) before the launch ends. Negative, so that it is nobody's owner.
PAGE_FREE = 0
PAGE_SHARED = -1
PAGE_MARK = -2


def page_owner(row: int) -> int:
    """The page_state value of a page that request row `row` of req_to_token holds."""
    return row + 1


# status[0] codes, shared with the Triton and CUDA kernels (csrc/include/spec_kernels/launchers.h).
STATUS_OK = 0
STATUS_OUT_OF_PAGES = 1  # alloc: the stack cannot serve the whole batch
STATUS_BAD_REQUEST = 2  # a request's values are invalid; status[3] is the first such request
STATUS_BAD_STACK = 3  # num_free is out of range, or a commit would overflow the stack
STATUS_OUT_TOO_SMALL = 4  # alloc: out_cache_loc has fewer entries than sum(num_draft)
STATUS_PAGE_CONFLICT = 5  # the free stack, page_state and req_to_token disagree (see the module docstring)
STATUS_LEN = 5  # [code, pages needed/released, num_free before, first bad request or -1, tokens]


@dataclass
class Verdict:
    """What a call will do, as its status tensor reports it.

    code is STATUS_OK or why nothing may change; request is the first invalid request (or -1,
    whatever the code); pages (needed by alloc / released by commit) and tokens (allocated /
    accepted) are batch totals, 0 when a request is invalid; message explains a failure."""

    code: int
    pages: int
    top: int
    request: int
    tokens: int
    message: str = ""

    def as_list(self) -> list[int]:
        return [self.code, self.pages, self.top, self.request, self.tokens]


def _roundup(x: int, page_size: int) -> int:
    return -(-x // page_size) * page_size


def pages_spanned(begin: int, end: int, page_size: int) -> int:
    """Pages a request holding positions [0, end) needs beyond those holding [0, begin)."""
    return (_roundup(end, page_size) - _roundup(begin, page_size)) // page_size


def _request_problem(b, r, L, n, rows, max_context, max_draft) -> Optional[str]:
    if not 0 <= r < rows:
        return f"req_pool_indices[{b}] = {r} is not a row of req_to_token (0..{rows - 1})"
    if L < 0:
        return f"seq_lens[{b}] = {L} is negative"
    if not 0 <= n <= max_draft:
        return f"num_draft[{b}] = {n} must be in [0, max_draft={max_draft}]"
    if L + n > max_context:
        return (f"seq_lens[{b}] + num_draft[{b}] = {L + n} exceeds the context of req_to_token "
                f"({max_context} positions)")
    return None


def _verdict(top: int, capacity: int, bad: Optional[tuple[int, str]], pages: int, tokens: int,
             totals_problem: Optional[tuple[int, str]], conflict=None) -> Verdict:
    """Precedence shared with the kernels: num_free out of range, then the first invalid request,
    then the batch totals (out_cache_loc size, free pages, stack capacity), then the page state
    (`conflict`, a function giving the problem or None, asked only when all else is valid)."""
    request = bad[0] if bad else -1
    if bad:
        pages = tokens = 0
    if not 0 <= top <= capacity:
        return Verdict(STATUS_BAD_STACK, pages, top, request, tokens,
                       f"num_free = {top} must be in [0, free_pages.numel()={capacity}]")
    if bad:
        return Verdict(STATUS_BAD_REQUEST, pages, top, request, tokens, bad[1])
    if totals_problem:
        return Verdict(totals_problem[0], pages, top, request, tokens, totals_problem[1])
    why = conflict() if conflict else None
    if why:
        return Verdict(STATUS_PAGE_CONFLICT, pages, top, request, tokens, why)
    return Verdict(STATUS_OK, pages, top, request, tokens)


def _state_text(page: int, value: int) -> str:
    """What page_state[page] = value says, for messages."""
    if value == PAGE_FREE:
        what = "free"
    elif value == PAGE_SHARED:
        what = "held by no single request (PAGE_SHARED, e.g. a shared prefix page)"
    elif value > 0:
        what = f"owned by row {value - 1}"
    else:
        what = "not a page state"
    return f"page_state[{page}] = {value}, {what}"


def _not_own(r: int, b: int, page: int, value: int, free_hint: str) -> str:
    return (f"which request {b} (row {r}) does not own ({_state_text(page, value)}"
            f"{': ' + free_hint if value == PAGE_FREE else ''})")


def alloc_verdict(req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free, page_state,
                  page_size: int, max_draft: int, out_capacity: int) -> Verdict:
    """Whether alloc_draft_slots may run on these values, and the totals it reports."""
    capacity = free_pages.numel()
    rows, max_context = req_to_token.shape
    state = page_state.tolist()
    bad, pages, tokens = None, 0, 0
    continued = []  # (request, page) of every request continuing its partially filled last page
    for b, (r, L, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), num_draft.tolist())):
        why = _request_problem(b, r, L, n, rows, max_context, max_draft)
        if why is None and n > 0 and L % page_size:
            last = int(req_to_token[r, L - 1])
            page = last // page_size
            if not 0 <= page < capacity:
                why = (f"req_to_token[{r}, {L - 1}] = {last} (the last slot of request {b}) is not in a "
                       f"page of the pool (page ids 0..{capacity - 1})")
            elif state[page] != page_owner(r):
                why = (f"req_to_token[{r}, {L - 1}] = {last} (the last slot of request {b}) is on page {page}, "
                       f"{_not_own(r, b, page, state[page], 'was the request released?')}: a request continues "
                       f"only a last page it owns")
            else:
                continued.append((b, page))
        if why:
            bad = (b, why)
            break
        pages += pages_spanned(L, L + n, page_size)
        tokens += n
    top = int(num_free.item())
    totals_problem = None
    if tokens > out_capacity:
        totals_problem = (STATUS_OUT_TOO_SMALL, f"total_draft = {out_capacity} is less than sum(num_draft) = {tokens}")
    elif pages > top:
        totals_problem = (STATUS_OUT_OF_PAGES,
                          f"out of KV pages: the batch needs {pages} pages of {page_size} slots, {top} are free")

    def conflict() -> Optional[str]:
        stack = free_pages.tolist()
        popped = {}
        for j in range(top - 1, top - 1 - pages, -1):  # pop order
            page = stack[j]
            if not 0 <= page < capacity:
                return (f"free_pages[{j}] = {page}, a page this call would pop, is not a page of the pool "
                        f"(0..{capacity - 1})")
            if state[page] != PAGE_FREE:
                return (f"free_pages[{j}] = {page}, a page this call would pop, is not free "
                        f"({_state_text(page, state[page])}): the free stack and page_state disagree")
            if page in popped:
                return (f"page {page} is twice in the part of the free stack this call pops "
                        f"(free_pages[{popped[page]}] and [{j}])")
            popped[page] = j
        owner = {}
        for b, page in continued:
            if page in owner:
                return (f"requests {owner[page]} and {b} both continue page {page} (their last slots share it): "
                        f"its free slots would go to both")
            owner[page] = b
        return None

    return _verdict(top, capacity, bad, pages, tokens, totals_problem, conflict)


def draft_pages(L: int, n: int, page_size: int) -> list[tuple[int, int]]:
    """(block start, first draft position) of every page-block the draft positions L .. L+n-1
    touch, in position order; the block's page is that of its first draft position's slot."""
    if n == 0:
        return []
    first_block = L - L % page_size
    return [(start, max(L, start)) for start in range(first_block, L + n, page_size)]


def commit_verdict(req_to_token, req_pool_indices, seq_lens, num_draft, accept_index, accept_len,
                   free_pages, num_free, page_state, page_size: int, max_draft: int,
                   kv_buffers: Sequence[torch.Tensor]) -> Verdict:
    """Whether commit_draft_slots may run on these values, and the totals it reports."""
    capacity = free_pages.numel()
    rows, max_context = req_to_token.shape
    width = accept_index.shape[1]
    moves_kv = page_size > 1 and len(kv_buffers) > 0
    # Every draft slot is pushed back or kept; with moves it also indexes the KV buffers.
    slot_bound = min(capacity * page_size, kv_buffers[0].shape[0]) if moves_kv else capacity * page_size
    state = page_state.tolist()
    bad, released, accepted = None, 0, 0
    requests = list(zip(req_pool_indices.tolist(), seq_lens.tolist(), num_draft.tolist(), accept_len.tolist(),
                        accept_index.tolist()))
    for b, (r, L, n, k, path) in enumerate(requests):
        why = _request_problem(b, r, L, n, rows, max_context, max_draft)
        if why is None:
            why = _path_problem(b, n, k, path, width, page_size > 1 and not moves_kv)
        if why is None:
            for i, slot in enumerate(req_to_token[r, L:L + n].tolist()):
                if not 0 <= slot < slot_bound:
                    why = (f"req_to_token[{r}, {L + i}] = {slot} (draft {i} of request {b}) is not a slot of "
                           f"the pool{' and kv_buffers' if moves_kv else ''} (0..{slot_bound - 1})")
                    break
                page = slot // page_size
                if state[page] != page_owner(r):
                    hint = "were these drafts already committed, or the request released?"
                    why = (f"req_to_token[{r}, {L + i}] = {slot} (draft {i} of request {b}) is on page {page}, "
                           f"{_not_own(r, b, page, state[page], hint)}: a commit frees or keeps only the "
                           f"request's own pages")
                    break
        if why:
            bad = (b, why)
            break
        released += (n - k) if page_size == 1 else pages_spanned(L + k, L + n, page_size)
        accepted += k
    top = int(num_free.item())
    totals_problem = None
    if top + released > capacity:
        totals_problem = (STATUS_BAD_STACK,
                          f"the commit releases {released} pages but the stack has room for {capacity - top} "
                          f"(num_free = {top} of {capacity}): a page would be freed twice")

    def conflict() -> Optional[str]:
        owner = {}
        for b, (r, L, n, _, _) in enumerate(requests):
            for _, pos in draft_pages(L, n, page_size):
                page = int(req_to_token[r, pos]) // page_size
                if page in owner:
                    b0, pos0 = owner[page]
                    whose = (f"positions {pos0} and {pos} of request {b}" if b0 == b else
                             f"position {pos0} of request {b0} and position {pos} of request {b}")
                    return (f"page {page} holds the drafts of {whose} (req_to_token gives both the page): one page "
                            f"cannot be freed or kept twice")
                owner[page] = (b, pos)
        return None

    return _verdict(top, capacity, bad, released, accepted, totals_problem, conflict)


def _path_problem(b, n, k, path, width, prefix_only) -> Optional[str]:
    if not 0 <= k <= min(n, width):
        return f"accept_len[{b}] = {k} must be in [0, min(num_draft[{b}]={n}, accept_index.shape[1]={width})]"
    for j, a in enumerate(path):
        if j >= k:
            if a != -1:
                return f"accept_index[{b}, {j}] = {a} must be -1 (padding beyond accept_len[{b}] = {k})"
        elif not 0 <= a < n:
            return f"accept_index[{b}, {j}] = {a} is not a draft of request {b} (0..{n - 1})"
        elif j > 0 and a <= path[j - 1]:
            return f"accept_index[{b}] must be increasing, got {path[j - 1]} then {a} at column {j}"
        elif prefix_only and a != j:
            return (f"accept_index[{b}, {j}] = {a}: with page_size > 1 and no kv_buffers the accepted "
                    f"path must be a prefix (0, 1, ..., k-1), since no KV row can be moved")
    return None


# --------------------------------------------------------------------------- the ops
def alloc_draft_slots(req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free, page_state,
                      page_size: int, max_draft: int, out_cache_loc, status) -> None:
    """Give positions seq_len_b .. seq_len_b + num_draft_b - 1 of every request a slot.

    A request first fills the free slots of its partially filled last page, then takes pages
    from the top of the stack (request 0 first); page_state records each popped page's owner
    (the request's row + 1).
    out_cache_loc gets the slots in request order (draft order inside a request) and -1 in
    entries beyond sum(num_draft). An invalid call changes nothing but out_cache_loc (all -1)
    and status."""
    verdict = alloc_verdict(req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free, page_state,
                            page_size, max_draft, out_cache_loc.numel())
    out_cache_loc.fill_(-1)
    status.copy_(torch.tensor(verdict.as_list()))
    if verdict.code != STATUS_OK:
        return
    top = verdict.top
    stack = free_pages.tolist()
    slots = []
    for r, L, n in zip(req_pool_indices.tolist(), seq_lens.tolist(), num_draft.tolist()):
        for pos in range(L, L + n):
            if pos % page_size == 0:  # a page boundary: take the page on top of the stack
                page = stack[top - 1]
                top -= 1
                page_state[page] = page_owner(r)
            elif pos == L:  # continue the request's partially filled last page
                page = int(req_to_token[r, L - 1]) // page_size
            slot = page * page_size + pos % page_size
            req_to_token[r, pos] = slot
            slots.append(slot)
    out_cache_loc[:len(slots)] = torch.tensor(slots, dtype=torch.int64)
    num_free.fill_(top)


def commit_draft_slots(req_to_token, req_pool_indices, seq_lens, num_draft, accept_index, accept_len,
                       free_pages, num_free, page_state, page_size: int, max_draft: int,
                       kv_buffers: Sequence[torch.Tensor], new_seq_lens, status) -> None:
    """Keep the accepted path of every request's drafts and release the rest.

    Afterwards positions seq_len_b .. seq_len_b + accept_len_b - 1 hold the accepted drafts in
    path order. page_size 1: req_to_token is remapped to the accepted drafts' slots (no KV is
    copied) and the rejected slots are pushed (request order, draft order). page_size > 1: the
    accepted draft path[j] moves its KV row to the slot of position seq_len + j in every
    kv_buffers tensor, in path order (path[j] >= j, so no row is overwritten before it is read),
    and the pages wholly beyond the new length are pushed. The pushed pages become free in
    page_state; the kept ones stay the request's. Entries of req_to_token beyond the new lengths are left as they are. An invalid
    call changes nothing but new_seq_lens (= seq_lens) and status."""
    verdict = commit_verdict(req_to_token, req_pool_indices, seq_lens, num_draft, accept_index, accept_len,
                             free_pages, num_free, page_state, page_size, max_draft, kv_buffers)
    status.copy_(torch.tensor(verdict.as_list()))
    if verdict.code != STATUS_OK:
        new_seq_lens.copy_(seq_lens)
        return
    pushed = []
    for r, L, n, k, path in zip(req_pool_indices.tolist(), seq_lens.tolist(), num_draft.tolist(),
                                accept_len.tolist(), accept_index.tolist()):
        path = path[:k]
        drafts = req_to_token[r, L:L + n].tolist()  # draft i's slot
        if page_size == 1:
            for j, i in enumerate(path):
                req_to_token[r, L + j] = drafts[i]
            pushed += [slot for i, slot in enumerate(drafts) if i not in path]
        else:
            for j, i in enumerate(path):
                if i != j:
                    for buf in kv_buffers:
                        buf[drafts[j]] = buf[drafts[i]]
            first_free = _roundup(L + k, page_size)  # first position of the first page to release
            pushed += [drafts[pos - L] // page_size for pos in range(first_free, L + n, page_size)]
    top = verdict.top
    free_pages[top:top + len(pushed)] = torch.tensor(pushed, dtype=torch.int64)
    for page in pushed:
        page_state[page] = PAGE_FREE
    num_free.fill_(top + len(pushed))
    new_seq_lens.copy_(seq_lens + accept_len.to(seq_lens.dtype))
