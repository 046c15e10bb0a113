// Small device helpers both attention kernels use to walk a paged KV cache.
#pragma once

#include <cmath>
#include <cstdint>

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

// kv_indices[i] as int64, whichever index dtype the caller passed (Params: TreeVerifyParams or
// MlaParams: both carry kv_indices and kv_indices_int64).
template <class Params>
__device__ __forceinline__ int64_t load_slot(const Params& p, int64_t i) {
  return p.kv_indices_int64 ? static_cast<const int64_t*>(p.kv_indices)[i]
                            : static_cast<int64_t>(static_cast<const int32_t*>(p.kv_indices)[i]);
}

}  // namespace spec_kernels
