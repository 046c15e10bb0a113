// Host-side entry points of the CUDA kernels. Plain C++ and CUDA runtime types only, no torch:
// the bindings (csrc/<family>/*_binding.cpp, the torch-facing files) check arguments and call
// these; the .cu files implement them. Every launcher returns the launch's cudaError_t instead of throwing.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace spec_kernels {

// Largest draft-token count per request: a tree-mask row is one 64-bit word.
constexpr int kMaxDraftTokens = 64;

// Archs compiled into this binary (nvcc's __CUDA_ARCH_LIST__, e.g. 900, 1200); returns how many
// were written to `out` (at most `capacity`).
int compiled_cuda_archs(int* out, int capacity);
// CUDART_VERSION the extension was compiled with, e.g. 13000.
int compiled_cuda_runtime_version();

// tree_mask[t] = bits of draft t and of all its ancestors (indices within its request).
// parents: int64 [T], parent index within the request or -1; parents must precede children.
cudaError_t launch_tree_mask_from_parents(const int64_t* parents, const int32_t* qo_indptr,
                                          int64_t* tree_mask, int num_requests, int64_t num_tokens,
                                          cudaStream_t stream);

// ---------------------------------------------------------------- draft-token KV slots (kv_slots/)
// Contract, validity rules and status codes: spec_kernels/kv_slots/reference.py.

// Threads of the alloc and commit kernels' blocks.
constexpr int kKvSlotsThreads = 1024;

// A device vector of int32 or int64 values (the kernels read and write it as int64).
struct IndexTensor {
  void* data;
  bool is_int64;
};

// status[0]; status = [code, pages needed/released, num_free before, first bad request or -1, tokens].
enum KvSlotStatus : int {
  kKvSlotsOk = 0,
  kKvSlotsOutOfPages = 1,
  kKvSlotsBadRequest = 2,
  kKvSlotsBadStack = 3,
  kKvSlotsOutTooSmall = 4,
  kKvSlotsPageConflict = 5,  // the free stack, page_state and req_to_token disagree
};
constexpr int kKvSlotsStatusLen = 5;

// page_state values: a page's owner. kPageFree: on the stack; row + 1 (>= 1): held by request row
// `row`; kPageShared: held by no single request (never popped, continued, committed or freed).
// kPageMark is seen only inside a launch: the bookkeeping claims the call's pages with atomic
// exchanges to it (a page claimed twice reads kPageMark back) and gives every claimed page its
// final state, or the one it had on a refusal, before the launch ends. Negative: nobody's owner.
constexpr int32_t kPageFree = 0;
constexpr int32_t kPageShared = -1;
constexpr int32_t kPageMark = -2;

// The batch and the allocator state, shared by alloc and commit.
struct KvSlotBatch {
  IndexTensor req_to_token;  // [num_rows, max_context], contiguous
  int64_t num_rows;
  int64_t max_context;
  IndexTensor req_pool_indices;  // [num_requests]
  IndexTensor seq_lens;          // [num_requests]
  IndexTensor num_draft;         // [num_requests]
  int num_requests;
  int64_t* free_pages;  // [num_pages]: stack of free page ids; its length is the pool's page count
  int64_t num_pages;
  int64_t* num_free;  // [1]
  int32_t* page_state;  // [num_pages]: kPageFree (on the stack), owner row + 1, or kPageShared
  int log2_page_size;
  int max_draft;    // 1..kMaxDraftTokens
  int64_t* status;  // [kKvSlotsStatusLen]
};

// Positions seq_len .. seq_len + num_draft - 1 of every request get slots (first its partial last
// page, which it must own, then pages popped from the stack, which it comes to own); out_cache_loc
// [out_capacity] gets them in batch order, -1 beyond. One launch; validates everything before
// writing anything.
cudaError_t launch_alloc_draft_slots(const KvSlotBatch& batch, int64_t* out_cache_loc, int64_t out_capacity,
                                     cudaStream_t stream);

struct KvCommitArgs {
  IndexTensor accept_index;  // [num_requests, accept_width], -1 padded
  int64_t accept_width;
  IndexTensor accept_len;    // [num_requests]
  IndexTensor new_seq_lens;  // [num_requests], written
  // KV buffers whose rows move when page_size > 1 (kv_table == nullptr: none; paths must be
  // prefixes): int64 [3, num_kv_buffers] = (base address, row stride bytes, row bytes).
  const int64_t* kv_table;
  int num_kv_buffers;
  int64_t num_kv_rows;  // rows (slots) of every KV buffer
  int kv_unit_bytes;    // 1, 2, 4, 8 or 16; divides every address, stride and row size
  int kv_blocks_per_request;
  // When rows move: the kKvMoveSyncWords scratch words of the launch-wide hand-off of the verdict
  // to the KV-move blocks (see kv_slots.cu): zero when first used, then as the previous launch on
  // it left them; never shared with a launch that may run at the same time.
  uint64_t* move_sync;
};
// The scratch: [generation, election, verdict, blocks finished]. An election or verdict word is
// (tag << kKvMoveTagShift) | value with tag = generation + 1, below 2^63 (a non-negative int64
// for the Triton kernel too); generations run 0 .. kKvMoveGenerations - 1, then 0 again.
constexpr int kKvMoveSyncWords = 4;
constexpr int kKvMoveTagShift = 8;
constexpr int64_t kKvMoveGenerations = (int64_t{1} << (63 - kKvMoveTagShift)) - 1;
// Largest commit grid when rows move (num_requests x kv_blocks_per_request blocks).
constexpr int64_t kKvMoveMaxBlocks = (int64_t{1} << 24) - 1;

// Keeps each request's accepted path (page_size 1: remaps req_to_token; > 1: moves KV rows)
// and pushes every other draft slot / wholly freed page (which become free; kept pages stay the
// request's). Refuses drafts on pages the request does not own. One launch.
cudaError_t launch_commit_draft_slots(const KvSlotBatch& batch, const KvCommitArgs& args, cudaStream_t stream);

}  // namespace spec_kernels
