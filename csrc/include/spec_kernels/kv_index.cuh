// Small device helpers both attention kernels use to walk a paged KV cache.
#pragma once

#include <cmath>
#include <cstdint>

#include "spec_kernels/mma.cuh"

namespace spec_kernels {

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Draft slots a mask word can address: draft j > 63 of a request is never visible.
constexpr int kMaskBits = 64;

// [lo, hi) of entry b of an indptr, cut to [0, limit): the identity for valid values; invalid
// (unchecked) ones - negative, decreasing, past the end - never reach outside (an empty range
// attends to nothing). The reference and the Triton kernels cut the same way.
__device__ __forceinline__ void indptr_range(const int32_t* indptr, int b, int64_t limit, int64_t& lo, int64_t& hi) {
  const int64_t a = indptr[b], e = indptr[b + 1];
  lo = a < 0 ? 0 : a > limit ? limit : a;
  hi = e < lo ? lo : e > limit ? limit : e;
}

// Bits 0..i of a mask word (all 64 at i >= 63): draft i sees itself and earlier drafts only, so
// bits of later drafts - and of drafts at or past n_b - are ignored.
__device__ __forceinline__ uint64_t draft_bits(int i) { return i >= 63 ? ~0ull : (2ull << i) - 1ull; }

// A logit that is +-inf (inf in q or K) becomes NaN, so that -inf never reads as "masked" and the
// row's output and lse come out NaN; NaN stays NaN.
__device__ __forceinline__ float finite_or_nan(float x) { return fabsf(x) == INFINITY ? NAN : x; }

// Slot ids are staged in shared memory at 8 bytes per key whatever the index dtype (Params:
// TreeVerifyParams or MlaParams: both carry kv_indices, kv_indices_int64 and num_indices).

// Starts copying kv_indices[at] into the 8-byte staging cell at shared address dst (cp.async, not
// waited for); an id outside the range is not read (the cell is zero-filled).
template <class Params>
__device__ __forceinline__ void copy_slot_id_async(const Params& p, int64_t at, bool in_range, uint32_t dst) {
  if (p.kv_indices_int64) {
    cp_async_small<8>(dst, static_cast<const int64_t*>(p.kv_indices) + (in_range ? at : 0), in_range);
  } else {
    cp_async_small<4>(dst, static_cast<const int32_t*>(p.kv_indices) + (in_range ? at : 0), in_range);
  }
}

// The staged slot id of key r of a tile (ids: the tile's staging cells).
template <class Params>
__device__ __forceinline__ int64_t staged_slot_id(const Params& p, const uint8_t* ids, int r) {
  return p.kv_indices_int64 ? *reinterpret_cast<const int64_t*>(ids + r * 8)
                            : static_cast<int64_t>(*reinterpret_cast<const int32_t*>(ids + r * 8));
}

}  // namespace spec_kernels
