// Host interface of the CUDA MLA tree-verify attention kernel (no torch types; the torch wrapper
// is csrc/mla/mla_binding.cpp).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "spec_kernels/tree_verify.h"  // Dtype

namespace spec_kernels {

// DeepSeek-V3 / Kimi K2.5: one latent KV head of 576 = 512 latent + 64 rope values per token;
// the value is the first 512 of them.
constexpr int kMlaHeadDim = 576;
constexpr int kMlaVHeadDim = 512;

// Rows per CTA (n_b drafts x H heads, packed): 16 when no request has more (decode with <= 16
// heads), 32 up to 32 rows, else 64 (8 warps). Exported so that the caller sizes the KV splits
// like the launch does.
constexpr int mla_block_m(int max_rows) { return max_rows <= 16 ? 16 : max_rows <= 32 ? 32 : 64; }

// All pointers are device pointers. Request b owns queries qo_indptr[b]..qo_indptr[b+1] (decode:
// qo_indptr == nullptr, query b only) and KV slots kv_indices[kv_indptr[b]..kv_indptr[b+1]]: its
// prefix, then its n_b draft slots. Query i of a request sees draft j iff bit j of tree_mask[i]
// (decode: tree_mask == nullptr, every slot is visible).
struct MlaParams {
  const void* q;         // [T, H, 576], rows 16-byte aligned
  const void* kv_cache;  // [S, 576] in q's dtype, or fp8 bytes (kv_format)
  const int32_t* kv_indptr;
  const void* kv_indices;  // int32 or int64 (kv_indices_int64)
  bool kv_indices_int64;
  const int32_t* qo_indptr;  // nullptr: decode
  const int64_t* tree_mask;  // nullptr: decode
  void* out;                 // [T, H, 512]
  float* lse;                // [T, H] natural log, or nullptr
  float* o_partial;          // [num_splits, T, H, 512] when num_splits > 1
  float* lse_partial;        // [num_splits, T, H] (base 2) when num_splits > 1
  int64_t q_stride_t, q_stride_h;
  int64_t kv_stride_s;
  int64_t o_stride_t, o_stride_h;
  // Bounds of every index read (invalid indptr / slot values never cause an out-of-bounds
  // access: such keys are skipped, such rows left unwritten).
  int64_t num_slots;    // S: rows of kv_cache
  int64_t num_indices;  // length of kv_indices
  int num_requests, num_tokens, num_heads;
  int max_rows;    // upper bound of n_b * H over the batch: sizes the grid
  int num_splits;  // KV splits per request (grid.y); 1 = no combine pass
  int min_chunk;   // smallest prefix share of a split (multiple of 16 keys), 0 = even split
  float sm_scale_log2;  // softmax scale * log2(e)
  // The cache's element format (kKvLikeQ, kKvE4M3, kKvE5M2: spec_kernels/tree_verify.h); an fp8
  // cache's values are byte * k_scale in the logits and byte * v_scale in the output (a non-null
  // pointer: a device fp32 read at launch, which wins over the host value).
  int kv_format;
  float k_scale, v_scale;
  const float* k_scale_ptr;
  const float* v_scale_ptr;
};

cudaError_t launch_mla_tree_verify_attention(const MlaParams& params, Dtype dtype, cudaStream_t stream);

}  // namespace spec_kernels
