"""SIMT emulation of csrc/kv_slots/kv_slots.cu (alloc_draft_slots_kernel, commit_draft_slots_kernel
and the KV row moves, as launched by launch_alloc_draft_slots / launch_commit_draft_slots), and its
lockstep checks against spec_kernels/kv_slots/reference.py.

A hand transliteration, thread by thread between barriers: every thread of a block runs one
phase of the kernel, then the next barrier. Global and shared memory are tracked arrays
(Arr, Heap): every access records (block, thread, warp, barrier epoch, warp epoch), and two
accesses to one address from different threads, at least one a write, not ordered by a
__syncthreads (same block) or a __syncwarp (same warp), are reported as a race - across blocks
nothing orders them, so any such pair is a race. Out-of-bounds accesses raise. Shuffles within a
group of G lanes are butterflies over the 32 lanes (__shfl_xor_sync). cub's BlockReduce /
BlockScan are modelled by their results (sums in thread order), not by their code. Atomics
(the page_state exchanges) never race with each other, but do with a plain access of another
thread that no barrier orders; within a phase the threads' atomics take effect in thread order
(one of the orders the hardware may pick).

K is the number of threads per block: the kernel's kThreads = 1024; smaller K (32, 64) gives
several request tiles per batch with small batches, which is what exercises pass 2's re-analysis
and the running carry. Update this file together with the kernel (see README.md).
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

KERNEL = "csrc/kv_slots/kv_slots.cu"
K_MAX_DRAFT = 64  # kMaxDraftTokens
OK, OUT_OF_PAGES, BAD_REQUEST, BAD_STACK, OUT_TOO_SMALL, PAGE_CONFLICT = 0, 1, 2, 3, 4, 5  # kKvSlots* codes
PAGE_FREE, PAGE_HELD, PAGE_MARK = 0, 1, 2  # kPage*
INT_MAX = 2**31 - 1
M64 = (1 << 64) - 1


def i32(v):  # a C cast to int32_t (wraps)
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >> 31 else v


def i64(v):
    v &= M64
    return v - (1 << 64) if v >> 63 else v


class Tracker:
    """The race detector: every access to an address, with who made it and when."""

    def __init__(self, check=True):
        self.log = {}
        self.races = []
        self.check = check

    def access(self, name, i, ctx, kind):
        if not self.check:
            return
        key = (name, i)
        me = (ctx.block, ctx.tid, ctx.warp, ctx.bepoch, ctx.wepoch, kind)
        lst = self.log.setdefault(key, [])
        for o in lst:
            if (o[5] == "r" and kind == "r") or (o[5] == "a" and kind == "a"):
                continue  # two reads, or two atomics, never conflict
            if (o[0], o[1]) == (me[0], me[1]):
                continue  # program order within a thread
            if o[0] == me[0]:
                if o[3] != me[3]:
                    continue  # same block, a __syncthreads in between
                if o[2] == me[2] and o[4] != me[4]:
                    continue  # same warp, a __syncwarp (or __syncthreads) in between
            # else: unordered (different blocks are never ordered within a launch)
            if len(self.races) < 20:
                self.races.append((key, o, me))
        lst.append(me)


class Ctx:
    """One thread: its ids and how many barriers / warp barriers it has passed."""

    def __init__(self, block, tid):
        self.block, self.tid, self.warp = block, tid, tid // 32
        self.bepoch = 0
        self.wepoch = 0


class Arr:
    """A tracked array of integers; bits 32 or 64: stores wrap like a C cast; 0: stored as is
    (bools, the uint64 mask)."""

    def __init__(self, name, values, tracker, bits=64):
        self.name, self.d, self.t, self.bits = name, list(values), tracker, bits

    def ld(self, i, ctx):
        assert 0 <= i < len(self.d), f"OOB read {self.name}[{i}] (size {len(self.d)})"
        self.t.access(self.name, i, ctx, "r")
        return self.d[i]

    def st(self, i, v, ctx):
        assert 0 <= i < len(self.d), f"OOB write {self.name}[{i}] (size {len(self.d)})"
        self.t.access(self.name, i, ctx, "w")
        self.d[i] = i32(v) if self.bits == 32 else (i64(v) if self.bits == 64 else v)

    def xchg(self, i, v, ctx):  # atomicExch: returns the old value
        assert 0 <= i < len(self.d), f"OOB atomic {self.name}[{i}] (size {len(self.d)})"
        self.t.access(self.name, i, ctx, "a")
        old = self.d[i]
        self.d[i] = i32(v) if self.bits == 32 else (i64(v) if self.bits == 64 else v)
        return old


class Heap:
    """KV memory: bytes, tracked per unit-sized access at its byte address (one copy unit per
    launch and every address a multiple of it, so equal addresses = overlapping accesses)."""

    def __init__(self, data: np.ndarray, tracker):
        self.b, self.t = data, tracker

    def ld(self, addr, unit, ctx):
        assert 0 <= addr and addr + unit <= len(self.b), f"OOB KV read {addr}"
        self.t.access("kv", addr, ctx, "r")
        return self.b[addr:addr + unit].copy()

    def st(self, addr, v, unit, ctx):
        assert 0 <= addr and addr + unit <= len(self.b), f"OOB KV write {addr}"
        self.t.access("kv", addr, ctx, "w")
        self.b[addr:addr + unit] = v


class Block:
    """The threads of one block, and its barriers."""

    def __init__(self, block, nthreads):
        self.ctx = [Ctx(block, t) for t in range(nthreads)]

    def sync(self):  # __syncthreads
        for c in self.ctx:
            c.bepoch += 1
            c.wepoch += 1

    def syncwarp(self, warp):
        for c in self.ctx[warp * 32:(warp + 1) * 32]:
            c.wepoch += 1

    def sync_or(self, vals):  # __syncthreads_or(vals[tid])
        self.sync()
        return any(vals)


# ----------------------------------------------------------------------------- helpers
def load_index(t, i, ctx):
    return t.ld(i, ctx)


def store_index(t, i, v, ctx):
    t.st(i, v, ctx)


def roundup(x, log2p):
    return ((x + (1 << log2p) - 1) >> log2p) << log2p


def pages_spanned(b, e, log2p):
    return (roundup(e, log2p) - roundup(b, log2p)) >> log2p


def group_all(vals, G):
    """vals: 32 lane values; butterfly xor over groups of G (as __shfl_xor_sync)."""
    v = [bool(x) for x in vals]
    o = G // 2
    while o > 0:
        v = [v[l] & v[l ^ o] for l in range(32)]
        o //= 2
    return v


def group_or(vals, G):
    v = list(vals)
    o = G // 2
    while o > 0:
        v = [v[l] | v[l ^ o] for l in range(32)]
        o //= 2
    return v


class Tile:
    def __init__(self, K, tr, block):
        n = f"b{block}.tile."
        self.row = Arr(n + "row", [0] * K, tr, 32)
        self.len = Arr(n + "len", [0] * K, tr, 32)
        self.drafts = Arr(n + "drafts", [0] * K, tr, 32)
        self.count = Arr(n + "count", [0] * K, tr, 32)
        self.tokens = Arr(n + "tokens", [0] * K, tr, 32)
        self.token_off = Arr(n + "token_off", [0] * K, tr, 32)
        # union last_page (int32) / mask (uint64): same storage name, so races show
        self.u = Arr(n + "union", [0] * K, tr, 0)
        self.valid = Arr(n + "valid", [False] * K, tr, 0)


class Batch:
    """KvSlotBatch."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def load_request(a, b, ctx):
    row = load_index(a.req_pool_indices, b, ctx)
    ln = load_index(a.seq_lens, b, ctx)
    dr = load_index(a.num_draft, b, ctx)
    ok = row >= 0 and row < a.num_rows and ln >= 0 and dr >= 0 and dr <= a.max_draft and ln <= a.max_context - dr
    return [row, ln, dr, ok]


def record(t, i, q, ok, count, tokens, ctx):
    t.row.st(i, q[0], ctx)
    t.len.st(i, q[1], ctx)
    t.drafts.st(i, q[2], ctx)
    t.valid.st(i, ok, ctx)
    t.count.st(i, count if ok else 0, ctx)
    t.tokens.st(i, tokens if ok else 0, ctx)


def groups(tid, G, K):
    return G, tid & (G - 1), tid // G, K // G


# ----------------------------------------------------------------------------- alloc
class AllocOp:
    def __init__(self, a, out, out_capacity, group_size, K):
        self.a, self.out, self.out_capacity, self.group_size, self.K = a, out, out_capacity, group_size, K

    def analyze_tile(self, blk, t, t0, ln, check_state):
        a = self.a
        for ctx in blk.ctx:
            i = ctx.tid
            if i >= ln:
                continue
            q = load_request(a, t0 + i, ctx)
            ok = q[3]
            last_page = -1
            if ok and q[2] > 0 and (q[1] & ((1 << a.log2_page_size) - 1)):
                last_page = load_index(a.req_to_token, q[0] * a.max_context + q[1] - 1, ctx) >> a.log2_page_size
                ok = (last_page >= 0 and last_page < a.num_pages
                      and (not check_state or a.page_state.ld(last_page, ctx) == PAGE_HELD))
            record(t, i, q, ok, pages_spanned(q[1], q[1] + q[2], a.log2_page_size), q[2], ctx)
            t.u.st(i, i32(last_page), ctx)

    def totals_code(self, pages, tokens, top):
        if tokens > self.out_capacity:
            return OUT_TOO_SMALL
        return OUT_OF_PAGES if pages > top else OK

    def apply_tile(self, blk, t, t0, ln, top):
        a = self.a
        log2p = a.log2_page_size
        for ctx in blk.ctx:
            G, lane, gid, gcount = groups(ctx.tid, self.group_size, self.K)
            i = gid
            while i < ln:
                L = t.len.ld(i, ctx)
                first_fresh = roundup(L, log2p)
                row_base = t.row.ld(i, ctx) * a.max_context
                for m in range(K_MAX_DRAFT // 32):
                    d = lane + m * G
                    if d >= t.drafts.ld(i, ctx):
                        break
                    pos = L + d
                    if pos < first_fresh:
                        page = t.u.ld(i, ctx)
                    else:
                        page = a.free_pages.ld(top - 1 - t.count.ld(i, ctx) - ((pos - first_fresh) >> log2p), ctx)
                    slot = (page << log2p) | (pos & ((1 << log2p) - 1))
                    store_index(a.req_to_token, row_base + pos, slot, ctx)
                    self.out.st(t.token_off.ld(i, ctx) + d, slot, ctx)
                i += gcount

    def each_continued(self, blk, t, f):
        """f(page, ctx) for the last page of every request that continues one; per-thread ORs."""
        a, K = self.a, self.K
        B = a.num_requests
        anys = [False] * K
        t0 = 0
        while t0 < B:
            ln = min(K, B - t0)
            if B > K:
                self.analyze_tile(blk, t, t0, ln, False)
                blk.sync()
            for ctx in blk.ctx:
                if ctx.tid < ln:
                    lp = t.u.ld(ctx.tid, ctx)
                    if lp >= 0:
                        anys[ctx.tid] |= f(lp, ctx)
            blk.sync()
            t0 += K
        return anys

    def popped(self, blk, top, pages, f):
        """f(j, ctx) for the stack entries the call pops, thread tid taking j = top - pages + tid + K*i."""
        for ctx in blk.ctx:
            j = top - pages + ctx.tid
            while j < top:
                f(j, ctx)
                j += self.K

    def claim_pages(self, blk, t, top, pages):
        a = self.a
        bad = [False] * self.K

        def check(j, ctx):
            p = a.free_pages.ld(j, ctx)
            bad[ctx.tid] |= p < 0 or p >= a.num_pages or a.page_state.ld(p, ctx) != PAGE_FREE
        self.popped(blk, top, pages, check)
        if blk.sync_or(bad):
            return True  # nothing claimed yet

        def claim(j, ctx):
            bad[ctx.tid] |= a.page_state.xchg(a.free_pages.ld(j, ctx), PAGE_MARK, ctx) == PAGE_MARK
        self.popped(blk, top, pages, claim)
        cont = self.each_continued(blk, t, lambda p, ctx: a.page_state.xchg(p, PAGE_MARK, ctx) == PAGE_MARK)
        bad = [x or y for x, y in zip(bad, cont)]
        if not blk.sync_or(bad):
            return False
        self.settle(blk, t, top, pages, PAGE_FREE)
        return True

    def settle(self, blk, t, top, pages, popped):
        a = self.a
        self.popped(blk, top, pages, lambda j, ctx: a.page_state.xchg(a.free_pages.ld(j, ctx), popped, ctx))
        self.each_continued(blk, t, lambda p, ctx: a.page_state.xchg(p, PAGE_HELD, ctx) and False)

    def publish(self, code):
        pass

    def refuse(self, blk):
        self.fill_out(blk, 0)

    def finish(self, blk, t, top, pages, tokens):
        self.fill_out(blk, tokens)
        self.settle(blk, t, top, pages, PAGE_HELD)
        ctx = blk.ctx[0]
        self.a.num_free.st(0, top - pages, ctx)

    def fill_out(self, blk, frm):
        for ctx in blk.ctx:
            i = frm + ctx.tid
            while i < self.out_capacity:
                self.out.st(i, -1, ctx)
                i += self.K


# ----------------------------------------------------------------------------- commit
class CommitOp:
    def __init__(self, a, c, group_size, slot_bound, prefix_only, K):
        self.a, self.c, self.group_size, self.slot_bound, self.prefix_only, self.K = (
            a, c, group_size, slot_bound, prefix_only, K)

    def analyze_request_warp(self, ctxs, t, items, G, check_state):
        """ctxs: the 32 threads of a warp; items[lane] = (i, b, active) for that lane's group."""
        a, c = self.a, self.c
        oks, masks, qs, ks = [], [], [], []
        for lane_w, ctx in enumerate(ctxs):
            i, b, active = items[lane_w]
            lane = lane_w & (G - 1)
            q = [0, 0, 0, False]
            k = 0
            if active:
                q = load_request(a, b, ctx)
                k = load_index(c.accept_len, b, ctx)
            ok = q[3] and k >= 0 and k <= q[2] and k <= c.accept_width
            mask = 0
            j = lane
            while active and j < c.accept_width:
                x = load_index(c.accept_index, b * c.accept_width + j, ctx)
                if j < k:
                    prev = load_index(c.accept_index, b * c.accept_width + j - 1, ctx) if j > 0 else -1
                    ok = ok and x >= 0 and x < q[2] and x > prev and (not self.prefix_only or x == j)
                    if 0 <= x < K_MAX_DRAFT:
                        mask |= 1 << x
                else:
                    ok = ok and x == -1
                j += G
            if q[3]:
                base = q[0] * a.max_context + q[1]
                for m in range(K_MAX_DRAFT // 32):
                    d = lane + m * G
                    if d < q[2]:
                        slot = load_index(a.req_to_token, base + d, ctx)
                        ok = (ok and slot >= 0 and slot < self.slot_bound
                              and (not check_state or a.page_state.ld(slot >> a.log2_page_size, ctx) == PAGE_HELD))
            oks.append(ok)
            masks.append(mask)
            qs.append(q)
            ks.append(k)
        oks = group_all(oks, G)
        masks = group_or(masks, G)
        for lane_w, ctx in enumerate(ctxs):
            i, b, active = items[lane_w]
            lane = lane_w & (G - 1)
            if active and lane == 0:
                q, k = qs[lane_w], ks[lane_w]
                released = q[2] - k if self.a.log2_page_size == 0 else pages_spanned(
                    q[1] + k, q[1] + q[2], self.a.log2_page_size)
                record(t, i, q, oks[lane_w], released, k, ctx)
                t.u.st(i, masks[lane_w], ctx)

    def analyze_tile(self, blk, t, t0, ln, check_state):
        G = self.group_size
        gcount = self.K // G
        base = 0
        while base < ln:
            for w in range(self.K // 32):
                ctxs = blk.ctx[w * 32:(w + 1) * 32]
                items = []
                for ctx in ctxs:
                    i = base + ctx.tid // G
                    items.append((i, t0 + i, i < ln))
                self.analyze_request_warp(ctxs, t, items, G, check_state)
            base += gcount

    def draft_page(self, t, i, e, ctx):
        """(page, released) of draft page e of request i of the tile."""
        a = self.a
        log2p = a.log2_page_size
        L = t.len.ld(i, ctx)
        block = ((L >> log2p) + e) << log2p
        page = load_index(a.req_to_token, t.row.ld(i, ctx) * a.max_context + (block if block > L else L), ctx) >> log2p
        if log2p == 0:
            released = not ((t.u.ld(i, ctx) >> e) & 1)
        else:
            released = block >= roundup(L + t.tokens.ld(i, ctx), log2p)
        return page, released

    def draft_page_count(self, t, i, ctx):
        L, n = t.len.ld(i, ctx), t.drafts.ld(i, ctx)
        log2p = self.a.log2_page_size
        return 0 if n == 0 else ((L + n - 1) >> log2p) - (L >> log2p) + 1

    def each_draft_page(self, blk, t, f):
        """f(page, ctx) for every draft page of the batch; per-thread ORs of its results."""
        a, K, G = self.a, self.K, self.group_size
        B = a.num_requests
        anys = [False] * K
        t0 = 0
        while t0 < B:
            ln = min(K, B - t0)
            if B > K:
                self.analyze_tile(blk, t, t0, ln, False)
                blk.sync()
            for ctx in blk.ctx:
                G_, lane, gid, gcount = groups(ctx.tid, G, K)
                i = gid
                while i < ln:
                    count = self.draft_page_count(t, i, ctx)
                    for m in range(K_MAX_DRAFT // 32):
                        e = lane + m * G
                        if e >= count:
                            break
                        page, _ = self.draft_page(t, i, e, ctx)
                        anys[ctx.tid] |= f(page, ctx)
                    i += gcount
            blk.sync()
            t0 += K
        return anys

    def claim_pages(self, blk, t, top, released):
        ps = self.a.page_state
        twice = self.each_draft_page(blk, t, lambda p, ctx: ps.xchg(p, PAGE_MARK, ctx) == PAGE_MARK)
        if not blk.sync_or(twice):
            return False
        self.each_draft_page(blk, t, lambda p, ctx: ps.xchg(p, PAGE_HELD, ctx) and False)
        return True

    def totals_code(self, released, tokens, top):
        return BAD_STACK if top + released > self.a.num_pages else OK

    def apply_tile(self, blk, t, t0, ln, top):
        a, c = self.a, self.c
        log2p = a.log2_page_size
        G = self.group_size
        gcount = self.K // G
        base = 0
        while base < ln:
            for w in range(self.K // 32):
                ctxs = blk.ctx[w * 32:(w + 1) * 32]
                regs = []
                for ctx in ctxs:
                    lane = ctx.tid & (G - 1)
                    i = base + ctx.tid // G
                    active = i < ln
                    L = t.len.ld(i, ctx) if active else 0
                    n = t.drafts.ld(i, ctx) if active else 0
                    k = t.tokens.ld(i, ctx) if active else 0
                    row_base = t.row.ld(i, ctx) * a.max_context if active else 0
                    push_at = top + (t.count.ld(i, ctx) if active else 0)
                    r = dict(lane=lane, i=i, active=active, L=L, n=n, k=k, row_base=row_base, push_at=push_at)
                    if log2p == 0:
                        r["mask"] = t.u.ld(i, ctx) if active else 0
                        slot = []
                        for m in range(K_MAX_DRAFT // 32):
                            d = lane + m * G
                            slot.append(load_index(a.req_to_token, row_base + L + d, ctx) if d < n else 0)
                        r["slot"] = slot
                    regs.append(r)
                if log2p == 0:
                    blk.syncwarp(w)
                for ctx, r in zip(ctxs, regs):
                    lane, i, active, L, n, k = r["lane"], r["i"], r["active"], r["L"], r["n"], r["k"]
                    if log2p == 0:
                        mask = r["mask"]
                        for m in range(K_MAX_DRAFT // 32):
                            d = lane + m * G
                            if d >= n:
                                continue
                            below = mask & ((1 << d) - 1)
                            if (mask >> d) & 1:
                                store_index(a.req_to_token, r["row_base"] + L + bin(below).count("1"), r["slot"][m], ctx)
                                a.page_state.xchg(r["slot"][m], PAGE_HELD, ctx)
                            else:
                                a.free_pages.st(r["push_at"] + d - bin(below).count("1"), r["slot"][m], ctx)
                                a.page_state.xchg(r["slot"][m], PAGE_FREE, ctx)
                    else:
                        first = roundup(L + k, log2p)
                        p = lane
                        while active and first + (p << log2p) < L + n:
                            a.free_pages.st(r["push_at"] + p,
                                            load_index(a.req_to_token, r["row_base"] + first + (p << log2p), ctx)
                                            >> log2p, ctx)
                            p += G
                        count = self.draft_page_count(t, i, ctx) if active else 0
                        e = lane
                        while e < count:
                            page, released = self.draft_page(t, i, e, ctx)
                            a.page_state.xchg(page, PAGE_FREE if released else PAGE_HELD, ctx)
                            e += G
                    if active and lane == 0:
                        store_index(c.new_seq_lens, t0 + i, L + k, ctx)
            base += gcount

    def publish(self, code):
        """The verdict (thread 0, after the status): the zeroed count of finished blocks, then the
        verdict word (a release store)."""
        if self.c.move_sync is not None:
            self.c.move_sync.w[2] = self.c.move_tag << TAG_SHIFT
            self.c.move_sync.w[1] = (self.c.move_tag << TAG_SHIFT) | code

    def refuse(self, blk):
        for ctx in blk.ctx:
            b = ctx.tid
            while b < self.a.num_requests:
                store_index(self.c.new_seq_lens, b, load_index(self.a.seq_lens, b, ctx), ctx)
                b += self.K

    def finish(self, blk, t, top, released, tokens):
        self.a.num_free.st(0, top + released, blk.ctx[0])


# ----------------------------------------------------------------------------- bookkeeping
def keep_books(op, a, blk, tile, K):
    B = a.num_requests
    top = [a.num_free.ld(0, ctx) for ctx in blk.ctx]
    mine = [[0, 0, INT_MAX] for _ in range(K)]
    t0 = 0
    while t0 < B:
        ln = min(K, B - t0)
        op.analyze_tile(blk, tile, t0, ln, True)
        blk.sync()
        for ctx in blk.ctx:
            i = ctx.tid
            if i < ln:
                mine[i][0] += tile.count.ld(i, ctx)
                mine[i][1] += tile.tokens.ld(i, ctx)
                if not tile.valid.ld(i, ctx):
                    mine[i][2] = min(mine[i][2], t0 + i)
        blk.sync()
        t0 += K
    total = [sum(m[0] for m in mine), sum(m[1] for m in mine), min(m[2] for m in mine)]  # BlockReduce
    ctx = blk.ctx[0]
    found = total[2] != INT_MAX
    if found:
        total[0] = total[1] = 0
    verdict = BAD_REQUEST if found else op.totals_code(total[0], total[1], top[0])
    if top[0] < 0 or top[0] > a.num_pages:
        verdict = BAD_STACK
    batch, code = total, verdict
    blk.sync()
    conflict = code == OK and op.claim_pages(blk, tile, top[0], batch[0])
    if conflict:
        code = PAGE_CONFLICT
    for idx, v in enumerate([code, batch[0], top[0], batch[2] if batch[2] != INT_MAX else -1, batch[1]]):
        a.status.st(idx, v, ctx)
    op.publish(code)
    blk.sync()
    if code != OK:
        op.refuse(blk)
        return
    carry = [0, 0]
    t0 = 0
    while t0 < B:
        ln = min(K, B - t0)
        if B > K:
            op.analyze_tile(blk, tile, t0, ln, False)
            blk.sync()
        v = []
        for ctx in blk.ctx:
            i = ctx.tid
            v.append((tile.count.ld(i, ctx), tile.tokens.ld(i, ctx)) if i < ln else (0, 0))
        # BlockScan::ExclusiveScan (int32 sums, as Offsets is int32)
        before, acc = [], [0, 0]
        for x in v:
            before.append(tuple(acc))
            acc = [i32(acc[0] + x[0]), i32(acc[1] + x[1])]
        tile_total = acc
        for ctx in blk.ctx:
            i = ctx.tid
            if i < ln:
                tile.count.st(i, i32(carry[0] + before[i][0]), ctx)
                tile.token_off.st(i, i32(carry[1] + before[i][1]), ctx)
        blk.sync()
        op.apply_tile(blk, tile, t0, ln, top[0])
        carry = [i32(carry[0] + tile_total[0]), i32(carry[1] + tile_total[1])]
        blk.sync()
        t0 += K
    op.finish(blk, tile, top[0], batch[0], batch[1])


def alloc_kernel(a, out, out_capacity, group_size, K, tr):
    blk = Block(0, K)
    tile = Tile(K, tr, 0)
    keep_books(AllocOp(a, out, out_capacity, group_size, K), a, blk, tile, K)


def move_rows(op, blk, heap, unit, k, src, dst, share, shares, K):
    c = op.c
    nb = c.num_kv_buffers
    kwarps = K // 32
    tbl = c.kv_table
    for ctx in blk.ctx:
        warp, lane = ctx.tid // 32, ctx.tid % 32
        buf = share + shares * warp
        while buf < nb:
            base = tbl.ld(buf, ctx)
            stride = tbl.ld(nb + buf, ctx) // unit
            units = tbl.ld(2 * nb + buf, ctx) // unit
            assert base % unit == 0
            for j in range(k):
                sj, dj = src.ld(j, ctx), dst.ld(j, ctx)
                if sj == dj:
                    continue
                frm = base // unit + sj * stride
                to = base // unit + dj * stride
                c0 = lane
                while c0 < units:
                    vals = {}
                    for u in range(4):
                        if c0 + 32 * u < units:
                            vals[u] = heap.ld((frm + c0 + 32 * u) * unit, unit, ctx)
                    for u in range(4):
                        if c0 + 32 * u < units:
                            heap.st((to + c0 + 32 * u) * unit, vals[u], unit, ctx)
                    c0 += 32 * 4
            buf += shares * kwarps


# ----------------------------------------------------------------------------- hand-off
TAG_SHIFT = 25  # kKvMoveTagShift
VALUE_MASK = (1 << TAG_SHIFT) - 1
SYNC_WORDS = 3  # kKvMoveSyncWords
WAIT_LIMIT = 100_000  # scheduler turns a waiting block may spend (the kernel: 2^27 polls, then __trap)


class Scratch:
    """The hand-off's scratch words (uint64). Only thread 0 of a block touches them, through
    atomics and acquire / release accesses, so they are not race-tracked; the emulated blocks
    do not interleave inside one of these operations (atomicity)."""

    def __init__(self, words):
        self.w = [v & M64 for v in words]


def elect_bookkeeper(scr, tag):
    seen = scr.w[0]
    if (seen >> TAG_SHIFT) == tag:
        return False
    if scr.w[0] == seen:  # atomicCAS(seen -> tag << TAG_SHIFT)
        scr.w[0] = tag << TAG_SHIFT
        return True
    return False


def move_kv_rows(op, blk, tile, b, share, shares, heap, K, tr):
    """A generator: yields while it waits for the verdict. (src / dst: the kernel's threads
    d < k each load one entry; written as a strided loop, the same for K >= 64 > k - 1, so that
    the 32-thread emulations fill all 64.)"""
    src = Arr(f"b{blk.ctx[0].block}.src", [0] * K_MAX_DRAFT, tr)
    dst = Arr(f"b{blk.ctx[0].block}.dst", [0] * K_MAX_DRAFT, tr)
    ctxs = blk.ctx[:32]
    op.analyze_request_warp(ctxs, tile, [(0, b, True)] * 32, 32, False)
    blk.sync()
    ctx0 = blk.ctx[0]
    valid = tile.valid.ld(0, ctx0)
    k = tile.tokens.ld(0, ctx0) if valid else 0
    prefix = M64 if k == K_MAX_DRAFT else (1 << k) - 1
    moves = k > 0 and tile.u.ld(0, ctx0) != prefix
    c = op.c
    a = op.a
    if moves:
        for ctx in blk.ctx:
            for d in range(ctx.tid, k, K):
                base = tile.row.ld(0, ctx) * a.max_context + tile.len.ld(0, ctx)
                frm = load_index(c.accept_index, b * c.accept_width + d, ctx)
                src.st(d, load_index(a.req_to_token, base + frm, ctx), ctx)
                dst.st(d, load_index(a.req_to_token, base + d, ctx), ctx)
    waited = 0
    while (c.move_sync.w[1] >> TAG_SHIFT) != c.move_tag:  # wait_for_verdict (thread 0)
        waited += 1
        if waited > WAIT_LIMIT:
            raise AssertionError(f"block {blk.ctx[0].block} waits for a verdict that never comes (hang)")
        yield "wait"
    verdict = c.move_sync.w[1] & VALUE_MASK
    blk.sync()
    if not moves or verdict != OK:
        return
    move_rows(op, blk, heap, c.kv_unit_bytes, k, src, dst, share, shares, K)


def group_size_for(max_draft):
    g = 1
    while g < max_draft and g < 32:
        g *= 2
    return g


def commit_block(op, a, c, heap, K, tr, bid, nblocks):
    """Block bid of commit_draft_slots_kernel, a generator: yields after the election and while
    it waits, so that the scheduler can interleave blocks."""
    blk = Block(bid, K)
    tile = Tile(K, tr, bid)
    if c.move_sync is None:
        keep_books(op, a, blk, tile, K)
        return
    bookkeeper = elect_bookkeeper(c.move_sync, c.move_tag)
    yield "books" if bookkeeper else "elected"
    if bookkeeper:
        keep_books(op, a, blk, tile, K)
        blk.sync()
    shares = c.kv_blocks_per_request
    yield from move_kv_rows(op, blk, tile, bid // shares, bid % shares, shares, heap, K, tr)
    blk.sync()
    before = c.move_sync.w[2]  # atomicAdd
    c.move_sync.w[2] = (before + 1) & M64
    if (before & VALUE_MASK) + 1 == nblocks:
        for i in range(SYNC_WORDS):
            c.move_sync.w[i] = 0


def commit_kernel(a, c, heap, K, tr, seed=0):
    """The launch. Blocks start in a random order (seeded); then either a random started block
    resumes or the next one starts, or (one launch in three) the bookkeeping block runs only once
    every other block has started and is waiting or done, so that blocks do wait."""
    moves = a.log2_page_size > 0 and c.kv_table is not None and a.num_requests > 0
    if moves:
        assert c.move_sync is not None and 1 <= c.move_tag < 1 << (63 - TAG_SHIFT)
    else:
        c.move_sync = None
    pool_slots = a.num_pages << a.log2_page_size
    slot_bound = c.num_kv_rows if moves and c.num_kv_rows < pool_slots else pool_slots
    prefix_only = a.log2_page_size > 0 and not moves
    nblocks = a.num_requests * c.kv_blocks_per_request if moves else 1
    op = CommitOp(a, c, group_size_for(a.max_draft), slot_bound, prefix_only, K)
    rng = random.Random(seed)
    waiting = list(range(nblocks))
    rng.shuffle(waiting)  # the order blocks arrive in
    running = {}  # generator -> what it last yielded
    books_last = rng.random() < 1 / 3
    eager = rng.choice([0.2, 0.5, 0.9])  # how often a new block starts rather than one resuming
    while waiting or running:
        if waiting and (books_last or not running or rng.random() < eager):
            bid = waiting.pop()
            g = commit_block(op, a, c, heap, K, tr, bid, nblocks)
        elif books_last:
            busy = [g for g, what in running.items() if what not in ("books", "wait")]
            books = [g for g, what in running.items() if what == "books"]
            g = busy[0] if busy else books[0] if books else rng.choice(list(running))
        else:
            g = rng.choice(list(running))
        try:
            running[g] = next(g)
        except StopIteration:
            running.pop(g, None)


# ================================================================================ launches
# The two launches on CPU tensors, as spec_kernels/kv_slots/api.py + csrc/ops.cpp call them. The
# inputs are not modified; the results come back as new tensors, plus the detector's races.
def _arr(name, t, tr):
    """A tensor as a tracked array (stores into int32 tensors wrap like the kernel's casts)."""
    return Arr(name, t.reshape(-1).tolist(), tr, 32 if t.dtype == torch.int32 else 64)


def _back(a, like):
    return torch.tensor(a.d, dtype=like.dtype).reshape(like.shape)


def _batch(tr, rtt, rpi, seq, nd, free, num_free, page_state, page_size, max_draft):
    """KvSlotBatch as kv_slot_batch() in ops.cpp fills it."""
    return Batch(req_to_token=_arr("req_to_token", rtt, tr), num_rows=rtt.shape[0], max_context=rtt.shape[1],
                 req_pool_indices=_arr("req_pool_indices", rpi, tr), seq_lens=_arr("seq_lens", seq, tr),
                 num_draft=_arr("num_draft", nd, tr), num_requests=rpi.numel(), free_pages=_arr("free_pages", free, tr),
                 num_pages=free.numel(), num_free=_arr("num_free", num_free, tr),
                 page_state=_arr("page_state", page_state, tr),
                 log2_page_size=page_size.bit_length() - 1, max_draft=max_draft, status=Arr("status", [-9] * 5, tr, 64))


def emulate_alloc(req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free, page_state, page_size,
                  max_draft, out_capacity, threads=1024):
    """launch_alloc_draft_slots. Returns dict of the resulting req_to_token, free_pages,
    num_free, page_state, out_cache_loc (entries never written stay -9), status and races."""
    tr = Tracker()
    a = _batch(tr, req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free, page_state, page_size,
               max_draft)
    out = Arr("out_cache_loc", [-9] * out_capacity, tr, 64)
    alloc_kernel(a, out, out_capacity, group_size_for(max_draft), threads, tr)
    return dict(req_to_token=_back(a.req_to_token, req_to_token), free_pages=_back(a.free_pages, free_pages),
                num_free=_back(a.num_free, num_free), page_state=_back(a.page_state, page_state),
                out_cache_loc=torch.tensor(out.d, dtype=torch.int64),
                status=torch.tensor(a.status.d, dtype=torch.int64), races=tr.races)


def _kv_heap(kv_buffers):
    """Lay the buffers' storages out in one byte heap (addresses = heap offsets, each storage
    keeping its real address modulo 16, so the copy unit comes out as on the GPU). Returns the
    heap, {storage address: heap offset} and the kv_table rows (base, row stride, row bytes)."""
    where, parts, off = {}, [], 0
    for t in kv_buffers:
        st = t.untyped_storage()
        if st.data_ptr() in where:
            continue
        off += (st.data_ptr() - off) % 16
        where[st.data_ptr()] = off
        parts.append((off, torch.empty(0, dtype=torch.uint8).set_(st).numpy()))
        off += st.nbytes()
    heap = np.zeros(off + 16, np.uint8)
    for o, b in parts:
        heap[o:o + b.size] = b
    rows = [(where[t.untyped_storage().data_ptr()] + t.data_ptr() - t.untyped_storage().data_ptr(),
             t.stride(0) * t.element_size(), t[0].numel() * t.element_size()) for t in kv_buffers]
    return heap, where, rows


def emulate_commit(req_to_token, req_pool_indices, seq_lens, num_draft, accept_index, accept_len, free_pages,
                   num_free, page_state, page_size, max_draft, kv_buffers=(), threads=1024, kv_blocks_per_request=1,
                   seed=0, scratch=(0, 0, 0), tag=1 << 32):
    """launch_commit_draft_slots, its blocks interleaved as commit_kernel says (seed). scratch:
    the hand-off words before the launch (any contents), tag: the call's tag. Returns dict of the
    resulting req_to_token, free_pages, num_free, page_state, new_seq_lens (-9 = never written),
    status, kv_buffers (new tensors with the emulated contents), kv_storages ({storage address:
    bytes}), scratch (after the launch) and races."""
    tr = Tracker()
    a = _batch(tr, req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free, page_state, page_size,
               max_draft)
    kv_buffers = list(kv_buffers)
    table, nb, unit, rows = None, 0, 1, 0
    heap_bytes, where = np.zeros(16, np.uint8), {}
    if kv_buffers and page_size > 1:  # api.py passes a kv_table only then
        heap_bytes, where, trows = _kv_heap(kv_buffers)
        unit = 16  # api.kv_table: the largest unit dividing every address, stride and row size
        while unit > 1 and any(v % unit for row in trows for v in row):
            unit //= 2
        nb, rows = len(trows), kv_buffers[0].shape[0]
        table = Arr("kv_table", [r[0] for r in trows] + [r[1] for r in trows] + [r[2] for r in trows], tr, 64)
    new = Arr("new_seq_lens", [-9] * seq_lens.numel(), tr, 32 if seq_lens.dtype == torch.int32 else 64)
    c = Batch(accept_index=_arr("accept_index", accept_index, tr), accept_width=accept_index.shape[1],
              accept_len=_arr("accept_len", accept_len, tr), new_seq_lens=new, kv_table=table, num_kv_buffers=nb,
              num_kv_rows=rows, kv_unit_bytes=unit, kv_blocks_per_request=kv_blocks_per_request,
              move_sync=Scratch(scratch), move_tag=tag)
    sync = c.move_sync
    heap = Heap(heap_bytes.copy(), tr)
    commit_kernel(a, c, heap, threads, tr, seed)
    storages = {ptr: heap.b[off:off + kv_buffers[i].untyped_storage().nbytes()].copy()
                for i, (ptr, off) in enumerate((t.untyped_storage().data_ptr(), where.get(t.untyped_storage().data_ptr()))
                                               for t in kv_buffers) if off is not None}
    new_kv = []
    for t in kv_buffers:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in storages:
            new_kv.append(t.clone())
            continue
        b = storages[ptr]
        flat = torch.from_numpy(b[: b.size - b.size % t.element_size()].copy()).view(t.dtype)
        new_kv.append(flat.as_strided(t.shape, t.stride(), t.storage_offset()))
    return dict(req_to_token=_back(a.req_to_token, req_to_token), free_pages=_back(a.free_pages, free_pages),
                num_free=_back(a.num_free, num_free), page_state=_back(a.page_state, page_state),
                new_seq_lens=_back(new, seq_lens),
                status=torch.tensor(a.status.d, dtype=torch.int64), kv_buffers=new_kv, kv_storages=storages,
                scratch=list(sync.w), races=tr.races)


# ================================================================================ checks
class Stats:
    """Counters of one check case, and the first few problems found."""

    def __init__(self):
        self.n = dict(alloc=0, alloc_refused=0, commit=0, commit_refused=0, commit_moves=0, page_conflicts=0,
                      mismatch=0, races=0)
        self.notes = []

    def problem(self, msg):
        if len(self.notes) < 5:
            self.notes.append(msg)


def _compare(stats, op, ctx, names, want, got, races):
    ok = True
    for n, w, g in zip(names, want, got):
        if not torch.equal(w, g):
            ok = False
            stats.n["mismatch"] += 1
            at = (w != g).nonzero()[:5].tolist()
            stats.problem(f"MISMATCH {op} {n} {ctx} at {at}: "
                          f"want {w.reshape(-1)[:16].tolist()} got {g.reshape(-1)[:16].tolist()}")
    if races:
        ok = False
        stats.n["races"] += 1
        stats.problem(f"RACE {op} {ctx}: {races[:2]}")
    return ok


def check_alloc(stats, ctx, rtt, rpi, seq, nd, free, num_free, state, page_size, max_draft, out_cap, threads):
    """Reference and emulation on the same inputs; every output compared bit for bit."""
    from spec_kernels.kv_slots import reference as R
    r_rtt, r_free, r_nf, r_state = rtt.clone(), free.clone(), num_free.clone(), state.clone()
    r_out = torch.full((out_cap,), -9, dtype=torch.int64)
    r_st = torch.full((R.STATUS_LEN,), -9, dtype=torch.int64)
    R.alloc_draft_slots(r_rtt, rpi, seq, nd, r_free, r_nf, r_state, page_size, max_draft, r_out, r_st)
    e = emulate_alloc(rtt, rpi, seq, nd, free, num_free, state, page_size, max_draft, out_cap, threads)
    names = ["req_to_token", "free_pages", "num_free", "page_state", "out_cache_loc", "status"]
    ok = _compare(stats, "alloc", ctx, names, [r_rtt, r_free, r_nf, r_state, r_out, r_st], [e[n] for n in names],
                  e["races"])
    stats.n["alloc"] += 1
    stats.n["alloc_refused"] += int(r_st[0].item() != OK)
    stats.n["page_conflicts"] += int(r_st[0].item() == PAGE_CONFLICT)
    return ok, dict(status=r_st, req_to_token=r_rtt, free_pages=r_free, num_free=r_nf, page_state=r_state,
                    out_cache_loc=r_out)


def check_commit(stats, ctx, rtt, rpi, seq, nd, acc, acc_len, free, num_free, state, page_size, max_draft, kv,
                 threads, kv_blocks_per_request=1, seed=0, scratch=(0, 0, 0)):
    """Reference and emulation on the same inputs, compared bit for bit, KV contents included
    (a refused call moves no row), and the hand-off's scratch zeroed afterwards."""
    from spec_kernels.kv_slots import reference as R
    e = emulate_commit(rtt, rpi, seq, nd, acc, acc_len, free, num_free, state, page_size, max_draft, kv, threads,
                       kv_blocks_per_request, seed, scratch)
    r_rtt, r_free, r_nf, r_state = rtt.clone(), free.clone(), num_free.clone(), state.clone()
    r_new = torch.full_like(seq, -9)
    r_st = torch.full((R.STATUS_LEN,), -9, dtype=torch.int64)
    R.commit_draft_slots(r_rtt, rpi, seq, nd, acc, acc_len, r_free, r_nf, r_state, page_size, max_draft, kv, r_new,
                         r_st)
    refused = r_st[0].item() != OK
    names = ["req_to_token", "free_pages", "num_free", "page_state", "new_seq_lens", "status"]
    want = [r_rtt, r_free, r_nf, r_state, r_new, r_st]
    got = [e[n] for n in names]
    for ptr, b in e["kv_storages"].items():  # the reference ran on kv itself: whole storages, byte for byte
        st = next(t.untyped_storage() for t in kv if t.untyped_storage().data_ptr() == ptr)
        names.append(f"kv storage @{ptr:#x}")
        want.append(torch.empty(0, dtype=torch.uint8).set_(st).clone())
        got.append(torch.from_numpy(b))
    moves = bool(kv) and page_size > 1 and rpi.numel() > 0
    if moves:  # the last block zeroes the scratch; without moves the kernel never touches it
        names.append("scratch")
        want.append(torch.zeros(3, dtype=torch.int64))
        got.append(torch.tensor([v - (1 << 64) if v >> 63 else v for v in e["scratch"]], dtype=torch.int64))
    ok = _compare(stats, "commit", ctx, names, want, got, e["races"])
    stats.n["commit"] += 1
    stats.n["commit_refused"] += int(refused)
    stats.n["commit_moves"] += int(moves and not refused)
    stats.n["page_conflicts"] += int(r_st[0].item() == PAGE_CONFLICT)
    return ok, dict(status=r_st, req_to_token=r_rtt, free_pages=r_free, num_free=r_nf, page_state=r_state,
                    new_seq_lens=r_new)


class World:
    """A random pool (page size, max_draft, rows, context, pages, index dtypes) with requests
    that come and go, and KV buffers of mixed layouts (copy unit 16, 8 or 1; strided K/V views;
    an odd-address uint8 buffer) as views of one byte heap, so that moved rows can be compared."""

    def __init__(self, rng: random.Random, threads: int):
        self.rng, self.threads = rng, threads
        self.P = rng.choice([1, 1, 2, 4, 16, 16, 64])
        self.max_draft = rng.choice([1, 3, 4, 8, 16, 31, 33, 64])
        self.rows = rng.choice([4, 8, 40, 100, 150])
        self.max_context = rng.choice([70, 128, 320])
        need = self.rows * -(-self.max_context // self.P)
        self.num_pages = max(2, int(need * rng.choice([0.3, 0.6, 1.0, 1.2])))
        self.rtt_dtype = rng.choice([torch.int32, torch.int64])
        self.idx_dtype = rng.choice([torch.int32, torch.int64])
        self.reset_pool()
        kind = rng.choice(["mixed", "aligned16", "aligned8"])
        S = self.S
        sizes = {"mixed": [("kv", S * 32), ("u8", S * 5 + 16), ("f64", S * 8)],
                 "aligned16": [("kv", S * 32), ("kv2", S * 32)], "aligned8": [("f64", S * 8), ("kv", S * 32)]}[kind]
        self.make_kv(sizes)
        if rng.random() < 0.3:
            rng.shuffle(self.kv)

    def reset_pool(self):
        order = list(range(self.num_pages))
        self.rng.shuffle(order)
        self.rtt = torch.full((self.rows, self.max_context), -1, dtype=self.rtt_dtype)
        self.free = torch.tensor(order, dtype=torch.int64)
        self.num_free = torch.tensor([self.num_pages], dtype=torch.int64)
        self.state = torch.zeros(self.num_pages, dtype=torch.int32)  # every page free
        self.lens = {}
        self.S = self.num_pages * self.P

    def make_kv(self, sizes):
        total = sum(-(-n // 16) * 16 for _, n in sizes) + 64
        self.heap = np.zeros(total, dtype=np.uint8)
        base = torch.from_numpy(self.heap)
        S, self.kv, off = self.S, [], 16
        for name, n in sizes:
            flat = base[off:off + n]
            if name.startswith("kv"):  # K and V interleaved per slot: two strided views
                comb = flat.view(torch.float16).view(S, 2, 2, 4)
                self.kv += [comb[:, 0], comb[:, 1]]
            elif name == "u8":
                self.kv.append(flat[1:1 + S * 5].view(S, 5))  # odd address: copy unit 1
            else:
                self.kv.append(flat.view(torch.float64))
            off += -(-n // 16) * 16

    def idx(self, v):
        return torch.tensor(v, dtype=self.idx_dtype)

    def admit(self, row, n):
        """A new request of n tokens (through the reference; not a checked step)."""
        from spec_kernels.kv_slots import reference as R
        out = torch.empty(n, dtype=torch.int64)
        st = torch.empty(R.STATUS_LEN, dtype=torch.int64)
        R.alloc_draft_slots(self.rtt, torch.tensor([row]), torch.tensor([0]), torch.tensor([n]), self.free,
                            self.num_free, self.state, self.P, self.max_context, out, st)
        if st[0].item() != OK:
            return False
        self.lens[row] = n
        self.write_kv(out)
        return True

    def finish(self, row):
        n = self.lens.pop(row)
        pages = (self.rtt[row, :n:self.P].long() // self.P).tolist()
        top = int(self.num_free.item())
        self.free[top:top + len(pages)] = torch.tensor(pages, dtype=torch.int64)
        self.num_free += len(pages)
        self.state[torch.tensor(pages, dtype=torch.int64)] = PAGE_FREE

    def take(self, ref):
        """The state after an accepted call (the reference's outputs)."""
        self.rtt, self.free, self.num_free, self.state = (ref[k] for k in ("req_to_token", "free_pages", "num_free",
                                                                           "page_state"))

    def write_kv(self, slots):
        """Random contents for these slots' rows, so that a wrong move shows."""
        slots = slots[slots >= 0].long()
        for buf in self.kv:
            shape = (len(slots),) + tuple(buf.shape[1:])
            if buf.dtype == torch.uint8:
                buf[slots] = torch.randint(0, 256, shape, dtype=torch.uint8)
            else:
                buf[slots] = torch.randint(-1000, 1000, shape).to(buf.dtype)

    def alloc(self, stats, ctx, rpi, seq, nd, out_cap, rtt=None, num_free=None, free=None, state=None):
        return check_alloc(stats, ctx, self.rtt if rtt is None else rtt, rpi, seq, nd,
                           self.free if free is None else free, self.num_free if num_free is None else num_free,
                           self.state if state is None else state, self.P, self.max_draft, out_cap, self.threads)

    def commit(self, stats, ctx, rpi, seq, nd, acc, acc_len, use_kv, kv_rows=None, num_free=None, rtt=None,
               state=None):
        kv = self.kv if use_kv else []
        if kv_rows is not None:
            kv = [t[:kv_rows] for t in kv]
        # stale scratch: zeros, an older call's words, or garbage (never this call's tag)
        old = (1 << 33) + self.rng.randrange(1 << 20)  # never the tag of the call: 1 << 32
        scratch = self.rng.choice([(0, 0, 0), (old << TAG_SHIFT | 7, old << TAG_SHIFT | 2, old << TAG_SHIFT | 9),
                                   (M64, 12345, 1 << 62)])
        return check_commit(stats, ctx, self.rtt if rtt is None else rtt, rpi, seq, nd, acc, acc_len, self.free,
                            self.num_free if num_free is None else num_free, self.state if state is None else state,
                            self.P, self.max_draft, kv,
                            self.threads, self.rng.choice([1, 2, 3]), self.rng.randrange(1 << 30), scratch)


def random_path(rng, n):
    """An accepted path of a random tree (or chain) of n drafts: root .. a random node; sometimes empty."""
    if n == 0 or rng.random() < 0.1:
        return []
    chain = rng.random() < 0.3
    parents = [-1] + [i - 1 if chain else rng.randint(0, i - 1) for i in range(1, n)]
    node, path = rng.randint(0, n - 1), []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def run_world(seed, threads, steps):
    """Random steps: requests finish and arrive; a random subset allocates drafts (sometimes an
    invalid variant first: every kind of bad value, out of pages, undersized output); then it
    commits random tree paths (sometimes an invalid variant first). Each launch is checked."""
    rng = random.Random(seed)
    w = World(rng, threads)
    stats = Stats()
    for step in range(steps):
        ctx = dict(seed=seed, threads=threads, P=w.P, max_draft=w.max_draft, step=step)
        for row in sorted(w.lens):
            if rng.random() < 0.1 or w.lens[row] > w.max_context - w.max_draft:
                w.finish(row)
        free_rows = [r for r in range(w.rows) if r not in w.lens]
        rng.shuffle(free_rows)
        for row in free_rows[:rng.randint(0, max(1, w.rows // 3))]:
            w.admit(row, rng.randint(0, w.max_context // 3))
        live = sorted(w.lens)
        rng.shuffle(live)
        rows = live[:rng.randint(0, len(live))]
        counts = [0 if rng.random() < 0.15 else rng.randint(0, min(w.max_draft, w.max_context - w.lens[r])) for r in rows]
        lens = [w.lens[r] for r in rows]
        rpi, seq, nd = w.idx(rows), w.idx(lens), w.idx(counts)
        tokens = sum(counts)

        if rows and rng.random() < 0.3:  # an invalid alloc: must be refused, changing nothing
            b = rng.randrange(len(rows))
            what = rng.choice(["nd", "seq", "rpi", "nf", "last", "out", "nf_neg", "last_free", "pop_held", "pop_twice",
                               "pop_outside", "share_last"])
            bad = dict(rpi=rpi.clone(), seq=seq.clone(), nd=nd.clone())
            rtt, nf, cap, free, state = None, None, tokens, None, None
            top = int(w.num_free.item())
            need = sum(pages_spanned(L, L + n, w.P.bit_length() - 1) for L, n in zip(lens, counts))
            if what == "nd":
                bad["nd"][b] = rng.choice([-1, w.max_draft + 1])
            elif what == "seq":
                bad["seq"][b] = rng.choice([-2, w.max_context])
            elif what == "rpi":
                bad["rpi"][b] = rng.choice([-1, w.rows])
            elif what == "nf":
                nf = torch.tensor([w.num_pages + 1])
            elif what == "nf_neg":
                nf = torch.tensor([-1])
            elif what == "last":  # the partial last page's slot is out of range
                rtt = w.rtt.clone()
                rtt[rows[b], max(lens[b] - 1, 0)] = rng.choice([-5, w.S + w.P * 3])
            elif what == "out":
                cap = max(0, tokens - 1)
            elif what == "last_free" and counts[b] and lens[b] % w.P:  # the continued page is not held
                state = w.state.clone()
                state[int(w.rtt[rows[b], lens[b] - 1]) // w.P] = PAGE_FREE
            elif what == "pop_held" and 1 <= need <= top:  # a held page on top of the stack
                held = (w.state == PAGE_HELD).nonzero().flatten().tolist()
                if held:
                    free = w.free.clone()
                    free[top - 1] = rng.choice(held)
            elif what == "pop_twice" and 2 <= need <= top:  # the stack's top page again below it
                free = w.free.clone()
                free[top - 1 - rng.randrange(1, need)] = free[top - 1]
            elif what == "pop_outside" and 1 <= need <= top:
                free = w.free.clone()
                free[top - rng.randint(1, need)] = rng.choice([-1, w.num_pages])
            elif what == "share_last":  # two requests continue one page
                partial = [i for i in range(len(rows)) if lens[i] % w.P and lens[i] > 0]
                if len(partial) >= 2:
                    i, j = rng.sample(partial, 2)
                    rtt = w.rtt.clone()
                    rtt[rows[j], lens[j] - 1] = (int(w.rtt[rows[i], lens[i] - 1]) // w.P) * w.P + (lens[j] - 1) % w.P
                    bad["nd"][i], bad["nd"][j] = max(1, counts[i]), max(1, counts[j])
                    cap = tokens + 2
            w.alloc(stats, dict(ctx, bad=what), bad["rpi"], bad["seq"], bad["nd"], cap, rtt=rtt, num_free=nf,
                    free=free, state=state)

        _, ref = w.alloc(stats, ctx, rpi, seq, nd, tokens + rng.choice([0, 0, 3]))
        if ref["status"][0].item() != OK:
            continue  # out of pages: nothing changed
        w.take(ref)
        w.write_kv(ref["out_cache_loc"][:tokens])

        paths = [random_path(rng, n) for n in counts]
        use_kv = rng.random() < 0.8
        if w.P > 1 and not use_kv:
            paths = [list(range(len(p))) for p in paths]  # without KV buffers only prefixes are valid
        width = max([len(p) for p in paths] + [rng.choice([1, 2])])
        acc = w.idx([p + [-1] * (width - len(p)) for p in paths]).reshape(len(rows), width)
        acc_len = w.idx([len(p) for p in paths])

        if rows and rng.random() < 0.3:  # an invalid commit
            b = rng.randrange(len(rows))
            what = rng.choice(["acc_len", "order", "pad", "slot", "nf", "kvrows", "noprefix", "nf_neg", "draft_free",
                               "share", "share_own"])
            a2, l2, rtt, nf, kv_rows, state = acc.clone(), acc_len.clone(), None, None, None, None
            if what == "acc_len":
                l2[b] = counts[b] + 1
            elif what == "order" and len(paths[b]) >= 2:
                a2[b, 1] = a2[b, 0]
            elif what == "pad" and len(paths[b]) < width:
                a2[b, width - 1] = 0
            elif what == "slot" and counts[b]:
                rtt = w.rtt.clone()
                rtt[rows[b], lens[b] + rng.randrange(counts[b])] = rng.choice([-1, w.S])
            elif what == "nf":
                nf = torch.tensor([w.num_pages])
            elif what == "nf_neg":
                nf = torch.tensor([-1])
            elif what == "kvrows" and w.P > 1:
                kv_rows = max(1, w.S // 2)
            elif what == "draft_free" and counts[b]:  # a draft on a page that is not held
                state = w.state.clone()
                state[int(w.rtt[rows[b], lens[b] + rng.randrange(counts[b])]) // w.P] = PAGE_FREE
            elif what in ("share", "share_own"):  # a draft position on a page of another draft block
                drafted = [i for i in range(len(rows)) if counts[i]]
                if drafted:
                    i = rng.choice(drafted)
                    j = i if what == "share_own" else rng.choice(drafted)
                    d = rng.randrange(counts[j])
                    pos = lens[i] + rng.randrange(counts[i])
                    if (i, pos // w.P) != (j, (lens[j] + d) // w.P):  # another block than its own
                        rtt = w.rtt.clone()
                        page = int(w.rtt[rows[j], lens[j] + d]) // w.P
                        first = max(lens[i], pos - pos % w.P)  # the block's first draft position
                        for q in range(first, min(first - first % w.P + w.P, lens[i] + counts[i])):
                            rtt[rows[i], q] = page * w.P + q % w.P
            w.commit(stats, dict(ctx, bad=what), rpi, seq, nd, a2, l2, use_kv, kv_rows=kv_rows, num_free=nf, rtt=rtt,
                     state=state)

        _, ref = w.commit(stats, ctx, rpi, seq, nd, acc, acc_len, use_kv)
        if ref["status"][0].item() != OK:
            stats.problem(f"valid commit refused by the reference {ctx}")
            stats.n["mismatch"] += 1
            break
        w.take(ref)
        if rng.random() < 0.3:  # the same commit again: refused whenever the first released something
            _, again = w.commit(stats, dict(ctx, bad="replay"), rpi, seq, nd, acc, acc_len, use_kv)
            released = sum(n - len(p) if w.P == 1 else pages_spanned(L + len(p), L + n, w.P.bit_length() - 1)
                           for L, n, p in zip(lens, counts, paths))
            if released and again["status"][0].item() == OK:
                stats.problem(f"a replayed commit that released {released} pages was accepted {ctx}")
                stats.n["mismatch"] += 1
                break
            if again["status"][0].item() == OK:
                w.take(again)  # nothing was released: an accepted no-op (KV rows may move again)
        for r, L, p in zip(rows, lens, paths):
            w.lens[r] = L + len(p)
    return stats


def _edge_world(seed, threads, P, rows, max_context, max_draft):
    rng = random.Random(seed)
    w = World(rng, threads)
    w.P, w.max_draft, w.rows, w.max_context = P, max_draft, rows, max_context
    w.num_pages = int(rows * -(-max_context // P) * 1.3) + 2
    w.reset_pool()
    w.make_kv([("kv", w.S * 32), ("f64", w.S * 8)])
    return w, rng


def full_paths(P):
    """64-draft requests (mask bit 63, k = 64) with full and near-full non-prefix paths."""
    w, rng = _edge_world(1, 64, P, 6, 200, 64)
    stats = Stats()
    for r in range(6):
        w.admit(r, rng.randint(0, 60))
    rows = list(range(6))
    lens, counts = [w.lens[r] for r in rows], [64, 64, 64, 63, 1, 0]
    ok, ref = w.alloc(stats, dict(case="full paths", P=P), w.idx(rows), w.idx(lens), w.idx(counts), sum(counts))
    assert ref["status"][0].item() == OK
    w.take(ref)
    w.write_kv(ref["out_cache_loc"])
    paths = [list(range(64)), list(range(1, 64)), [0] + list(range(2, 64)), [62], [0], []]
    acc = w.idx([p + [-1] * (64 - len(p)) for p in paths]).reshape(6, 64)
    w.commit(stats, dict(case="full paths", P=P), w.idx(rows), w.idx(lens), w.idx(counts), acc,
             w.idx([len(p) for p in paths]), True)
    return stats


def big_batch(P):
    """B = 2100 (P = 1) or 1100 (P = 16) requests at the real 1024-thread block: several tiles,
    pass 2 re-analysing them, the carry; then a refusal caused by a request in the second tile."""
    B = 1100 if P > 1 else 2100
    w, rng = _edge_world(2, 1024, P, B, 40, 8)
    stats = Stats()
    for r in range(B):
        w.admit(r, r % 23)
    rows = list(range(B))
    rng.shuffle(rows)
    lens, counts = [w.lens[r] for r in rows], [rng.randint(0, 8) for _ in rows]
    _, ref = w.alloc(stats, dict(case="big batch", P=P), w.idx(rows), w.idx(lens), w.idx(counts), sum(counts))
    assert ref["status"][0].item() == OK
    w.take(ref)
    w.write_kv(ref["out_cache_loc"])
    paths = [random_path(rng, n) for n in counts]
    width = max(len(p) for p in paths)
    acc = w.idx([p + [-1] * (width - len(p)) for p in paths]).reshape(B, width)
    _, ref = w.commit(stats, dict(case="big batch", P=P), w.idx(rows), w.idx(lens), w.idx(counts), acc,
                      w.idx([len(p) for p in paths]), True)
    w.take(ref)
    # the same commit again: refused by the page state (found by a request in the second tile too)
    w.commit(stats, dict(case="big batch replay", P=P), w.idx(rows), w.idx(lens), w.idx(counts), acc,
             w.idx([len(p) for p in paths]), True)
    nd = w.idx([0] * B)
    nd[1050] = 99  # invalid num_draft in the second tile of 1024
    w.alloc(stats, dict(case="big batch refusal", P=P), w.idx(rows), w.idx([w.lens[r] for r in rows]), nd, 8)
    return stats


def refusals():
    """tests/test_kv_slots.py's KERNEL_REFUSALS and PAGE_STATE_REFUSALS (every invalid-value kind
    the kernels must refuse) plus a successful alloc, through the emulation at 1024 threads: status
    equal to the reference, nothing changed (state, page_state, KV), outputs -1 / the old
    seq_lens, no races."""
    sys.path.insert(0, str(REPO / "tests"))
    import test_kv_slots as T  # the test suite's own cases (imports pytest)
    stats = Stats()
    cases = [(op, name, T._refusal_case(op, name, make_bad)) for op, name, make_bad in T.KERNEL_REFUSALS]
    cases += [(op, spoil.__name__, (T._page_state_case(op, P, spoil), 16))
              for op, P, spoil, *_ in T.PAGE_STATE_REFUSALS]
    for op, name, (args, total) in cases:
        P, ctx = args["page_size"], dict(refusal=f"{op}:{name}")
        common = [args[k] for k in ("req_to_token", "req_pool_indices", "seq_lens", "num_draft")]
        pool = [args["free_pages"], args["num_free"], args["page_state"]]
        if op == "alloc":
            e = emulate_alloc(*common, *pool, P, 8, total)
            check_alloc(stats, ctx, *common, *pool, P, 8, total, 1024)
            outputs_ok = e["out_cache_loc"].tolist() == [-1] * total
            kv_same = True
        else:
            kv = args["kv_buffers"]
            e = emulate_commit(*common, args["accept_index"], args["accept_len"], *pool, P, 8, kv)
            check_commit(stats, ctx, *common, args["accept_index"], args["accept_len"], *pool, P, 8,
                         [t.clone() for t in kv], 1024)
            outputs_ok = torch.equal(e["new_seq_lens"], args["seq_lens"])
            kv_same = all(torch.equal(a, b) for a, b in zip(kv, e["kv_buffers"]))
        unchanged = all(torch.equal(e[k], args[k]) for k in ("req_to_token", "free_pages", "num_free", "page_state"))
        if e["status"][0].item() == OK or not (unchanged and outputs_ok and kv_same):
            stats.n["mismatch"] += 1
            stats.problem(f"refusal {op}:{name}: status {e['status'].tolist()} unchanged={unchanged} "
                          f"outputs={outputs_ok} kv_unchanged={kv_same}")
    args = T.make_args(after_alloc=False)
    check_alloc(stats, dict(case="successful alloc"), *[args[k] for k in ("req_to_token", "req_pool_indices",
                "seq_lens", "num_draft", "free_pages", "num_free", "page_state")], args["page_size"], 8, 10, 1024)
    return stats


def _result(stats):
    n = stats.n
    ok = n["mismatch"] == 0 and n["races"] == 0
    launches = n["alloc"] + n["commit"]
    note = (f"{n['alloc']} allocs ({n['alloc_refused']} refused), {n['commit']} commits ({n['commit_refused']} refused, "
            f"{n['commit_moves']} moving KV; {n['page_conflicts']} page conflicts), {n['mismatch']} mismatches, "
            f"{n['races']} races")
    if stats.notes:
        note += "\n      " + "\n      ".join(stats.notes)
    return dict(ok=ok, launches=launches, note=note, counts=dict(n))


def cases(quick):
    """(name, thunk) pairs. Random worlds at 32, 64 and 1024 threads per block (page sizes
    1/2/4/16/64, max_draft 1..64, int32/int64 tensors, mixed KV buffers, invalid variants), the
    64-draft and big-batch edges, and the test suite's refusals."""
    out = []
    # (first seed, worlds) per block size; the full lists include the reviewers' runs (32: 150 worlds,
    # 1024: 60 worlds); the quick ones use disjoint seeds so that they see 24 different worlds
    worlds = {32: (0, 10), 64: (10, 10), 1024: (20, 4)} if quick else {32: (0, 150), 64: (0, 300), 1024: (0, 60)}
    steps = {32: 8, 64: 8, 1024: 6}
    for threads, (first, n) in worlds.items():
        chunk = 1 if quick else 10  # seeds per case
        for s0 in range(first, first + n, chunk):
            seeds = range(s0, min(s0 + chunk, first + n))
            name = f"random worlds, {threads} threads, seeds {seeds.start}-{seeds.stop - 1}, {steps[threads]} steps"
            out.append((name, lambda seeds=seeds, t=threads: _merge(run_world(s, t, steps[t]) for s in seeds)))
    for P in ((1, 16, 64) if quick else (1, 2, 16, 64)):
        out.append((f"64-draft full paths, P={P}", lambda P=P: _result(full_paths(P))))
    if not quick:
        for P in (1, 16):
            out.append((f"big batch at 1024 threads, P={P}", lambda P=P: _result(big_batch(P))))
    out.append(("tests/test_kv_slots.py KERNEL_REFUSALS + PAGE_STATE_REFUSALS + a successful alloc",
                lambda: _result(refusals())))
    return out


def _merge(stats_list):
    total = Stats()
    for s in stats_list:
        for k, v in s.n.items():
            total.n[k] += v
        for note in s.notes:
            total.problem(note)
    return _result(total)
