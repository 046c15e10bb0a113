// Programmatic dependent launch (sm_90 and newer, both targets): a split-KV merge kernel is
// launched so that the GPU schedules it while the attention kernel before it drains, instead of
// after it, which hides the second launch's fixed cost. Correctness rests on the dependent
// kernel alone: it calls grid_dependency_wait() before touching anything the primary kernel
// writes; that returns once the primary grid has completed and its memory is visible. The
// primary's launch_dependents() only says how early the dependent may be scheduled.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "spec_kernels/launch_once.cuh"  // programmatic_launch_enabled

namespace spec_kernels {

// Blocks until every prerequisite grid has completed and its writes are visible; returns at once
// in a kernel launched without the programmatic attribute.
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// Lets the dependent grid be scheduled once every CTA of this grid has called it or exited. Call
// it after a CTA's main loop: earlier, the dependent's CTAs would take SM slots from this grid's
// later waves.
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// Launches Kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent of the
// kernel launched before it on `stream` (where enabled); CUDA-graph capture records the edge.
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = programmatic_launch_enabled().load(std::memory_order_relaxed) ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace spec_kernels
