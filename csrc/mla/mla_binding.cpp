// torch.ops.spec_kernels_cuda.mla_tree_verify_attention: checks, then the MlaParams of
// csrc/include/spec_kernels/mla.h, then the launch.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "spec_kernels/mla.h"
#include "spec_kernels/mla_config.h"

#include "../bindings.h"
#include "../torch_checks.h"

namespace spec_kernels::binding {

void mla_tree_verify_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& kv_indptr,
                               const at::Tensor& kv_indices, const std::optional<at::Tensor>& qo_indptr,
                               const std::optional<at::Tensor>& tree_mask, at::Tensor& out,
                               const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& o_partial,
                               const std::optional<at::Tensor>& lse_partial, double sm_scale, int64_t num_splits,
                               int64_t min_chunk, int64_t max_rows, double k_scale, double v_scale,
                               const std::optional<at::Tensor>& k_scale_tensor,
                               const std::optional<at::Tensor>& v_scale_tensor) {
  using spec_kernels::kMlaHeadDim;
  using spec_kernels::kMlaVHeadDim;
  TORCH_CHECK(q.is_cuda(), "q must be a CUDA tensor, got device ", q.device());
  const at::Device dev = q.device();
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "q must be float16 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kMlaHeadDim, "q must be [T, H, ", kMlaHeadDim, "], got ", q.sizes());
  const int64_t T = q.size(0), H = q.size(1);
  TORCH_CHECK(H >= 1 && H <= 128, "q must have 1..128 heads, got ", H);
  // cp.async moves 16-byte chunks: rows contiguous, strides and base 16-byte aligned.
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) % 8 == 0 && q.stride(0) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0,
              "q must have contiguous, 16-byte aligned rows, got strides ", q.strides());
  TORCH_CHECK(kv_cache.device() == dev, "kv_cache must be on ", dev, " like q, got ", kv_cache.device());
  const KvFormat kv_format = check_kv_format(q, kv_cache, "kv_cache", k_scale, v_scale, k_scale_tensor, v_scale_tensor);
  TORCH_CHECK(kv_cache.dim() == 2 && kv_cache.size(1) == kMlaHeadDim, "kv_cache must be [S, ", kMlaHeadDim,
              "], got ", kv_cache.sizes());
  TORCH_CHECK(kv_cache.stride(1) == 1 && kv_cache.stride(0) % (16 / static_cast<int64_t>(kv_cache.element_size())) == 0 &&
                  reinterpret_cast<uintptr_t>(kv_cache.data_ptr()) % 16 == 0,
              "kv_cache must have contiguous, 16-byte aligned rows, got strides ", kv_cache.strides());
  check_cuda_vector(kv_indptr, "kv_indptr", at::kInt);
  TORCH_CHECK(kv_indptr.device() == dev, "kv_indptr must be on ", dev, ", got ", kv_indptr.device());
  TORCH_CHECK(kv_indptr.numel() >= 1, "kv_indptr must have B+1 >= 1 entries");
  const int64_t B = kv_indptr.numel() - 1;
  TORCH_CHECK(kv_indices.is_cuda() && kv_indices.device() == dev, "kv_indices must be on ", dev, ", got ",
              kv_indices.device());
  TORCH_CHECK(kv_indices.dim() == 1 && kv_indices.is_contiguous(), "kv_indices must be a contiguous 1-D tensor");
  TORCH_CHECK(kv_indices.scalar_type() == at::kInt || kv_indices.scalar_type() == at::kLong,
              "kv_indices must be int32 or int64, got ", kv_indices.scalar_type());
  TORCH_CHECK(qo_indptr.has_value() == tree_mask.has_value(),
              "qo_indptr and tree_mask must be given together (tree verify) or both omitted (decode)");
  if (qo_indptr.has_value()) {
    check_buffer(*qo_indptr, "qo_indptr", dev, "q", at::kInt, {B + 1});
    check_buffer(*tree_mask, "tree_mask", dev, "q", at::kLong, {T});
  } else {
    TORCH_CHECK(T == B, "decode needs one query per request: q has ", T, " rows, kv_indptr ", B, " requests");
  }
  check_buffer(out, "out", dev, "q", q.scalar_type(), {T, H, kMlaVHeadDim});
  TORCH_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0, "out must be 4-byte aligned (the kernel "
              "stores pairs of values)");
  if (lse.has_value()) check_buffer(*lse, "lse", dev, "q", at::kFloat, {T, H});
  TORCH_CHECK(num_splits >= 1 && num_splits <= 64, "num_splits must be in [1, 64], got ", num_splits);
  TORCH_CHECK(o_partial.has_value() == (num_splits > 1) && lse_partial.has_value() == (num_splits > 1),
              "o_partial and lse_partial must be given exactly when num_splits > 1");
  if (num_splits > 1) {
    check_buffer(*o_partial, "o_partial", dev, "q", at::kFloat, {num_splits, T, H, kMlaVHeadDim});
    check_buffer(*lse_partial, "lse_partial", dev, "q", at::kFloat, {num_splits, T, H});
    TORCH_CHECK(reinterpret_cast<uintptr_t>(o_partial->data_ptr()) % 8 == 0,
                "o_partial must be 8-byte aligned (the kernel stores pairs of floats)");
  }
  TORCH_CHECK(min_chunk >= 0 && min_chunk % 16 == 0 && min_chunk < (int64_t{1} << 30),
              "min_chunk must be a multiple of 16 in [0, 2^30), got ", min_chunk);
  TORCH_CHECK(max_rows >= 1 && max_rows <= 64 * H, "max_rows must be in [1, 64 * H], got ", max_rows);
  const int64_t block_m = spec_kernels::mla_block_m(static_cast<int>(max_rows));
  TORCH_CHECK(B * ((max_rows + block_m - 1) / block_m) < (int64_t{1} << 31), "too many requests for one launch: ", B);
  TORCH_CHECK(T < (int64_t{1} << 31) / H, "too many query rows: T * H must be < 2^31, got T=", T, " H=", H);
  TORCH_CHECK(std::isfinite(sm_scale), "sm_scale must be finite, got ", sm_scale);

  spec_kernels::MlaParams p{};
  p.q = q.data_ptr();
  p.kv_cache = kv_cache.data_ptr();
  fill_attention_batch(p, q, kv_indptr, kv_indices, qo_indptr, tree_mask, out, lse, o_partial, lse_partial,
                       num_splits, min_chunk, max_rows, sm_scale);
  p.kv_stride_s = kv_cache.stride(0);
  p.o_stride_t = out.stride(0);
  p.o_stride_h = out.stride(1);
  p.num_slots = kv_cache.size(0);
  p.num_indices = kv_indices.numel();
  p.num_requests = static_cast<int>(B);
  p.num_tokens = static_cast<int>(T);
  p.num_heads = static_cast<int>(H);
  fill_kv_format(p, kv_format);
  const auto dtype = q.scalar_type() == at::kBFloat16 ? spec_kernels::Dtype::kBFloat16 : spec_kernels::Dtype::kFloat16;
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(spec_kernels::launch_mla_tree_verify_attention(p, dtype, c10::cuda::getCurrentCUDAStream(dev.index()).stream()),
               "mla_tree_verify_attention");
}

std::vector<int64_t> mla_launch_config(int64_t max_rows, int64_t smem_per_sm, int64_t smem_reserved_per_cta,
                                       bool kv_fp8) {
  TORCH_CHECK(max_rows >= 1 && max_rows <= (1 << 30), "max_rows must be in [1, 2^30], got ", max_rows);
  TORCH_CHECK(smem_per_sm >= 0 && smem_per_sm <= (1 << 30), "smem_per_sm must be in [0, 2^30], got ", smem_per_sm);
  TORCH_CHECK(smem_reserved_per_cta >= 0 && smem_reserved_per_cta <= (1 << 20),
              "smem_reserved_per_cta must be in [0, 2^20], got ", smem_reserved_per_cta);
  return shape_values(mla_launch_shape(static_cast<int>(max_rows), static_cast<int>(smem_per_sm),
                                       static_cast<int>(smem_reserved_per_cta), kv_fp8));
}

std::string mla_configs() {
  std::string s;
#define SPEC_KERNELS_MLA_LINE(M_TILES, K_SPLIT, REGS, FP8_REGS)                                        \
  s += shape_line("mla_tree_verify_kernel", #M_TILES ",false," #K_SPLIT,                                 \
                  mla_instance_shape<M_TILES, K_SPLIT, false, REGS>());                                  \
  s += shape_line("mla_tree_verify_kernel", #M_TILES ",true," #K_SPLIT,                                  \
                  mla_instance_shape<M_TILES, K_SPLIT, true, FP8_REGS>());
  SPEC_KERNELS_MLA_CONFIGS(SPEC_KERNELS_MLA_LINE)
#undef SPEC_KERNELS_MLA_LINE
  return s;
}

}  // namespace spec_kernels::binding
