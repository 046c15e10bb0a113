"""Draft-token KV slot allocation and commit: public functions, their checks, and the custom ops.

    torch.ops.spec_kernels.alloc_draft_slots
    torch.ops.spec_kernels.commit_draft_slots

Each custom op mutates the allocator state and preallocated outputs and returns nothing, has a
fake implementation, and picks its implementation with the dispatch rule of spec_kernels._ops
(cuda -> triton -> reference, or the one forced with impl=). The model and the exact rules are
in reference.py.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .._checks import INDEX_DTYPES, _is_fake, check_shape, check_tensor, common_device, values_checkable
from .._limits import MAX_DRAFT_TOKENS  # an accepted path is one 64-bit mask of draft indices
from .._ops import cuda_ops, op_impls, sm_count
from . import reference, triton_kernel
from .reference import PAGE_FREE, PAGE_SHARED, STATUS_LEN, STATUS_OK, STATUS_OUT_OF_PAGES, Verdict

ALLOC = op_impls("alloc_draft_slots")
COMMIT = op_impls("commit_draft_slots")


# --------------------------------------------------------------------------- KV buffer table
@dataclass(frozen=True)
class KvTable:
    """The KV buffers as the kernels see them: int64 [3, num_buffers] of (base address, row
    stride in bytes, row size in bytes) on the buffers' device, and the largest power of two
    <= 16 dividing every address, stride and row size (the copy unit)."""

    table: torch.Tensor
    num_buffers: int
    num_rows: int
    unit_bytes: int


_KV_TABLES: "collections.OrderedDict[tuple, KvTable]" = collections.OrderedDict()


def kv_table(kv_buffers: Sequence[torch.Tensor]) -> KvTable:
    """The KvTable of these buffers, cached by their addresses and layout: building one copies it
    to the device (not capturable), so call commit once before capturing it in a CUDA graph."""
    rows = [(t.data_ptr(), t.stride(0) * t.element_size(), t[0].numel() * t.element_size()) for t in kv_buffers]
    key = (kv_buffers[0].device, kv_buffers[0].shape[0], tuple(rows))
    found = _KV_TABLES.get(key)
    if found is None:
        unit = 16
        while unit > 1 and any(v % unit for row in rows for v in row):
            unit //= 2
        table = torch.tensor(rows, dtype=torch.int64).t().contiguous().to(kv_buffers[0].device)
        found = KvTable(table, len(rows), kv_buffers[0].shape[0], unit)
        _KV_TABLES[key] = found
        if len(_KV_TABLES) > 16:
            _KV_TABLES.popitem(last=False)
    _KV_TABLES.move_to_end(key)
    return found


def _kv_shares(device: torch.device, num_requests: int, num_buffers: int, buffers_per_share: int) -> int:
    """Programs (blocks) per request for the KV moves: about two waves of the GPU; shapes only."""
    if device.type != "cuda":
        return 1
    sms = sm_count(device.index if device.index is not None else torch.cuda.current_device())
    most = -(-num_buffers // buffers_per_share)
    return max(1, min(most, -(-2 * sms // max(num_requests, 1))))


_MOVE_SYNCS: dict[tuple, torch.Tensor] = {}


def move_sync(device: torch.device) -> torch.Tensor:
    """The scratch of the launch-wide hand-off of one commit launch that moves KV rows
    (csrc/kv_slots/kv_slots.cu, "launch-wide hand-off"): int64 [MOVE_SYNC_WORDS], zero when first
    used, owned by the library. Its first word is the generation, which every launch advances
    and tags its other words with, and every launch leaves the others zeroed: the next launch
    on the scratch finds zeros (or, were they left, the previous generation's words, which it
    cannot take for its own).

    Concurrency contract: no two launches that may run at the same time share a scratch. Eager
    CUDA calls use one scratch per (device, stream), since the launches of a stream run one after
    another; it is created with torch.zeros, on that stream, by the first call there (outside any
    capture) and kept. During CUDA-graph capture every captured call gets a new zeroed scratch
    from the graph's memory: the zeroing is captured too (a memset before the commit), so every
    replay starts from zeros, and a graph never shares a scratch with eager calls or another
    graph, whatever streams they replay on. CPU calls (the Triton interpreter, run one program
    after another) use one scratch per thread."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(index):
            if torch.cuda.is_current_stream_capturing():
                return torch.zeros(triton_kernel.MOVE_SYNC_WORDS, dtype=torch.int64, device=device)
            key = (device.type, index, torch.cuda.current_stream(index).cuda_stream)
    else:
        key = (device.type, device.index, threading.get_ident())
    found = _MOVE_SYNCS.get(key)
    if found is None:
        found = _MOVE_SYNCS[key] = torch.zeros(triton_kernel.MOVE_SYNC_WORDS, dtype=torch.int64, device=device)
    return found


def _kv_moves(req_to_token, req_pool_indices, kv_buffers, page_size: int, buffers_per_share: int):
    """What a commit kernel needs to move KV rows: (KvTable or None, programs per request,
    hand-off scratch or None). Rows move only with pages > 1, buffers and requests."""
    table = kv_table(kv_buffers) if kv_buffers and page_size > 1 else None
    B = req_pool_indices.numel()
    shares = _kv_shares(req_to_token.device, B, len(kv_buffers), buffers_per_share)
    sync = move_sync(req_to_token.device) if table is not None and B > 0 else None
    return table, shares, sync


# --------------------------------------------------------------------------- implementations
ALLOC.register("reference")(reference.alloc_draft_slots)
ALLOC.register("triton")(triton_kernel.alloc_draft_slots)
COMMIT.register("reference")(reference.commit_draft_slots)


@COMMIT.register("triton")
def _commit_triton(req_to_token, req_pool_indices, seq_lens, num_draft, accept_index, accept_len, free_pages,
                   num_free, page_state, page_size, max_draft, kv_buffers, new_seq_lens, status):
    table, shares, sync = _kv_moves(req_to_token, req_pool_indices, kv_buffers, page_size, 1)
    triton_kernel.commit_draft_slots(req_to_token, req_pool_indices, seq_lens, num_draft, accept_index, accept_len,
                                     free_pages, num_free, page_state, page_size, max_draft, table, new_seq_lens,
                                     status, shares, sync)


@ALLOC.register("cuda")
def _alloc_cuda(req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free, page_state, page_size,
                max_draft, out_cache_loc, status):
    cuda_ops().alloc_draft_slots(req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free,
                                 page_state, page_size, max_draft, out_cache_loc, status)


CUDA_WARPS_PER_BLOCK = 32  # csrc/kv_slots: every warp of a KV-move block copies one buffer at a time


@COMMIT.register("cuda")
def _commit_cuda(req_to_token, req_pool_indices, seq_lens, num_draft, accept_index, accept_len, free_pages,
                 num_free, page_state, page_size, max_draft, kv_buffers, new_seq_lens, status):
    table, shares, sync = _kv_moves(req_to_token, req_pool_indices, kv_buffers, page_size, CUDA_WARPS_PER_BLOCK)
    cuda_ops().commit_draft_slots(
        req_to_token, req_pool_indices, seq_lens, num_draft, accept_index, accept_len, free_pages, num_free,
        page_state, page_size, max_draft, table.table if table else None, table.num_rows if table else 0,
        table.unit_bytes if table else 1, shares, sync, new_seq_lens, status)


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("spec_kernels::alloc_draft_slots",
                         mutates_args=("req_to_token", "free_pages", "num_free", "page_state", "out_cache_loc",
                                       "status"))
def _alloc_op(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
              num_draft: torch.Tensor, free_pages: torch.Tensor, num_free: torch.Tensor, page_state: torch.Tensor,
              page_size: int, max_draft: int, out_cache_loc: torch.Tensor, status: torch.Tensor, impl: str) -> None:
    _, fn = ALLOC.select(req_to_token.device, impl or None)
    fn(req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free, page_state, page_size, max_draft,
       out_cache_loc, status)


@_alloc_op.register_fake
def _(req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free, page_state, page_size, max_draft,
      out_cache_loc, status, impl):
    return None


@torch.library.custom_op("spec_kernels::commit_draft_slots",
                         mutates_args=("req_to_token", "free_pages", "num_free", "page_state", "kv_buffers",
                                       "new_seq_lens", "status"))
def _commit_op(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               num_draft: torch.Tensor, accept_index: torch.Tensor, accept_len: torch.Tensor,
               free_pages: torch.Tensor, num_free: torch.Tensor, page_state: torch.Tensor, page_size: int,
               max_draft: int, kv_buffers: list[torch.Tensor], new_seq_lens: torch.Tensor, status: torch.Tensor,
               impl: str) -> None:
    _, fn = COMMIT.select(req_to_token.device, impl or None)
    fn(req_to_token, req_pool_indices, seq_lens, num_draft, accept_index, accept_len, free_pages, num_free,
       page_state, page_size, max_draft, kv_buffers, new_seq_lens, status)


@_commit_op.register_fake
def _(req_to_token, req_pool_indices, seq_lens, num_draft, accept_index, accept_len, free_pages, num_free,
      page_state, page_size, max_draft, kv_buffers, new_seq_lens, status, impl):
    return None


# --------------------------------------------------------------------------- checks
def _inputs_device(named: Sequence[tuple[str, object]]) -> torch.device:
    """The device the inputs agree on: the one most of the tensors are on (req_to_token's on a
    tie), so that the error names the tensor that is elsewhere, req_to_token included."""
    devices = [t.device for _, t in named if isinstance(t, torch.Tensor)]
    if not devices:
        return torch.device("cpu")
    counts = collections.Counter(devices)
    first = named[0][1]
    best = max(counts.values())
    if isinstance(first, torch.Tensor) and counts[first.device] == best:
        return first.device
    return next(d for d in devices if counts[d] == best)


def _check_state(req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free, page_state, page_size,
                 max_draft, status, others: Sequence[tuple[str, object]] = ()) -> torch.Tensor:
    """Metadata checks shared by both ops (others: the op's other tensors, for the device vote);
    returns the status buffer to use."""
    named = [("req_to_token", req_to_token), ("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens),
             ("num_draft", num_draft), ("free_pages", free_pages), ("num_free", num_free),
             ("page_state", page_state), *others]
    dev = _inputs_device(named)
    check_tensor(req_to_token, "req_to_token", dim=2, dtypes=INDEX_DTYPES, device=dev)
    check_tensor(req_pool_indices, "req_pool_indices", dim=1, dtypes=INDEX_DTYPES, device=dev)
    B = req_pool_indices.shape[0]
    for t, name in ((seq_lens, "seq_lens"), (num_draft, "num_draft")):
        check_tensor(t, name, dim=1, dtypes=INDEX_DTYPES, device=dev)
        check_shape(t, name, (B,), "one entry per request, like req_pool_indices")
    check_tensor(free_pages, "free_pages", dim=1, dtypes=(torch.int64,), device=dev)
    check_tensor(num_free, "num_free", dim=1, dtypes=(torch.int64,), device=dev)
    check_shape(num_free, "num_free", (1,))
    check_tensor(page_state, "page_state", dim=1, dtypes=(torch.int32,), device=dev)
    check_shape(page_state, "page_state", tuple(free_pages.shape), "one entry per page, like free_pages")
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise TypeError(f"page_size must be an int, got {type(page_size).__name__}")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two >= 1, got {page_size}")
    if isinstance(max_draft, bool) or not isinstance(max_draft, int) or not 1 <= max_draft <= MAX_DRAFT_TOKENS:
        raise ValueError(f"max_draft must be an int in [1, {MAX_DRAFT_TOKENS}], got {max_draft!r}")
    if status is None:
        return torch.empty(STATUS_LEN, dtype=torch.int64, device=dev)
    check_tensor(status, "status", dim=1, dtypes=(torch.int64,), device=dev)
    check_shape(status, "status", (STATUS_LEN,))
    return status


def _check_unique_rows(req_pool_indices: torch.Tensor) -> None:
    rows = req_pool_indices.tolist()
    if len(set(rows)) != len(rows):
        dup = next(r for r in rows if rows.count(r) > 1)
        raise ValueError(f"req_pool_indices must be distinct (two requests cannot share a row), "
                         f"row {dup} appears {rows.count(dup)} times")


def _raise_for(op: str, verdict: Verdict) -> None:
    if verdict.code == STATUS_OK:
        return
    kind = RuntimeError if verdict.code == STATUS_OUT_OF_PAGES else ValueError
    raise kind(f"{op}: {verdict.message}; nothing was changed")


def _may_sync(t: torch.Tensor) -> bool:
    """Whether reading a result back now is possible (not capturing, compiling or faking)."""
    if _is_fake(t) or torch.compiler.is_compiling():
        return False
    return t.device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def _read_status(op: str, status: torch.Tensor, recheck) -> list[int]:
    """Read the status back (one sync) and, if the kernel refused the call, raise with the
    reference's message: the kernel changed nothing, so a host re-check sees the same values."""
    values = status.tolist()
    if values[0] != STATUS_OK:
        verdict = recheck()
        if verdict.code == STATUS_OK:  # cannot happen unless the kernels and reference disagree
            verdict = Verdict(*values, message=f"the kernel refused the call (status {values})")
        _raise_for(op, verdict)
    return values


# --------------------------------------------------------------------------- public API
def alloc_draft_slots(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_draft: torch.Tensor,
    free_pages: torch.Tensor,
    num_free: torch.Tensor,
    page_state: torch.Tensor,
    page_size: int,
    impl: Optional[str] = None,
    *,
    max_draft: int = MAX_DRAFT_TOKENS,
    check_free: bool = True,
    total_draft: Optional[int] = None,
    status: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Give the draft tokens of a batch their KV slots: exactly the slots they need.

    Request b (row ``r = req_pool_indices[b]`` of ``req_to_token``) gets slots for positions
    ``seq_lens[b] .. seq_lens[b] + num_draft[b] - 1`` (num_draft[b] may be 0): first the free slots
    of its partially filled last page, then slots of pages popped from the top of the free-page
    stack ``free_pages[:num_free]``, requests in batch order. A position always sits at offset
    ``pos % page_size`` of its page. ``req_to_token``, ``num_free`` and ``page_state`` (each
    popped page gets the owner of the request it is given to: its row + 1) are updated in place.
    A request continues its partially filled last page only if page_state says it owns it.

    Args:
        req_to_token: int32/int64 [rows, max_context], slot of each position of each request row.
        req_pool_indices, seq_lens, num_draft: int32/int64 [B]; rows must be distinct.
        free_pages: int64 [num_pages], the stack of free page ids (its length is the pool's page
            count; page p is slots p * page_size .. p * page_size + page_size - 1).
        num_free: int64 [1], stack height.
        page_state: int32 [num_pages], the owner of every page: PAGE_FREE (0) for the pages on
            the stack, row + 1 for a page request row ``row`` holds, PAGE_SHARED (-1) for a page
            held by no single request (a prefix cache's shared pages; never popped, continued,
            committed into or freed by these ops). Build it once with
            :func:`page_state_from_free_stack` (from the initial stack, where every page is free,
            or from the stack and the requests admitted before) and keep it with the stack: the
            two ops update it. A caller that moves pages itself writes what it did: 0 for pages
            it pushes (a finished request's), row + 1 for pages it gives request row ``row`` (its
            prompt's), PAGE_SHARED for pages it shares between requests or hands to a prefix
            cache. The exact rules: spec_kernels/kv_slots/reference.py.
        page_size: a power of two >= 1.
        impl: "cuda", "triton" or "reference" to force one; default the fastest available.
        max_draft: the largest allowed num_draft[b] (<= 64).
        check_free: read the status back after the launch (one host sync on CUDA) and raise if
            the call was refused. Skipped during CUDA graph capture and torch.compile.
        total_draft: sum(num_draft) if the caller knows it (no sync needed to size the output).
            May be larger: the tail of the output is -1 (e.g. a padded CUDA-graph batch).
        status: optional int64 [5] device buffer receiving [code, pages needed, num_free before,
            first invalid request or -1, tokens]; code 0 = done (reference.STATUS_* otherwise).

    Returns:
        out_cache_loc, int64 [total_draft or sum(num_draft)]: the slots in request order (draft
        order inside a request), -1 beyond sum(num_draft), all -1 if the call was refused.

    Raises:
        RuntimeError if the stack cannot serve the whole batch (saying how many pages were needed
        and free); ValueError/TypeError naming the argument for bad input, ValueError naming the
        request, the slot, the page and its owner when a request would continue a last page it
        does not own, and ValueError when the stack and page_state disagree (a page to pop is
        not free or on the stack twice). Either way nothing was changed.

    Guarantees: metadata of every input is checked. Values (rows in range and distinct, counts
    in [0, max_draft], lengths within req_to_token, the page of a partially filled last slot in
    the pool and owned by the request, enough free pages, the pages to pop in the pool, free and
    distinct) are checked on CPU tensors, and on CUDA in debug mode (SPEC_KERNELS_DEBUG=1), before
    anything changes. The Triton and CUDA kernels check the same rules themselves (except distinct rows)
    before writing anything: a refused call changes nothing but the status and out_cache_loc
    (page_state included: the kernels claim pages with atomic exchanges and undo them on
    refusal before the launch ends), and never accesses memory out of bounds. One launch, no
    host synchronisation when check_free=False and total_draft is given, so it can be captured
    in a CUDA graph. Deterministic.

    Example:
        >>> page_state = spec_kernels.kv_slots.page_state_from_free_stack(free_pages, num_free)
        >>> loc = spec_kernels.alloc_draft_slots(req_to_token, req_pool_indices, seq_lens,
        ...                                      num_draft, free_pages, num_free, page_state, page_size=16)
    """
    status = _check_state(req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free, page_state,
                          page_size, max_draft, status)
    B = req_pool_indices.shape[0]
    if total_draft is not None and (isinstance(total_draft, bool) or not isinstance(total_draft, int)
                                    or total_draft < 0):
        raise ValueError(f"total_draft must be an int >= 0, got {total_draft!r}")
    args = (req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free, page_state, page_size,
            max_draft)

    def verdict(out_capacity: int) -> Verdict:
        return reference.alloc_verdict(*args, out_capacity)

    host_checked = values_checkable(req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free,
                                    page_state)
    if host_checked:
        _check_unique_rows(req_pool_indices)
        v = verdict(total_draft if total_draft is not None else B * max_draft)
        _raise_for("alloc_draft_slots", v)
        size = total_draft if total_draft is not None else v.tokens
    elif total_draft is not None:
        size = total_draft
    elif check_free and _may_sync(req_to_token):
        size = B * max_draft  # sized from the status read below
    else:
        raise ValueError("alloc_draft_slots: without check_free (or during capture/compile) the output size "
                         "cannot be read back: pass total_draft = sum(num_draft)")
    out = torch.empty(size, dtype=torch.int64, device=req_to_token.device)
    torch.ops.spec_kernels.alloc_draft_slots(*args, out, status, impl or "")
    if check_free and not host_checked and _may_sync(req_to_token):
        tokens = _read_status("alloc_draft_slots", status, lambda: verdict(size))[4]
        if total_draft is None:
            out = out[:tokens]
    return out


def commit_draft_slots(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_draft: torch.Tensor,
    accept_index: torch.Tensor,
    accept_len: torch.Tensor,
    free_pages: torch.Tensor,
    num_free: torch.Tensor,
    page_state: torch.Tensor,
    page_size: int,
    kv_buffers: Optional[Sequence[torch.Tensor]] = None,
    impl: Optional[str] = None,
    *,
    max_draft: int = MAX_DRAFT_TOKENS,
    check_status: bool = False,
    status: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Keep the accepted path of every request's drafts and release every other draft slot.

    Call it after verify with the arguments of the step's :func:`alloc_draft_slots` (same
    seq_lens and num_draft). ``accept_index[b, :accept_len[b]]`` are the accepted drafts of
    request b (indices 0..num_draft[b]-1) in path order, strictly increasing, then -1 padding.
    Afterwards positions ``seq_lens[b] .. seq_lens[b] + accept_len[b] - 1`` map to slots that hold
    exactly those drafts' KV, in path order:

    * page_size 1: req_to_token is remapped to the accepted drafts' slots (no KV is copied) and
      the rejected slots are pushed onto the free stack (request order, draft order);
    * page_size > 1: accepted draft ``accept_index[b, j]`` moves its KV row to the slot of
      position seq_lens[b] + j in every tensor of kv_buffers (every layer's K and V), and the
      pages lying wholly beyond the new length are pushed. With kv_buffers=None every accepted
      path must be a prefix (0, 1, ..., k-1), e.g. chain drafts.

    Every pushed page becomes free (0) in ``page_state``; the kept pages stay the request's
    (row + 1). Entries of req_to_token beyond the new lengths are left as they are.

    A commit must match a live alloc: every draft slot must lie on a page that page_state says
    the request owns (row + 1), and no page may carry the drafts of two positions of the call in
    two page-blocks (page_size 1: no two draft slots may be equal). So the same commit twice, a
    commit of slots that were never allocated, of a request already released, or of slots on
    another request's pages (a req_to_token row pointing into them) or on PAGE_SHARED pages is
    refused as a whole (ValueError naming the request, the position and slot, the page and its
    owner), before any slot is freed twice or a page taken from its owner. (A repeat that
    releases no page, e.g. page_size 16 with every draft on kept pages, only moves the same KV
    rows again, and a stale commit whose pages were given to the same row again in between
    passes the checks; the reference's module docstring has the exact rules.)

    Args:
        req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free, page_state,
        page_size, max_draft, status: as in :func:`alloc_draft_slots`.
        accept_index: int32/int64 [B, A], A <= 64. accept_len: int32/int64 [B].
        kv_buffers: distinct, non-overlapping tensors [num_slots, ...] (any dtype, rows
            contiguous, one num_slots) on the same device; used when page_size > 1.
        impl: "cuda", "triton" or "reference" to force one; default the fastest available.
        check_status: read the status back after the launch (one host sync on CUDA) and raise if
            the kernel refused the call.

    Returns:
        new_seq_lens = seq_lens + accept_len (seq_lens' dtype); seq_lens if the call was refused.

    Guarantees: metadata is always checked; values (paths in range, increasing, -1 padded,
    accept_len <= num_draft, draft slots in the pool and in kv_buffers and on pages the request
    owns, the draft pages distinct, the stack not overflowing, distinct rows) on CPU tensors and
    on CUDA in debug mode, before anything changes (ValueError naming the argument). The kernels
    check the same rules (except distinct rows) before touching the allocator state or any KV
    row: a refused call leaves req_to_token, free_pages, num_free, page_state and kv_buffers
    unchanged (the kernels claim the call's pages with atomic exchanges and undo the claims of a
    refused call before the launch ends). One launch (the KV-move blocks wait inside it for the
    bookkeeping block's verdict on the whole batch, through a scratch the library owns: see
    :func:`move_sync` for its concurrency contract), no host synchronisation unless
    check_status, capturable in a CUDA graph once the kv_buffers table is cached (call it once
    before capture). Deterministic.

    Example:
        >>> new_lens = spec_kernels.commit_draft_slots(req_to_token, req_pool_indices, seq_lens,
        ...     num_draft, accept_index, accept_len, free_pages, num_free, page_state, 16, kv_buffers=k_and_v)
    """
    status = _check_state(req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free, page_state,
                          page_size, max_draft, status,
                          others=(("accept_index", accept_index), ("accept_len", accept_len)))
    dev = req_to_token.device
    B = req_pool_indices.shape[0]
    check_tensor(accept_index, "accept_index", dim=2, dtypes=INDEX_DTYPES, device=dev)
    if accept_index.shape[0] != B or accept_index.shape[1] > MAX_DRAFT_TOKENS:
        raise ValueError(f"accept_index must have shape ({B}, A) with A <= {MAX_DRAFT_TOKENS}, "
                         f"got {tuple(accept_index.shape)}")
    check_tensor(accept_len, "accept_len", dim=1, dtypes=INDEX_DTYPES, device=dev)
    check_shape(accept_len, "accept_len", (B,), "one entry per request")
    kv_buffers = _check_kv_buffers(kv_buffers, dev)
    args = (req_to_token, req_pool_indices, seq_lens, num_draft, accept_index, accept_len, free_pages, num_free,
            page_state, page_size, max_draft, kv_buffers)

    host_checked = values_checkable(req_to_token, req_pool_indices, seq_lens, num_draft, accept_index, accept_len,
                                    free_pages, num_free, page_state)
    if host_checked:
        _check_unique_rows(req_pool_indices)
        _raise_for("commit_draft_slots", reference.commit_verdict(*args))
    new_seq_lens = torch.empty_like(seq_lens)
    torch.ops.spec_kernels.commit_draft_slots(*args, new_seq_lens, status, impl or "")
    if check_status and not host_checked and _may_sync(req_to_token):
        _read_status("commit_draft_slots", status, lambda: reference.commit_verdict(*args))
    return new_seq_lens


def page_state_from_free_stack(
    free_pages: torch.Tensor,
    num_free: torch.Tensor,
    *,
    req_to_token: Optional[torch.Tensor] = None,
    req_pool_indices: Optional[torch.Tensor] = None,
    seq_lens: Optional[torch.Tensor] = None,
    page_size: Optional[int] = None,
) -> torch.Tensor:
    """The page_state of a pool whose free pages are ``free_pages[:num_free]``: int32
    [free_pages.numel()] on their device, with

    * PAGE_FREE (0) for every page on the stack;
    * row + 1 for every page that holds a position in [0, seq_lens[b]) of exactly one of the
      given requests (row ``req_pool_indices[b]`` of ``req_to_token``, pages of ``page_size``
      slots): its owner, which alone may continue it (alloc) or commit drafts on it;
    * PAGE_SHARED (-1) for every other page: held, but by no single given request (pages of
      requests not given, pages another allocator or a radix cache holds, and pages that two or
      more of the given requests hold, e.g. a shared prefix). The ops never pop, continue, commit
      into or free such a page: a request whose partially filled last page is PAGE_SHARED cannot
      continue it, and a commit of drafts on it is refused.

    Without requests (the pool is new, every page free; or nothing needs to be continued) every
    page off the stack is PAGE_SHARED. Build it once, when the pool is created or taken over, and
    pass it to every :func:`alloc_draft_slots` / :func:`commit_draft_slots` of that pool; a caller
    that moves pages itself afterwards writes 0 for pages it pushes onto the stack, row + 1 for
    pages it gives request row ``row``, and PAGE_SHARED for pages it shares or hands to a cache.

    It reads num_free, the requests and their slots, and checks the stack (page ids in range,
    none twice), the requests (rows in range and distinct, 0 <= seq_lens <= req_to_token's
    context) and their slots (in the pool, not on a free page), each ValueError naming the
    argument; so it syncs with the GPU: do not call it per step or inside a CUDA graph.

    Example (an SGLang-style pool of 4096 pages, all free, page 0 on top):
        >>> free_pages = torch.arange(4095, -1, -1, device="cuda")
        >>> num_free = torch.tensor([4096], device="cuda")
        >>> page_state = page_state_from_free_stack(free_pages, num_free)
    and of a pool taken over with requests in flight:
        >>> page_state = page_state_from_free_stack(free_pages, num_free, req_to_token=req_to_token,
        ...     req_pool_indices=rows, seq_lens=seq_lens, page_size=16)
    """
    requests = [("req_to_token", req_to_token), ("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens)]
    given = [name for name, t in requests if t is not None]
    if given and len(given) < 3:
        missing = [name for name, t in requests if t is None]
        raise ValueError(f"{' and '.join(missing)} must be given with {' and '.join(given)}: the requests are "
                         f"req_to_token rows req_pool_indices holding positions [0, seq_lens)")
    if given and page_size is None:
        raise ValueError("page_size must be given with the requests (req_to_token holds slots, page_state pages)")
    if page_size is not None:
        if isinstance(page_size, bool) or not isinstance(page_size, int):
            raise TypeError(f"page_size must be an int, got {type(page_size).__name__}")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 1, got {page_size}")
    dev, like = common_device([("free_pages", free_pages), ("num_free", num_free)] + (requests if given else []))
    check_tensor(free_pages, "free_pages", dim=1, dtypes=(torch.int64,), device=dev, like=like)
    check_tensor(num_free, "num_free", dim=1, dtypes=(torch.int64,), device=dev, like=like)
    check_shape(num_free, "num_free", (1,))
    if given:
        check_tensor(req_to_token, "req_to_token", dim=2, dtypes=INDEX_DTYPES, device=dev, like=like)
        check_tensor(req_pool_indices, "req_pool_indices", dim=1, dtypes=INDEX_DTYPES, device=dev, like=like)
        check_tensor(seq_lens, "seq_lens", dim=1, dtypes=INDEX_DTYPES, device=dev, like=like)
        check_shape(seq_lens, "seq_lens", tuple(req_pool_indices.shape), "one entry per request, like req_pool_indices")
    capacity = free_pages.numel()
    top = int(num_free.item())
    if not 0 <= top <= capacity:
        raise ValueError(f"num_free = {top} must be in [0, free_pages.numel()={capacity}]")
    live = free_pages[:top]
    if top and (int(live.min()) < 0 or int(live.max()) >= capacity):
        raise ValueError(f"free_pages[:num_free] must be page ids in [0, {capacity}), got range "
                         f"[{int(live.min())}, {int(live.max())}]")
    state = torch.full((capacity,), PAGE_SHARED, dtype=torch.int32, device=free_pages.device)
    counts = torch.bincount(live, minlength=capacity) if top else torch.zeros(capacity, dtype=torch.int64, device=dev)
    if top:
        if int(counts.max()) > 1:
            page = int(counts.argmax())
            raise ValueError(f"free_pages[:num_free] holds page {page} {int(counts[page])} times; a page can be "
                             f"free only once")
        state[live] = PAGE_FREE
    if given:
        _set_owners(state, counts > 0, req_to_token, req_pool_indices, seq_lens, page_size)
    return state


def _set_owners(state, on_stack, req_to_token, req_pool_indices, seq_lens, page_size: int) -> None:
    """page_state_from_free_stack's requests: the pages of their positions [0, seq_len) get
    their owner (row + 1), or stay PAGE_SHARED when two rows hold one."""
    rows, max_context = req_to_token.shape
    _check_unique_rows(req_pool_indices)
    for b, (r, L) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        if not 0 <= r < rows:
            raise ValueError(f"req_pool_indices[{b}] = {r} is not a row of req_to_token (0..{rows - 1})")
        if not 0 <= L <= max_context:
            raise ValueError(f"seq_lens[{b}] = {L} must be in [0, {max_context}] (the context of req_to_token)")
    capacity = state.numel()
    dev = state.device
    lowest = torch.full((capacity,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=dev)
    highest = torch.full((capacity,), -1, dtype=torch.int64, device=dev)
    positions = torch.arange(max_context, device=dev)
    chunk = max(1, (1 << 22) // max(max_context, 1))  # requests per pass: bounded temporaries
    B = req_pool_indices.numel()
    for start in range(0, B, chunk):
        r = req_pool_indices[start:start + chunk].long()
        held = positions[None, :] < seq_lens[start:start + chunk].long()[:, None]
        slots = req_to_token[r].long()
        problem = held & ((slots < 0) | (slots >= capacity * page_size))
        if bool(problem.any()):
            b, pos = (int(x) for x in problem.nonzero()[0])
            raise ValueError(f"req_to_token[{int(r[b])}, {pos}] = {int(slots[b, pos])} (position {pos} of request "
                             f"{start + b}) is not a slot of the pool (free_pages.numel() = {capacity} pages of "
                             f"{page_size}: slots 0..{capacity * page_size - 1})")
        pages = torch.where(held, slots // page_size, 0)
        problem = held & on_stack[pages]
        if bool(problem.any()):
            b, pos = (int(x) for x in problem.nonzero()[0])
            raise ValueError(f"req_to_token[{int(r[b])}, {pos}] = {int(slots[b, pos])} (position {pos} of request "
                             f"{start + b}) is on page {int(pages[b, pos])}, which is on the free stack "
                             f"(free_pages[:num_free]): a page is free or held, not both")
        owner = (r + 1)[:, None].expand_as(pages)[held]
        lowest.scatter_reduce_(0, pages[held], owner, "amin")
        highest.scatter_reduce_(0, pages[held], owner, "amax")
    one_owner = (highest >= 0) & (lowest == highest)
    state[one_owner] = highest[one_owner].to(torch.int32)


def _check_kv_buffers(kv_buffers, device: torch.device) -> list[torch.Tensor]:
    if kv_buffers is None:
        return []
    if isinstance(kv_buffers, torch.Tensor) or not isinstance(kv_buffers, (list, tuple)):
        raise TypeError(f"kv_buffers must be a list or tuple of tensors, got {type(kv_buffers).__name__}")
    kv_buffers = list(kv_buffers)
    for i, t in enumerate(kv_buffers):
        name = f"kv_buffers[{i}]"
        check_tensor(t, name, device=device, contiguous=False)
        if t.dim() < 1 or t.shape[0] != kv_buffers[0].shape[0] or t.shape[0] == 0:
            raise ValueError(f"{name} must have shape [num_slots, ...] with num_slots = {kv_buffers[0].shape[0]} "
                             f"like kv_buffers[0] (and > 0), got {tuple(t.shape)}")
        if not t[0].is_contiguous() or t.stride(0) < t[0].numel():
            raise ValueError(f"{name} must have contiguous, non-overlapping rows (got strides {tuple(t.stride())})")
    addresses = [] if torch.compiler.is_compiling() else [t.data_ptr() for t in kv_buffers if not _is_fake(t)]
    if len(set(addresses)) != len(addresses):  # two copies of a buffer would race over its rows
        raise ValueError("kv_buffers must be distinct tensors; one appears twice")
    return kv_buffers
