// Checks every binding (csrc/<family>/*_binding.cpp) shares: a bad argument of a direct call of
// torch.ops.spec_kernels_cuda.* raises an error naming it (TORCH_CHECK), never a crash.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "spec_kernels/launch_shape.h"
#include "spec_kernels/tree_verify.h"  // kKvLikeQ, kKvE4M3, kKvE5M2

namespace spec_kernels::binding {

// A KV cache's element format and dequantisation scales, as the attention params carry them.
struct KvFormat {
  int format;  // kKvLikeQ, kKvE4M3, kKvE5M2
  float k_scale, v_scale;
  const float* k_scale_ptr;  // device fp32, or nullptr (then the host value)
  const float* v_scale_ptr;
};

// The format of `cache` (named `cache_name`) read with q: q's dtype, or float8_e4m3fn /
// float8_e5m2 with scales (host values finite and > 0, or 1-element fp32 tensors on q's device);
// scales given for a cache of q's dtype are refused.
inline KvFormat check_kv_format(const at::Tensor& q, const at::Tensor& cache, const char* cache_name, double k_scale,
                                double v_scale, const std::optional<at::Tensor>& k_scale_tensor,
                                const std::optional<at::Tensor>& v_scale_tensor) {
  const at::ScalarType kv = cache.scalar_type();
  const bool fp8 = kv == at::kFloat8_e4m3fn || kv == at::kFloat8_e5m2;
  TORCH_CHECK(kv == q.scalar_type() || fp8, cache_name, " must have q's dtype ", q.scalar_type(),
              " or be float8_e4m3fn / float8_e5m2, got ", kv);
  for (const auto& [t, name] : {std::pair{&k_scale_tensor, "k_scale_tensor"}, {&v_scale_tensor, "v_scale_tensor"}}) {
    if (!t->has_value()) continue;
    TORCH_CHECK(fp8, name, " is given but ", cache_name, " is ", kv, ": scales only apply to fp8 caches");
    TORCH_CHECK((*t)->device() == q.device() && (*t)->scalar_type() == at::kFloat && (*t)->numel() == 1, name,
                " must be one float32 on ", q.device());
  }
  TORCH_CHECK(fp8 || (k_scale == 1.0 && v_scale == 1.0), "k_scale / v_scale only apply to fp8 caches, ", cache_name,
              " is ", kv);
  for (const auto& [s, name] : {std::pair{k_scale, "k_scale"}, {v_scale, "v_scale"}}) {
    TORCH_CHECK(std::isfinite(s) && s > 0, name, " must be finite and > 0, got ", s);
  }
  return KvFormat{!fp8 ? kKvLikeQ : kv == at::kFloat8_e5m2 ? kKvE5M2 : kKvE4M3, static_cast<float>(k_scale),
                  static_cast<float>(v_scale), k_scale_tensor.has_value() ? k_scale_tensor->data_ptr<float>() : nullptr,
                  v_scale_tensor.has_value() ? v_scale_tensor->data_ptr<float>() : nullptr};
}

template <typename Params>
void fill_kv_format(Params& p, const KvFormat& f) {
  p.kv_format = f.format;
  p.k_scale = f.k_scale;
  p.v_scale = f.v_scale;
  p.k_scale_ptr = f.k_scale_ptr;
  p.v_scale_ptr = f.v_scale_ptr;
}

inline void check_cuda_vector(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.dim() == 1, name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// A LaunchShape as the exported ops return it: [head_dim, block_m, threads, smem_bytes, regs,
// min_ctas_per_sm, kv_fp8, block_n] (spec_kernels/_ops.py LaunchShape reads it in this order).
inline std::vector<int64_t> shape_values(const LaunchShape& s) {
  return {s.head_dim, s.block_m, s.threads, s.smem_bytes, s.regs, s.min_ctas_per_sm, s.kv_fp8, s.block_n,
          s.warp_rows};
}

// One line of kernel_configs(): "<kernel> <template args> head_dim=.. block_m=.. ...".
inline std::string shape_line(const char* kernel, const std::string& template_args, const LaunchShape& s) {
  return std::string(kernel) + " " + template_args + " head_dim=" + std::to_string(s.head_dim) +
         " block_m=" + std::to_string(s.block_m) + " threads=" + std::to_string(s.threads) +
         " smem_bytes=" + std::to_string(s.smem_bytes) + " regs=" + std::to_string(s.regs) +
         " min_ctas_per_sm=" + std::to_string(s.min_ctas_per_sm) + " kv_fp8=" + std::to_string(s.kv_fp8) +
         " block_n=" + std::to_string(s.block_n) + " warp_rows=" + std::to_string(s.warp_rows) + "\n";
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
