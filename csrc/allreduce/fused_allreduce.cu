// Allreduce across GPUs (or processes sharing one GPU) through CUDA IPC buffers, with the
// residual add + RMSNorm epilogue of csrc/norm/ fused. Three algorithms:
//
// * one-shot push: every rank writes its rows into a slot of every peer's buffer; the slots are
//   pre-filled with a sentinel (-0.0, which senders never send: they write +0.0 instead), so a
//   receiver polls its own memory until no element is the sentinel. One one-way trip, no fence,
//   no barrier. Three rotating slots: a slot is re-filled with the sentinel by its owner at the end
//   of the call that used it (then a system-scope fence: the peers' next writes into it, three
//   push calls later, come from other GPUs) and written again two calls later.
// * one-shot push in one block (kOneShotPush1Block): the same for small messages (a decode
//   token), one handshake per peer instead of one per block and peer.
// * one-shot pull: every rank copies its rows into its own staging buffer, raises a flag in every
//   peer's buffer, waits for the peers' flags, and reads every peer's rows.
// * two-shot: the same copy and flags, then rank r reduces only its share of the rows into its
//   gather buffer, a second flag round, then every rank reads every share (2 (W-1)/W of the bytes
//   of one-shot, one more round trip).
//
// Work split: block b of every rank handles the same rows, so the flags are per (block, rank)
// and no grid-wide barrier is needed. Sums are in fp32, in rank order 0..W-1, rounded to the
// element type once: every rank computes the same bits. Every flag word carries the call's
// device sequence number and a header (operation, algorithm, grid, rows: message_header): ranks
// that disagree on the message report kSizeMismatch instead of exchanging garbage, on the first
// call (a rank whose algorithm is of the other family is found in that family's words). The grid is fixed
// when the buffer is created (Signals::num_blocks): a launch with another grid is refused
// (kBlocksMismatch). Every wait gives up after timeout_ns (%globaltimer) and reports kTimeout;
// after a failure, the calls already queued on the rank do nothing but write NaN into their
// outputs (a CUDA graph replay that nobody checks must not compute on stale buffers). Counters
// live in the buffer (per block), so a CUDA graph replay advances them like an eager call. Flags
// are polled with relaxed loads; one acquire load follows once the expected word is seen.
#include <cuda_runtime.h>

#include <cstring>

#include "../norm/rmsnorm_row.cuh"
#include "spec_kernels/norm_allreduce.h"

namespace spec_kernels {
namespace allreduce {
namespace {

using norm::add_rmsnorm_row;
using norm::load_vec;
using norm::round_to;
using norm::store_vec;

constexpr size_t kAlign = 256;
constexpr uint32_t kSentinelPair = 0x80008000u;  // two 16-bit -0.0
constexpr int kPushSlots = 3;

struct BlockState {  // this rank's progress, per block; never read by peers
  uint32_t seq;        // calls through these buffers
  uint32_t push_slot;  // slot of the last push call (0 before the first)
};

// The head of every rank's buffer. Peers write the flag words; the rest is local.
struct Signals {
  uint64_t flags[2][2][kMaxBlocks][kMaxRanks];           // [seq parity][round][block][from rank]
  uint64_t push_headers[kPushSlots][kMaxBlocks][kMaxRanks];  // [slot][block][from rank]
  BlockState state[kMaxBlocks];
  ErrorWord first_error;  // claimed by atomicCAS; the winner copies it to host memory
  uint32_t num_blocks;    // the grid of every call (init_buffer); never changes
};

struct Layout {
  size_t staging[2], gather[2], push[kPushSlots], total;
};

size_t align_up(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

Layout make_layout(int world, int64_t max_bytes, int64_t push_bytes) {
  Layout l{};
  size_t off = align_up(sizeof(Signals));
  const size_t msg = align_up(static_cast<size_t>(max_bytes));
  for (auto& s : l.staging) s = off, off += msg;
  for (auto& g : l.gather) g = off, off += msg;
  const size_t push_slot = align_up(static_cast<size_t>(push_bytes)) * world;
  for (auto& p : l.push) p = off, off += push_slot;
  l.total = off;
  return l;
}

// What the kernels get by value (a CUDA graph keeps it).
struct Params {
  char* bases[kMaxRanks];
  Layout layout;
  size_t push_stride;  // bytes per sender in a push slot
  const void* x;
  const void* residual;
  const void* weight;
  void* out;
  void* residual_out;
  ErrorWord* host_error;
  int rows, hidden, world, rank, algorithm;
  uint32_t header;  // message_header(op, algorithm, gridDim.x, rows)
  bool fused;
  float eps, inv_scale;
  uint64_t timeout_ns;
};

__device__ __forceinline__ Signals* signals_of(const Params& p, int rank) {
  return reinterpret_cast<Signals*>(p.bases[rank]);
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void store_relaxed_sys(uint64_t* ptr, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* ptr) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t load_relaxed_sys(const uint64_t* ptr) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
  return v;
}

// The push data: written by one rank while another polls it, so both sides are volatile
// (relaxed, system scope, in the PTX memory model) rather than plain accesses, which would be a
// data race there.
__device__ __forceinline__ void store_volatile_16(void* ptr, const uint4& v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

__device__ __forceinline__ uint4 load_volatile_16(const void* ptr) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr)
               : "memory");
  return v;
}

// Record the first failure of this rank (device memory), then publish it to the host.
__device__ void report(const Params& p, int code, uint32_t seq, int peer, uint32_t theirs) {
  Signals* sig = signals_of(p, p.rank);
  if (atomicCAS(&sig->first_error.code, 0, code) != 0) return;
  volatile ErrorWord* e = p.host_error;
  e->seq = seq;
  e->rank = p.rank;
  e->peer = peer;
  e->block = blockIdx.x;
  e->algorithm = p.algorithm;
  e->mine = p.header;
  e->theirs = theirs;
  __threadfence_system();
  e->code = code;
  __threadfence_system();
}

// Spin-wait bookkeeping: true once the wait must stop (timeout, or another block of this rank
// already failed). Reads the clock only every 256 polls.
struct Deadline {
  uint64_t start = 0;
  uint32_t polls = 0;

  __device__ __forceinline__ bool expired(const Params& p, uint32_t seq, int peer) {
    if ((++polls & 255u) != 0) return false;
    const uint64_t now = global_timer_ns();
    if (start == 0) start = now;
    if (*reinterpret_cast<volatile int32_t*>(&signals_of(p, p.rank)->first_error.code) != 0)
      return true;
    if (now - start > p.timeout_ns) {
      report(p, kTimeout, seq, peer, 0);
      return true;
    }
    return false;
  }
};

// Where a peer would have announced call `seq` had it picked an algorithm of the other family
// (the push protocol writes push headers, pull and two-shot write flags): the words its call
// writes into this rank's buffer. Two ranks whose algorithms differ in family never meet in one
// word, so each wait also looks here (push: the peer's round-0 flag; pull and two-shot: its
// header in any push slot) and reports the mismatch at once instead of timing out.
struct OtherFamily {
  const uint64_t* first;
  int count, stride;
};

__device__ __forceinline__ OtherFamily other_family(const Params& p, bool push, int peer, uint32_t seq) {
  Signals* s = signals_of(p, p.rank);
  if (push) return {&s->flags[seq & 1][0][blockIdx.x][peer], 1, 0};
  return {&s->push_headers[0][blockIdx.x][peer], kPushSlots, kMaxBlocks * kMaxRanks};
}

// True (and reported) if the peer announced call `seq` in the other family's words.
__device__ bool peer_in_other_family(const Params& p, const OtherFamily& other, uint32_t seq, int peer) {
  for (int i = 0; i < other.count; ++i) {
    const uint64_t w = load_relaxed_sys(other.first + i * other.stride);
    if (static_cast<uint32_t>(w >> 32) == seq) {
      report(p, kSizeMismatch, seq, peer, static_cast<uint32_t>(w));
      return true;
    }
  }
  return false;
}

// Wait until `slot` holds call `seq`'s word; false on timeout or a header that is not ours. The
// polls are relaxed; once the word is there, one acquire load of it orders this thread's later
// reads after the peer's release (the word cannot change meanwhile: the peer writes this slot
// again only two calls later, which needs our flag of the next call first). Every 256 polls it
// also looks for the peer in the other family's words.
__device__ bool wait_word(const Params& p, const uint64_t* slot, uint32_t seq, int peer, const OtherFamily& other) {
  Deadline deadline;
  for (uint32_t polls = 1;; ++polls) {
    if (static_cast<uint32_t>(load_relaxed_sys(slot) >> 32) == seq) {
      const uint64_t w = load_acquire_sys(slot);
      if (static_cast<uint32_t>(w >> 32) == seq) {
        if (static_cast<uint32_t>(w) == p.header) return true;
        report(p, kSizeMismatch, seq, peer, static_cast<uint32_t>(w));
        return false;
      }
    }
    if ((polls & 255u) == 0 && peer_in_other_family(p, other, seq, peer)) return false;
    if (deadline.expired(p, seq, peer)) return false;
  }
}

// Block b of every rank meets block b of every other rank. Everything this block wrote before
// is visible to the peers' block b afterwards. One thread raises every flag: after
// __syncthreads its fence is cumulative over the whole block's earlier stores, and fence plus
// relaxed store is a release pattern, so one system-scope fence per block orders them all (a
// fence per flag, or st.release per flag, would order the same stores again).
__device__ bool block_barrier(const Params& p, uint32_t seq, int round) {
  const int b = blockIdx.x;
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint64_t word = (static_cast<uint64_t>(seq) << 32) | p.header;
    __threadfence_system();
    for (int peer = 0; peer < p.world; ++peer)
      store_relaxed_sys(&signals_of(p, peer)->flags[seq & 1][round][b][p.rank], word);
  }
  bool ok = true;
  if (threadIdx.x < p.world) {
    const int peer = threadIdx.x;
    ok = wait_word(p, &signals_of(p, p.rank)->flags[seq & 1][round][b][peer], seq, peer,
                   other_family(p, false, peer, seq));
  }
  return __syncthreads_and(ok);
}

__device__ __forceinline__ size_t row_bytes(const Params& p, int elem_size) {
  return static_cast<size_t>(p.hidden) * elem_size;
}

// Rows of a share: owner o of W has rows [start(o), start(o + 1)).
__device__ __forceinline__ int share_start(const Params& p, int owner) {
  return static_cast<int>(static_cast<int64_t>(p.rows) * owner / p.world);
}

__device__ __forceinline__ void copy_row(char* dst, const char* src, int nvec) {
  for (int v = threadIdx.x; v < nvec; v += blockDim.x)
    reinterpret_cast<uint4*>(dst)[v] = reinterpret_cast<const uint4*>(src)[v];
}

// acc = sum over ranks 0..W-1 (in order) of the row at `offset` in each rank's buffer, rounded
// to T once.
template <typename T, int VEC, int ITEMS>
__device__ __forceinline__ void sum_ranks(const Params& p, size_t offset, int nvec,
                                          float (&acc)[ITEMS][VEC]) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v >= nvec) continue;
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[i][k] = 0.f;
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) {
      if (q >= p.world) break;
      float part[VEC];
      load_vec<T, VEC>(reinterpret_cast<const T*>(p.bases[q] + offset) + v * VEC, part);
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[i][k] += part[k];
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[i][k] = round_to<T>(acc[i][k]);
  }
}

// The end of every algorithm for one row: the plain sum, or residual add + RMSNorm.
template <typename T, typename OutT, int VEC, int ITEMS>
__device__ __forceinline__ void finish_row(const Params& p, int row, float (&acc)[ITEMS][VEC],
                                           int nvec) {
  const int64_t start = static_cast<int64_t>(row) * p.hidden;
  if (p.fused) {
    add_rmsnorm_row<T, OutT, VEC, ITEMS>(
        acc, static_cast<const T*>(p.residual) + start, static_cast<const T*>(p.weight),
        static_cast<OutT*>(p.out) + start, static_cast<T*>(p.residual_out) + start, nvec, p.hidden,
        p.eps, p.inv_scale);
    return;
  }
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v < nvec) store_vec<T, VEC>(static_cast<T*>(p.out) + start + v * VEC, acc[i]);
  }
}

// The call number after `seq`. It skips 0 and 1 at the wrap (days of decoding): flag words
// never written since init_buffer read as call 0, and skipping two keeps the parity (staging and
// flags alternate on seq & 1).
__device__ __forceinline__ uint32_t next_seq(uint32_t seq) { return seq == 0xffffffffu ? 2u : seq + 1; }

// NaN in the element type of a refused call's outputs.
template <typename T> __device__ __forceinline__ T nan_of();
template <> __device__ __forceinline__ __half nan_of<__half>() { return __ushort_as_half(0x7e00); }
template <> __device__ __forceinline__ __nv_bfloat16 nan_of<__nv_bfloat16>() { return __ushort_as_bfloat16(0x7fc0); }
template <> __device__ __forceinline__ __nv_fp8_e4m3 nan_of<__nv_fp8_e4m3>() {
  __nv_fp8_e4m3 v;
  v.__x = 0x7f;
  return v;
}

template <typename T>
__device__ __forceinline__ void fill_row_nan(T* row, int hidden) {
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) row[i] = nan_of<T>();
}

// A failed or refused call: NaN into every row of out (and residual_out) this block owns - the
// rows finish_row would have written - so nothing downstream computes on stale data unnoticed.
template <typename T, typename OutT>
__device__ void poison_outputs(const Params& p) {
  const auto poison = [&](int row) {
    const int64_t start = static_cast<int64_t>(row) * p.hidden;
    fill_row_nan(static_cast<OutT*>(p.out) + start, p.hidden);
    if (p.fused) fill_row_nan(static_cast<T*>(p.residual_out) + start, p.hidden);
  };
  if (p.algorithm == kTwoShot) {
    for (int o = 0; o < p.world; ++o)
      for (int row = share_start(p, o) + blockIdx.x; row < share_start(p, o + 1); row += gridDim.x) poison(row);
  } else {
    for (int row = blockIdx.x; row < p.rows; row += gridDim.x) poison(row);
  }
}

// The grid every call of these buffers must have; a launch with another one is refused (per-block
// counters and slots would pair with other blocks' state on the peers).
__device__ __forceinline__ bool grid_ok(const Params& p) {
  const uint32_t want = p.algorithm == kOneShotPush1Block ? 1u : signals_of(p, p.rank)->num_blocks;
  if (gridDim.x == want) return true;
  if (threadIdx.x == 0) report(p, kBlocksMismatch, 0, -1, gridDim.x);
  return false;
}

// Whether this rank already failed (uniform across the block). The host sees a failure only after
// launching more calls; those calls must not run: they would reuse the failed call's number and
// exchange stale data with the peers, or overwrite what a late peer still reads.
__device__ __forceinline__ bool rank_failed(const Params& p) {
  return __syncthreads_or(
      threadIdx.x == 0 &&
      *reinterpret_cast<volatile int32_t*>(&signals_of(p, p.rank)->first_error.code) != 0);
}

// A call that must not run: an earlier failure, or the wrong grid.
__device__ __forceinline__ bool refused(const Params& p) { return rank_failed(p) || !grid_ok(p); }

__device__ __forceinline__ void commit_state(const Params& p, uint32_t seq) {
  __syncthreads();
  if (threadIdx.x == 0) signals_of(p, p.rank)->state[blockIdx.x].seq = seq;
}

// ---------------------------------------------------------------------------------- one-shot pull
template <typename T, typename OutT, int ITEMS>
__global__ void __launch_bounds__(1024, 1) oneshot_pull_kernel(const Params p) {
  constexpr int VEC = 16 / sizeof(T);
  if (refused(p)) return poison_outputs<T, OutT>(p);
  const int nvec = p.hidden / VEC;
  const size_t rb = row_bytes(p, sizeof(T));
  const uint32_t seq = next_seq(signals_of(p, p.rank)->state[blockIdx.x].seq);
  const size_t staging = p.layout.staging[seq & 1];
  for (int row = blockIdx.x; row < p.rows; row += gridDim.x)
    copy_row(p.bases[p.rank] + staging + row * rb, static_cast<const char*>(p.x) + row * rb, nvec);
  if (!block_barrier(p, seq, 0)) return poison_outputs<T, OutT>(p);
  for (int row = blockIdx.x; row < p.rows; row += gridDim.x) {
    float acc[ITEMS][VEC];
    sum_ranks<T, VEC, ITEMS>(p, staging + row * rb, nvec, acc);
    finish_row<T, OutT, VEC, ITEMS>(p, row, acc, nvec);
  }
  commit_state(p, seq);
}

// ---------------------------------------------------------------------------------- two-shot
template <typename T, typename OutT, int ITEMS>
__global__ void __launch_bounds__(1024, 1) twoshot_kernel(const Params p) {
  constexpr int VEC = 16 / sizeof(T);
  if (refused(p)) return poison_outputs<T, OutT>(p);
  const int nvec = p.hidden / VEC;
  const size_t rb = row_bytes(p, sizeof(T));
  const uint32_t seq = next_seq(signals_of(p, p.rank)->state[blockIdx.x].seq);
  const size_t staging = p.layout.staging[seq & 1], gather = p.layout.gather[seq & 1];
  // Row i of every share is handled by block i % gridDim.x on every rank, in all three phases.
  for (int o = 0; o < p.world; ++o)
    for (int row = share_start(p, o) + blockIdx.x; row < share_start(p, o + 1); row += gridDim.x)
      copy_row(p.bases[p.rank] + staging + row * rb, static_cast<const char*>(p.x) + row * rb,
                  nvec);
  if (!block_barrier(p, seq, 0)) return poison_outputs<T, OutT>(p);
  for (int row = share_start(p, p.rank) + blockIdx.x; row < share_start(p, p.rank + 1);
       row += gridDim.x) {
    float acc[ITEMS][VEC];
    sum_ranks<T, VEC, ITEMS>(p, staging + row * rb, nvec, acc);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (v < nvec)
        store_vec<T, VEC>(reinterpret_cast<T*>(p.bases[p.rank] + gather + row * rb) + v * VEC,
                          acc[i]);
    }
  }
  if (!block_barrier(p, seq, 1)) return poison_outputs<T, OutT>(p);
  for (int o = 0; o < p.world; ++o)
    for (int row = share_start(p, o) + blockIdx.x; row < share_start(p, o + 1); row += gridDim.x) {
      float acc[ITEMS][VEC];
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int v = threadIdx.x + i * blockDim.x;
        if (v < nvec)
          load_vec<T, VEC>(reinterpret_cast<const T*>(p.bases[o] + gather + row * rb) + v * VEC,
                           acc[i]);
      }
      finish_row<T, OutT, VEC, ITEMS>(p, row, acc, nvec);
    }
  commit_state(p, seq);
}

// ---------------------------------------------------------------------------------- one-shot push
__device__ __forceinline__ bool has_sentinel(const uint4& u) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if ((w[k] & 0xffffu) == 0x8000u || (w[k] >> 16) == 0x8000u) return true;
  return false;
}

__device__ __forceinline__ uint32_t no_negative_zero(uint32_t w) {
  if ((w & 0xffffu) == 0x8000u) w &= 0xffff0000u;
  if ((w >> 16) == 0x8000u) w &= 0x0000ffffu;
  return w;
}

template <typename T, int VEC>
__device__ __forceinline__ void unpack(const uint4& u, float (&dst)[VEC]) {
  const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int k = 0; k < VEC; ++k) dst[k] = norm::to_float(e[k]);
}

template <typename T, typename OutT, int ITEMS>
__global__ void __launch_bounds__(1024, 1) oneshot_push_kernel(const Params p) {
  static_assert(sizeof(T) == 2, "the -0.0 sentinel is a 16-bit pattern");
  constexpr int VEC = 8;
  if (refused(p)) return poison_outputs<T, OutT>(p);
  const int nvec = p.hidden / VEC;
  const size_t rb = row_bytes(p, sizeof(T));
  BlockState* st = &signals_of(p, p.rank)->state[blockIdx.x];
  // The slot is counted modulo kPushSlots, not derived from a uint32 call count: 2^32 is not a
  // multiple of 3, so at the wrap (days of decoding) two consecutive calls would share a slot
  // that was never re-armed and read the previous call's data as this call's.
  const uint32_t seq = next_seq(st->seq);
  const int slot = static_cast<int>((st->push_slot + 1) % kPushSlots);
  char* mine = p.bases[p.rank];

  // Header first (receivers check it before polling data), then the rows themselves.
  if (threadIdx.x < p.world)
    reinterpret_cast<volatile uint64_t*>(
        signals_of(p, threadIdx.x)->push_headers[slot][blockIdx.x])[p.rank] =
        (static_cast<uint64_t>(seq) << 32) | p.header;
  for (int row = blockIdx.x; row < p.rows; row += gridDim.x)
    for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
      uint4 u = reinterpret_cast<const uint4*>(static_cast<const char*>(p.x) + row * rb)[v];
      u = make_uint4(no_negative_zero(u.x), no_negative_zero(u.y), no_negative_zero(u.z),
                     no_negative_zero(u.w));
#pragma unroll
      for (int q = 0; q < kMaxRanks; ++q) {
        if (q >= p.world) break;
        store_volatile_16(p.bases[q] + p.layout.push[slot] + p.rank * p.push_stride + row * rb + v * 16, u);
      }
    }

  bool ok = true;
  if (threadIdx.x < p.world)
    ok = wait_word(p, &signals_of(p, p.rank)->push_headers[slot][blockIdx.x][threadIdx.x], seq,
                   threadIdx.x, other_family(p, true, threadIdx.x, seq));
  if (!__syncthreads_and(ok)) return poison_outputs<T, OutT>(p);

  for (int row = blockIdx.x; row < p.rows; row += gridDim.x) {
    float acc[ITEMS][VEC];
    bool row_ok = true;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (v >= nvec) continue;
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[i][k] = 0.f;
      for (int q = 0; q < p.world && row_ok; ++q) {
        const char* src = mine + p.layout.push[slot] + q * p.push_stride + row * rb + v * 16;
        Deadline deadline;
        uint4 u = load_volatile_16(src);
        while (has_sentinel(u)) {
          if (deadline.expired(p, seq, q)) {
            row_ok = false;
            break;
          }
          u = load_volatile_16(src);
        }
        float part[VEC];
        unpack<T, VEC>(u, part);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[i][k] += part[k];
      }
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[i][k] = round_to<T>(acc[i][k]);
    }
    if (!__syncthreads_and(row_ok)) return poison_outputs<T, OutT>(p);
    finish_row<T, OutT, VEC, ITEMS>(p, row, acc, nvec);
  }

  // Re-arm the rows this block just read with the sentinel. The peers write this slot again three
  // push calls from now, after they have this rank's rows of the next two calls, which it sends
  // only after this point: the system-scope fence makes the sentinel land before those (the peers'
  // writes come from other GPUs, so a GPU-scope fence would not order them). One thread fences,
  // after __syncthreads: the fence is cumulative over every thread's re-arm stores.
  __syncthreads();
  for (int row = blockIdx.x; row < p.rows; row += gridDim.x)
    for (int q = 0; q < p.world; ++q) {
      uint4* dst = reinterpret_cast<uint4*>(mine + p.layout.push[slot] + q * p.push_stride + row * rb);
      for (int v = threadIdx.x; v < nvec; v += blockDim.x)
        dst[v] = make_uint4(kSentinelPair, kSentinelPair, kSentinelPair, kSentinelPair);
    }
  __syncthreads();
  if (threadIdx.x == 0) __threadfence_system();
  __syncthreads();
  // The one-block variant advances every block's counters: all blocks stay at the same call
  // number and push slot, so a later call with the full grid pairs up like any other.
  const int states = p.algorithm == kOneShotPush1Block ? static_cast<int>(signals_of(p, p.rank)->num_blocks) : 1;
  for (int b = threadIdx.x; b < states; b += blockDim.x) {
    st[b].seq = seq;
    st[b].push_slot = static_cast<uint32_t>(slot);
  }
}

__global__ void fill_kernel(uint32_t* ptr, size_t n, uint32_t value) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    ptr[i] = value;
}

// ---------------------------------------------------------------------------------- host side
template <typename T, typename OutT, int ITEMS>
void launch_items(const Params& p, int blocks, int threads, cudaStream_t stream) {
  switch (p.algorithm) {
    case kOneShotPush:
    case kOneShotPush1Block: oneshot_push_kernel<T, OutT, ITEMS><<<blocks, threads, 0, stream>>>(p); break;
    case kOneShotPull: oneshot_pull_kernel<T, OutT, ITEMS><<<blocks, threads, 0, stream>>>(p); break;
    default: twoshot_kernel<T, OutT, ITEMS><<<blocks, threads, 0, stream>>>(p); break;
  }
}

template <typename T, typename OutT>
cudaError_t launch_typed(const Params& p, int blocks, cudaStream_t stream) {
  // hidden <= 16384 at 8 elements per vector: at most 2048 vectors, 2 per thread at 1024.
  const norm::RowLaunch cfg = norm::row_launch(p.hidden / 8, 2);
  if (cfg.items == 1)
    launch_items<T, OutT, 1>(p, blocks, cfg.threads, stream);
  else
    launch_items<T, OutT, 2>(p, blocks, cfg.threads, stream);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_out(const Params& p, bool fp8_out, int blocks, cudaStream_t stream) {
  return fp8_out ? launch_typed<T, __nv_fp8_e4m3>(p, blocks, stream)
                 : launch_typed<T, T>(p, blocks, stream);
}

}  // namespace

size_t buffer_bytes(int world, int64_t max_bytes, int64_t push_bytes) {
  return make_layout(world, max_bytes, push_bytes).total;
}

cudaError_t init_buffer(void* base, int world, int64_t max_bytes, int64_t push_bytes, int num_blocks,
                        cudaStream_t stream) {
  if (num_blocks < 1 || num_blocks > kMaxBlocks) return cudaErrorInvalidValue;
  const Layout l = make_layout(world, max_bytes, push_bytes);
  cudaError_t err = cudaMemsetAsync(base, 0, l.push[0], stream);
  if (err != cudaSuccess) return err;
  fill_kernel<<<1, 32, 0, stream>>>(&reinterpret_cast<Signals*>(base)->num_blocks, 1, static_cast<uint32_t>(num_blocks));
  const size_t words = (l.total - l.push[0]) / 4;
  fill_kernel<<<256, 256, 0, stream>>>(
      reinterpret_cast<uint32_t*>(static_cast<char*>(base) + l.push[0]), words, kSentinelPair);
  return cudaGetLastError();
}

cudaError_t launch(const Call& c, cudaStream_t stream) {
  const bool sizes_ok = c.world >= 2 && c.world <= kMaxRanks && c.rank >= 0 && c.rank < c.world &&
                        c.num_blocks >= 1 && c.num_blocks <= kMaxBlocks && c.hidden >= 8 &&
                        c.hidden <= kMaxNormHidden && c.hidden % 8 == 0 && c.rows >= 0 &&
                        c.algorithm >= kOneShotPush && c.algorithm <= kOneShotPush1Block;
  if (!sizes_ok || (c.dtype != NormDType::kFloat16 && c.dtype != NormDType::kBFloat16))
    return cudaErrorInvalidValue;
  // Every tensor is accessed with 16-byte vectors (an fp8 out with 8-byte ones); a misaligned
  // pointer would fault in the kernel (a sticky error that kills the context): refuse it here.
  const auto aligned = [](const void* ptr, uintptr_t a) {
    return reinterpret_cast<uintptr_t>(ptr) % a == 0;
  };
  if (!aligned(c.x, 16) || !aligned(c.out, c.fused && c.fp8_out ? 8 : 16) ||
      (c.fused && (!aligned(c.residual, 16) || !aligned(c.weight, 16) ||
                   !aligned(c.residual_out, 16))))
    return cudaErrorMisalignedAddress;
  const int64_t bytes = c.rows * c.hidden * 2;
  const bool push = c.algorithm == kOneShotPush || c.algorithm == kOneShotPush1Block;
  if (bytes > c.max_bytes || (push && bytes > c.push_bytes) ||
      bytes >= kMaxMessageBytes || c.rows > kMaxHeaderRows)
    return cudaErrorInvalidValue;
  Params p{};
  for (int r = 0; r < kMaxRanks; ++r) p.bases[r] = static_cast<char*>(r < c.world ? c.bases[r] : nullptr);
  p.layout = make_layout(c.world, c.max_bytes, c.push_bytes);
  p.push_stride = align_up(static_cast<size_t>(c.push_bytes));
  p.x = c.x;
  p.residual = c.residual;
  p.weight = c.weight;
  p.out = c.out;
  p.residual_out = c.residual_out;
  p.host_error = c.error;
  p.rows = static_cast<int>(c.rows);
  p.hidden = c.hidden;
  p.world = c.world;
  p.rank = c.rank;
  p.algorithm = c.algorithm;
  const uint32_t op = c.fused ? (c.fp8_out ? 2u : 1u) : 0u;
  const int blocks = c.algorithm == kOneShotPush1Block ? 1 : c.num_blocks;
  p.header = message_header(op, static_cast<uint32_t>(c.algorithm), static_cast<uint32_t>(blocks),
                            static_cast<uint32_t>(c.rows));
  p.fused = c.fused;
  p.eps = c.eps;
  p.inv_scale = c.fp8_out ? c.inv_scale : 1.f;
  p.timeout_ns = c.timeout_ns;
  const bool fp8 = c.fused && c.fp8_out;
  return c.dtype == NormDType::kFloat16 ? launch_out<__half>(p, fp8, blocks, stream)
                                        : launch_out<__nv_bfloat16>(p, fp8, blocks, stream);
}

cudaError_t ipc_alloc(size_t bytes, void** ptr) { return cudaMalloc(ptr, bytes); }
cudaError_t ipc_free(void* ptr) { return cudaFree(ptr); }

cudaError_t ipc_handle(void* ptr, unsigned char handle[64]) {
  static_assert(sizeof(cudaIpcMemHandle_t) == 64, "CUDA IPC handles are 64 bytes");
  cudaIpcMemHandle_t h;
  const cudaError_t err = cudaIpcGetMemHandle(&h, ptr);
  if (err == cudaSuccess) memcpy(handle, &h, 64);
  return err;
}

cudaError_t ipc_open(const unsigned char handle[64], void** ptr) {
  cudaIpcMemHandle_t h;
  memcpy(&h, handle, 64);
  return cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess);
}

cudaError_t ipc_close(void* ptr) { return cudaIpcCloseMemHandle(ptr); }

}  // namespace allreduce
}  // namespace spec_kernels
