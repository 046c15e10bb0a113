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
#include "spec_kernels/programmatic_launch.cuh"

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

// Columns a merge thread combines at once: one 16-byte load of each split's fp32 partial row.
constexpr int kMergeVec = 4;

// Stores 4 consecutive outputs: one 8-byte store where the row allows it (out_row 8-byte aligned,
// the same for every thread of the block), else one at a time.
template <typename T>
__device__ __forceinline__ void store4(T* dst, bool aligned8, float a, float b, float c, float d) {
  if (aligned8) {
    union {
      T v[4];
      uint2 u;
    } pack;
    pack.v[0] = from_float<T>(a);
    pack.v[1] = from_float<T>(b);
    pack.v[2] = from_float<T>(c);
    pack.v[3] = from_float<T>(d);
    *reinterpret_cast<uint2*>(dst) = pack.u;
  } else {
    dst[0] = from_float<T>(a);
    dst[1] = from_float<T>(b);
    dst[2] = from_float<T>(c);
    dst[3] = from_float<T>(d);
  }
}

// Called by every thread of one block per row; each thread combines kMergeVec consecutive columns
// per step (16-byte loads of the partials), striding over the row's `dim` columns, and reads each
// split's weight once per step. o_partial: fp32 [splits, num_rows, dim], 16-byte aligned, dim a
// multiple of kMergeVec (every head dim of the kernels); lse_partial: fp32 [splits, num_rows]
// (base 2); idx = token * heads + head; out_row: the row's output; lse: fp32 [num_rows] in
// natural log, or nullptr when not wanted. The merge kernels run as programmatic dependents of the
// attention kernel (launch_dependent): nothing is read before that kernel has completed.
template <typename T>
__device__ void merge_split_row(const float* o_partial, const float* lse_partial, int num_splits, int64_t num_rows,
                                int64_t idx, int dim, T* out_row, float* lse) {
  grid_dependency_wait();
  float mx = -INFINITY;
  for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, lse_partial[s * num_rows + idx]);
  const float m_safe = mx == -INFINITY ? 0.f : mx;
  float total = 0.f;
  for (int s = 0; s < num_splits; ++s) total += exp2f(lse_partial[s * num_rows + idx] - m_safe);
  const bool seen = total != 0.f;  // NaN counts as seen
  const float inv_total = seen ? 1.f / total : 0.f;
  const bool aligned8 = (reinterpret_cast<uintptr_t>(out_row) & 7) == 0;
  for (int d = threadIdx.x * kMergeVec; d < dim; d += blockDim.x * kMergeVec) {
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < num_splits; ++s) {
      const float w = exp2f(lse_partial[s * num_rows + idx] - m_safe);
      const float4 v = *reinterpret_cast<const float4*>(o_partial + (s * num_rows + idx) * dim + d);
      o.x += w * v.x;
      o.y += w * v.y;
      o.z += w * v.z;
      o.w += w * v.w;
    }
    store4(out_row + d, aligned8, o.x * inv_total, o.y * inv_total, o.z * inv_total, o.w * inv_total);
  }
  if (lse != nullptr && threadIdx.x == 0) {
    lse[idx] = seen ? (m_safe + log2f(total)) * 0.69314718055994531f : -INFINITY;
  }
}

}  // namespace spec_kernels
