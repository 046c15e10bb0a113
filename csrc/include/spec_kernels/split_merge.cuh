// Split-KV (flash-decoding) pieces shared by the attention kernels: which keys a split reads, and
// the combine. Each split s wrote, for a
// (token, head) row, its normalised output o_s and its base-2 log-sum-exp lse_s; the row's result
// is sum_s 2^(lse_s - lse) * o_s with lse = log2 sum_s 2^lse_s, summed in split order (bitwise
// deterministic, no atomics). A row no split saw (every lse_s = -inf) gets zeros and lse = -inf; a
// NaN lse_s (a NaN logit in that split) makes the total, and so the row's output and lse, NaN.
#pragma once

#include <cmath>
#include <cstdint>

#include "spec_kernels/mma.cuh"  // from_float<T>

namespace spec_kernels {

// The prefix keys [lo, hi) that split `split` of `num_splits` reads: chunks of
// ceil(prefix_len / num_splits) keys rounded up to `tile` keys, at least min_chunk; the last splits
// may get none. Overflow-free for any min_chunk < 2^31 (split * chunk is never formed when it
// would pass prefix_len).
__device__ __forceinline__ void split_bounds(int prefix_len, int num_splits, int split, int tile, int min_chunk,
                                             int& lo, int& hi) {
  const int per_split = (prefix_len + num_splits - 1) / num_splits;
  const int chunk = max((per_split + tile - 1) / tile * tile, min_chunk);
  lo = split > 0 && chunk > prefix_len / split ? prefix_len : split * chunk;
  hi = lo + min(chunk, prefix_len - lo);
}

// Called by every thread of one block per row; the threads stride over the row's `dim` columns.
// o_partial: fp32 [splits, num_rows, dim]; lse_partial: fp32 [splits, num_rows] (base 2);
// idx = token * heads + head; out_row: the row's output; lse: fp32 [num_rows] in natural log, or
// nullptr when not wanted.
template <typename T>
__device__ void merge_split_row(const float* o_partial, const float* lse_partial, int num_splits, int64_t num_rows,
                                int64_t idx, int dim, T* out_row, float* lse) {
  float mx = -INFINITY;
  for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, lse_partial[s * num_rows + idx]);
  const float m_safe = mx == -INFINITY ? 0.f : mx;
  float total = 0.f;
  for (int s = 0; s < num_splits; ++s) total += exp2f(lse_partial[s * num_rows + idx] - m_safe);
  const bool seen = total != 0.f;  // NaN counts as seen
  const float inv_total = seen ? 1.f / total : 0.f;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    float o = 0.f;
    for (int s = 0; s < num_splits; ++s) {
      const float w = exp2f(lse_partial[s * num_rows + idx] - m_safe);
      o += w * o_partial[(s * num_rows + idx) * dim + d];
    }
    out_row[d] = from_float<T>(o * inv_total);
  }
  if (lse != nullptr && threadIdx.x == 0) {
    lse[idx] = seen ? (m_safe + log2f(total)) * 0.69314718055994531f : -INFINITY;
  }
}

}  // namespace spec_kernels
