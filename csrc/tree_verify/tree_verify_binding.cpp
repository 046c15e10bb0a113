// torch.ops.spec_kernels_cuda.tree_mask_from_parents / tree_verify_attention: checks, then the
// TreeVerifyParams of csrc/include/spec_kernels/tree_verify.h, then the launch.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "spec_kernels/launchers.h"
#include "spec_kernels/tree_verify.h"
#include "spec_kernels/tree_verify_config.h"

#include "../bindings.h"
#include "../torch_checks.h"

namespace spec_kernels::binding {

void tree_mask_from_parents(const at::Tensor& parents, const at::Tensor& qo_indptr,
                            at::Tensor& tree_mask) {
  check_cuda_vector(parents, "parents", at::kLong);
  check_cuda_vector(qo_indptr, "qo_indptr", at::kInt);
  check_cuda_vector(tree_mask, "tree_mask", at::kLong);
  TORCH_CHECK(qo_indptr.numel() >= 1, "qo_indptr must have B+1 >= 1 entries");
  TORCH_CHECK(tree_mask.numel() == parents.numel(), "tree_mask must have ", parents.numel(),
              " entries (one per draft token), got ", tree_mask.numel());
  TORCH_CHECK(parents.device() == qo_indptr.device() && parents.device() == tree_mask.device(),
              "parents, qo_indptr and tree_mask must be on one device");
  const c10::cuda::CUDAGuard guard(parents.device());
  check_launch(spec_kernels::launch_tree_mask_from_parents(
                   parents.data_ptr<int64_t>(), qo_indptr.data_ptr<int32_t>(),
                   tree_mask.data_ptr<int64_t>(), static_cast<int>(qo_indptr.numel() - 1), parents.numel(),
                   c10::cuda::getCurrentCUDAStream(parents.get_device()).stream()),
               "tree_mask_from_parents");
}

void tree_verify_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                           const std::optional<at::Tensor>& qo_indptr, const std::optional<at::Tensor>& tree_mask,
                           at::Tensor& out, const std::optional<at::Tensor>& lse,
                           const std::optional<at::Tensor>& o_partial, const std::optional<at::Tensor>& lse_partial,
                           double sm_scale, int64_t num_splits, int64_t min_chunk, int64_t max_rows,
                           double k_scale, double v_scale, const std::optional<at::Tensor>& k_scale_tensor,
                           const std::optional<at::Tensor>& v_scale_tensor) {
  TORCH_CHECK(q.is_cuda(), "q must be a CUDA tensor, got device ", q.device());
  const at::Device dev = q.device();
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "q must be float16 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              "q, k_cache and v_cache must be 3-D ([T, Hq, D], [S, Hkv, D], [S, Hkv, D])");
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&out, "out"}}) {
    check_cuda(*t, name, dev);
  }
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out must have q's dtype ", q.scalar_type());
  const KvFormat kv_format = check_kv_format(q, k_cache, "k_cache", k_scale, v_scale, k_scale_tensor, v_scale_tensor);
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "v_cache must have k_cache's dtype ",
              k_cache.scalar_type(), ", got ", v_cache.scalar_type());
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), S = k_cache.size(0), Hkv = k_cache.size(1);
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "head dim must be 64, 128 or 256, got ", D);
  check_shape(k_cache, "k_cache", {S, Hkv, D});
  check_shape(v_cache, "v_cache", {S, Hkv, D});
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "q heads (", Hq, ") must be a multiple of KV heads (", Hkv, ")");
  check_shape(out, "out", {T, Hq, D});
  check_cuda(kv_indptr, "kv_indptr", dev);
  TORCH_CHECK(kv_indptr.dim() == 1 && kv_indptr.numel() >= 1 && kv_indptr.scalar_type() == at::kInt,
              "kv_indptr must be int32 [B+1]");
  const int64_t B = kv_indptr.numel() - 1;
  check_cuda(kv_indices, "kv_indices", dev);
  TORCH_CHECK(kv_indices.dim() == 1 && (kv_indices.scalar_type() == at::kInt || kv_indices.scalar_type() == at::kLong),
              "kv_indices must be 1-D int32 or int64");
  TORCH_CHECK(qo_indptr.has_value() == tree_mask.has_value(), "qo_indptr and tree_mask go together (both None: decode)");
  if (qo_indptr.has_value()) {
    check_buffer(*qo_indptr, "qo_indptr", dev, "q", at::kInt, {B + 1});
    check_buffer(*tree_mask, "tree_mask", dev, "q", at::kLong, {T});
  } else {
    TORCH_CHECK(T == B, "decode needs one query per request: q has ", T, " rows, kv_indptr ", B, " requests");
  }
  if (lse.has_value()) check_buffer(*lse, "lse", dev, "q", at::kFloat, {T, Hq});
  TORCH_CHECK(num_splits >= 1 && num_splits <= 64, "num_splits must be in [1, 64], got ", num_splits);
  TORCH_CHECK(min_chunk >= 0 && min_chunk < (int64_t{1} << 30), "min_chunk must be in [0, 2^30), got ", min_chunk);
  if (num_splits > 1) {
    TORCH_CHECK(o_partial.has_value() && lse_partial.has_value(), "num_splits > 1 needs o_partial and lse_partial");
    check_buffer(*o_partial, "o_partial", dev, "q", at::kFloat, {num_splits, T, Hq, D});
    check_buffer(*lse_partial, "lse_partial", dev, "q", at::kFloat, {num_splits, T, Hq});
    // The kernel stores o_partial in 8-byte pairs.
    TORCH_CHECK(reinterpret_cast<uintptr_t>(o_partial->data_ptr()) % 8 == 0, "o_partial must be 8-byte aligned");
  }
  // cp.async moves 16-byte chunks of q/k/v rows; a view with an odd storage offset would fault.
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&out, "out"}}) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
    const int64_t chunk = 16 / static_cast<int64_t>(t->element_size());  // elements per 16-byte chunk
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) % chunk == 0 && t->stride(0) % chunk == 0, name,
                " must have a unit last stride and the others multiples of 16 bytes, got strides ", t->strides());
  }
  TORCH_CHECK(num_splits * T * Hq < (int64_t{1} << 31) && B * Hkv * (Hq / Hkv) * 64 < (int64_t{1} << 31),
              "batch too large for 32-bit grid indexing");

  spec_kernels::TreeVerifyParams p{};
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  fill_attention_batch(p, q, kv_indptr, kv_indices, qo_indptr, tree_mask, out, lse, o_partial, lse_partial,
                       num_splits, min_chunk, max_rows, sm_scale);
  p.k_stride_s = k_cache.stride(0);
  p.k_stride_h = k_cache.stride(1);
  p.v_stride_s = v_cache.stride(0);
  p.v_stride_h = v_cache.stride(1);
  p.o_stride_t = out.stride(0);
  p.o_stride_h = out.stride(1);
  p.num_requests = static_cast<int>(B);
  p.num_tokens = static_cast<int>(T);
  p.num_q_heads = static_cast<int>(Hq);
  p.num_kv_heads = static_cast<int>(Hkv);
  p.head_dim = static_cast<int>(D);
  p.num_slots = S;
  p.num_indices = kv_indices.numel();
  fill_kv_format(p, kv_format);
  const int64_t group = Hq / Hkv;
  TORCH_CHECK(max_rows >= 1 && max_rows <= spec_kernels::kMaxDraftTokens * group,
              "max_rows must be in [1, 64 * Hq / Hkv], got ", max_rows);
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(spec_kernels::launch_tree_verify_attention(
                   p, q.scalar_type() == at::kBFloat16 ? spec_kernels::Dtype::kBFloat16 : spec_kernels::Dtype::kFloat16,
                   c10::cuda::getCurrentCUDAStream(dev.index()).stream()),
               "tree_verify_attention");
}

std::vector<int64_t> tree_verify_launch_config(int64_t head_dim, int64_t max_rows, int64_t smem_per_sm,
                                               int64_t smem_reserved_per_cta, bool kv_fp8) {
  TORCH_CHECK(max_rows >= 1 && max_rows <= (1 << 30), "max_rows must be in [1, 2^30], got ", max_rows);
  TORCH_CHECK(smem_per_sm >= 0 && smem_per_sm <= (1 << 30), "smem_per_sm must be in [0, 2^30], got ", smem_per_sm);
  TORCH_CHECK(smem_reserved_per_cta >= 0 && smem_reserved_per_cta <= (1 << 20),
              "smem_reserved_per_cta must be in [0, 2^20], got ", smem_reserved_per_cta);
  TORCH_CHECK(head_dim >= 0 && head_dim <= (1 << 20), "head_dim must be in [0, 2^20], got ", head_dim);
  return shape_values(tree_verify_launch_shape(static_cast<int>(head_dim), static_cast<int>(max_rows),
                                               static_cast<int>(smem_per_sm), static_cast<int>(smem_reserved_per_cta),
                                               kv_fp8));
}

std::string tree_verify_configs() {
  std::string s;
#define SPEC_KERNELS_TV_LINE(D, ROWS, MT, REGS, FP8_REGS)                                         \
  s += shape_line("tree_verify_kernel", #D "," #ROWS ",false," #MT,                                  \
                  tree_verify_instance_shape<D, ROWS, false, MT, REGS>());                          \
  s += shape_line("tree_verify_kernel", #D "," #ROWS ",true," #MT, tree_verify_instance_shape<D, ROWS, true, MT, FP8_REGS>());
  SPEC_KERNELS_TREE_VERIFY_CONFIGS(SPEC_KERNELS_TV_LINE)
#undef SPEC_KERNELS_TV_LINE
  return s;
}

}  // namespace spec_kernels::binding
