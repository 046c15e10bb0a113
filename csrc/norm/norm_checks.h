// Checks of the add + RMSNorm epilogue, shared by the norm and allreduce bindings.
#pragma once

#include <cmath>
#include <optional>

#include "../torch_checks.h"
#include "spec_kernels/norm_allreduce.h"

namespace spec_kernels::binding {

inline spec_kernels::NormDType norm_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kHalf: return spec_kernels::NormDType::kFloat16;
    case at::kBFloat16: return spec_kernels::NormDType::kBFloat16;
    case at::kFloat: return spec_kernels::NormDType::kFloat32;
    default: break;
  }
  TORCH_CHECK(false, name, " must be float16, bfloat16 or float32, got ", t.scalar_type());
}

// t: a contiguous CUDA tensor like `like` (same device and shape) of dtype `dtype`.
inline void check_like(const at::Tensor& t, const char* name, const at::Tensor& like, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  check_buffer(t, name, like.device(), "x", dtype, like.sizes());
}

inline void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor, got device ", x.device());
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [tokens, hidden], got shape ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK(x.size(1) >= 1 && x.size(1) <= spec_kernels::kMaxNormHidden,
              "x must have 1 <= hidden <= ", spec_kernels::kMaxNormHidden, " columns, got ", x.size(1));
}

inline void check_weight(const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK(weight.is_cuda() && weight.device() == x.device(), "weight must be on ", x.device());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must have shape [", x.size(1),
              "], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight must be ", x.scalar_type(), ", got ",
              weight.scalar_type());
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
}

// 1 / out_scale in fp32 (what every implementation multiplies by), 1 without fp8 output.
inline float inv_out_scale(const std::optional<double>& out_scale) {
  if (!out_scale.has_value()) return 1.f;
  TORCH_CHECK(std::isfinite(*out_scale) && *out_scale > 0, "out_scale must be finite and > 0, got ", *out_scale);
  return static_cast<float>(1.0 / *out_scale);
}

}  // namespace spec_kernels::binding
