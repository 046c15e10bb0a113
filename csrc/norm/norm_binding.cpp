// torch.ops.spec_kernels_cuda.fused_add_rmsnorm: checks, then the launch.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>

#include "norm_checks.h"
#include "spec_kernels/norm_allreduce.h"

#include "../bindings.h"
#include "../torch_checks.h"

namespace spec_kernels::binding {

void fused_add_rmsnorm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                       at::Tensor& out, at::Tensor& residual_out, double eps,
                       std::optional<double> out_scale) {
  check_rows(x);
  const auto dtype = norm_dtype(x, "x");
  check_like(residual, "residual", x, x.scalar_type());
  check_weight(weight, x);
  check_like(out, "out", x, out_scale.has_value() ? at::kFloat8_e4m3fn : x.scalar_type());
  check_like(residual_out, "residual_out", x, x.scalar_type());
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  const float inv_scale = inv_out_scale(out_scale);
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(spec_kernels::launch_fused_add_rmsnorm(
                   x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                   residual_out.data_ptr(), x.size(0), static_cast<int>(x.size(1)), dtype,
                   out_scale.has_value(), static_cast<float>(eps), inv_scale,
                   c10::cuda::getCurrentCUDAStream(x.get_device()).stream()),
               "fused_add_rmsnorm");
}

}  // namespace spec_kernels::binding
