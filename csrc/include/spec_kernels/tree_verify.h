// Host interface of the CUDA tree-verify attention kernel (no torch types; see csrc/tree_verify/tree_verify_binding.cpp).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace spec_kernels {

enum class Dtype : int { kFloat16 = 0, kBFloat16 = 1 };

// KV cache element formats (TreeVerifyParams::kv_format): q's dtype, or 8-bit floats.
constexpr int kKvLikeQ = 0;
constexpr int kKvE4M3 = 1;  // float8_e4m3fn: no infinities, 0x7f / 0xff are NaN
constexpr int kKvE5M2 = 2;  // float8_e5m2: the upper byte of an IEEE half

// All pointers are device pointers. Request b owns queries qo_indptr[b]..qo_indptr[b+1] (decode:
// qo_indptr == nullptr, query b only) and KV slots kv_indices[kv_indptr[b]..kv_indptr[b+1]]: its
// prefix, then its n_b draft slots. Query i of a request sees draft j iff bit j of tree_mask[i]
// (decode: tree_mask == nullptr, every slot is visible).
struct TreeVerifyParams {
  const void* q;        // [T, Hq, D]
  const void* k_cache;  // [S, Hkv, D], q's dtype or fp8 (kv_format)
  const void* v_cache;  // [S, Hkv, D], k_cache's dtype
  const int32_t* kv_indptr;
  const void* kv_indices;  // int32 or int64 (kv_indices_int64)
  bool kv_indices_int64;
  const int32_t* qo_indptr;  // nullptr: decode
  const int64_t* tree_mask;  // nullptr: decode
  void* out;                 // [T, Hq, D]
  float* lse;                // [T, Hq] natural log, or nullptr
  float* o_partial;          // [num_splits, T, Hq, D] when num_splits > 1
  float* lse_partial;        // [num_splits, T, Hq] (base 2) when num_splits > 1
  int64_t q_stride_t, q_stride_h;
  int64_t k_stride_s, k_stride_h;
  int64_t v_stride_s, v_stride_h;
  int64_t o_stride_t, o_stride_h;
  int num_requests, num_tokens, num_q_heads, num_kv_heads, head_dim;
  int64_t num_slots;    // S: slot ids outside [0, S) are skipped, never read
  int64_t num_indices;  // length of kv_indices: indptr values past it are skipped
  int max_rows;    // upper bound of n_b * (Hq / Hkv) over the batch: sizes the grid
  int num_splits;  // KV splits per request (grid.y); 1 = no combine pass
  int min_chunk;   // smallest prefix share of a split (multiple of the KV tile), 0 = even split
  float sm_scale_log2;  // softmax scale * log2(e)
  // fp8 caches (kv_format kKvE4M3 / kKvE5M2): K = cache value * k_scale, V = cache value * v_scale;
  // a non-null *_scale_ptr (one fp32 on the device) is read instead of the host value, so a
  // CUDA-graph replay sees its current value. Unused for kKvLikeQ.
  int kv_format;
  float k_scale, v_scale;
  const float* k_scale_ptr;
  const float* v_scale_ptr;
};

// Rows of queries per CTA (n_b drafts x GQA group, packed) of the default configuration; at D = 128
// the launch takes 128 for more than 64 rows and 32 for decode on sm_120 (tree_verify_attention.cu).
constexpr int kTreeVerifyBlockM = 64;

cudaError_t launch_tree_verify_attention(const TreeVerifyParams& params, Dtype dtype, cudaStream_t stream);

}  // namespace spec_kernels
