// Checks every binding (csrc/<family>/*_binding.cpp) shares: a bad argument of a direct call of
// torch.ops.spec_kernels_cuda.* raises an error naming it (TORCH_CHECK), never a crash.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <optional>
#include <string>
#include <vector>

#include "spec_kernels/launch_shape.h"

namespace spec_kernels::binding {

inline void check_cuda_vector(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.dim() == 1, name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// A LaunchShape as the exported ops return it: [head_dim, block_m, threads, smem_bytes, regs,
// min_ctas_per_sm] (spec_kernels/attention/plan.py LaunchShape reads it in this order).
inline std::vector<int64_t> shape_values(const LaunchShape& s) {
  return {s.head_dim, s.block_m, s.threads, s.smem_bytes, s.regs, s.min_ctas_per_sm};
}

// One line of kernel_configs(): "<kernel> <template args> head_dim=.. block_m=.. ...".
inline std::string shape_line(const char* kernel, const std::string& template_args, const LaunchShape& s) {
  return std::string(kernel) + " " + template_args + " head_dim=" + std::to_string(s.head_dim) +
         " block_m=" + std::to_string(s.block_m) + " threads=" + std::to_string(s.threads) +
         " smem_bytes=" + std::to_string(s.smem_bytes) + " regs=" + std::to_string(s.regs) +
         " min_ctas_per_sm=" + std::to_string(s.min_ctas_per_sm) + "\n";
}

inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

// t: on `device` (the device of the argument `like`) and contiguous.
inline void check_cuda(const at::Tensor& t, const char* name, const at::Device& device, const char* like = "q") {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, " like ", like, ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// t: a buffer on `device` (the device of the argument `like`) of `dtype` with exactly `sizes`,
// contiguous: the outputs, split buffers and side inputs of every family.
inline void check_buffer(const at::Tensor& t, const char* name, const at::Device& device, const char* like,
                         at::ScalarType dtype, c10::IntArrayRef sizes) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, " like ", like, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == sizes, name, " must have shape ", sizes, ", got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

inline void check_shape(const at::Tensor& t, const char* name, c10::IntArrayRef expected) {
  TORCH_CHECK(t.sizes() == expected, name, " must have shape ", expected, ", got ", t.sizes());
}

// The fields TreeVerifyParams and MlaParams share: the batch layout (checked before), the outputs,
// the split buffers (present when num_splits > 1) and the launch sizes.
template <typename Params>
void fill_attention_batch(Params& p, const at::Tensor& q, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                          const std::optional<at::Tensor>& qo_indptr, const std::optional<at::Tensor>& tree_mask,
                          const at::Tensor& out, const std::optional<at::Tensor>& lse,
                          const std::optional<at::Tensor>& o_partial, const std::optional<at::Tensor>& lse_partial,
                          int64_t num_splits, int64_t min_chunk, int64_t max_rows, double sm_scale) {
  p.kv_indptr = kv_indptr.data_ptr<int32_t>();
  p.kv_indices = kv_indices.data_ptr();
  p.kv_indices_int64 = kv_indices.scalar_type() == at::kLong;
  p.qo_indptr = qo_indptr.has_value() ? qo_indptr->data_ptr<int32_t>() : nullptr;
  p.tree_mask = tree_mask.has_value() ? tree_mask->data_ptr<int64_t>() : nullptr;
  p.out = out.data_ptr();
  p.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  p.o_partial = num_splits > 1 ? o_partial->data_ptr<float>() : nullptr;
  p.lse_partial = num_splits > 1 ? lse_partial->data_ptr<float>() : nullptr;
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.max_rows = static_cast<int>(max_rows);
  p.num_splits = static_cast<int>(num_splits);
  p.min_chunk = static_cast<int>(min_chunk);
  p.sm_scale_log2 = static_cast<float>(sm_scale * 1.4426950408889634);  // the softmax runs in base 2
}

}  // namespace spec_kernels::binding
