// MLA tree-verify attention (and MLA decode): one launch, the latent KV read once for all rows.
//
// DeepSeek-V3 / Kimi K2.5 with absorbed projections: each token caches ONE KV row of 576 values
// (512 latent + 64 rope), the key of every query head; its first 512 values are the value. A CTA
// (4 warps) owns up to 32 query rows of one (request, KV split): the request's n_b drafts x H
// heads, packed (row = draft * H + head). It streams its share of the prefix through a
// double-buffered shared-memory tile of 16 KV rows (cp.async gathers, one slot id per row, the ids
// themselves copied into shared memory two tiles ahead), then
// - last split only - the n_b draft slots; only those tail tiles test the 64-bit ancestor words.
//
// 576-wide rows do not fit the usual "each warp owns 16 rows" layout (a 16 x 512 fp32 accumulator
// per warp, Q fragments of 576 columns), so the tile's work is split over the head dims instead:
//   S = Q K^T  : every warp computes the whole [rows x 16 keys] tile over a quarter of the 576
//                dims (9 of the 36 k16 steps) and publishes its partial in fragment order; every
//                warp then sums the four partials in the same order (identical S in all warps, so
//                every warp runs the same online softmax and no statistics are exchanged);
//   O += P V   : every warp owns 128 of the 512 output columns for all rows; P stays in registers
//                (the S accumulators are the A fragments) and V is the same smem tile as K.
// Shared memory: Q tile (16 or 32 rows x 576) + two KV stages (16 x 576) + S partials + slot ids
// = 58.5 KB / 80.5 KB, under sm_120's 99 KB per block.
//
// With num_splits > 1 every split writes a normalised partial output and its base-2 log-sum-exp;
// mla_merge_splits_kernel combines them in a fixed order (bitwise deterministic, no atomics).
#include <cfloat>

#include "spec_kernels/mla.h"
#include "spec_kernels/kv_index.cuh"
#include "spec_kernels/mma.cuh"
#include "spec_kernels/split_merge.cuh"

namespace spec_kernels {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kD = kMlaHeadDim;
constexpr int kDv = kMlaVHeadDim;
constexpr int kChunks = kD / 8;                   // 16-byte chunks per row: 72
constexpr int kBlockN = 16;                       // keys per tile (one k16 step of P V)
constexpr int kKStepsPerWarp = kD / 16 / kWarps;  // S = Q K^T: 9 of the 36 k16 steps per warp
constexpr int kDvTiles = kDv / kWarps / 8;        // O += P V: 128 columns = 16 n8 tiles per warp
static_assert(kD % (16 * kWarps) == 0 && kDvTiles % 2 == 0, "head dims must split evenly over the warps");

template <int kMTiles>
struct MlaTile {
  static constexpr int kBlockM = 16 * kMTiles;
  static constexpr int kStageElems = kBlockN * kD;
  static constexpr int kPartialFloats = kMTiles * 2 * 4 * 32;  // one warp's S: [m tile][n8 tile][4][lane]
  static constexpr int kIdxStages = 4;  // slot ids of 4 tiles in flight, 8 bytes each
  static constexpr int kSmemBytes =
      (kBlockM * kD + 2 * kStageElems) * 2 + kWarps * kPartialFloats * 4 + kIdxStages * kBlockN * 8;
  static_assert(kSmemBytes <= 99 * 1024, "sm_120 allows 99 KB of shared memory per block");
};

template <typename T, int kMTiles>
__global__ void __launch_bounds__(kThreads) mla_tree_verify_kernel(const MlaParams p) {
  using Tile = MlaTile<kMTiles>;
  constexpr int kBlockM = Tile::kBlockM;
  extern __shared__ __align__(128) uint8_t smem[];
  T* s_q = reinterpret_cast<T*>(smem);
  T* s_kv = s_q + kBlockM * kD;  // two stages of [kBlockN][kD]
  float* s_part = reinterpret_cast<float*>(s_kv + 2 * Tile::kStageElems);
  uint8_t* s_idx = reinterpret_cast<uint8_t*>(s_part + kWarps * Tile::kPartialFloats);  // [4][kBlockN] x 8 B

  // ---- which rows, which request, which KV range
  const int H = p.num_heads;
  const int m_blocks = ceil_div(p.max_rows, kBlockM);
  const int m_block = blockIdx.x % m_blocks;
  const int req = blockIdx.x / m_blocks;
  const int split = blockIdx.y;

  // Ranges cut to the tensors (no-ops for valid input): invalid values never reach outside.
  int64_t q_start = req, q_end = req + 1;
  if (p.qo_indptr) indptr_range(p.qo_indptr, req, p.num_tokens, q_start, q_end);
  const int n_draft = static_cast<int>(q_end - q_start);
  int64_t kv_start, kv_end;
  indptr_range(p.kv_indptr, req, p.num_indices, kv_start, kv_end);
  const int kv_len = static_cast<int>(kv_end - kv_start);
  const int prefix_len = max(kv_len - n_draft, 0);
  const int num_tail = min(kv_len - prefix_len, kMaskBits);  // = n_draft for valid input
  const int row0 = m_block * kBlockM;
  // Drafts past the launch's bound (max_rows; only invalid input has them) are not computed.
  const int rows_here = min(kBlockM, min(n_draft * H, p.max_rows) - row0);
  if (rows_here <= 0) return;  // uniform over the CTA

  int lo, hi;
  split_bounds(prefix_len, p.num_splits, split, kBlockN, p.min_chunk, lo, hi);
  const int prefix_tiles = ceil_div(hi - lo, kBlockN);
  const int tail_tiles = split == p.num_splits - 1 ? ceil_div(num_tail, kBlockN) : 0;
  const int total_tiles = prefix_tiles + tail_tiles;

  const T* q = static_cast<const T*>(p.q);
  const T* kv = static_cast<const T*>(p.kv_cache);

  // Row r of the block: query token and head, or token -1 past the rows / for invalid qo_indptr.
  auto row_token = [&](int r) -> int64_t {
    const int64_t token = q_start + (row0 + r) / H;
    return r < rows_here && token >= 0 && token < p.num_tokens ? token : -1;
  };

  // ---- Q block (rows past rows_here are zero-filled)
  for (int i = threadIdx.x; i < kBlockM * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const int64_t token = row_token(r);
    const T* src = token < 0 ? q : q + token * p.q_stride_t + ((row0 + r) % H) * p.q_stride_h + c * 8;
    cp_async_16(smem_addr(s_q + swizzled<kChunks>(r, c)), src, token >= 0);
  }

  // Tile t covers key positions [base, base + kBlockN) clipped to end: prefix tiles first.
  auto tile_base = [&](int t) {
    return t < prefix_tiles ? lo + t * kBlockN : prefix_len + (t - prefix_tiles) * kBlockN;
  };
  auto tile_end = [&](int t) { return t < prefix_tiles ? hi : prefix_len + num_tail; };

  // Tile t's slot ids into s_idx stage t % kIdxStages (thread r copies key r's id; none read past
  // the range), two tiles ahead of the tile's gather, so the gather never waits on an index load.
  auto load_indices = [&](int t) {
    if (t >= total_tiles || threadIdx.x >= kBlockN) return;
    const int r = threadIdx.x;
    const int base = tile_base(t), end = tile_end(t);
    const int64_t at = kv_start + base + r;
    const bool in_range = base + r < end && at >= 0 && at < p.num_indices;
    const uint32_t dst = smem_addr(s_idx + ((t % Tile::kIdxStages) * kBlockN + r) * 8);
    copy_slot_id_async(p, at, in_range, dst);
  };

  auto load_tile = [&](int t, int stage) {
    const int base = tile_base(t), end = tile_end(t);
    T* dst = s_kv + stage * Tile::kStageElems;
    const uint8_t* ids = s_idx + (t % Tile::kIdxStages) * kBlockN * 8;
    for (int i = threadIdx.x; i < kBlockN * kChunks; i += kThreads) {
      const int r = i / kChunks, c = i % kChunks;
      const int64_t at = kv_start + base + r;
      const int64_t slot = !(base + r < end && at >= 0 && at < p.num_indices) ? -1 : staged_slot_id(p, ids, r);
      const bool valid = slot >= 0 && slot < p.num_slots;  // else a zero row
      cp_async_16(smem_addr(dst + swizzled<kChunks>(r, c)), kv + (valid ? slot : 0) * p.kv_stride_s + c * 8, valid);
    }
  };

  // ---- per-thread state: rows mt * 16 + g and mt * 16 + g + 8 of every m tile
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  uint64_t row_mask[kMTiles][2];
  float m_i[kMTiles][2], l_i[kMTiles][2];
  float acc[kMTiles][kDvTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mt * 16 + g + h * 8;
      const int64_t token = row_token(r);
      row_mask[mt][h] = ~0ull;  // decode: the single tail key is the query's own token
      // Only the bits of the draft itself and earlier drafts count.
      if (p.tree_mask != nullptr) {
        row_mask[mt][h] = token >= 0 ? static_cast<uint64_t>(p.tree_mask[token]) & draft_bits((row0 + r) / H) : 0ull;
      }
      m_i[mt][h] = -INFINITY;
      l_i[mt][h] = 0.f;
    }
#pragma unroll
    for (int d = 0; d < kDvTiles; ++d) acc[mt][d][0] = acc[mt][d][1] = acc[mt][d][2] = acc[mt][d][3] = 0.f;
  }

  // Slot ids of tiles 0 and 1 (with Q) visible to every thread before the first gathers; then
  // tile t + 3's ids travel with tile t + 1's rows (their stage held tile t - 1's ids, last read
  // before the previous iteration's barrier).
  load_indices(0);
  load_indices(1);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  if (total_tiles > 0) load_tile(0, 0);
  load_indices(2);
  cp_async_commit();  // tile 0 (and tile 2's ids)

  for (int t = 0; t < total_tiles; ++t) {
    if (t + 1 < total_tiles) {
      load_tile(t + 1, (t + 1) & 1);
      load_indices(t + 3);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* kv_s = s_kv + (t & 1) * Tile::kStageElems;

    // S partial: all rows x 16 keys over this warp's 9 k16 steps of the 576 dims
    float s[kMTiles][2][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
    }
#pragma unroll
    for (int ks = 0; ks < kKStepsPerWarp; ++ks) {
      const int kk = warp * kKStepsPerWarp + ks;
      uint32_t b[4];  // keys 0-7: b0, b1; keys 8-15: b2, b3
      ldmatrix_x4(b, smem_addr(kv_s + swizzled<kChunks>((lane / 16) * 8 + lane % 8, kk * 2 + lane / 8 % 2)));
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        uint32_t a[4];
        ldmatrix_x4(a, smem_addr(s_q + swizzled<kChunks>(mt * 16 + (lane / 8 % 2) * 8 + lane % 8, kk * 2 + lane / 16)));
        mma_16816<T>(s[mt][0], a, b[0], b[1]);
        mma_16816<T>(s[mt][1], a, b[2], b[3]);
      }
    }

    // publish the partials (fragment order: conflict-free), then sum all four in a fixed order
    float* mine = s_part + warp * Tile::kPartialFloats;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) mine[((mt * 2 + j) * 4 + e) * 32 + lane] = s[mt][j][e];
      }
    }
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = 0.f;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) x += s_part[w * Tile::kPartialFloats + ((mt * 2 + j) * 4 + e) * 32 + lane];
          s[mt][j][e] = x;
        }
      }
    }

    // scale; mask keys past the end (last tile of a range) and, in the tail, non-ancestors
    const int base = tile_base(t), end = tile_end(t);
    const bool is_tail = t >= prefix_tiles;
    const bool full = !is_tail && base + kBlockN <= end;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = finite_or_nan(s[mt][j][e] * p.sm_scale_log2);
          if (!full) {
            const int pos = base + j * 8 + t4 * 2 + (e & 1);
            bool visible = pos < end;
            // min(.., 63): never a shift by >= 64 (UB), whatever the input (pos - prefix_len < 64 anyway).
            if (is_tail && visible) visible = (row_mask[mt][e >> 1] >> min(pos - prefix_len, 63)) & 1ull;
            x = visible ? x : -INFINITY;
          }
          s[mt][j][e] = x;
        }
      }
    }

    // online softmax (base 2) of the thread's rows; a quad of lanes shares a row. Every warp
    // holds the same S, so every warp computes the same m_i and (after the final quad sum) l_i.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = fmaxf(m_i[mt][h], fmaxf(fmaxf(s[mt][0][2 * h], s[mt][0][2 * h + 1]),
                                           fmaxf(s[mt][1][2 * h], s[mt][1][2 * h + 1])));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_safe = mx == -INFINITY ? 0.f : mx;
        const float alpha = exp2f(m_i[mt][h] - m_safe);
        float row_sum = 0.f;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          s[mt][j][2 * h] = exp2f(s[mt][j][2 * h] - m_safe);
          s[mt][j][2 * h + 1] = exp2f(s[mt][j][2 * h + 1] - m_safe);
          row_sum += s[mt][j][2 * h] + s[mt][j][2 * h + 1];
        }
        l_i[mt][h] = l_i[mt][h] * alpha + row_sum;
        m_i[mt][h] = mx;
#pragma unroll
        for (int d = 0; d < kDvTiles; ++d) {
          acc[mt][d][2 * h] *= alpha;
          acc[mt][d][2 * h + 1] *= alpha;
        }
      }
    }

    // O[:, this warp's 128 columns] += P V: the S accumulators of the two key tiles are the A
    // fragment of the tile's one k16 step; V is the latent part of the same smem rows as K.
    uint32_t a_p[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      a_p[mt][0] = pack2<T>(s[mt][0][0], s[mt][0][1]);
      a_p[mt][1] = pack2<T>(s[mt][0][2], s[mt][0][3]);
      a_p[mt][2] = pack2<T>(s[mt][1][0], s[mt][1][1]);
      a_p[mt][3] = pack2<T>(s[mt][1][2], s[mt][1][3]);
    }
#pragma unroll
    for (int d = 0; d < kDvTiles; d += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, smem_addr(kv_s + swizzled<kChunks>((lane / 8 % 2) * 8 + lane % 8,
                                                              warp * kDvTiles + d + lane / 16)));
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        mma_16816<T>(acc[mt][d], a_p[mt], b[0], b[1]);
        mma_16816<T>(acc[mt][d + 1], a_p[mt], b[2], b[3]);
      }
    }
    __syncthreads();  // the stage and the partials are rewritten by the next iteration
  }
  cp_async_wait<0>();

  // ---- epilogue: every warp writes its 128 columns; rows that saw no key get zeros, lse = -inf
  // (selected, not 0 * acc: acc may hold NaN from a V row of a draft slot the row does not see)
  const int col0 = warp * kDvTiles * 8;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_i[mt][h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int r = mt * 16 + g + h * 8;
      const int64_t token = row_token(r);
      if (token < 0) continue;
      const int head = (row0 + r) % H;
      // l is 0 iff the row saw no key; NaN (a NaN logit) counts as seen: NaN output and lse.
      const bool seen = l != 0.f;
      const float inv_l = seen ? 1.f / l : 0.f;
      const float lse2 = seen ? m_i[mt][h] + log2f(l) : -INFINITY;
      if (p.num_splits > 1) {
        const int64_t idx = (static_cast<int64_t>(split) * p.num_tokens + token) * H + head;
        float* dst = p.o_partial + idx * kDv + col0;
#pragma unroll
        for (int d = 0; d < kDvTiles; ++d) {
          *reinterpret_cast<float2*>(dst + d * 8 + t4 * 2) =
              make_float2(seen ? acc[mt][d][2 * h] * inv_l : 0.f, seen ? acc[mt][d][2 * h + 1] * inv_l : 0.f);
        }
        if (warp == 0 && t4 == 0) p.lse_partial[idx] = lse2;
      } else {
        T* dst = static_cast<T*>(p.out) + token * p.o_stride_t + head * p.o_stride_h + col0;
#pragma unroll
        for (int d = 0; d < kDvTiles; ++d) {
          *reinterpret_cast<uint32_t*>(dst + d * 8 + t4 * 2) =
              pack2<T>(seen ? acc[mt][d][2 * h] * inv_l : 0.f, seen ? acc[mt][d][2 * h + 1] * inv_l : 0.f);
        }
        if (p.lse != nullptr && warp == 0 && t4 == 0) p.lse[token * H + head] = lse2 * 0.69314718055994531f;
      }
    }
  }
}

// One block per (token, head): the split-KV combine (spec_kernels/split_merge.cuh).
template <typename T>
__global__ void mla_merge_splits_kernel(const MlaParams p) {
  const int64_t idx = blockIdx.x;  // token * H + head
  const int64_t token = idx / p.num_heads;
  const int head = static_cast<int>(idx % p.num_heads);
  merge_split_row(p.o_partial, p.lse_partial, p.num_splits, static_cast<int64_t>(p.num_tokens) * p.num_heads, idx, kDv,
                  static_cast<T*>(p.out) + token * p.o_stride_t + head * p.o_stride_h, p.lse);
}

template <typename T, int kMTiles>
cudaError_t launch(const MlaParams& p, cudaStream_t stream) {
  constexpr int kSmem = MlaTile<kMTiles>::kSmemBytes;
  // Opt in to > 48 KB of dynamic shared memory (per device, so on every launch; not a stream
  // operation, so also allowed while a CUDA graph is being captured).
  const cudaError_t attr_err =
      cudaFuncSetAttribute(mla_tree_verify_kernel<T, kMTiles>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (attr_err != cudaSuccess) return attr_err;
  const int m_blocks = (p.max_rows + 16 * kMTiles - 1) / (16 * kMTiles);
  const dim3 grid(static_cast<unsigned>(p.num_requests) * m_blocks, p.num_splits);
  mla_tree_verify_kernel<T, kMTiles><<<grid, kThreads, kSmem, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.num_splits == 1) return err;
  mla_merge_splits_kernel<T><<<static_cast<unsigned>(p.num_tokens) * p.num_heads, 128, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_for_rows(const MlaParams& p, cudaStream_t stream) {
  return mla_block_m(p.max_rows) == 16 ? launch<T, 1>(p, stream) : launch<T, 2>(p, stream);
}

}  // namespace

cudaError_t launch_mla_tree_verify_attention(const MlaParams& p, Dtype dtype, cudaStream_t stream) {
  if (p.num_requests == 0 || p.num_tokens == 0) return cudaSuccess;
  return dtype == Dtype::kBFloat16 ? launch_for_rows<__nv_bfloat16>(p, stream) : launch_for_rows<__half>(p, stream);
}

}  // namespace spec_kernels
