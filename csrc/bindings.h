// The torch-facing functions of the bindings (csrc/<family>/*_binding.cpp), registered as
// torch.ops.spec_kernels_cuda.* by csrc/registration.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace spec_kernels::binding {

void tree_mask_from_parents(const at::Tensor& parents, const at::Tensor& qo_indptr,
                            at::Tensor& tree_mask);

void tree_verify_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                           const std::optional<at::Tensor>& qo_indptr, const std::optional<at::Tensor>& tree_mask,
                           at::Tensor& out, const std::optional<at::Tensor>& lse,
                           const std::optional<at::Tensor>& o_partial, const std::optional<at::Tensor>& lse_partial,
                           double sm_scale, int64_t num_splits, int64_t min_chunk, int64_t max_rows,
                           double k_scale, double v_scale, const std::optional<at::Tensor>& k_scale_tensor,
                           const std::optional<at::Tensor>& v_scale_tensor);

// The configuration a launch takes, as [head_dim, block_m, threads, smem_bytes, regs,
// min_ctas_per_sm] (block_m 0: none), and every compiled configuration, one line each.
std::vector<int64_t> tree_verify_launch_config(int64_t head_dim, int64_t max_rows, int64_t smem_per_sm,
                                               int64_t smem_reserved_per_cta, bool kv_fp8);
std::string tree_verify_configs();
std::vector<int64_t> mla_launch_config(int64_t max_rows, int64_t smem_per_sm, int64_t smem_reserved_per_cta,
                                       bool kv_fp8);
std::string mla_configs();

void mla_tree_verify_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& kv_indptr,
                               const at::Tensor& kv_indices, const std::optional<at::Tensor>& qo_indptr,
                               const std::optional<at::Tensor>& tree_mask, at::Tensor& out,
                               const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& o_partial,
                               const std::optional<at::Tensor>& lse_partial, double sm_scale, int64_t num_splits,
                               int64_t min_chunk, int64_t max_rows, double k_scale, double v_scale,
                               const std::optional<at::Tensor>& k_scale_tensor,
                               const std::optional<at::Tensor>& v_scale_tensor);

void alloc_draft_slots(at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                       const at::Tensor& num_draft, at::Tensor& free_pages, at::Tensor& num_free,
                       at::Tensor& page_state, int64_t page_size, int64_t max_draft, at::Tensor& out_cache_loc,
                       at::Tensor& status);

void commit_draft_slots(at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                        const at::Tensor& num_draft, const at::Tensor& accept_index, const at::Tensor& accept_len,
                        at::Tensor& free_pages, at::Tensor& num_free, at::Tensor& page_state, int64_t page_size,
                        int64_t max_draft, const std::optional<at::Tensor>& kv_table, int64_t kv_rows,
                        int64_t kv_unit_bytes, int64_t kv_blocks_per_request,
                        const std::optional<at::Tensor>& move_sync, at::Tensor& new_seq_lens, at::Tensor& status);

void fused_add_rmsnorm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                       at::Tensor& out, at::Tensor& residual_out, double eps,
                       std::optional<double> out_scale);

int64_t allreduce_buffer_bytes(int64_t world, int64_t max_bytes, int64_t push_bytes);

int64_t allreduce_ipc_alloc(int64_t bytes, int64_t device);

void allreduce_ipc_free(int64_t ptr, int64_t device);

at::Tensor allreduce_ipc_handle(int64_t ptr, int64_t device);

int64_t allreduce_ipc_open(const at::Tensor& handle, int64_t device);

void allreduce_ipc_close(int64_t ptr, int64_t device);

void allreduce_init_buffer(int64_t ptr, int64_t world, int64_t max_bytes, int64_t push_bytes, int64_t num_blocks,
                           int64_t device);

void fused_allreduce(int64_t algorithm, int64_t rank, at::IntArrayRef bases, int64_t max_bytes,
                     int64_t push_bytes, int64_t num_blocks, const at::Tensor& x,
                     const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& weight,
                     at::Tensor& out, const std::optional<at::Tensor>& residual_out, double eps,
                     std::optional<double> out_scale, int64_t timeout_ns, int64_t error_word);

}  // namespace spec_kernels::binding
