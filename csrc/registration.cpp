// The one registration of the C++ ops: torch.ops.spec_kernels_cuda.*, the raw CUDA implementations.
//
// The public ops (torch.ops.spec_kernels.*, with fake implementations and the cuda -> triton ->
// reference dispatch) live in Python and call these. Each family's binding
// (csrc/<family>/*_binding.cpp) checks every input with TORCH_CHECK, so a direct call cannot
// crash on bad metadata.
#include <Python.h>

#include <torch/library.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "spec_kernels/launch_once.cuh"
#include "spec_kernels/launchers.h"
#include "spec_kernels/mla.h"
#include "spec_kernels/mla_config.h"
#include "spec_kernels/norm_allreduce.h"
#include "spec_kernels/tree_verify.h"
#include "spec_kernels/tree_verify_config.h"

namespace {

std::vector<int64_t> compiled_archs() {
  int archs[16];
  const int n = spec_kernels::compiled_cuda_archs(archs, 16);
  return std::vector<int64_t>(archs, archs + n);
}

int64_t compiled_cuda_version() { return spec_kernels::compiled_cuda_runtime_version(); }

// The constants the Python side must agree on, as "name=value" lines (tests/test_limits.py
// compares them with the Python definitions, so a copy that drifts fails).
std::string compiled_constants() {
  namespace sk = spec_kernels;
  namespace ar = spec_kernels::allreduce;
  std::string s;
  const auto add = [&s](const char* name, long long value) {
    s.append(name).append("=").append(std::to_string(value)).append("\n");
  };
  add("kMaxDraftTokens", sk::kMaxDraftTokens);
  add("kTreeVerifyBlockM", sk::kTreeVerifyBlockM);
  add("kMlaHeadDim", sk::kMlaHeadDim);
  add("kMlaVHeadDim", sk::kMlaVHeadDim);
  add("kKvSlotsOk", sk::kKvSlotsOk);
  add("kKvSlotsOutOfPages", sk::kKvSlotsOutOfPages);
  add("kKvSlotsBadRequest", sk::kKvSlotsBadRequest);
  add("kKvSlotsBadStack", sk::kKvSlotsBadStack);
  add("kKvSlotsOutTooSmall", sk::kKvSlotsOutTooSmall);
  add("kKvSlotsPageConflict", sk::kKvSlotsPageConflict);
  add("kKvSlotsStatusLen", sk::kKvSlotsStatusLen);
  add("kPageFree", sk::kPageFree);
  add("kPageShared", sk::kPageShared);
  add("kPageMark", sk::kPageMark);
  add("kKvMoveSyncWords", sk::kKvMoveSyncWords);
  add("kKvMoveTagShift", sk::kKvMoveTagShift);
  add("kKvMoveGenerations", sk::kKvMoveGenerations);
  add("kKvMoveMaxBlocks", sk::kKvMoveMaxBlocks);
  add("kMaxNormHidden", sk::kMaxNormHidden);
  add("kMaxRanks", ar::kMaxRanks);
  add("kMaxBlocks", ar::kMaxBlocks);
  add("kOneShotPush", ar::kOneShotPush);
  add("kOneShotPull", ar::kOneShotPull);
  add("kTwoShot", ar::kTwoShot);
  add("kOneShotPush1Block", ar::kOneShotPush1Block);
  add("kOk", ar::kOk);
  add("kTimeout", ar::kTimeout);
  add("kSizeMismatch", ar::kSizeMismatch);
  add("kBlocksMismatch", ar::kBlocksMismatch);
  add("kTreeVerifyMergeThreads", sk::kTreeVerifyMergeThreads);
  add("kMlaMergeThreads", sk::kMlaMergeThreads);
  add("kKvSlotsThreads", sk::kKvSlotsThreads);
  // Parameter structs the PTX interpreter's glue builds from the headers: their sizes here.
  add("sizeof(TreeVerifyParams)", sizeof(sk::TreeVerifyParams));
  add("sizeof(MlaParams)", sizeof(sk::MlaParams));
  add("sizeof(IndexTensor)", sizeof(sk::IndexTensor));
  add("sizeof(KvSlotBatch)", sizeof(sk::KvSlotBatch));
  add("sizeof(KvCommitArgs)", sizeof(sk::KvCommitArgs));
  return s;
}

// Every compiled configuration of the attention kernels, one line each (csrc/torch_checks.h
// shape_line), from the lists in spec_kernels/tree_verify_config.h and mla_config.h.
std::string kernel_configs() {
  return spec_kernels::binding::tree_verify_configs() + spec_kernels::binding::mla_configs();
}

// For tests (spec_kernels.testing.launch_rule_as_on): the shared memory per SM the launches'
// configuration choice sees, capped at smem_per_sm (0: the device's own); returns the cap before.
int64_t set_launch_smem_limit(int64_t smem_per_sm) {
  TORCH_CHECK(smem_per_sm >= 0 && smem_per_sm <= (1 << 30), "smem_per_sm must be in [0, 2^30], got ", smem_per_sm);
  return spec_kernels::launch_smem_limit().exchange(static_cast<int>(smem_per_sm));
}

// Whether the attention kernels' split merges are launched as programmatic dependents
// (spec_kernels/programmatic_launch.cuh; SPEC_KERNELS_PDL=0 starts it off); returns the setting before.
bool set_programmatic_launch(bool enabled) { return spec_kernels::programmatic_launch_enabled().exchange(enabled); }

namespace b = spec_kernels::binding;

}  // namespace

TORCH_LIBRARY(spec_kernels_cuda, m) {
  m.def("compiled_archs() -> int[]", &compiled_archs);
  m.def("compiled_cuda_version() -> int", &compiled_cuda_version);
  m.def("compiled_constants() -> str", &compiled_constants);
  m.def("kernel_configs() -> str", &kernel_configs);
  m.def("set_launch_smem_limit(int smem_per_sm) -> int", &set_launch_smem_limit);
  m.def("set_programmatic_launch(bool enabled) -> bool", &set_programmatic_launch);
  m.def("tree_verify_launch_config(int head_dim, int max_rows, int smem_per_sm, int smem_reserved_per_cta, "
        "bool kv_fp8=False) -> int[]",
        &b::tree_verify_launch_config);
  m.def("mla_launch_config(int max_rows, int smem_per_sm, int smem_reserved_per_cta, bool kv_fp8=False) -> int[]",
        &b::mla_launch_config);
  m.def("tree_mask_from_parents(Tensor parents, Tensor qo_indptr, Tensor(a!) tree_mask) -> ()");
  m.impl("tree_mask_from_parents", c10::DispatchKey::CUDA, &b::tree_mask_from_parents);
  m.def(
      "tree_verify_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_indptr, Tensor kv_indices, "
      "Tensor? qo_indptr, Tensor? tree_mask, Tensor(a!) out, Tensor(b!)? lse, Tensor(c!)? o_partial, "
      "Tensor(d!)? lse_partial, float sm_scale, int num_splits, int min_chunk, int max_rows, float k_scale=1.0, "
      "float v_scale=1.0, Tensor? k_scale_tensor=None, Tensor? v_scale_tensor=None) -> ()");
  m.impl("tree_verify_attention", c10::DispatchKey::CUDA, &b::tree_verify_attention);
  m.def(
      "mla_tree_verify_attention(Tensor q, Tensor kv_cache, Tensor kv_indptr, Tensor kv_indices, Tensor? qo_indptr, "
      "Tensor? tree_mask, Tensor(a!) out, Tensor(b!)? lse, Tensor(c!)? o_partial, Tensor(d!)? lse_partial, "
      "float sm_scale, int num_splits, int min_chunk, int max_rows, float k_scale=1.0, float v_scale=1.0, "
      "Tensor? k_scale_tensor=None, Tensor? v_scale_tensor=None) -> ()");
  m.impl("mla_tree_verify_attention", c10::DispatchKey::CUDA, &b::mla_tree_verify_attention);
  m.def(
      "alloc_draft_slots(Tensor(a!) req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor num_draft, "
      "Tensor(b!) free_pages, Tensor(c!) num_free, Tensor(f!) page_state, int page_size, int max_draft, "
      "Tensor(d!) out_cache_loc, Tensor(e!) status) -> ()");
  m.impl("alloc_draft_slots", c10::DispatchKey::CUDA, &b::alloc_draft_slots);
  m.def(
      "commit_draft_slots(Tensor(a!) req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor num_draft, "
      "Tensor accept_index, Tensor accept_len, Tensor(b!) free_pages, Tensor(c!) num_free, Tensor(g!) page_state, "
      "int page_size, int max_draft, Tensor? kv_table, int kv_rows, int kv_unit_bytes, int kv_blocks_per_request, "
      "Tensor(f!)? move_sync, Tensor(d!) new_seq_lens, Tensor(e!) status) -> ()");
  m.impl("commit_draft_slots", c10::DispatchKey::CUDA, &b::commit_draft_slots);
  m.def("fused_add_rmsnorm(Tensor x, Tensor residual, Tensor weight, Tensor(a!) out, Tensor(b!) residual_out, "
        "float eps, float? out_scale) -> ()");
  m.impl("fused_add_rmsnorm", c10::DispatchKey::CUDA, &b::fused_add_rmsnorm);
  m.def("allreduce_buffer_bytes(int world, int max_bytes, int push_bytes) -> int", &b::allreduce_buffer_bytes);
  m.def("allreduce_ipc_alloc(int bytes, int device) -> int", &b::allreduce_ipc_alloc);
  m.def("allreduce_ipc_free(int ptr, int device) -> ()", &b::allreduce_ipc_free);
  m.def("allreduce_ipc_handle(int ptr, int device) -> Tensor", &b::allreduce_ipc_handle);
  m.def("allreduce_ipc_open(Tensor handle, int device) -> int", &b::allreduce_ipc_open);
  m.def("allreduce_ipc_close(int ptr, int device) -> ()", &b::allreduce_ipc_close);
  m.def("allreduce_init_buffer(int ptr, int world, int max_bytes, int push_bytes, int num_blocks, int device) -> ()",
        &b::allreduce_init_buffer);
  m.def("fused_allreduce(int algorithm, int rank, int[] bases, int max_bytes, int push_bytes, int num_blocks, "
        "Tensor x, Tensor? residual, Tensor? weight, Tensor(a!) out, Tensor(b!)? residual_out, float eps, "
        "float? out_scale, int timeout_ns, int error_word) -> ()");
  m.impl("fused_allreduce", c10::DispatchKey::CUDA, &b::fused_allreduce);
}

// `import spec_kernels._C` loads the library above; the module itself is empty.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
