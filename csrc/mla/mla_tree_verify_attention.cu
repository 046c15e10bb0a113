// MLA tree-verify attention (and MLA decode): one launch, the latent KV read once for all rows.
//
// DeepSeek-V3 / Kimi K2.5 with absorbed projections: each token caches ONE KV row of 576 values
// (512 latent + 64 rope), the key of every query head; its first 512 values are the value. A CTA
// (4 warps; 8 for 64 rows) owns kBlockM = 16, 32 or 64 query rows of one (request, KV split): the
// request's n_b drafts x H heads, packed (row = draft * H + head), so the KV is read once per
// kBlockM rows. It streams its share of the prefix through a 2- or 3-stage shared-memory ring of
// kBlockN-row KV tiles (cp.async gathers, one slot id per row, the ids themselves copied into
// shared memory two tiles ahead), then - last split only - the n_b draft slots; only those tail
// tiles test the 64-bit ancestor words.
//
// Work split (no partial sums of S are exchanged, no softmax is computed twice):
//   S = Q K^T  : the [kBlockM x kBlockN] tile is kMTiles x (kBlockN / 8) units of 16 rows x 8 keys,
//                one per warp; warp w computes unit (m tile w % kMTiles, keys w / kMTiles) over all
//                576 dims (36 k16 steps, K fragments by ldmatrix from shared memory; Q fragments
//                too, except those of the first kQRegSteps steps, held in registers);
//   softmax    : the unit's owner scales / masks it, and the owners of a row publish their row
//                maxima (one float per row and warp); every warp then forms the same new row max
//                from them, the owner writes P = exp2(S - max) once to shared memory (fp16/bf16)
//                and keeps its share of the row sum;
//   O += P V   : every warp owns 512 / kWarps output columns for all rows (the accumulator:
//                64 / 128 / 128 fp32 registers); A = P from shared memory, B = V^T by
//                ldmatrix.trans of the same KV tile as K.
// Barriers per tile: row maxima published, P written, and with 2 stages also tile landed.
//
// Shape. One unit of S per warp over the whole 576 dims needs kBlockM * kBlockN = warps x 128;
// the O accumulator (kBlockM x 512 fp32) over the CTA's threads must stay <= 128 registers per
// thread, and shared memory holds Q + the KV stages (kBlockN rows each) of 1152 bytes per row
// under sm_120's 99 KB per block:
//   kBlockM = 16, kBlockN = 32: (16 + 2 * 32) * 1152 = 90 KB (+ P, row maxima, slot ids: 92.5 KB)
//   kBlockM = 32, kBlockN = 16: (32 + 3 * 16) * 1152 = 90 KB (+ P, row maxima, slot ids: 92.25 KB)
//   kBlockM = 64, kBlockN = 16, 8 warps (FlashMLA's CTA shape): all of Q would take 72 KB, and
//     (64 + 2 * 16) * 1152 = 108 KB does not fit; so the fragments of the first 8 k16 steps (128
//     columns) stay in registers (32 per thread, beside the 128 of O: 255 in all, no spill) and
//     the Q tile holds the other 448 columns: 56 KB + 2 * 18 KB = 92 KB (+ P etc.: 96 KB). It
//     halves the KV read through L2 against 32-row CTAs when a request has more than 32 rows
//     (H = 16 x n = 16: 4 CTAs, not 8) and gives sm_120 8 warps per SM instead of 4.
//
// With num_splits > 1 every split writes a normalised partial output and its base-2 log-sum-exp;
// mla_merge_splits_kernel combines them in a fixed order (bitwise deterministic, no atomics),
// launched as a programmatic dependent (spec_kernels/programmatic_launch.cuh) so that its launch
// overlaps this kernel's last CTAs.
//
// An fp8 cache (kFp8) is gathered as bytes and converted once per tile into one tile of q's dtype
// (MlaTile's comment says why), which K and V^T are read from; the 64-row CTA stages its Q
// columns there instead of in KV stage 0. k_scale folds into the softmax scale, v_scale into the
// output, as in the Triton kernel.
#include <cfloat>
#include <type_traits>

#include "spec_kernels/mla.h"
#include "spec_kernels/mla_config.h"
#include "spec_kernels/kv_index.cuh"
#include "spec_kernels/launch_once.cuh"
#include "spec_kernels/mma.cuh"
#include "spec_kernels/split_merge.cuh"

namespace spec_kernels {
namespace {

using mla::kChunks;
using mla::kD;
using mla::kDv;
using mla::kKSteps;
using mla::kRowBytes;

// MlaTile<kMTiles> (the tile constants) and the list of configurations: spec_kernels/mla_config.h.

template <typename T, int kMTiles, bool kFp8, int kKSplit>
__global__ void __launch_bounds__(MlaTile<kMTiles, kFp8, kKSplit>::kThreads) mla_tree_verify_kernel(const MlaParams p) {
  using Tile = MlaTile<kMTiles, kFp8, kKSplit>;
  using KvT = std::conditional_t<kFp8, uint8_t, T>;
  constexpr int kThreads = Tile::kThreads, kDvTiles = Tile::kDvTiles;
  constexpr int kQRegSteps = Tile::kQRegSteps, kQStagedChunks = Tile::kQStagedChunks, kQChunks = Tile::kQChunks;
  constexpr int kBlockM = Tile::kBlockM;
  constexpr int kBlockN = Tile::kBlockN;
  constexpr int kNWarps = Tile::kNWarps;
  constexpr int kOwnN = Tile::kOwnN;
  extern __shared__ __align__(128) uint8_t smem[];
  T* s_q = reinterpret_cast<T*>(smem);
  T* s_conv = s_q + kBlockM * kQChunks * 8;  // fp8: the converted tile [kBlockN][kD]
  KvT* s_kv = reinterpret_cast<KvT*>(s_conv + Tile::kConvertedElems);  // kStages stages of [kBlockN][kD]
  // The first Q columns of the 64-row CTA, until they are in registers: KV stage 0, or (fp8) the
  // converted tile.
  T* s_q_staged = kFp8 ? s_conv : reinterpret_cast<T*>(s_kv);
  uint8_t* s_p = reinterpret_cast<uint8_t*>(s_kv + Tile::kStages * Tile::kStageElems);  // [kBlockM][kPStride] bytes
  float* s_red = reinterpret_cast<float*>(s_p + kBlockM * Tile::kPStride);  // [kBlockM][kNWarps]
  uint8_t* s_idx = reinterpret_cast<uint8_t*>(s_red + kNWarps * kBlockM);  // [4][kBlockN] x 8 B
  // k split: [owner warp][kKSplit - 1 cells][kOwnN][lane] float4s of partial S
  float4* s_x = reinterpret_cast<float4*>(s_idx + Tile::kIdxStages * kBlockN * 8);

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
  const KvT* kv = static_cast<const KvT*>(p.kv_cache);
  float qk_scale_log2 = p.sm_scale_log2, v_scale = 1.f;
  if constexpr (kFp8) {
    qk_scale_log2 *= p.k_scale_ptr != nullptr ? *p.k_scale_ptr : p.k_scale;
    v_scale = p.v_scale_ptr != nullptr ? *p.v_scale_ptr : p.v_scale;
  }

  // Row r of the block: query token and head, or token -1 past the rows / for invalid qo_indptr.
  auto row_token = [&](int r) -> int64_t {
    const int64_t token = q_start + (row0 + r) / H;
    return r < rows_here && token >= 0 && token < p.num_tokens ? token : -1;
  };

  // ---- Q block (rows past rows_here are zero-filled): chunks from kQStagedChunks on to the Q tile
  // (rows of kQChunks), the first ones (64-row CTAs) to KV stage 0 until they are in registers
  for (int i = threadIdx.x; i < kBlockM * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const int64_t token = row_token(r);
    const T* src = token < 0 ? q : q + token * p.q_stride_t + ((row0 + r) % H) * p.q_stride_h + c * 8;
    T* dst = s_q + swizzled<kQChunks>(r, c - kQStagedChunks);
    if constexpr (kQStagedChunks > 0) {
      if (c < kQStagedChunks) dst = s_q_staged + swizzled<kQStagedChunks>(r, c);
    }
    cp_async_16(smem_addr(dst), src, token >= 0);
  }

  // Tile t covers key positions [base, base + kBlockN) clipped to end: prefix tiles first.
  auto tile_base = [&](int t) {
    return t < prefix_tiles ? lo + t * kBlockN : prefix_len + (t - prefix_tiles) * kBlockN;
  };
  auto tile_end = [&](int t) { return t < prefix_tiles ? hi : prefix_len + num_tail; };

  // Tile t's slot ids into s_idx stage t % kIdxStages (lanes 0-15 of warp w copy the ids of keys
  // 16 w + lane: 128 bytes of cells per warp, one bank wavefront; none read past the range), two
  // tiles ahead of the tile's gather, so the gather never waits on an index load.
  const int idx_r = static_cast<int>(pinned(threadIdx.x / 32 * 16 + threadIdx.x % 32));
  const bool idx_copier = pinned(threadIdx.x % 32 < 16 && idx_r < kBlockN) != 0;
  const uint32_t idx_dst = pinned(smem_addr(s_idx + idx_r * 8));
  auto load_indices = [&](int t) {
    if (t >= total_tiles || !idx_copier) return;
    const int r = idx_r;
    const int base = tile_base(t), end = tile_end(t);
    const int64_t at = kv_start + base + r;
    const bool in_range = base + r < end && at >= 0 && at < p.num_indices;
    copy_slot_id_async(p, at, in_range, idx_dst + (t % Tile::kIdxStages) * kBlockN * 8);
  };

  // Thread i gathers chunks i % 8 + 8 j (j < 9) of key rows i / 8 (+ 16): one slot id per row, and
  // (swizzle: chunk ^ (row & 7) changes only the low 3 bits) constant offsets between the chunks.
  const int gather_row = static_cast<int>(pinned(threadIdx.x / 8));
  const T* gather_src = pinned(static_cast<const T*>(p.kv_cache) + threadIdx.x % 8 * 8);  // 16-bit caches
  const uint32_t gather_dst = pinned(smem_addr(s_kv + swizzled<kChunks>(threadIdx.x / 8, threadIdx.x % 8)));
  // fp8: a row is kD bytes, 36 chunks, stored unswizzled (read once each, by the conversion).
  constexpr int kByteChunks = kD / 16;
  auto load_tile_fp8 = [&](int t, int stage) {
    const int base = tile_base(t), end = tile_end(t);
    const uint8_t* ids = s_idx + (t % Tile::kIdxStages) * kBlockN * 8;
    for (int i = threadIdx.x; i < kBlockN * kByteChunks; i += kThreads) {
      const int r = i / kByteChunks, c = i % kByteChunks;
      const int64_t at = kv_start + base + r;
      const int64_t slot = !(base + r < end && at >= 0 && at < p.num_indices) ? -1 : staged_slot_id(p, ids, r);
      const bool valid = slot >= 0 && slot < p.num_slots;  // else a zero row
      cp_async_16(smem_addr(s_kv + stage * Tile::kStageElems + r * kD + c * 16),
                  kv + (valid ? slot : 0) * p.kv_stride_s + c * 16, valid);
    }
  };
  // fp8: stage `stage`'s bytes -> the converted tile, 8 values (one 16-bit chunk) per step, so
  // that 8 consecutive threads write 8 chunks of a row (8 bank groups, as swizzled).
  auto convert_tile = [&](int stage) {
    const bool e5m2 = p.kv_format == kKvE5M2;
    const KvT* src = s_kv + stage * Tile::kStageElems;
    for (int i = threadIdx.x; i < kBlockN * kChunks; i += kThreads) {
      const int r = i / kChunks, c = i % kChunks;
      const uint2 bytes = *reinterpret_cast<const uint2*>(src + r * kD + c * 8);
      const uint4 h = make_uint4(fp8x2_to<T>(static_cast<uint16_t>(bytes.x & 0xffffu), e5m2),
                                 fp8x2_to<T>(static_cast<uint16_t>(bytes.x >> 16), e5m2),
                                 fp8x2_to<T>(static_cast<uint16_t>(bytes.y & 0xffffu), e5m2),
                                 fp8x2_to<T>(static_cast<uint16_t>(bytes.y >> 16), e5m2));
      *reinterpret_cast<uint4*>(s_conv + swizzled<kChunks>(r, c)) = h;
    }
  };
  auto load_tile_16bit = [&](int t, int stage) {
    // 8 warps, 16 keys: the first 4 warps gather (warp-uniform)
    if (kBlockN * 8 < kThreads && threadIdx.x >= kBlockN * 8) return;
    const int base = tile_base(t), end = tile_end(t);
    const uint8_t* ids = s_idx + (t % Tile::kIdxStages) * kBlockN * 8;
#pragma unroll
    for (int rr = 0; rr < (kBlockN * 8 + kThreads - 1) / kThreads; ++rr) {
      const int r = gather_row + rr * (kThreads / 8);  // r & 7 as for gather_dst
      const int64_t at = kv_start + base + r;
      const int64_t slot = !(base + r < end && at >= 0 && at < p.num_indices) ? -1 : staged_slot_id(p, ids, r);
      const bool valid = slot >= 0 && slot < p.num_slots;  // else a zero row
      const T* src = gather_src + (valid ? slot : 0) * p.kv_stride_s;
      const uint32_t dst = gather_dst + (stage * Tile::kStageElems + rr * (kThreads / 8) * kD) * 2;
#pragma unroll
      for (int j = 0; j < kChunks / 8; ++j) cp_async_16(dst + j * 128, src + j * 64, valid);
    }
  };
  auto load_tile = [&](int t, int stage) {
    if constexpr (kFp8) {
      load_tile_fp8(t, stage);
    } else {
      load_tile_16bit(t, stage);
    }
  };

  // ---- per-thread state
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  // k split: the warp's unit (group of kKSplit warps) and its place kq in it; the unit's m tiles
  // unit_m0.., n8 groups unit_n0..; part kq of the unit (m tile kq / kParts, n8 groups
  // (kq % kParts) * kOwnN..) is the warp's own. Else unit and own part are one 16 x 8 unit.
  constexpr int kParts = Tile::kUnitN / kOwnN;  // owned parts across a unit's keys
  constexpr int kUnitsM = kMTiles / Tile::kUnitM;
  const int kq = warp % kKSplit, unit = warp / kKSplit;
  const int unit_m0 = unit % kUnitsM * Tile::kUnitM, unit_n0 = unit / kUnitsM * Tile::kUnitN;
  // this warp's own part of S: m tile mw, key group nw (8 kOwnN keys)
  const int mw = Tile::kSplit ? unit_m0 + kq / kParts : warp % kMTiles;
  const int nw = Tile::kSplit ? (unit_n0 + kq % kParts * kOwnN) / kOwnN : warp / kMTiles;
  // O rows: mt * 16 + g (+ 8) of every m tile; S rows: mw * 16 + g (+ 8)
  float m_i[kMTiles][2];
  float acc[kMTiles][kDvTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    m_i[mt][0] = m_i[mt][1] = -INFINITY;
#pragma unroll
    for (int d = 0; d < kDvTiles; ++d) acc[mt][d][0] = acc[mt][d][1] = acc[mt][d][2] = acc[mt][d][3] = 0.f;
  }
  uint64_t row_mask[2];
  float l_own[2];  // this warp's share (its S units' keys) of the row sums of rows mw * 16 + g (+ 8)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = mw * 16 + g + h * 8;
    const int64_t token = row_token(r);
    row_mask[h] = ~0ull;  // decode: the single tail key is the query's own token
    // Only the bits of the draft itself and earlier drafts count.
    if (p.tree_mask != nullptr) {
      row_mask[h] = token >= 0 ? static_cast<uint64_t>(p.tree_mask[token]) & draft_bits((row0 + r) / H) : 0ull;
    }
    l_own[h] = 0.f;
  }

  // ldmatrix lane addresses (bytes). Rows are 1152 bytes; row & 7 == lane & 7 in all three, so a
  // chunk 8 K + c is stored at 8 K + (c ^ (lane & 7)): per lane a few offsets, the rest immediates.
  const int x7 = lane & 7;
  // Q (A of S): rows mw * 16 + (lane / 8 % 2) * 8 + lane % 8, chunk 2 kk + lane / 16 (of the Q
  // tile: 2 kk + lane / 16 - kQStagedChunks).
  const int q_row = mw * 16 + (lane / 8 % 2) * 8 + x7;
  const uint32_t q_lane = smem_addr(s_q) + q_row * kQChunks * 16;
  uint32_t q_off[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) q_off[j] = pinned(q_lane + (((2 * j + lane / 16) ^ x7) << 4));
  // K (B of S, two k16 steps per ldmatrix): key nw * 8 + lane % 8, chunk 4 i + lane / 8.
  uint32_t k_off[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) k_off[j] = pinned((nw * 8 + x7) * kRowBytes + (((4 * j + lane / 8) ^ x7) << 4));
  // V^T (B of P V, ldmatrix.trans): key (lane / 8 % 2) * 8 + lane % 8, chunk warp * kDvTiles + d + lane / 16.
  uint32_t v_off[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    v_off[j] = pinned(((lane / 8 % 2) * 8 + x7) * kRowBytes + warp * kDvTiles * 16 + (((2 * j + lane / 16) ^ x7) << 4));
  }
  // P (A of P V): rows mt * 16 + (lane / 8 % 2) * 8 + lane % 8, 8-key chunk 2 ks + lane / 16.
  const uint32_t p_lane = pinned(smem_addr(s_p) + ((lane / 8 % 2) * 8 + x7) * Tile::kPStride + (lane / 16) * 16);
  const uint32_t kv_smem = smem_addr(s_kv), conv_smem = smem_addr(s_conv);
  // the own part's first key (of s[0][0], s[0][2]); s[j] holds keys 8 j on
  const int s_col = static_cast<int>(pinned(nw * 8 * kOwnN + t4 * 2));
  const int red_at = static_cast<int>(pinned((mw * 16 + g) * kNWarps + nw));  // s_red cell of row mw * 16 + g
  // A row's kNWarps cells (one per warp of its m tile) in one vector load.
  auto row_cells = [&](int r, float(&c)[kNWarps]) {
    static_assert(kNWarps == 2 || kNWarps == 4, "row cells are one float2 / float4");
    if constexpr (kNWarps == 4) {
      const float4 v = *reinterpret_cast<const float4*>(s_red + r * 4);
      c[0] = v.x, c[1] = v.y, c[2] = v.z, c[3] = v.w;
    } else {
      const float2 v = *reinterpret_cast<const float2*>(s_red + r * 2);
      c[0] = v.x, c[1] = v.y;
    }
  };
  uint8_t* const p_at = s_p + pinned((mw * 16 + g) * Tile::kPStride + s_col * 2);  // P of s[0][0], s[0][1]
  // k split: lane offsets of this warp's first 4 k16 steps (9 kq..); step 9 kq + j + 4 i is 128 bytes
  // further than step 9 kq + j (its chunks are 8 further: the swizzle keeps the low 3 bits).
  // Q (A of the unit's m tiles): rows unit_m0 * 16 + (lane / 8 % 2) * 8 + lane % 8 (+ 16);
  // K (B, 16 keys per ldmatrix): key unit_n0 * 8 + (lane / 16) * 8 + lane % 8 (+ 16), chunk 2 k + lane / 8 % 2.
  uint32_t qs_off[4], ks_off[4];
  if constexpr (Tile::kSplit) {
    const int k0 = kq * Tile::kUnitSteps;
    const uint32_t q_unit = smem_addr(s_q) + (unit_m0 * 16 + (lane / 8 % 2) * 8 + x7) * kQChunks * 16;
    const int key = unit_n0 * 8 + (lane / 16) * 8 + x7;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int k = k0 + j;
      qs_off[j] = pinned(q_unit + (k / 4) * 128 + (((2 * (k % 4) + lane / 16) ^ x7) << 4));
      ks_off[j] = pinned(key * kRowBytes + (k / 4) * 128 + (((2 * (k % 4) + lane / 8 % 2) ^ x7) << 4));
    }
  }


  // Slot ids of tiles 0 and 1 (with Q) visible to every thread before the first gathers; every
  // gather of tile u is issued with the ids of tile u + 2, one cp.async group per tile.
  //   2 stages: tile t + 1 is gathered once tile t has landed (the loop-top barrier): its stage
  //     and the ids' stage were last read in tile t - 1, before that barrier.
  //   3 stages: tiles 0 and 1 before the loop; tile t + 2 is gathered after tile t's first barrier
  //     (its stage was last read by tile t - 1's P V, which every warp finished before that
  //     barrier), and tile t + 1 is waited for before tile t's second barrier, which makes it
  //     visible for the next iteration: no loop-top barrier.
  load_indices(0);
  load_indices(1);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  // The Q fragments of the first kQRegSteps k16 steps into registers (Tile::kQRegSteps).
  uint32_t q_reg[kQRegSteps > 0 ? kQRegSteps : 1][4];
  if constexpr (kQStagedChunks > 0) {
    const uint32_t staged = smem_addr(s_q_staged) + q_row * kQStagedChunks * 16;
#pragma unroll
    for (int kk = 0; kk < kQRegSteps; ++kk) ldmatrix_x4(q_reg[kk], staged + (((2 * kk + lane / 16) ^ x7) << 4));
    __syncthreads();  // the staged Q columns are KV stage 0 (tile 0 refills it) or the converted tile
  } else {
#pragma unroll
    for (int kk = 0; kk < kQRegSteps; ++kk) ldmatrix_x4(q_reg[kk], q_off[kk % 4] + (kk / 4) * 128);
  }
  if (total_tiles > 0) load_tile(0, 0);
  load_indices(2);
  cp_async_commit();  // tile 0 (and tile 2's ids)
  if constexpr (Tile::kStages == 3) {
    if (total_tiles > 1) load_tile(1, 1);
    load_indices(3);
    cp_async_commit();  // tile 1 (and tile 3's ids)
    cp_async_wait<1>();
    __syncthreads();  // tile 0 (and tile 2's ids) visible
  }

  int stage = 0;  // t % kStages
  for (int t = 0; t < total_tiles; ++t) {
    if constexpr (Tile::kStages == 2) {
      cp_async_wait<0>();
      __syncthreads();  // tile t (and the ids of t + 1, t + 2) visible; tile t - 1 fully read
      if (t + 1 < total_tiles) {
        load_tile(t + 1, stage ^ 1);
        load_indices(t + 3);
        cp_async_commit();
      }
    }
    uint32_t kv_s = kv_smem + stage * Tile::kStageElems * 2;
    if constexpr (kFp8) {
      // 3 stages (no loop-top barrier): every warp has finished tile t - 1's P V, which read the
      // converted tile, before it is overwritten; 2 stages: the loop-top barrier did that.
      if constexpr (Tile::kStages == 3) __syncthreads();
      convert_tile(stage);
      __syncthreads();  // the converted tile visible
      kv_s = conv_smem;
    }

    // s[j]: the own part's n8 group j (16 rows x 8 keys), 4 values per lane as an mma accumulator
    float s[kOwnN][4];
    if constexpr (!Tile::kSplit) {
      // S unit: 16 rows x 8 keys over all 36 k16 steps, even and odd steps in two accumulator chains
      float s2[2][4] = {};
#pragma unroll
      for (int i = 0; i < kKSteps / 2; ++i) {
        uint32_t b[4];  // k16 step 2 i: b0, b1; step 2 i + 1: b2, b3
        ldmatrix_x4(b, kv_s + k_off[i % 2] + (i / 2) * 128);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int kk = 2 * i + h;
          if (kk < kQRegSteps) {
            mma_16816<T>(s2[h], q_reg[kk < kQRegSteps ? kk : 0], b[2 * h], b[2 * h + 1]);
          } else {
            uint32_t a[4];
            ldmatrix_x4(a, q_off[kk % 4] + ((kk - kQStagedChunks / 2) / 4) * 128);
            mma_16816<T>(s2[h], a, b[2 * h], b[2 * h + 1]);
          }
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][e] = s2[0][e] + s2[1][e];
    } else {
      // the unit's partial S over this warp's k16 steps: each Q fragment for kUnitN n8 groups, each
      // K fragment for kUnitM m tiles, kUnitM x kUnitN independent accumulators
      constexpr int kUM = Tile::kUnitM, kUN = Tile::kUnitN;
      float ps[kUM][kUN][4] = {};
#pragma unroll
      for (int kk = 0; kk < Tile::kUnitSteps; ++kk) {
        uint32_t a[kUM][4];
#pragma unroll
        for (int i = 0; i < kUM; ++i) ldmatrix_x4(a[i], qs_off[kk % 4] + (kk / 4) * 128 + i * 16 * kQChunks * 16);
#pragma unroll
        for (int n = 0; n < kUN; n += 2) {
          uint32_t b[4];  // n8 group n: b0, b1; group n + 1: b2, b3
          ldmatrix_x4(b, kv_s + ks_off[kk % 4] + (kk / 4) * 128 + n * 8 * kRowBytes);
#pragma unroll
          for (int i = 0; i < kUM; ++i) {
            mma_16816<T>(ps[i][n], a[i], b[0], b[1]);
            mma_16816<T>(ps[i][n + 1], a[i], b[2], b[3]);
          }
        }
      }
      // hand each other warp of the unit its part; keep the own one (selected: no dynamic indexing)
#pragma unroll
      for (int part = 0; part < kKSplit; ++part) {
        const int owner = unit * kKSplit + part, cell = (kq - part - 1 + kKSplit) % kKSplit;
#pragma unroll
        for (int j = 0; j < kOwnN; ++j) {
          const float* v = ps[part / kParts][part % kParts * kOwnN + j];
          if (part != kq) {
            s_x[((owner * (kKSplit - 1) + cell) * kOwnN + j) * 32 + lane] = make_float4(v[0], v[1], v[2], v[3]);
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) s[j][e] = part == kq || part == 0 ? v[e] : s[j][e];
        }
      }
      __syncthreads();  // partial sums handed over
      // the other warps' parts of the own one, in a fixed order (cell c: from warp kq - c - 1)
#pragma unroll
      for (int c = 0; c < kKSplit - 1; ++c) {
#pragma unroll
        for (int j = 0; j < kOwnN; ++j) {
          const float4 v = s_x[((warp * (kKSplit - 1) + c) * kOwnN + j) * 32 + lane];
          s[j][0] += v.x, s[j][1] += v.y, s[j][2] += v.z, s[j][3] += v.w;
        }
      }
    }

    // scale; mask keys past the end (last tile of a range) and, in the tail, non-ancestors
    const int base = tile_base(t), end = tile_end(t);
    const bool is_tail = t >= prefix_tiles;
    const bool full = !is_tail && base + kBlockN <= end;
#pragma unroll
    for (int j = 0; j < kOwnN; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = finite_or_nan(s[j][e] * qk_scale_log2);
    }
    if (!full) {
#pragma unroll
      for (int j = 0; j < kOwnN; ++j) {
        const int first = base + s_col + 8 * j;  // key of s[j][0] and s[j][2]; s[j][1], s[j][3]: the next one
        const int left = end - first;            // keys of the pair before the end
        // The mask bits of the pair, from bit first - prefix_len (< 64 for any input: tail tiles
        // start below prefix_len + 64; min(.., 63) keeps the shift defined regardless; a key past
        // bit 63 reads 0).
        const int shift = min(first - prefix_len, 63);
        uint32_t bits[2] = {3u, 3u};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (is_tail) bits[h] = static_cast<uint32_t>(row_mask[h] >> shift) & 3u;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool visible = (e & 1) < left && (bits[e >> 1] >> (e & 1)) & 1u;
          s[j][e] = visible ? s[j][e] : -INFINITY;
        }
      }
    }

    // the own part's row maxima (a quad of lanes shares a row) -> s_red[row][nw]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = fmaxf(s[0][2 * h], s[0][2 * h + 1]);
#pragma unroll
      for (int j = 1; j < kOwnN; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      if (t4 == 0) s_red[red_at + h * 8 * kNWarps] = mx;
    }
    __syncthreads();  // row maxima published
    if constexpr (Tile::kStages == 3) {
      if (t + 2 < total_tiles) {
        load_tile(t + 2, stage == 0 ? 2 : stage - 1);
        load_indices(t + 4);
        cp_async_commit();
        cp_async_wait<1>();  // tile t + 1 (and the ids of t + 3)
      } else {
        cp_async_wait<0>();
      }
    }

    // every warp: the new max of all its O rows (same values, same order in every warp). m_safe
    // is finite: a row with no visible key so far (mx = -inf) subtracts -FLT_MAX, which keeps
    // 2^(-inf - m_safe) = 0 and needs no select.
    float alpha[kMTiles][2], m_safe[kMTiles][2];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = m_i[mt][h], cells[kNWarps];
        row_cells(mt * 16 + g + h * 8, cells);
#pragma unroll
        for (int n = 0; n < kNWarps; ++n) mx = fmaxf(mx, cells[n]);
        m_safe[mt][h] = fmaxf(mx, -FLT_MAX);
        alpha[mt][h] = ex2(m_i[mt][h] - m_safe[mt][h]);
        m_i[mt][h] = mx;
      }
    }
    // the part's owner: P = 2^(S - max) once, to shared memory; its share of the row sum
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float ms = m_safe[0][h], al = alpha[0][h];  // of m tile mw (selected: no dynamic indexing)
#pragma unroll
      for (int mt = 1; mt < kMTiles; ++mt) {
        ms = mw == mt ? m_safe[mt][h] : ms;
        al = mw == mt ? alpha[mt][h] : al;
      }
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kOwnN; ++j) {
        const float p0 = ex2(s[j][2 * h] - ms), p1 = ex2(s[j][2 * h + 1] - ms);
        sum += p0 + p1;
        *reinterpret_cast<uint32_t*>(p_at + h * 8 * Tile::kPStride + j * 16) = pack2<T>(p0, p1);
      }
      l_own[h] = l_own[h] * al + sum;
    }
    __syncthreads();  // P written (3 stages: and tile t + 1 visible)

    // O[:, this warp's 128 columns] = alpha O + P V over the tile's kBlockN / 16 k16 steps (the
    // rescale next to each n8 tile's first mma, so that it issues between mma instructions)
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      uint32_t a_p[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) ldmatrix_x4(a_p[mt], p_lane + mt * 16 * Tile::kPStride + ks * 32);
#pragma unroll
      for (int d = 0; d < kDvTiles; d += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, kv_s + v_off[d % 8 / 2] + (d / 8) * 128 + ks * 16 * kRowBytes);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          if (ks == 0) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              acc[mt][d][e] *= alpha[mt][e >> 1];
              acc[mt][d + 1][e] *= alpha[mt][e >> 1];
            }
          }
          mma_16816<T>(acc[mt][d], a_p[mt], b[0], b[1]);
          mma_16816<T>(acc[mt][d + 1], a_p[mt], b[2], b[3]);
        }
      }
    }
    stage = stage + 1 == Tile::kStages ? 0 : stage + 1;
  }
  cp_async_wait<0>();
  launch_dependents();  // the merge kernel may be scheduled now (it waits for this grid's end)

  // ---- row sums: each owner's quad sum -> s_red (last read before the last tile's P barrier)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_own[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (t4 == 0) s_red[red_at + h * 8 * kNWarps] = l;
  }
  __syncthreads();

  // ---- epilogue: every warp writes its 512 / kWarps columns; rows that saw no key get zeros, lse = -inf
  // (selected, not 0 * acc: acc may hold NaN from a V row of a draft slot the row does not see)
  const int col0 = warp * kDvTiles * 8;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mt * 16 + g + h * 8;
      float l = 0.f, cells[kNWarps];
      row_cells(r, cells);
#pragma unroll
      for (int n = 0; n < kNWarps; ++n) l += cells[n];
      const int64_t token = row_token(r);
      if (token < 0) continue;
      const int head = (row0 + r) % H;
      // l is 0 iff the row saw no key; NaN (a NaN logit) counts as seen: NaN output and lse.
      const bool seen = l != 0.f;
      const float inv_l = seen ? v_scale / l : 0.f;  // v_scale: 1 but for fp8 caches
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
  static_assert(kDv % kMergeVec == 0, "the merge combines kMergeVec columns per load");
  const int64_t idx = blockIdx.x;  // token * H + head
  const int64_t token = idx / p.num_heads;
  const int head = static_cast<int>(idx % p.num_heads);
  merge_split_row(p.o_partial, p.lse_partial, p.num_splits, static_cast<int64_t>(p.num_tokens) * p.num_heads, idx, kDv,
                  static_cast<T*>(p.out) + token * p.o_stride_t + head * p.o_stride_h, p.lse);
}

template <typename T, int kMTiles, int kKSplit, bool kFp8>
cudaError_t launch(const MlaParams& p, int device, cudaStream_t stream) {
  using Tile = MlaTile<kMTiles, kFp8, kKSplit>;
  constexpr int kSmem = Tile::kSmemBytes;
  const cudaError_t attr_err =
      opt_in_dynamic_smem_once<mla_tree_verify_kernel<T, kMTiles, kFp8, kKSplit>, kSmem>(device);
  if (attr_err != cudaSuccess) return attr_err;
  const int m_blocks = (p.max_rows + 16 * kMTiles - 1) / (16 * kMTiles);
  const dim3 grid(static_cast<unsigned>(p.num_requests) * m_blocks, p.num_splits);
  mla_tree_verify_kernel<T, kMTiles, kFp8, kKSplit><<<grid, Tile::kThreads, kSmem, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.num_splits == 1) return err;
  return launch_dependent(mla_merge_splits_kernel<T>, dim3(static_cast<unsigned>(p.num_tokens) * p.num_heads),
                          dim3(kMlaMergeThreads), 0, stream, p);
}

template <typename T>
cudaError_t launch_for_rows(const MlaParams& p, cudaStream_t stream) {
  int device = 0, per_sm = 0, reserved = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = device_smem(device, per_sm, reserved);
  if (err != cudaSuccess) return err;
  const bool fp8 = p.kv_format != kKvLikeQ;
  const LaunchShape shape = mla_launch_shape(p.max_rows, per_sm, reserved, fp8);
#define SPEC_KERNELS_MLA_LAUNCH(M_TILES, K_SPLIT, REGS, FP8_REGS)                                  \
  if (shape.block_m == 16 * M_TILES && shape.block_n == MlaTile<M_TILES, false, K_SPLIT>::kBlockN) \
    return fp8 ? launch<T, M_TILES, K_SPLIT, true>(p, device, stream)                            \
               : launch<T, M_TILES, K_SPLIT, false>(p, device, stream);
  SPEC_KERNELS_MLA_CONFIGS(SPEC_KERNELS_MLA_LAUNCH)
#undef SPEC_KERNELS_MLA_LAUNCH
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_mla_tree_verify_attention(const MlaParams& p, Dtype dtype, cudaStream_t stream) {
  if (p.num_requests == 0 || p.num_tokens == 0) return cudaSuccess;
  return dtype == Dtype::kBFloat16 ? launch_for_rows<__nv_bfloat16>(p, stream) : launch_for_rows<__half>(p, stream);
}

}  // namespace spec_kernels
