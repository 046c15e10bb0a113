// Tree mask from parent pointers: one 64-bit word per draft token (bit j = "attends to draft j").
// One block per request, one thread per draft token; each thread walks its ancestor chain.
#include "spec_kernels/kv_index.cuh"
#include "spec_kernels/launchers.h"

namespace spec_kernels {
namespace {

__global__ void tree_mask_from_parents_kernel(const int64_t* __restrict__ parents,
                                              const int32_t* __restrict__ qo_indptr,
                                              int64_t* __restrict__ tree_mask, int64_t num_tokens) {
  // A malformed qo_indptr (values unchecked on the GPU unless in debug mode) is cut to [0, num_tokens),
  // like the reference does: no token outside, rows no request claims are left unwritten.
  int64_t start, end;
  indptr_range(qo_indptr, blockIdx.x, num_tokens, start, end);
  const int64_t n = end - start;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    uint64_t bits = 0;
    int64_t j = i;
    // Parents precede children, so the walk strictly descends and ends within 64 steps. A
    // malformed link (p >= j) stops the walk: wrong input never reads out of range.
    for (int step = 0; step < kMaxDraftTokens && j >= 0 && j < kMaxDraftTokens; ++step) {
      bits |= 1ull << j;
      const int64_t p = parents[start + j];
      if (p >= j) break;
      j = p;
    }
    tree_mask[start + i] = static_cast<int64_t>(bits);
  }
}

}  // namespace

cudaError_t launch_tree_mask_from_parents(const int64_t* parents, const int32_t* qo_indptr,
                                          int64_t* tree_mask, int num_requests, int64_t num_tokens,
                                          cudaStream_t stream) {
  if (num_requests == 0) return cudaSuccess;
  tree_mask_from_parents_kernel<<<num_requests, kMaxDraftTokens, 0, stream>>>(parents, qo_indptr,
                                                                             tree_mask, num_tokens);
  return cudaGetLastError();
}

}  // namespace spec_kernels
