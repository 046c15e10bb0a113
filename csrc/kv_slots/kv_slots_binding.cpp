// torch.ops.spec_kernels_cuda.alloc_draft_slots / commit_draft_slots: checks, then the KvSlotBatch
// and KvCommitArgs of csrc/include/spec_kernels/launchers.h, then the launch.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>

#include "spec_kernels/launchers.h"

#include "../bindings.h"
#include "../torch_checks.h"

namespace spec_kernels::binding {

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
  check_buffer(num_free, "num_free", dev, "req_to_token", at::kLong, {1});
  b.num_free = num_free.data_ptr<int64_t>();
  check_buffer(page_state, "page_state", dev, "req_to_token", at::kInt, {b.num_pages});  // one entry per page
  b.page_state = page_state.data_ptr<int32_t>();
  TORCH_CHECK(page_size >= 1 && page_size <= (1 << 20) && (page_size & (page_size - 1)) == 0,
              "page_size must be a power of two in [1, 2^20], got ", page_size);
  b.log2_page_size = __builtin_ctzll(static_cast<uint64_t>(page_size));
  TORCH_CHECK(max_draft >= 1 && max_draft <= spec_kernels::kMaxDraftTokens, "max_draft must be in [1, ",
              spec_kernels::kMaxDraftTokens, "], got ", max_draft);
  b.max_draft = static_cast<int>(max_draft);
  check_buffer(status, "status", dev, "req_to_token", at::kLong, {spec_kernels::kKvSlotsStatusLen});
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
                        const std::optional<at::Tensor>& move_sync, at::Tensor& new_seq_lens, at::Tensor& status) {
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
    check_buffer(*move_sync, "move_sync", dev, "req_to_token", at::kLong, {spec_kernels::kKvMoveSyncWords});
    args.move_sync = reinterpret_cast<uint64_t*>(move_sync->data_ptr<int64_t>());
  }
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(spec_kernels::launch_commit_draft_slots(batch, args, c10::cuda::getCurrentCUDAStream().stream()),
               "commit_draft_slots");
}

}  // namespace spec_kernels::binding
