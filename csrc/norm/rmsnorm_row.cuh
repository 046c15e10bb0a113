// Device building blocks shared by the fused add + RMSNorm kernel and the allreduce kernels:
// vector types, fp32 <-> storage conversions, a deterministic block sum, and the row epilogue
// (residual add + RMSNorm + store) that every allreduce algorithm ends with.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace spec_kernels {
namespace norm {

// N elements moved as one aligned access (N * sizeof(T) == 16 gives 128-bit loads/stores).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
// Round to nearest even, saturating to +-448 (NaN stays NaN).
template <>
__device__ __forceinline__ __nv_fp8_e4m3 from_float<__nv_fp8_e4m3>(float v) {
  return __nv_fp8_e4m3(v);
}

// Round v to T and back: the value a tensor of dtype T would hold.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}
template <>
__device__ __forceinline__ float round_to<float>(float v) { return v; }

template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* p, float (&dst)[N]) {
  const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int k = 0; k < N; ++k) dst[k] = to_float(v.v[k]);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const float (&src)[N]) {
  Vec<T, N> v;
#pragma unroll
  for (int k = 0; k < N; ++k) v.v[k] = from_float<T>(src[k]);
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block, the same bits in every thread; the order is fixed by blockDim, so results
// are deterministic. blockDim.x must be a multiple of 32. Safe to call repeatedly.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x >> 5) ? warp_sums[lane] : 0.f;
  v = warp_sum(v);
  __syncthreads();  // warp_sums is reused by the next call
  return v;
}

// One row of the fused epilogue, done by one thread block. The caller has put this thread's
// share of the row's first addend into x (vector i of the thread is vector
// threadIdx.x + i * blockDim.x of the row; vectors past nvec are ignored):
//   h = x + residual; out = h * rsqrt(mean(h^2) + eps) * weight [* inv_scale]; res_out = h.
// out may alias x's source and res_out may alias residual: every load precedes every store
// of the same element by the same thread.
template <typename T, typename OutT, int VEC, int ITEMS>
__device__ __forceinline__ void add_rmsnorm_row(float (&x)[ITEMS][VEC], const T* residual,
                                                const T* weight, OutT* out, T* res_out,
                                                int nvec, int hidden, float eps,
                                                float inv_scale) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v < nvec) {
      float r[VEC];
      load_vec<T, VEC>(residual + v * VEC, r);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        x[i][k] += r[k];
        ss += x[i][k] * x[i][k];
      }
    }
  }
  const float rstd = rsqrtf(block_sum(ss) / static_cast<float>(hidden) + eps);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v < nvec) {
      float w[VEC], y[VEC];
      load_vec<T, VEC>(weight + v * VEC, w);
#pragma unroll
      for (int k = 0; k < VEC; ++k) y[k] = x[i][k] * rstd * w[k] * inv_scale;
      store_vec<T, VEC>(res_out + v * VEC, x[i]);
      store_vec<OutT, VEC>(out + v * VEC, y);
    }
  }
}

// Threads per block and vectors per thread for a row of nvec vectors: as many threads as there
// are vectors (up to 1024), then more vectors per thread (a power of two, <= max_items).
struct RowLaunch {
  int threads;
  int items;
};

inline RowLaunch row_launch(int nvec, int max_items) {
  int items = 1;
  while (items < max_items && nvec > items * 1024) items *= 2;
  int threads = (nvec + items - 1) / items;
  threads = ((threads + 31) / 32) * 32;
  return {threads < 1024 ? threads : 1024, items};
}

}  // namespace norm
}  // namespace spec_kernels
