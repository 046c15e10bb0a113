// Draft-token KV slot allocation and commit: one launch each, no host synchronisation.
//
// The contract (model, validity rules, status codes and their precedence) is
// spec_kernels/kv_slots/reference.py; these kernels implement exactly that.
//
// The bookkeeping runs in ONE block: it validates the whole batch and totals what it needs before
// it changes anything (a refused call only writes the status), and every request's offset into the
// free-page stack and out_cache_loc is a block-wide prefix sum. Requests are taken in tiles of
// kThreads; inside a tile a group of G = min(32, next_pow2(max_draft)) lanes handles one request,
// each lane at most kItems draft tokens.
//
// Commit with page_size > 1 and KV buffers also moves the accepted KV rows, in the same launch
// of num_requests x kv_blocks_per_request blocks: block (b, s) moves request b's rows in buffers
// s, s + y, .... The first block to arrive is elected to keep the books first; it publishes its
// verdict once the whole batch is validated, and every block waits for it before moving anything
// (nothing moves if the call was refused). The blocks wait only for a block that was running when
// they arrived, so the wait ends. The move blocks never touch what the bookkeeping writes. See
// "launch-wide hand-off" below.
//
// Page state, an owner per page (kPageFree, row + 1, or kPageShared): once everything else is
// valid, the bookkeeping block claims the call's pages (alloc: the pages it pops and the last pages
// requests continue; commit: the draft pages) with atomic exchanges to kPageMark. Each was checked
// before to be in the state the call needs (popped: free; continued and draft pages: owned by the
// request, row + 1), so a kPageMark read back is a page claimed twice: the call is refused and
// every claimed page is set back to that state. Otherwise the writes give each its final state by
// atomic exchange (popped: the owner of the request it goes to; continued: its owner; commit:
// released free, kept their owner).
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <climits>

#include "spec_kernels/launchers.h"

namespace spec_kernels {
namespace {

constexpr int kThreads = kKvSlotsThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kItems = kMaxDraftTokens / 32;  // draft tokens per lane (G >= max_draft / 2)
constexpr int kCopyUnroll = 4;

__device__ __forceinline__ int64_t load_index(const IndexTensor& t, int64_t i) {
  return t.is_int64 ? static_cast<const int64_t*>(t.data)[i] : static_cast<const int32_t*>(t.data)[i];
}

__device__ __forceinline__ void store_index(const IndexTensor& t, int64_t i, int64_t v) {
  if (t.is_int64) {
    static_cast<int64_t*>(t.data)[i] = v;
  } else {
    static_cast<int32_t*>(t.data)[i] = static_cast<int32_t>(v);
  }
}

// The page_state of a page that request row `row` holds (reference.page_owner).
__device__ __forceinline__ int32_t page_owner(int64_t row) { return static_cast<int32_t>(row + 1); }

__device__ __forceinline__ int64_t roundup(int64_t x, int log2p) {
  return ((x + (int64_t{1} << log2p) - 1) >> log2p) << log2p;
}

__device__ __forceinline__ int64_t pages_spanned(int64_t begin, int64_t end, int log2p) {
  return (roundup(end, log2p) - roundup(begin, log2p)) >> log2p;
}

// Reductions over a group of G lanes (G a power of two <= 32, groups aligned in the warp).
// Every lane of the warp must call them.
__device__ __forceinline__ bool group_all(bool v, int G) {
  for (int o = G / 2; o > 0; o /= 2) v &= __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ uint64_t group_or(uint64_t v, int G) {
  for (int o = G / 2; o > 0; o /= 2) v |= __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The results for one tile of requests (index = request - tile start).
struct Tile {
  int32_t row[kThreads];
  int32_t len[kThreads];
  int32_t drafts[kThreads];
  int32_t count[kThreads];      // pages popped (alloc) / pushed (commit; slots if page_size 1),
                                // replaced by its prefix sum over the batch before apply_tile
  int32_t tokens[kThreads];     // drafts allocated (alloc) / accepted (commit)
  int32_t token_off[kThreads];  // alloc: prefix sum of tokens over the batch
  union {
    int32_t last_page[kThreads];  // alloc: the partially filled page it continues (if any)
    uint64_t mask[kThreads];      // commit: bit i set = draft i accepted
  };
  bool valid[kThreads];
};

struct Request {
  int64_t row, len, drafts;
  bool ok;  // the scalars are in range: reading row `row`, positions < len + drafts, is safe
};

__device__ Request load_request(const KvSlotBatch& a, int b) {
  Request q;
  q.row = load_index(a.req_pool_indices, b);
  q.len = load_index(a.seq_lens, b);
  q.drafts = load_index(a.num_draft, b);
  q.ok = q.row >= 0 && q.row < a.num_rows && q.len >= 0 && q.drafts >= 0 && q.drafts <= a.max_draft &&
         q.len <= a.max_context - q.drafts;
  return q;
}

__device__ void record(Tile& t, int i, const Request& q, bool ok, int64_t count, int64_t tokens) {
  t.row[i] = static_cast<int32_t>(q.row);
  t.len[i] = static_cast<int32_t>(q.len);
  t.drafts[i] = static_cast<int32_t>(q.drafts);
  t.valid[i] = ok;
  t.count[i] = ok ? static_cast<int32_t>(count) : 0;
  t.tokens[i] = ok ? static_cast<int32_t>(tokens) : 0;
}

// Group-of-G-lanes geometry of the calling thread.
struct Groups {
  int G, lane, id, count;
  __device__ explicit Groups(int group_size)
      : G(group_size), lane(threadIdx.x & (group_size - 1)), id(threadIdx.x / group_size),
        count(kThreads / group_size) {}
};

// ------------------------------------------------------------------------------------- alloc
struct AllocOp {
  KvSlotBatch a;
  int64_t* out;
  int64_t out_capacity;
  int group_size;

  // One thread per request: only scalars and one slot to read. check_state: the page continued
  // must be the request's own (pass 1 only: later passes run while pages are claimed).
  __device__ void analyze_tile(Tile& t, int t0, int len, bool check_state) const {
    const int i = threadIdx.x;
    if (i >= len) return;
    Request q = load_request(a, t0 + i);
    bool ok = q.ok;
    int64_t last_page = -1;
    if (ok && q.drafts > 0 && (q.len & ((1 << a.log2_page_size) - 1))) {
      last_page = load_index(a.req_to_token, q.row * a.max_context + q.len - 1) >> a.log2_page_size;
      ok = last_page >= 0 && last_page < a.num_pages &&
           (!check_state || a.page_state[last_page] == page_owner(q.row));
    }
    record(t, i, q, ok, pages_spanned(q.len, q.len + q.drafts, a.log2_page_size), q.drafts);
    t.last_page[i] = static_cast<int32_t>(last_page);
  }

  __device__ int totals_code(int64_t pages, int64_t tokens, int64_t top) const {
    if (tokens > out_capacity) return kKvSlotsOutTooSmall;
    return pages > top ? kKvSlotsOutOfPages : kKvSlotsOk;
  }

  // Request b's k-th new page is stack entry top - 1 - (pages taken by requests < b) - k.
  __device__ void apply_tile(const Tile& t, int t0, int len, int64_t top) const {
    const Groups g(group_size);
    const int log2p = a.log2_page_size;
    for (int i = g.id; i < len; i += g.count) {
      const int64_t L = t.len[i];
      const int64_t first_fresh = roundup(L, log2p);  // first position on a page from the stack
      const int64_t row_base = int64_t{t.row[i]} * a.max_context;
#pragma unroll
      for (int m = 0; m < kItems; ++m) {
        const int d = g.lane + m * g.G;
        if (d >= t.drafts[i]) break;
        const int64_t pos = L + d;
        const int64_t page = pos < first_fresh
                                 ? int64_t{t.last_page[i]}
                                 : a.free_pages[top - 1 - t.count[i] - ((pos - first_fresh) >> log2p)];
        const int64_t slot = (page << log2p) | (pos & ((int64_t{1} << log2p) - 1));
        store_index(a.req_to_token, row_base + pos, slot);
        out[t.token_off[i] + d] = slot;
        // A popped page (claimed) gets its owner at its first position, which starts the page.
        if (pos >= first_fresh && (pos & ((int64_t{1} << log2p) - 1)) == 0) {
          atomicExch(a.page_state + page, page_owner(t.row[i]));
        }
      }
    }
  }

  // f(page_state entry, its owner row + 1) for the last page of every request that continues one.
  template <class F>
  __device__ bool each_continued(Tile& t, F f) const {
    bool any = false;
    const int B = a.num_requests;
    for (int t0 = 0; t0 < B; t0 += kThreads) {
      const int len = min(kThreads, B - t0);
      if (B > kThreads) {  // else the tile of pass 1 is still here
        analyze_tile(t, t0, len, false);
        __syncthreads();
      }
      if (threadIdx.x < len && t.last_page[threadIdx.x] >= 0) {
        any |= f(a.page_state + t.last_page[threadIdx.x], page_owner(t.row[threadIdx.x]));
      }
      __syncthreads();
    }
    return any;
  }

  // Claims the pages popped (free_pages[top - pages, top)) and continued; true = a conflict (the
  // call is refused, page_state is as it was). Every thread calls it; block-uniform result.
  __device__ bool claim_pages(Tile& t, int64_t top, int64_t pages) const {
    bool bad = false;
    for (int64_t j = top - pages + threadIdx.x; j < top; j += kThreads) {
      const int64_t p = a.free_pages[j];
      bad |= p < 0 || p >= a.num_pages || a.page_state[p] != kPageFree;
    }
    if (__syncthreads_or(bad)) return true;  // nothing claimed yet
    for (int64_t j = top - pages + threadIdx.x; j < top; j += kThreads) {
      bad |= atomicExch(a.page_state + a.free_pages[j], kPageMark) == kPageMark;
    }
    bad |= each_continued(t, [](int32_t* s, int32_t) { return atomicExch(s, kPageMark) == kPageMark; });
    if (!__syncthreads_or(bad)) return false;
    for (int64_t j = top - pages + threadIdx.x; j < top; j += kThreads) {
      atomicExch(a.page_state + a.free_pages[j], kPageFree);
    }
    restore_continued(t);
    return true;
  }

  // The continued pages' final state, accepted or refused: their owner again.
  __device__ void restore_continued(Tile& t) const {
    each_continued(t, [](int32_t* s, int32_t owner) {
      atomicExch(s, owner);
      return false;
    });
  }

  __device__ void publish(int) const {}

  __device__ void refuse() const { fill_out(0); }

  // (The popped pages got their owners in apply_tile.)
  __device__ void finish(Tile& t, int64_t top, int64_t pages, int64_t tokens) const {
    fill_out(tokens);
    restore_continued(t);
    if (threadIdx.x == 0) *a.num_free = top - pages;
  }

  __device__ void fill_out(int64_t from) const {
    for (int64_t i = from + threadIdx.x; i < out_capacity; i += kThreads) out[i] = -1;
  }
};

// ------------------------------------------------------------------ launch-wide hand-off
// The scratch (api.move_sync: zero-initialised, owned by the library, never shared by two launches
// that may run at the same time) holds kKvMoveSyncWords words:
//   sync[kGeneration]  the generation g. Every block reads it at its start; only the last block to
//                      finish advances it, after every block has counted itself finished (so after
//                      every block has read it): g is the same for the whole launch.
//   sync[kElection]    the election and
//   sync[kVerdict]     the verdict, each (tag << kTagShift) | value with tag = g + 1: never 0, and
//                      different from the previous launch's tag (g advances mod kKvMoveGenerations).
//   sync[kFinished]    blocks finished, zeroed by the bookkeeper before it publishes the verdict;
//                      a block counts itself only after it has seen the verdict.
// The last block clears the election, verdict and count and advances g. So a launch finds those
// words zero, or (were they not cleared) words of the previous generation: never its own tag,
// which a stale word could fake only by being equal to it.
constexpr int kGeneration = 0, kElection = 1, kVerdict = 2, kFinished = 3;
constexpr int kTagShift = kKvMoveTagShift;
constexpr uint64_t kValueMask = (uint64_t{1} << kTagShift) - 1;
// Polls of the verdict before __trap() (a broken invariant, never a hang): with the back-off,
// minutes of polling. Counted in polls, not in wall time, so that a debugger pause or a
// preemption does not count.
constexpr uint32_t kMaxVerdictPolls = 1u << 27;

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t next_generation(uint64_t g) {
  return g + 1 < static_cast<uint64_t>(kKvMoveGenerations) ? g + 1 : 0;
}

// Whether the calling block keeps the books: exactly one block of the launch wins; at most one
// compare-and-swap per block, no retries (a block that sees this launch's tag has lost; a word
// of any other generation is taken over).
__device__ bool elect_bookkeeper(uint64_t* word, uint64_t tag) {
  const unsigned long long seen = load_acquire(word);
  if ((seen >> kTagShift) == tag) return false;
  return atomicCAS(reinterpret_cast<unsigned long long*>(word), seen, tag << kTagShift) == seen;
}

// The published verdict (a KvSlotStatus). Called by one thread per block.
__device__ int wait_for_verdict(const uint64_t* word, uint64_t tag) {
  unsigned sleep_ns = 32;
  for (uint32_t polls = 0;; ++polls) {
    const uint64_t v = load_acquire(word);
    if ((v >> kTagShift) == tag) return static_cast<int>(v & kValueMask);
    if (polls == kMaxVerdictPolls) __trap();  // cannot happen: the bookkeeper was running
    __nanosleep(sleep_ns);
    if (sleep_ns < 1024) sleep_ns *= 2;
  }
}

// ------------------------------------------------------------------------------------ commit
struct CommitOp {
  KvSlotBatch a;
  KvCommitArgs c;
  int group_size;
  int64_t slot_bound;  // every draft slot must be below: the pool, and the KV rows when they move
  bool prefix_only;    // page_size > 1 without KV buffers: accepted paths must be 0..k-1
  uint64_t tag;        // when rows move: this launch's hand-off tag (generation + 1)

  // One group of G lanes per request; every lane of the warp must call it (it shuffles).
  // check_state: every draft slot must be on a page the request owns (pass 1 only: later passes,
  // and the move blocks, run while the bookkeeping claims pages).
  __device__ void analyze_request(Tile& t, int i, int b, int lane, int G, bool active, bool check_state) const {
    Request q{0, 0, 0, false};
    int64_t k = 0;
    if (active) {
      q = load_request(a, b);
      k = load_index(c.accept_len, b);
    }
    bool ok = q.ok && k >= 0 && k <= q.drafts && k <= c.accept_width;
    // The path: drafts in range, strictly increasing, then -1 padding.
    uint64_t mask = 0;
    for (int64_t j = lane; active && j < c.accept_width; j += G) {
      const int64_t x = load_index(c.accept_index, b * c.accept_width + j);
      if (j < k) {
        const int64_t prev = j > 0 ? load_index(c.accept_index, b * c.accept_width + j - 1) : -1;
        ok = ok && x >= 0 && x < q.drafts && x > prev && (!prefix_only || x == j);
        if (x >= 0 && x < kMaxDraftTokens) mask |= uint64_t{1} << x;
      } else {
        ok = ok && x == -1;
      }
    }
    // Every draft slot is pushed back or kept (and indexes the KV buffers when rows move).
    if (q.ok) {
      const int64_t base = q.row * a.max_context + q.len;
#pragma unroll
      for (int m = 0; m < kItems; ++m) {
        const int d = lane + m * G;
        if (d < q.drafts) {
          const int64_t slot = load_index(a.req_to_token, base + d);
          ok = ok && slot >= 0 && slot < slot_bound &&
               (!check_state || a.page_state[slot >> a.log2_page_size] == page_owner(q.row));
        }
      }
    }
    ok = group_all(ok, G);
    mask = group_or(mask, G);
    if (active && lane == 0) {
      const int64_t released = a.log2_page_size == 0 ? q.drafts - k
                                                     : pages_spanned(q.len + k, q.len + q.drafts, a.log2_page_size);
      record(t, i, q, ok, released, k);
      t.mask[i] = mask;
    }
  }

  __device__ void analyze_tile(Tile& t, int t0, int len, bool check_state) const {
    const Groups g(group_size);
    for (int base = 0; base < len; base += g.count) {  // uniform trip count: the group reductions
      const int i = base + g.id;
      analyze_request(t, i, t0 + i, g.lane, g.G, i < len, check_state);
    }
  }

  // Draft page e of request i of the tile (reference.draft_pages): page_size 1 draft e's slot,
  // else the page of page-block e's first draft position; and whether the commit releases it.
  __device__ void draft_page(const Tile& t, int i, int e, int64_t& page, bool& released) const {
    const int log2p = a.log2_page_size;
    const int64_t L = t.len[i];
    const int64_t block = ((L >> log2p) + e) << log2p;
    page = load_index(a.req_to_token, int64_t{t.row[i]} * a.max_context + (block > L ? block : L)) >> log2p;
    released = log2p == 0 ? !((t.mask[i] >> e) & 1) : block >= roundup(L + t.tokens[i], log2p);
  }

  __device__ int draft_page_count(const Tile& t, int i) const {
    const int64_t L = t.len[i];
    const int n = t.drafts[i];
    return n == 0 ? 0 : static_cast<int>(((L + n - 1) >> a.log2_page_size) - (L >> a.log2_page_size)) + 1;
  }

  // f(page_state entry, its owner row + 1) for every draft page of the batch; returns whether any
  // f returned true.
  template <class F>
  __device__ bool each_draft_page(Tile& t, F f) const {
    const Groups g(group_size);
    const int B = a.num_requests;
    bool any = false;
    for (int t0 = 0; t0 < B; t0 += kThreads) {
      const int len = min(kThreads, B - t0);
      if (B > kThreads) {  // else the tile of pass 1 is still here
        analyze_tile(t, t0, len, false);
        __syncthreads();
      }
      for (int i = g.id; i < len; i += g.count) {
        const int count = draft_page_count(t, i);
#pragma unroll
        for (int m = 0; m < kItems; ++m) {
          const int e = g.lane + m * g.G;
          if (e >= count) break;
          int64_t page;
          bool released;
          draft_page(t, i, e, page, released);
          any |= f(a.page_state + page, page_owner(t.row[i]));
        }
      }
      __syncthreads();
    }
    return any;
  }

  // Claims every draft page (all checked owned in pass 1: kPageMark read back = claimed twice);
  // true = a conflict (the call is refused, page_state is as it was). Block-uniform result.
  __device__ bool claim_pages(Tile& t, int64_t, int64_t) const {
    const bool twice =
        each_draft_page(t, [](int32_t* s, int32_t) { return atomicExch(s, kPageMark) == kPageMark; });
    if (!__syncthreads_or(twice)) return false;
    each_draft_page(t, [](int32_t* s, int32_t owner) {
      atomicExch(s, owner);
      return false;
    });
    return true;
  }

  __device__ int totals_code(int64_t released, int64_t, int64_t top) const {
    return top + released > a.num_pages ? kKvSlotsBadStack : kKvSlotsOk;
  }

  // Request b pushes after the requests before it: stack entries top + count[b] (its offset) + ...
  __device__ void apply_tile(const Tile& t, int t0, int len, int64_t top) const {
    const Groups g(group_size);
    const int log2p = a.log2_page_size;
    for (int base = 0; base < len; base += g.count) {  // uniform trip count: __syncwarp below
      const int i = base + g.id;
      const bool active = i < len;
      const int64_t L = active ? t.len[i] : 0;
      const int64_t n = active ? t.drafts[i] : 0;
      const int64_t k = active ? t.tokens[i] : 0;
      const int64_t row_base = active ? int64_t{t.row[i]} * a.max_context : 0;
      const int64_t push_at = top + (active ? t.count[i] : 0);
      if (log2p == 0) {
        // Read every draft slot of the request before any is overwritten, then: accepted draft d
        // goes to position L + (accepted drafts before it), rejected ones are pushed in order.
        const uint64_t mask = active ? t.mask[i] : 0;
        int64_t slot[kItems];
#pragma unroll
        for (int m = 0; m < kItems; ++m) {
          const int d = g.lane + m * g.G;
          slot[m] = d < n ? load_index(a.req_to_token, row_base + L + d) : 0;
        }
        __syncwarp();
#pragma unroll
        for (int m = 0; m < kItems; ++m) {
          const int d = g.lane + m * g.G;
          if (d >= n) continue;
          const uint64_t below = mask & ((uint64_t{1} << d) - 1);  // d < 64
          if ((mask >> d) & 1) {
            store_index(a.req_to_token, row_base + L + __popcll(below), slot[m]);
            atomicExch(a.page_state + slot[m], page_owner(t.row[i]));
          } else {
            a.free_pages[push_at + d - __popcll(below)] = slot[m];
            atomicExch(a.page_state + slot[m], kPageFree);
          }
        }
      } else {
        // Push the pages lying wholly beyond the new length L + k, in position order.
        const int64_t first = roundup(L + k, log2p);
        for (int64_t p = g.lane; active && first + (p << log2p) < L + n; p += g.G) {
          a.free_pages[push_at + p] = load_index(a.req_to_token, row_base + first + (p << log2p)) >> log2p;
        }
        // Every draft page's final state: released free, kept its owner's.
        const int count = active ? draft_page_count(t, i) : 0;
        for (int e = g.lane; e < count; e += g.G) {
          int64_t page;
          bool released;
          draft_page(t, i, e, page, released);
          atomicExch(a.page_state + page, released ? kPageFree : page_owner(t.row[i]));
        }
      }
      if (active && g.lane == 0) store_index(c.new_seq_lens, t0 + i, L + k);
    }
  }

  // The verdict, for the blocks waiting on it (thread 0, after the status is written); the
  // release also publishes the zeroed count of finished blocks.
  __device__ void publish(int code) const {
    if (c.move_sync == nullptr) return;
    c.move_sync[kFinished] = 0;
    store_release(c.move_sync + kVerdict, (tag << kTagShift) | static_cast<uint64_t>(code));
  }

  __device__ void refuse() const {
    for (int b = threadIdx.x; b < a.num_requests; b += kThreads) {
      store_index(c.new_seq_lens, b, load_index(a.seq_lens, b));
    }
  }

  __device__ void finish(Tile&, int64_t top, int64_t released, int64_t) const {
    if (threadIdx.x == 0) *a.num_free = top + released;
  }
};

// ------------------------------------------------------------------------ the bookkeeping block
struct Totals {
  int64_t count, tokens;
  int bad;  // first invalid request, INT_MAX if none
};

struct CombineTotals {
  __device__ Totals operator()(const Totals& x, const Totals& y) const {
    return {x.count + y.count, x.tokens + y.tokens, min(x.bad, y.bad)};
  }
};

struct Offsets {
  int32_t count, tokens;
};

struct AddOffsets {
  __device__ Offsets operator()(const Offsets& x, const Offsets& y) const {
    return {x.count + y.count, x.tokens + y.tokens};
  }
};

template <class Op>
__device__ void keep_books(const Op& op, const KvSlotBatch& a, Tile& tile) {
  using Reduce = cub::BlockReduce<Totals, kThreads>;
  using Scan = cub::BlockScan<Offsets, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ Totals batch;
  __shared__ int code;
  const int B = a.num_requests;
  const int64_t top = *a.num_free;

  // Pass 1: validate every request and total what the batch needs, before changing anything.
  Totals mine{0, 0, INT_MAX};
  for (int t0 = 0; t0 < B; t0 += kThreads) {
    const int len = min(kThreads, B - t0);
    op.analyze_tile(tile, t0, len, true);
    __syncthreads();
    const int i = threadIdx.x;
    if (i < len) {
      mine.count += tile.count[i];
      mine.tokens += tile.tokens[i];
      if (!tile.valid[i]) mine.bad = min(mine.bad, t0 + i);
    }
    __syncthreads();
  }
  Totals total = Reduce(tmp.reduce).Reduce(mine, CombineTotals());
  if (threadIdx.x == 0) {
    const bool found = total.bad != INT_MAX;
    if (found) total.count = total.tokens = 0;
    int verdict = found ? kKvSlotsBadRequest : op.totals_code(total.count, total.tokens, top);
    if (top < 0 || top > a.num_pages) verdict = kKvSlotsBadStack;
    batch = total;
    code = verdict;
  }
  __syncthreads();
  // The page state last (claim_pages has barriers: every thread reads `code` before thread 0
  // may change it).
  const bool conflict = code == kKvSlotsOk && op.claim_pages(tile, top, batch.count);
  if (threadIdx.x == 0) {
    if (conflict) code = kKvSlotsPageConflict;
    a.status[0] = code;
    a.status[1] = batch.count;
    a.status[2] = top;
    a.status[3] = batch.bad != INT_MAX ? batch.bad : -1;
    a.status[4] = batch.tokens;
    op.publish(code);
  }
  __syncthreads();
  if (code != kKvSlotsOk) {
    op.refuse();
    return;
  }

  // Pass 2: offsets (running prefix sums over the batch), then the writes.
  Offsets carry{0, 0};
  for (int t0 = 0; t0 < B; t0 += kThreads) {
    const int len = min(kThreads, B - t0);
    if (B > kThreads) {  // else the tile of pass 1 is still here
      op.analyze_tile(tile, t0, len, false);
      __syncthreads();
    }
    const int i = threadIdx.x;
    const Offsets v = i < len ? Offsets{tile.count[i], tile.tokens[i]} : Offsets{0, 0};
    Offsets before, tile_total;
    Scan(tmp.scan).ExclusiveScan(v, before, Offsets{0, 0}, AddOffsets(), tile_total);
    if (i < len) {
      tile.count[i] = carry.count + before.count;
      tile.token_off[i] = carry.tokens + before.tokens;
    }
    __syncthreads();
    op.apply_tile(tile, t0, len, top);
    carry = AddOffsets()(carry, tile_total);
    __syncthreads();  // the tile and the scan storage are reused
  }
  op.finish(tile, top, batch.count, batch.tokens);
}

__global__ void __launch_bounds__(kThreads)
    alloc_draft_slots_kernel(KvSlotBatch a, int64_t* out, int64_t out_capacity, int group_size) {
  __shared__ Tile tile;
  keep_books(AllocOp{a, out, out_capacity, group_size}, a, tile);
}

// ------------------------------------------------------------------------------ KV row moves
// Accepted draft path[j] moves to position L + j, in path order: path[j] >= j, so row j is
// only overwritten after every step that reads it. A lane owns the same units of a buffer in
// every step, so program order alone keeps each element's read before its overwrite.
template <typename U>
__device__ void move_rows(const KvCommitArgs& c, int k, const int64_t* src, const int64_t* dst, int share,
                          int shares) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int nb = c.num_kv_buffers;
  for (int buf = share + shares * warp; buf < nb; buf += shares * kWarps) {
    U* rows = reinterpret_cast<U*>(c.kv_table[buf]);
    const int64_t stride = c.kv_table[nb + buf] / static_cast<int64_t>(sizeof(U));
    const int64_t units = c.kv_table[2 * nb + buf] / static_cast<int64_t>(sizeof(U));
    for (int j = 0; j < k; ++j) {
      if (src[j] == dst[j]) continue;
      const U* from = rows + src[j] * stride;
      U* to = rows + dst[j] * stride;
      for (int64_t c0 = lane; c0 < units; c0 += 32 * kCopyUnroll) {
        U v[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          if (c0 + 32 * u < units) v[u] = from[c0 + 32 * u];
        }
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          if (c0 + 32 * u < units) to[c0 + 32 * u] = v[u];
        }
      }
    }
  }
}

// Request b's rows in buffers share, share + shares, ...: its own request is analysed (and the
// rows' slots read) while the bookkeeping validates the batch; nothing moves unless the published
// verdict accepts the whole call. Every block waits for the verdict, also with nothing to move:
// the count of finished blocks is valid only after it.
__device__ void move_kv_rows(const CommitOp& op, Tile& tile, int b, int share, int shares) {
  __shared__ int64_t src[kMaxDraftTokens], dst[kMaxDraftTokens];
  __shared__ int verdict;
  if (threadIdx.x < 32) op.analyze_request(tile, 0, b, threadIdx.x, 32, true, false);
  __syncthreads();
  const int k = tile.valid[0] ? tile.tokens[0] : 0;
  const uint64_t prefix = k == kMaxDraftTokens ? ~uint64_t{0} : (uint64_t{1} << k) - 1;
  const bool moves = k > 0 && tile.mask[0] != prefix;  // else refused, or nothing moves
  const KvCommitArgs& c = op.c;
  if (moves && threadIdx.x < k) {
    const int64_t base = int64_t{tile.row[0]} * op.a.max_context + tile.len[0];
    const int64_t from = load_index(c.accept_index, b * c.accept_width + threadIdx.x);
    src[threadIdx.x] = load_index(op.a.req_to_token, base + from);
    dst[threadIdx.x] = load_index(op.a.req_to_token, base + threadIdx.x);
  }
  if (threadIdx.x == 0) verdict = wait_for_verdict(c.move_sync + kVerdict, op.tag);
  __syncthreads();
  if (!moves || verdict != kKvSlotsOk) return;
  switch (c.kv_unit_bytes) {
    case 16: move_rows<uint4>(c, k, src, dst, share, shares); break;
    case 8: move_rows<uint2>(c, k, src, dst, share, shares); break;
    case 4: move_rows<uint32_t>(c, k, src, dst, share, shares); break;
    case 2: move_rows<uint16_t>(c, k, src, dst, share, shares); break;
    default: move_rows<uint8_t>(c, k, src, dst, share, shares); break;
  }
}

__global__ void __launch_bounds__(kThreads)
    commit_draft_slots_kernel(KvSlotBatch a, KvCommitArgs c, int group_size, int64_t slot_bound, bool prefix_only) {
  __shared__ Tile tile;
  __shared__ bool bookkeeper;
  __shared__ uint64_t generation, tag;
  if (c.move_sync == nullptr) {  // no rows move: the bookkeeping block alone
    keep_books(CommitOp{a, c, group_size, slot_bound, prefix_only, 0}, a, tile);
    return;
  }
  if (threadIdx.x == 0) {  // the generation cannot change before this block counts itself finished
    generation = load_acquire(c.move_sync + kGeneration);
    tag = generation + 1;  // never 0 (a cleared word), and not the previous launch's
    bookkeeper = elect_bookkeeper(c.move_sync + kElection, tag);
  }
  __syncthreads();
  const CommitOp op{a, c, group_size, slot_bound, prefix_only, tag};
  if (bookkeeper) {
    keep_books(op, a, tile);
    __syncthreads();  // the tile is reused below
  }
  const int shares = c.kv_blocks_per_request;
  move_kv_rows(op, tile, static_cast<int>(blockIdx.x / shares), static_cast<int>(blockIdx.x % shares), shares);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this block's accesses to the scratch come before the last block clears it
    const unsigned long long before =
        atomicAdd(reinterpret_cast<unsigned long long*>(c.move_sync + kFinished), 1ull);
    if (before + 1 == gridDim.x) {  // every other block is done with the scratch
      __threadfence();
      c.move_sync[kElection] = c.move_sync[kVerdict] = c.move_sync[kFinished] = 0;
      c.move_sync[kGeneration] = next_generation(generation);
    }
  }
}

int group_size_for(int max_draft) {
  int g = 1;
  while (g < max_draft && g < 32) g *= 2;
  return g;
}

}  // namespace

cudaError_t launch_alloc_draft_slots(const KvSlotBatch& batch, int64_t* out_cache_loc, int64_t out_capacity,
                                     cudaStream_t stream) {
  alloc_draft_slots_kernel<<<1, kThreads, 0, stream>>>(batch, out_cache_loc, out_capacity,
                                                       group_size_for(batch.max_draft));
  return cudaGetLastError();
}

cudaError_t launch_commit_draft_slots(const KvSlotBatch& batch, const KvCommitArgs& args, cudaStream_t stream) {
  const bool moves = batch.log2_page_size > 0 && args.kv_table != nullptr && batch.num_requests > 0;
  if (moves && (args.move_sync == nullptr || args.kv_blocks_per_request < 1 ||
                int64_t{batch.num_requests} * args.kv_blocks_per_request > kKvMoveMaxBlocks)) {
    return cudaErrorInvalidValue;  // kv_slots_binding.cpp checks these with messages
  }
  const int64_t pool_slots = batch.num_pages << batch.log2_page_size;
  const int64_t slot_bound = moves && args.num_kv_rows < pool_slots ? args.num_kv_rows : pool_slots;
  const bool prefix_only = batch.log2_page_size > 0 && !moves;
  KvCommitArgs launch_args = args;
  if (!moves) launch_args.move_sync = nullptr;
  const unsigned blocks = moves ? static_cast<unsigned>(batch.num_requests) * args.kv_blocks_per_request : 1;
  commit_draft_slots_kernel<<<blocks, kThreads, 0, stream>>>(batch, launch_args, group_size_for(batch.max_draft),
                                                             slot_bound, prefix_only);
  return cudaGetLastError();
}

}  // namespace spec_kernels
