// The one registration file for the C++ ops: torch.ops.spec_kernels_cuda.*
//
// These are the raw CUDA implementations. The public ops (torch.ops.spec_kernels.*, with fake
// implementations and the cuda -> triton -> reference dispatch) live in Python and call these.
// Every input is checked here with TORCH_CHECK, so a direct call cannot crash on bad metadata.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "spec_kernels/launchers.h"
#include "spec_kernels/tree_verify.h"
#include "spec_kernels/norm_allreduce.h"
#include "spec_kernels/mla.h"

namespace {

void check_cuda_vector(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.dim() == 1, name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

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

std::vector<int64_t> compiled_archs() {
  int archs[16];
  const int n = spec_kernels::compiled_cuda_archs(archs, 16);
  return std::vector<int64_t>(archs, archs + n);
}

int64_t compiled_cuda_version() { return spec_kernels::compiled_cuda_runtime_version(); }

// ---------------------------------------------------------------- tree-verify attention
void check_cuda(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, " like q, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_shape(const at::Tensor& t, const char* name, c10::IntArrayRef expected) {
  TORCH_CHECK(t.sizes() == expected, name, " must have shape ", expected, ", got ", t.sizes());
}

void tree_verify_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                           const std::optional<at::Tensor>& qo_indptr, const std::optional<at::Tensor>& tree_mask,
                           at::Tensor& out, const std::optional<at::Tensor>& lse,
                           const std::optional<at::Tensor>& o_partial, const std::optional<at::Tensor>& lse_partial,
                           double sm_scale, int64_t num_splits, int64_t min_chunk, int64_t max_rows) {
  TORCH_CHECK(q.is_cuda(), "q must be a CUDA tensor, got device ", q.device());
  const at::Device dev = q.device();
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "q must be float16 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              "q, k_cache and v_cache must be 3-D ([T, Hq, D], [S, Hkv, D], [S, Hkv, D])");
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&out, "out"}}) {
    check_cuda(*t, name, dev);
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), name, " must have q's dtype ", q.scalar_type());
  }
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
    check_cuda(*qo_indptr, "qo_indptr", dev);
    TORCH_CHECK(qo_indptr->scalar_type() == at::kInt, "qo_indptr must be int32");
    check_shape(*qo_indptr, "qo_indptr", {B + 1});
    check_cuda(*tree_mask, "tree_mask", dev);
    TORCH_CHECK(tree_mask->scalar_type() == at::kLong, "tree_mask must be int64");
    check_shape(*tree_mask, "tree_mask", {T});
  } else {
    TORCH_CHECK(T == B, "decode needs one query per request: q has ", T, " rows, kv_indptr ", B, " requests");
  }
  if (lse.has_value()) {
    check_cuda(*lse, "lse", dev);
    TORCH_CHECK(lse->scalar_type() == at::kFloat, "lse must be float32");
    check_shape(*lse, "lse", {T, Hq});
  }
  TORCH_CHECK(num_splits >= 1 && num_splits <= 64, "num_splits must be in [1, 64], got ", num_splits);
  TORCH_CHECK(min_chunk >= 0 && min_chunk < (int64_t{1} << 30), "min_chunk must be in [0, 2^30), got ", min_chunk);
  if (num_splits > 1) {
    TORCH_CHECK(o_partial.has_value() && lse_partial.has_value(), "num_splits > 1 needs o_partial and lse_partial");
    check_cuda(*o_partial, "o_partial", dev);
    check_cuda(*lse_partial, "lse_partial", dev);
    TORCH_CHECK(o_partial->scalar_type() == at::kFloat && lse_partial->scalar_type() == at::kFloat,
                "o_partial and lse_partial must be float32");
    check_shape(*o_partial, "o_partial", {num_splits, T, Hq, D});
    check_shape(*lse_partial, "lse_partial", {num_splits, T, Hq});
    // The kernel stores o_partial in 8-byte pairs.
    TORCH_CHECK(reinterpret_cast<uintptr_t>(o_partial->data_ptr()) % 8 == 0, "o_partial must be 8-byte aligned");
  }
  // cp.async moves 16-byte chunks of q/k/v rows; a view with an odd storage offset would fault.
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&out, "out"}}) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
  }
  TORCH_CHECK(num_splits * T * Hq < (int64_t{1} << 31) && B * Hkv * (Hq / Hkv) * 64 < (int64_t{1} << 31),
              "batch too large for 32-bit grid indexing");

  spec_kernels::TreeVerifyParams p{};
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
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
  const int64_t group = Hq / Hkv;
  TORCH_CHECK(max_rows >= 1 && max_rows <= spec_kernels::kMaxDraftTokens * group,
              "max_rows must be in [1, 64 * Hq / Hkv], got ", max_rows);
  p.max_rows = static_cast<int>(max_rows);
  p.num_splits = static_cast<int>(num_splits);
  p.min_chunk = static_cast<int>(min_chunk);
  p.sm_scale_log2 = static_cast<float>(sm_scale * 1.4426950408889634);
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(spec_kernels::launch_tree_verify_attention(
                   p, q.scalar_type() == at::kBFloat16 ? spec_kernels::Dtype::kBFloat16 : spec_kernels::Dtype::kFloat16,
                   c10::cuda::getCurrentCUDAStream(dev.index()).stream()),
               "tree_verify_attention");
}

// ---------------------------------------------------------------- MLA tree-verify attention
// t: a CUDA tensor on `device` of `dtype` with exactly `sizes`, contiguous.
void check_mla_buffer(const at::Tensor& t, const char* name, const at::Device& device, at::ScalarType dtype,
                      at::IntArrayRef sizes) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, " like q, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == sizes, name, " must have shape ", sizes, ", got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void mla_tree_verify_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& kv_indptr,
                               const at::Tensor& kv_indices, const std::optional<at::Tensor>& qo_indptr,
                               const std::optional<at::Tensor>& tree_mask, at::Tensor& out,
                               const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& o_partial,
                               const std::optional<at::Tensor>& lse_partial, double sm_scale, int64_t num_splits,
                               int64_t min_chunk, int64_t max_rows) {
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
  TORCH_CHECK(kv_cache.scalar_type() == q.scalar_type(), "kv_cache must be ", q.scalar_type(), ", got ",
              kv_cache.scalar_type());
  TORCH_CHECK(kv_cache.dim() == 2 && kv_cache.size(1) == kMlaHeadDim, "kv_cache must be [S, ", kMlaHeadDim,
              "], got ", kv_cache.sizes());
  TORCH_CHECK(kv_cache.stride(1) == 1 && kv_cache.stride(0) % 8 == 0 &&
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
    check_mla_buffer(*qo_indptr, "qo_indptr", dev, at::kInt, {B + 1});
    check_mla_buffer(*tree_mask, "tree_mask", dev, at::kLong, {T});
  } else {
    TORCH_CHECK(T == B, "decode needs one query per request: q has ", T, " rows, kv_indptr ", B, " requests");
  }
  check_mla_buffer(out, "out", dev, q.scalar_type(), {T, H, kMlaVHeadDim});
  TORCH_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0, "out must be 4-byte aligned (the kernel "
              "stores pairs of values)");
  if (lse.has_value()) check_mla_buffer(*lse, "lse", dev, at::kFloat, {T, H});
  TORCH_CHECK(num_splits >= 1 && num_splits <= 64, "num_splits must be in [1, 64], got ", num_splits);
  TORCH_CHECK(o_partial.has_value() == (num_splits > 1) && lse_partial.has_value() == (num_splits > 1),
              "o_partial and lse_partial must be given exactly when num_splits > 1");
  if (num_splits > 1) {
    check_mla_buffer(*o_partial, "o_partial", dev, at::kFloat, {num_splits, T, H, kMlaVHeadDim});
    check_mla_buffer(*lse_partial, "lse_partial", dev, at::kFloat, {num_splits, T, H});
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
  p.kv_stride_s = kv_cache.stride(0);
  p.o_stride_t = out.stride(0);
  p.o_stride_h = out.stride(1);
  p.num_slots = kv_cache.size(0);
  p.num_indices = kv_indices.numel();
  p.num_requests = static_cast<int>(B);
  p.num_tokens = static_cast<int>(T);
  p.num_heads = static_cast<int>(H);
  p.max_rows = static_cast<int>(max_rows);
  p.num_splits = static_cast<int>(num_splits);
  p.min_chunk = static_cast<int>(min_chunk);
  p.sm_scale_log2 = static_cast<float>(sm_scale * 1.4426950408889634);
  const auto dtype = q.scalar_type() == at::kBFloat16 ? spec_kernels::Dtype::kBFloat16 : spec_kernels::Dtype::kFloat16;
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(spec_kernels::launch_mla_tree_verify_attention(p, dtype, c10::cuda::getCurrentCUDAStream(dev.index()).stream()),
               "mla_tree_verify_attention");
}

// ---------------------------------------------------------------- draft-token KV slots
spec_kernels::IndexTensor index_tensor(const at::Tensor& t, const char* name, const at::Device& device, int dim) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, " like req_to_token, got ", t.device());
  TORCH_CHECK(t.dim() == dim, name, " must be ", dim, "-D, got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name, " must be int32 or int64, got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  return {t.data_ptr(), t.scalar_type() == at::kLong};
}

spec_kernels::KvSlotBatch kv_slot_batch(const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                        const at::Tensor& seq_lens, const at::Tensor& num_draft,
                                        const at::Tensor& free_pages, const at::Tensor& num_free,
                                        const at::Tensor& page_state, int64_t page_size, int64_t max_draft,
                                        const at::Tensor& status) {
  TORCH_CHECK(req_to_token.is_cuda(), "req_to_token must be a CUDA tensor, got device ", req_to_token.device());
  const at::Device dev = req_to_token.device();
  spec_kernels::KvSlotBatch b{};
  b.req_to_token = index_tensor(req_to_token, "req_to_token", dev, 2);
  b.num_rows = req_to_token.size(0);
  b.max_context = req_to_token.size(1);
  TORCH_CHECK(b.num_rows < INT32_MAX && b.max_context < INT32_MAX, "req_to_token must have < 2^31 rows and columns");
  b.req_pool_indices = index_tensor(req_pool_indices, "req_pool_indices", dev, 1);
  const int64_t B = req_pool_indices.numel();
  TORCH_CHECK(B < (int64_t{1} << 24), "at most 2^24 requests, got ", B);
  b.seq_lens = index_tensor(seq_lens, "seq_lens", dev, 1);
  b.num_draft = index_tensor(num_draft, "num_draft", dev, 1);
  TORCH_CHECK(seq_lens.numel() == B && num_draft.numel() == B, "seq_lens and num_draft must have ", B,
              " entries like req_pool_indices, got ", seq_lens.numel(), " and ", num_draft.numel());
  b.num_requests = static_cast<int>(B);
  check_cuda_vector(free_pages, "free_pages", at::kLong);
  TORCH_CHECK(free_pages.device() == dev, "free_pages must be on ", dev, ", got ", free_pages.device());
  TORCH_CHECK(free_pages.numel() < INT32_MAX, "free_pages must have < 2^31 entries");
  b.free_pages = free_pages.data_ptr<int64_t>();
  b.num_pages = free_pages.numel();
  check_cuda_vector(num_free, "num_free", at::kLong);
  TORCH_CHECK(num_free.device() == dev && num_free.numel() == 1, "num_free must be one int64 on ", dev);
  b.num_free = num_free.data_ptr<int64_t>();
  check_cuda_vector(page_state, "page_state", at::kInt);
  TORCH_CHECK(page_state.device() == dev && page_state.numel() == b.num_pages, "page_state must be int32 [",
              b.num_pages, "] (one entry per page, like free_pages) on ", dev, ", got ", page_state.sizes(), " on ",
              page_state.device());
  b.page_state = page_state.data_ptr<int32_t>();
  TORCH_CHECK(page_size >= 1 && page_size <= (1 << 20) && (page_size & (page_size - 1)) == 0,
              "page_size must be a power of two in [1, 2^20], got ", page_size);
  b.log2_page_size = __builtin_ctzll(static_cast<uint64_t>(page_size));
  TORCH_CHECK(max_draft >= 1 && max_draft <= spec_kernels::kMaxDraftTokens, "max_draft must be in [1, ",
              spec_kernels::kMaxDraftTokens, "], got ", max_draft);
  b.max_draft = static_cast<int>(max_draft);
  check_cuda_vector(status, "status", at::kLong);
  TORCH_CHECK(status.device() == dev && status.numel() == spec_kernels::kKvSlotsStatusLen, "status must be int64 [",
              spec_kernels::kKvSlotsStatusLen, "] on ", dev);
  b.status = status.data_ptr<int64_t>();
  return b;
}

void alloc_draft_slots(at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                       const at::Tensor& num_draft, at::Tensor& free_pages, at::Tensor& num_free,
                       at::Tensor& page_state, int64_t page_size, int64_t max_draft, at::Tensor& out_cache_loc,
                       at::Tensor& status) {
  const auto batch = kv_slot_batch(req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free,
                                   page_state, page_size, max_draft, status);
  check_cuda_vector(out_cache_loc, "out_cache_loc", at::kLong);
  TORCH_CHECK(out_cache_loc.device() == req_to_token.device(), "out_cache_loc must be on ", req_to_token.device());
  const c10::cuda::CUDAGuard guard(req_to_token.device());
  check_launch(spec_kernels::launch_alloc_draft_slots(batch, out_cache_loc.data_ptr<int64_t>(), out_cache_loc.numel(),
                                                      c10::cuda::getCurrentCUDAStream().stream()),
               "alloc_draft_slots");
}

void commit_draft_slots(at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                        const at::Tensor& num_draft, const at::Tensor& accept_index, const at::Tensor& accept_len,
                        at::Tensor& free_pages, at::Tensor& num_free, at::Tensor& page_state, int64_t page_size,
                        int64_t max_draft, const std::optional<at::Tensor>& kv_table, int64_t kv_rows,
                        int64_t kv_unit_bytes, int64_t kv_blocks_per_request,
                        const std::optional<at::Tensor>& move_sync, int64_t move_tag, at::Tensor& new_seq_lens,
                        at::Tensor& status) {
  const auto batch = kv_slot_batch(req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free,
                                   page_state, page_size, max_draft, status);
  const at::Device dev = req_to_token.device();
  spec_kernels::KvCommitArgs args{};
  args.accept_index = index_tensor(accept_index, "accept_index", dev, 2);
  TORCH_CHECK(accept_index.size(0) == batch.num_requests && accept_index.size(1) <= spec_kernels::kMaxDraftTokens,
              "accept_index must have shape (", batch.num_requests, ", A) with A <= ", spec_kernels::kMaxDraftTokens,
              ", got ", accept_index.sizes());
  args.accept_width = accept_index.size(1);
  args.accept_len = index_tensor(accept_len, "accept_len", dev, 1);
  TORCH_CHECK(accept_len.numel() == batch.num_requests, "accept_len must have ", batch.num_requests, " entries");
  args.new_seq_lens = index_tensor(new_seq_lens, "new_seq_lens", dev, 1);
  TORCH_CHECK(new_seq_lens.numel() == batch.num_requests && new_seq_lens.scalar_type() == seq_lens.scalar_type(),
              "new_seq_lens must be like seq_lens");
  if (kv_table.has_value()) {
    const at::Tensor& t = *kv_table;
    TORCH_CHECK(t.device() == dev && t.scalar_type() == at::kLong && t.dim() == 2 && t.size(0) == 3 &&
                    t.size(1) >= 1 && t.is_contiguous(),
                "kv_table must be a contiguous int64 [3, num_buffers] on ", dev, ", got ", t.sizes());
    TORCH_CHECK(kv_rows >= 1, "kv_rows must be >= 1, got ", kv_rows);
    TORCH_CHECK(kv_unit_bytes >= 1 && kv_unit_bytes <= 16 && (kv_unit_bytes & (kv_unit_bytes - 1)) == 0,
                "kv_unit_bytes must be 1, 2, 4, 8 or 16, got ", kv_unit_bytes);
    TORCH_CHECK(kv_blocks_per_request >= 1 && kv_blocks_per_request <= 65535,
                "kv_blocks_per_request must be in [1, 65535], got ", kv_blocks_per_request);
    args.kv_table = t.data_ptr<int64_t>();
    args.num_kv_buffers = static_cast<int>(t.size(1));
    args.num_kv_rows = kv_rows;
    args.kv_unit_bytes = static_cast<int>(kv_unit_bytes);
    args.kv_blocks_per_request = static_cast<int>(kv_blocks_per_request);
  }
  // Rows move (and the kernel needs the hand-off scratch) only with pages > 1 and requests.
  if (kv_table.has_value() && page_size > 1 && batch.num_requests > 0) {
    TORCH_CHECK(int64_t{batch.num_requests} * kv_blocks_per_request <= spec_kernels::kKvMoveMaxBlocks,
                "commit_draft_slots: num_requests x kv_blocks_per_request must be <= ",
                spec_kernels::kKvMoveMaxBlocks, ", got ", batch.num_requests, " x ", kv_blocks_per_request);
    TORCH_CHECK(move_sync.has_value(), "move_sync is required when KV rows move (kv_table, page_size > 1)");
    const at::Tensor& w = *move_sync;
    TORCH_CHECK(w.device() == dev && w.scalar_type() == at::kLong && w.dim() == 1 &&
                    w.numel() == spec_kernels::kKvMoveSyncWords && w.is_contiguous(),
                "move_sync must be a contiguous int64 [", spec_kernels::kKvMoveSyncWords, "] on ", dev, ", got ",
                w.sizes());
    TORCH_CHECK(move_tag >= 1 && move_tag < (int64_t{1} << spec_kernels::kKvMoveTagBits), "move_tag must be in [1, 2^",
                spec_kernels::kKvMoveTagBits, "), got ", move_tag);
    args.move_sync = reinterpret_cast<uint64_t*>(w.data_ptr<int64_t>());
    args.move_tag = static_cast<uint64_t>(move_tag);
  }
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(spec_kernels::launch_commit_draft_slots(batch, args, c10::cuda::getCurrentCUDAStream().stream()),
               "commit_draft_slots");
}

// ---------------------------------------------------------------- fused add + RMSNorm, allreduce
spec_kernels::NormDType norm_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kHalf: return spec_kernels::NormDType::kFloat16;
    case at::kBFloat16: return spec_kernels::NormDType::kBFloat16;
    case at::kFloat: return spec_kernels::NormDType::kFloat32;
    default: break;
  }
  TORCH_CHECK(false, name, " must be float16, bfloat16 or float32, got ", t.scalar_type());
}

// t: a contiguous CUDA tensor like `like` (same device and shape) of dtype `dtype`.
void check_like(const at::Tensor& t, const char* name, const at::Tensor& like, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.device() == like.device(), name, " must be on ", like.device(), " like x, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == like.sizes(), name, " must have shape ", like.sizes(), ", got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor, got device ", x.device());
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [tokens, hidden], got shape ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK(x.size(1) >= 1 && x.size(1) <= spec_kernels::kMaxNormHidden,
              "x must have 1 <= hidden <= ", spec_kernels::kMaxNormHidden, " columns, got ", x.size(1));
}

void check_weight(const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK(weight.is_cuda() && weight.device() == x.device(), "weight must be on ", x.device());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must have shape [", x.size(1),
              "], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight must be ", x.scalar_type(), ", got ",
              weight.scalar_type());
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
}

// 1 / out_scale in fp32 (what every implementation multiplies by), 1 without fp8 output.
float inv_out_scale(const std::optional<double>& out_scale) {
  if (!out_scale.has_value()) return 1.f;
  TORCH_CHECK(std::isfinite(*out_scale) && *out_scale > 0, "out_scale must be finite and > 0, got ", *out_scale);
  return static_cast<float>(1.0 / *out_scale);
}

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

// ---- allreduce: buffers (raw device pointers travel as int64) and the call
namespace ar = spec_kernels::allreduce;

void* as_ptr(int64_t p, const char* name) {
  TORCH_CHECK(p != 0, name, " is a null pointer");
  return reinterpret_cast<void*>(static_cast<intptr_t>(p));
}

void check_buffer_sizes(int64_t world, int64_t max_bytes, int64_t push_bytes) {
  TORCH_CHECK(world == 2 || world == 4 || world == 8, "world must be 2, 4 or 8, got ", world);
  TORCH_CHECK(max_bytes > 0 && max_bytes < (int64_t{1} << 28), "max_bytes must be in (0, 2^28), got ", max_bytes);
  TORCH_CHECK(push_bytes > 0 && push_bytes <= max_bytes, "push_bytes must be in (0, max_bytes], got ", push_bytes);
}

int64_t allreduce_buffer_bytes(int64_t world, int64_t max_bytes, int64_t push_bytes) {
  check_buffer_sizes(world, max_bytes, push_bytes);
  return static_cast<int64_t>(ar::buffer_bytes(static_cast<int>(world), max_bytes, push_bytes));
}

int64_t allreduce_ipc_alloc(int64_t bytes, int64_t device) {
  TORCH_CHECK(bytes > 0, "bytes must be > 0, got ", bytes);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* ptr = nullptr;
  check_launch(ar::ipc_alloc(static_cast<size_t>(bytes), &ptr), "allreduce_ipc_alloc");
  return reinterpret_cast<intptr_t>(ptr);
}

void allreduce_ipc_free(int64_t ptr, int64_t device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  check_launch(ar::ipc_free(as_ptr(ptr, "ptr")), "allreduce_ipc_free");
}

at::Tensor allreduce_ipc_handle(int64_t ptr, int64_t device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  at::Tensor handle = at::empty({64}, at::TensorOptions().dtype(at::kByte));
  check_launch(ar::ipc_handle(as_ptr(ptr, "ptr"), handle.data_ptr<uint8_t>()), "allreduce_ipc_handle");
  return handle;
}

int64_t allreduce_ipc_open(const at::Tensor& handle, int64_t device) {
  TORCH_CHECK(handle.device().is_cpu() && handle.scalar_type() == at::kByte && handle.numel() == 64 &&
                  handle.is_contiguous(),
              "handle must be a contiguous CPU uint8 tensor of 64 bytes (from allreduce_ipc_handle)");
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* ptr = nullptr;
  check_launch(ar::ipc_open(handle.data_ptr<uint8_t>(), &ptr), "allreduce_ipc_open");
  return reinterpret_cast<intptr_t>(ptr);
}

void allreduce_ipc_close(int64_t ptr, int64_t device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  check_launch(ar::ipc_close(as_ptr(ptr, "ptr")), "allreduce_ipc_close");
}

void allreduce_init_buffer(int64_t ptr, int64_t world, int64_t max_bytes, int64_t push_bytes, int64_t num_blocks,
                           int64_t device) {
  check_buffer_sizes(world, max_bytes, push_bytes);
  TORCH_CHECK(num_blocks >= 1 && num_blocks <= ar::kMaxBlocks, "num_blocks must be in [1, ", ar::kMaxBlocks,
              "], got ", num_blocks);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  check_launch(ar::init_buffer(as_ptr(ptr, "ptr"), static_cast<int>(world), max_bytes, push_bytes,
                               static_cast<int>(num_blocks),
                               c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream()),
               "allreduce_init_buffer");
}

void fused_allreduce(int64_t algorithm, int64_t rank, at::IntArrayRef bases, int64_t max_bytes,
                     int64_t push_bytes, int64_t num_blocks, const at::Tensor& x,
                     const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& weight,
                     at::Tensor& out, const std::optional<at::Tensor>& residual_out, double eps,
                     std::optional<double> out_scale, int64_t timeout_ns, int64_t error_word) {
  const int64_t world = static_cast<int64_t>(bases.size());
  check_buffer_sizes(world, max_bytes, push_bytes);
  TORCH_CHECK(algorithm >= ar::kOneShotPush && algorithm <= ar::kOneShotPush1Block, "algorithm must be 0 "
              "(one-shot push), 1 (one-shot pull), 2 (two-shot) or 3 (one-shot push, one block), got ", algorithm);
  TORCH_CHECK(rank >= 0 && rank < world, "rank must be in [0, ", world, "), got ", rank);
  TORCH_CHECK(num_blocks >= 1 && num_blocks <= ar::kMaxBlocks, "num_blocks must be in [1, ", ar::kMaxBlocks,
              "], got ", num_blocks);
  TORCH_CHECK(timeout_ns > 0, "timeout_ns must be > 0, got ", timeout_ns);
  check_rows(x);
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "x must be float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) % 8 == 0, "x's hidden size must be a multiple of 8 (16-byte rows), got ", x.size(1));
  const int64_t bytes = x.numel() * x.element_size();
  TORCH_CHECK(bytes <= max_bytes, "x has ", bytes, " bytes, more than max_bytes=", max_bytes);
  TORCH_CHECK((algorithm != ar::kOneShotPush && algorithm != ar::kOneShotPush1Block) || bytes <= push_bytes, "x has ",
              bytes,
              " bytes, more than the push path's push_bytes=", push_bytes);
  const bool fused = residual.has_value();
  TORCH_CHECK(fused == weight.has_value() && fused == residual_out.has_value(),
              "residual, weight and residual_out must be given together (fused) or not at all");
  TORCH_CHECK(fused || !out_scale.has_value(), "out_scale needs the fused epilogue (residual, weight)");
  if (fused) {
    check_like(*residual, "residual", x, x.scalar_type());
    check_weight(*weight, x);
    check_like(*residual_out, "residual_out", x, x.scalar_type());
    TORCH_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  }
  check_like(out, "out", x, out_scale.has_value() ? at::kFloat8_e4m3fn : x.scalar_type());
  // The kernels move 16-byte vectors (8-byte ones of an fp8 out); launch() refuses misaligned
  // pointers too, but only here can the error name the tensor.
  const auto check_aligned = [](const at::Tensor& t, const char* name, uintptr_t bytes) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0, name, " must be ", bytes,
                "-byte aligned (the kernels move whole vectors); got a view at an odd offset");
  };
  check_aligned(x, "x", 16);
  check_aligned(out, "out", out_scale.has_value() ? 8 : 16);
  if (fused) {
    check_aligned(*residual, "residual", 16);
    check_aligned(*weight, "weight", 16);
    check_aligned(*residual_out, "residual_out", 16);
  }
  ar::Call call{};
  call.algorithm = static_cast<int>(algorithm);
  call.world = static_cast<int>(world);
  call.rank = static_cast<int>(rank);
  for (int64_t r = 0; r < world; ++r) call.bases[r] = as_ptr(bases[r], "bases[r]");
  call.max_bytes = max_bytes;
  call.push_bytes = push_bytes;
  call.num_blocks = static_cast<int>(num_blocks);
  call.x = x.data_ptr();
  call.residual = fused ? residual->data_ptr() : nullptr;
  call.weight = fused ? weight->data_ptr() : nullptr;
  call.out = out.data_ptr();
  call.residual_out = fused ? residual_out->data_ptr() : nullptr;
  call.rows = x.size(0);
  call.hidden = static_cast<int>(x.size(1));
  call.dtype = norm_dtype(x, "x");
  call.fused = fused;
  call.fp8_out = out_scale.has_value();
  call.eps = static_cast<float>(eps);
  call.inv_scale = inv_out_scale(out_scale);
  call.timeout_ns = static_cast<uint64_t>(timeout_ns);
  call.error = static_cast<ar::ErrorWord*>(as_ptr(error_word, "error_word"));
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(ar::launch(call, c10::cuda::getCurrentCUDAStream(x.get_device()).stream()), "fused_allreduce");
}

}  // namespace

TORCH_LIBRARY(spec_kernels_cuda, m) {
  m.def("compiled_archs() -> int[]", &compiled_archs);
  m.def("compiled_cuda_version() -> int", &compiled_cuda_version);
  m.def("tree_mask_from_parents(Tensor parents, Tensor qo_indptr, Tensor(a!) tree_mask) -> ()");
  m.impl("tree_mask_from_parents", c10::DispatchKey::CUDA, &tree_mask_from_parents);
  m.def(
      "tree_verify_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_indptr, Tensor kv_indices, "
      "Tensor? qo_indptr, Tensor? tree_mask, Tensor(a!) out, Tensor(b!)? lse, Tensor(c!)? o_partial, "
      "Tensor(d!)? lse_partial, float sm_scale, int num_splits, int min_chunk, int max_rows) -> ()");
  m.impl("tree_verify_attention", c10::DispatchKey::CUDA, &tree_verify_attention);
  m.def(
      "mla_tree_verify_attention(Tensor q, Tensor kv_cache, Tensor kv_indptr, Tensor kv_indices, Tensor? qo_indptr, "
      "Tensor? tree_mask, Tensor(a!) out, Tensor(b!)? lse, Tensor(c!)? o_partial, Tensor(d!)? lse_partial, "
      "float sm_scale, int num_splits, int min_chunk, int max_rows) -> ()");
  m.impl("mla_tree_verify_attention", c10::DispatchKey::CUDA, &mla_tree_verify_attention);
  m.def(
      "alloc_draft_slots(Tensor(a!) req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor num_draft, "
      "Tensor(b!) free_pages, Tensor(c!) num_free, Tensor(f!) page_state, int page_size, int max_draft, "
      "Tensor(d!) out_cache_loc, Tensor(e!) status) -> ()");
  m.impl("alloc_draft_slots", c10::DispatchKey::CUDA, &alloc_draft_slots);
  m.def(
      "commit_draft_slots(Tensor(a!) req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor num_draft, "
      "Tensor accept_index, Tensor accept_len, Tensor(b!) free_pages, Tensor(c!) num_free, Tensor(g!) page_state, "
      "int page_size, int max_draft, Tensor? kv_table, int kv_rows, int kv_unit_bytes, int kv_blocks_per_request, "
      "Tensor(f!)? move_sync, int move_tag, Tensor(d!) new_seq_lens, Tensor(e!) status) -> ()");
  m.impl("commit_draft_slots", c10::DispatchKey::CUDA, &commit_draft_slots);
  m.def("fused_add_rmsnorm(Tensor x, Tensor residual, Tensor weight, Tensor(a!) out, Tensor(b!) residual_out, "
        "float eps, float? out_scale) -> ()");
  m.impl("fused_add_rmsnorm", c10::DispatchKey::CUDA, &fused_add_rmsnorm);
  m.def("allreduce_buffer_bytes(int world, int max_bytes, int push_bytes) -> int", &allreduce_buffer_bytes);
  m.def("allreduce_ipc_alloc(int bytes, int device) -> int", &allreduce_ipc_alloc);
  m.def("allreduce_ipc_free(int ptr, int device) -> ()", &allreduce_ipc_free);
  m.def("allreduce_ipc_handle(int ptr, int device) -> Tensor", &allreduce_ipc_handle);
  m.def("allreduce_ipc_open(Tensor handle, int device) -> int", &allreduce_ipc_open);
  m.def("allreduce_ipc_close(int ptr, int device) -> ()", &allreduce_ipc_close);
  m.def("allreduce_init_buffer(int ptr, int world, int max_bytes, int push_bytes, int num_blocks, int device) -> ()",
        &allreduce_init_buffer);
  m.def("fused_allreduce(int algorithm, int rank, int[] bases, int max_bytes, int push_bytes, int num_blocks, "
        "Tensor x, Tensor? residual, Tensor? weight, Tensor(a!) out, Tensor(b!)? residual_out, float eps, "
        "float? out_scale, int timeout_ns, int error_word) -> ()");
  m.impl("fused_allreduce", c10::DispatchKey::CUDA, &fused_allreduce);
}

// `import spec_kernels._C` loads the library above; the module itself is empty.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
