// Small device helpers both attention kernels use to walk a paged KV cache.
#pragma once

#include <cstdint>

namespace spec_kernels {

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// kv_indices[i] as int64, whichever index dtype the caller passed (Params: TreeVerifyParams or
// MlaParams: both carry kv_indices and kv_indices_int64).
template <class Params>
__device__ __forceinline__ int64_t load_slot(const Params& p, int64_t i) {
  return p.kv_indices_int64 ? static_cast<const int64_t*>(p.kv_indices)[i]
                            : static_cast<int64_t>(static_cast<const int32_t*>(p.kv_indices)[i]);
}

}  // namespace spec_kernels
