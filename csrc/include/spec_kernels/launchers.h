// Host-side entry points of the CUDA kernels. Plain C++ and CUDA runtime types only, no torch:
// csrc/ops.cpp (the one torch-facing file) checks arguments and calls these; the .cu files
// implement them. Every launcher returns the launch's cudaError_t instead of throwing.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace spec_kernels {

// Largest draft-token count per request: a tree-mask row is one 64-bit word.
constexpr int kMaxDraftTokens = 64;

// Archs compiled into this binary (nvcc's __CUDA_ARCH_LIST__, e.g. 900, 1200); returns how many
// were written to `out` (at most `capacity`).
int compiled_cuda_archs(int* out, int capacity);
// CUDART_VERSION the extension was compiled with, e.g. 13000.
int compiled_cuda_runtime_version();

// tree_mask[t] = bits of draft t and of all its ancestors (indices within its request).
// parents: int64 [T], parent index within the request or -1; parents must precede children.
cudaError_t launch_tree_mask_from_parents(const int64_t* parents, const int32_t* qo_indptr,
                                          int64_t* tree_mask, int num_requests,
                                          cudaStream_t stream);

}  // namespace spec_kernels
