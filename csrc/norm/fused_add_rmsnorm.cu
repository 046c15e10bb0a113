// Fused residual add + RMSNorm: one thread block per row, the row held in registers between the
// reduction and the stores (one read and one write of each tensor). 16-byte vector accesses
// when the pointers and the row pitch allow; a scalar variant otherwise (odd hidden sizes).
#include "rmsnorm_row.cuh"
#include "spec_kernels/norm_allreduce.h"

namespace spec_kernels {
namespace {

using norm::add_rmsnorm_row;
using norm::load_vec;

template <typename T, typename OutT, int VEC, int ITEMS>
__global__ void __launch_bounds__(1024)
    fused_add_rmsnorm_kernel(const T* x, const T* residual, const T* __restrict__ weight,
                             OutT* out, T* residual_out, int hidden, float eps, float inv_scale) {
  // __restrict__ only on weight: out may be x (or residual) and residual_out may be residual (or
  // x), so promising the compiler that x / residual are never written (ld.global.nc, free to be
  // re-loaded after the stores) would be undefined behaviour for the documented in-place use.
  const int64_t row_start = static_cast<int64_t>(blockIdx.x) * hidden;
  const int nvec = hidden / VEC;
  float h[ITEMS][VEC];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v < nvec) load_vec<T, VEC>(x + row_start + v * VEC, h[i]);
  }
  add_rmsnorm_row<T, OutT, VEC, ITEMS>(h, residual + row_start, weight, out + row_start,
                                       residual_out + row_start, nvec, hidden, eps, inv_scale);
}

template <typename T, typename OutT, int VEC>
cudaError_t launch_vec(const void* x, const void* residual, const void* weight, void* out,
                       void* residual_out, int64_t rows, int hidden, float eps, float inv_scale,
                       cudaStream_t stream) {
  // Vector path: hidden <= 16384 is at most 4096 vectors, 4 per thread at 1024 threads.
  constexpr int kMaxItems = VEC == 1 ? 16 : 4;
  const norm::RowLaunch cfg = norm::row_launch(hidden / VEC, kMaxItems);
  const dim3 grid(static_cast<unsigned>(rows));
  const auto args = [&](auto kernel) {
    kernel<<<grid, cfg.threads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(residual), static_cast<const T*>(weight),
        static_cast<OutT*>(out), static_cast<T*>(residual_out), hidden, eps, inv_scale);
  };
  switch (cfg.items) {
    case 1: args(fused_add_rmsnorm_kernel<T, OutT, VEC, 1>); break;
    case 2: args(fused_add_rmsnorm_kernel<T, OutT, VEC, 2>); break;
    case 4: args(fused_add_rmsnorm_kernel<T, OutT, VEC, 4>); break;
    case 8: if constexpr (kMaxItems >= 8) args(fused_add_rmsnorm_kernel<T, OutT, VEC, 8>); break;
    case 16: if constexpr (kMaxItems >= 16) args(fused_add_rmsnorm_kernel<T, OutT, VEC, 16>); break;
    default: return cudaErrorInvalidConfiguration;
  }
  return cudaGetLastError();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T, typename OutT>
cudaError_t launch_typed(const void* x, const void* residual, const void* weight, void* out,
                         void* residual_out, int64_t rows, int hidden, float eps,
                         float inv_scale, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  // out's vector is kVec * sizeof(OutT) bytes, so its alignment follows from the same test.
  const bool vec_ok = hidden % kVec == 0 && aligned16(x) && aligned16(residual) &&
                      aligned16(weight) && aligned16(residual_out) &&
                      (reinterpret_cast<uintptr_t>(out) % (kVec * sizeof(OutT))) == 0;
  if (vec_ok)
    return launch_vec<T, OutT, kVec>(x, residual, weight, out, residual_out, rows, hidden, eps,
                                     inv_scale, stream);
  return launch_vec<T, OutT, 1>(x, residual, weight, out, residual_out, rows, hidden, eps,
                                inv_scale, stream);
}

template <typename T>
cudaError_t launch_out(bool fp8_out, const void* x, const void* residual, const void* weight,
                       void* out, void* residual_out, int64_t rows, int hidden, float eps,
                       float inv_scale, cudaStream_t stream) {
  if (fp8_out)
    return launch_typed<T, __nv_fp8_e4m3>(x, residual, weight, out, residual_out, rows, hidden,
                                          eps, inv_scale, stream);
  return launch_typed<T, T>(x, residual, weight, out, residual_out, rows, hidden, eps, 1.f,
                            stream);
}

}  // namespace

cudaError_t launch_fused_add_rmsnorm(const void* x, const void* residual, const void* weight,
                                     void* out, void* residual_out, int64_t rows, int hidden,
                                     NormDType dtype, bool fp8_out, float eps, float inv_scale,
                                     cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows < 0 || rows > 0x7fffffff || hidden < 1 || hidden > kMaxNormHidden)
    return cudaErrorInvalidValue;
  switch (dtype) {
    case NormDType::kFloat16:
      return launch_out<__half>(fp8_out, x, residual, weight, out, residual_out, rows, hidden,
                                eps, inv_scale, stream);
    case NormDType::kBFloat16:
      return launch_out<__nv_bfloat16>(fp8_out, x, residual, weight, out, residual_out, rows,
                                       hidden, eps, inv_scale, stream);
    case NormDType::kFloat32:
      return launch_out<float>(fp8_out, x, residual, weight, out, residual_out, rows, hidden,
                               eps, inv_scale, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace spec_kernels
