// Tree-verify attention (and plain decode): one launch, KV read once for all draft rows.
//
// A CTA (4 warps; 8 in the 128-row configuration) owns up to 64 (32, 128) query rows of one
// (request, KV head, KV split): the request's n_b draft tokens x the GQA group, packed row-major
// (row = draft * group + head_in_group), so each KV tile is read once per row block. It
// streams the split's share of the prefix through a 2- or 3-stage shared-memory pipeline filled by
// cp.async gathers (one slot id per KV row), then - in the last split only - the n_b draft slots.
// Prefix tiles need no mask; only tail tiles test the row's 64-bit ancestor word. At D <= 128 the
// Q fragments stay in registers for the whole loop.
//
// The slot ids of a tile are copied into shared memory (cp.async) two tiles ahead of its K/V
// gather, so issuing the gather never waits for an index load.
//
// Few rows (decode: rows = group <= 16) would leave warps idle, so the warps are arranged as
// warps_m x warps_n: warps_n warps share the same 16 rows (32 in sm_90's configuration of two m
// tiles per warp, whose K and V fragments then serve both) and take different keys of every
// tile, each with its own online softmax, merged through shared memory at the end.
//
// With num_splits > 1 every split writes a normalised partial output and its base-2 log-sum-exp;
// merge_splits_kernel combines them in a fixed order (bitwise deterministic, no atomics),
// launched as a programmatic dependent (spec_kernels/programmatic_launch.cuh) so that its launch
// overlaps this kernel's last CTAs.
//
// An fp8 cache (kFp8) is gathered as bytes and converted once per tile into K and V tiles of q's
// dtype (TileConfig's comment says why); k_scale folds into the softmax scale, v_scale into the
// output, as in the Triton kernel.
#include <atomic>
#include <cfloat>
#include <type_traits>

#include "spec_kernels/kv_index.cuh"
#include "spec_kernels/launch_once.cuh"
#include "spec_kernels/mma.cuh"
#include "spec_kernels/split_merge.cuh"
#include "spec_kernels/tree_verify.h"
#include "spec_kernels/tree_verify_config.h"

namespace spec_kernels {
namespace {

// The configurations (TileConfig<D, rows, fp8, m tiles per warp>) and the launch's choice among them:
// spec_kernels/tree_verify_config.h.

// How far (log2) a tile's row max may exceed the running max before O and l are rescaled to it.
constexpr float kLazyRescaleLog2 = 8.f;

template <typename T, int D, int kRows, bool kFp8, int kMTiles>
__global__ void __launch_bounds__(TileConfig<D, kRows, kFp8, kMTiles>::kThreads,
                                  TileConfig<D, kRows, kFp8, kMTiles>::kMinCtasPerSm)
    tree_verify_kernel(const TreeVerifyParams p) {
  using Cfg = TileConfig<D, kRows, kFp8, kMTiles>;
  constexpr int kMT = kMTiles;  // m16 tiles of a warp: its rows are wm * kWarpRows + 16 * mt + ...
  using KvT = std::conditional_t<kFp8, uint8_t, T>;
  constexpr int kWarps = Cfg::kWarps, kThreads = Cfg::kThreads;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kChunks = Cfg::kChunks;
  constexpr int kStageKeys = Cfg::kStageKeys;
  constexpr int kStages = Cfg::kStages;
  extern __shared__ __align__(128) uint8_t smem[];
  // fp8: the converted K and V tiles (q's dtype) the fragments are loaded from.
  T* s_kc = reinterpret_cast<T*>(smem) + Cfg::kQElems;
  T* s_vc = s_kc + kStageKeys * D;
  KvT* s_k = reinterpret_cast<KvT*>(smem + (Cfg::kQElems + Cfg::kConvertedElems) * 2);
  KvT* s_v = s_k + kStages * kStageKeys * D;
  // Chunk c of Q row r: with Q in registers it is staged in the last K stage (rows 0-63) and the
  // last V stage (rows 64-127), which the prologue does not fill (fp8: in the converted K and V
  // tiles); else in its own tile.
  auto q_chunk = [&](int r, int c) -> T* {
    if constexpr (!Cfg::kQInRegs) {
      return reinterpret_cast<T*>(smem) + swizzled<kChunks>(r, c);
    } else if constexpr (kFp8) {
      return (r < kStageKeys ? s_kc : s_vc) + swizzled<kChunks>(r % kStageKeys, c);
    } else {
      return (r < kStageKeys ? s_k : s_v) + (kStages - 1) * kStageKeys * D + swizzled<kChunks>(r % kStageKeys, c);
    }
  };
  uint8_t* s_idx = reinterpret_cast<uint8_t*>(s_v + kStages * kStageKeys * D);  // [kIdxStages][kStageKeys] x 8 B
  uint64_t* s_mask = reinterpret_cast<uint64_t*>(s_idx + Cfg::kIdxBytes);        // [kBlockM] (kMasksInSmem)

  // ---- which rows, which request, which KV range
  const int group = p.num_q_heads / p.num_kv_heads;
  const int m_blocks = ceil_div(p.max_rows, kBlockM);
  const int m_block = blockIdx.x % m_blocks;
  const int kv_head = (blockIdx.x / m_blocks) % p.num_kv_heads;
  const int req = blockIdx.x / (m_blocks * p.num_kv_heads);
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
  const int rows_here = min(kBlockM, min(n_draft * group, p.max_rows) - row0);
  if (rows_here <= 0) return;  // uniform over the CTA

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int units = ceil_div(rows_here, Cfg::kWarpRows);  // warps of rows needed
  const int warps_m = max(units <= 1 ? 1 : units <= 2 ? 2 : !Cfg::kWide || units <= 4 ? 4 : 8,
                          kWarps / Cfg::kMaxWarpsN);
  const int warps_n = kWarps / warps_m;
  const int wm = warp % warps_m, wn = warp / warps_m;
  const int keys_per_warp = kStageKeys / warps_n;
  const int ntiles = keys_per_warp / 8;  // even: 2..kMaxNTiles

  int lo, hi;
  split_bounds(prefix_len, p.num_splits, split, kStageKeys, p.min_chunk, lo, hi);
  const int prefix_tiles = ceil_div(hi - lo, kStageKeys);
  const int tail_tiles = split == p.num_splits - 1 ? ceil_div(num_tail, kStageKeys) : 0;
  const int total_tiles = prefix_tiles + tail_tiles;

  const T* q = static_cast<const T*>(p.q);
  const KvT* k_cache = static_cast<const KvT*>(p.k_cache) + kv_head * p.k_stride_h;
  const KvT* v_cache = static_cast<const KvT*>(p.v_cache) + kv_head * p.v_stride_h;
  float qk_scale_log2 = p.sm_scale_log2, v_scale = 1.f;
  if constexpr (kFp8) {
    qk_scale_log2 *= p.k_scale_ptr != nullptr ? *p.k_scale_ptr : p.k_scale;
    v_scale = p.v_scale_ptr != nullptr ? *p.v_scale_ptr : p.v_scale;
  }

  // ---- Q block (rows past rows_here are zero-filled)
  for (int i = threadIdx.x; i < kBlockM * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const int row = row0 + r;
    // token >= 0: a negative qo_indptr value (unchecked on the GPU) must not read before q.
    const int64_t token = q_start + row / group;
    const bool valid = r < rows_here && token >= 0 && token < p.num_tokens;
    const T* src = q;
    if (valid) {
      src = q + token * p.q_stride_t + (kv_head * group + row % group) * p.q_stride_h + c * 8;
    }
    cp_async_16(smem_addr(q_chunk(r, c)), src, valid);
  }

  // Tile t covers key positions [base, base + kStageKeys) clipped to end: prefix tiles first.
  auto tile_base = [&](int t) { return t < prefix_tiles ? lo + t * kStageKeys : prefix_len + (t - prefix_tiles) * kStageKeys; };
  auto tile_end = [&](int t) { return t < prefix_tiles ? hi : prefix_len + num_tail; };

  // Tile t's slot ids into s_idx stage t % kIdxStages: one coalesced cp.async per key (thread r
  // copies key r's id); ids past the range are not read (zero-fill).
  auto load_indices = [&](int t) {
    if (t >= total_tiles || threadIdx.x >= kStageKeys) return;
    const int r = threadIdx.x;
    const int base = tile_base(t), end = tile_end(t);
    const int64_t at = kv_start + base + r;
    const bool in_range = base + r < end && at >= 0 && at < p.num_indices;
    const uint32_t dst = smem_addr(s_idx + ((t % Cfg::kIdxStages) * kStageKeys + r) * 8);
    copy_slot_id_async(p, at, in_range, dst);
  };

  // 16-byte chunks of a cached row: 8 elements (16-bit), or 16 (fp8: rows stored unswizzled,
  // read once each by the conversion)
  constexpr int kRowChunks = D * sizeof(KvT) / 16;
  auto stage_chunk = [&](KvT* stage, int r, int c) -> KvT* {
    if constexpr (kFp8) {
      return stage + r * D + c * 16;
    } else {
      return stage + swizzled<kChunks>(r, c);
    }
  };
  auto load_tile = [&](int t, int stage) {
    if (t >= total_tiles) return;  // uniform over the CTA
    const int base = tile_base(t), end = tile_end(t);
    KvT* dst_k = s_k + stage * kStageKeys * D;
    KvT* dst_v = s_v + stage * kStageKeys * D;
    const uint8_t* ids = s_idx + (t % Cfg::kIdxStages) * kStageKeys * 8;
    for (int i = threadIdx.x; i < kStageKeys * kRowChunks; i += kThreads) {
      const int r = i / kRowChunks, c = i % kRowChunks;
      // A slot id outside [0, S) (unchecked on the GPU unless in debug mode) is never followed: such a
      // key reads as a zero row (as in the reference and the Triton kernel).
      const int64_t at = kv_start + base + r;
      const bool in_range = base + r < end && at >= 0 && at < p.num_indices;
      const int64_t slot = !in_range ? 0 : staged_slot_id(p, ids, r);
      const bool valid = in_range && slot >= 0 && slot < p.num_slots;
      constexpr int kElems = 16 / sizeof(KvT);
      cp_async_16(smem_addr(stage_chunk(dst_k, r, c)), k_cache + slot * p.k_stride_s + c * kElems, valid);
      cp_async_16(smem_addr(stage_chunk(dst_v, r, c)), v_cache + slot * p.v_stride_s + c * kElems, valid);
    }
  };

  // fp8: stage `stage`'s bytes -> the converted tiles, 8 values (one 16-bit chunk) per step, so
  // that 8 consecutive threads write the 8 chunks of a row segment (8 bank groups, as swizzled).
  auto convert_tile = [&](int stage) {
    const bool e5m2 = p.kv_format == kKvE5M2;
    for (int i = threadIdx.x; i < 2 * kStageKeys * kChunks; i += kThreads) {
      const bool is_v = i >= kStageKeys * kChunks;
      const int j = is_v ? i - kStageKeys * kChunks : i;
      const int r = j / kChunks, c = j % kChunks;
      const KvT* src = (is_v ? s_v : s_k) + stage * kStageKeys * D;
      const uint2 bytes = *reinterpret_cast<const uint2*>(src + r * D + c * 8);
      const uint4 h = make_uint4(fp8x2_to<T>(static_cast<uint16_t>(bytes.x & 0xffffu), e5m2),
                                 fp8x2_to<T>(static_cast<uint16_t>(bytes.x >> 16), e5m2),
                                 fp8x2_to<T>(static_cast<uint16_t>(bytes.y & 0xffffu), e5m2),
                                 fp8x2_to<T>(static_cast<uint16_t>(bytes.y >> 16), e5m2));
      *reinterpret_cast<uint4*>((is_v ? s_vc : s_kc) + swizzled<kChunks>(r, c)) = h;
    }
  };

  // ---- per-thread state for rows g and g + 8 of each of this warp's m tiles
  const int g = lane / 4, t4 = lane % 4;
  const int warp_row0 = wm * Cfg::kWarpRows;
  // The ancestor word of row r of the CTA. The thread's rows' words are held in registers, or
  // (Cfg::kMasksInSmem) in a table in shared memory that tail tiles read: 8 registers fewer
  // across the loop.
  auto row_mask = [&](int r) -> uint64_t {
    if (p.tree_mask == nullptr) return ~0ull;  // decode: the single tail key is the query's own token
    const int64_t token = q_start + (row0 + r) / group;
    // Only the bits of the draft itself and earlier drafts count.
    return r < rows_here && token >= 0 && token < p.num_tokens
               ? static_cast<uint64_t>(p.tree_mask[token]) & draft_bits((row0 + r) / group)
               : 0ull;
  };
  uint64_t reg_mask[kMT][2];
  if constexpr (Cfg::kMasksInSmem) {
    for (int r = threadIdx.x; r < kBlockM; r += kThreads) s_mask[r] = row_mask(r);  // published by the prologue's barrier
  } else {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) reg_mask[mt][h] = row_mask(warp_row0 + mt * 16 + g + h * 8);
    }
  }
  float m_i[kMT][2], l_i[kMT][2];
  float acc[kMT][Cfg::kDvTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_i[mt][h] = -INFINITY;
      l_i[mt][h] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < Cfg::kDvTiles; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.f;
  }

  // Slot ids of tiles 0 .. kStages-1 (with Q), visible to every thread before the first gathers;
  // from then on tile u's ids travel with tile u - kStages's K/V, so they have been waited for
  // and passed a barrier when tile u's gather is issued. One commit group per tile, even empty
  // (with three stages, tiles 0 and 1 share the first).
  for (int u = 0; u < kStages; ++u) load_indices(u);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  for (int u = 0; u < kStages - 1; ++u) load_tile(u, u);
  // The ids of tiles kStages .. 2 kStages - 2 go to the cells of tiles 0 .. once every thread has
  // read those (more than kIdxStages ids in the prologue: three stages).
  if constexpr (2 * kStages - 1 > Cfg::kIdxStages) __syncthreads();
  for (int u = 0; u < kStages - 1; ++u) {
    load_indices(u + kStages);
    cp_async_commit();
  }
  uint32_t q_frag[D / 16][4];  // kQInRegs only
  if constexpr (Cfg::kQInRegs) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      ldmatrix_x4(q_frag[kk], smem_addr(q_chunk(warp_row0 + (lane / 8 % 2) * 8 + lane % 8, kk * 2 + lane / 16)));
    }
    __syncthreads();  // the Q tile is in stage kStages - 1: the loop's first prefetch fills it
  }

  // This warp's K and V fragment addresses within a stage, per lane: the swizzle of chunk c of a
  // row r is (c ^ r % 8), and r % 8 = lane % 8 for every fragment (key0 and the tiles' rows are
  // multiples of 8), so chunk 8 * a + b maps to 8 * a + (b ^ lane % 8): four offsets per operand
  // and compile-time steps (16 bytes per chunk, kRowBytes per row).
  constexpr int kRowBytes = kChunks * 16;
  const int key0 = wn * keys_per_warp;  // this warp's first key within a tile
  const int x7 = lane % 8;
  uint32_t k_off[4], v_off[4], q_off[4];  // q_off: Q in its own tile (!kQInRegs), m tile 0
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    k_off[i] = pinned((key0 + lane / 16 * 8 + x7) * kRowBytes + (((2 * i + lane / 8 % 2) ^ x7) << 4));
    v_off[i] = pinned((key0 + lane / 8 % 2 * 8 + x7) * kRowBytes + (((2 * i + lane / 16) ^ x7) << 4));
    if constexpr (!Cfg::kQInRegs) {
      q_off[i] = pinned(smem_addr(smem) + (warp_row0 + lane / 8 % 2 * 8 + x7) * kRowBytes +
                        (((2 * i + lane / 16) ^ x7) << 4));
    }
  }

  for (int t = 0; t < total_tiles; ++t) {
    // Stage (t - 1) % kStages, read by the previous iteration, gets tile t + kStages - 1.
    load_tile(t + kStages - 1, (t + kStages - 1) % kStages);
    load_indices(t + 2 * kStages - 1);
    cp_async_commit();
    cp_async_wait<kStages - 1>();  // tile t has landed
    __syncthreads();
    const T* k_s;
    const T* v_s;
    if constexpr (kFp8) {
      // The converted tiles were last read by the previous iteration, before its closing barrier.
      convert_tile(t % kStages);
      __syncthreads();
      k_s = s_kc;
      v_s = s_vc;
    } else {
      k_s = s_k + (t % kStages) * kStageKeys * D;
      v_s = s_v + (t % kStages) * kStageKeys * D;
    }
    const int base = tile_base(t), end = tile_end(t);
    const bool is_tail = t >= prefix_tiles;
    // A warp whose keys of the tile are all past `end` (decode's tail tile holds one key: 3 of its
    // 4 warps), or whose rows are all past rows_here, skips it. Warp-uniform; per-n8-tile
    // predicates would cost more than they save.
    const bool live = end - base > key0 && warp_row0 < rows_here;

    if (live) {
      const uint32_t k_base = smem_addr(k_s), v_base = smem_addr(v_s);
      // S = Q K^T for the warp's rows x keys_per_warp keys, k16 steps over D; each K fragment
      // serves every m tile
      float s[kMT][Cfg::kMaxNTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int j = 0; j < Cfg::kMaxNTiles; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
      }
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          if constexpr (Cfg::kQInRegs) {
#pragma unroll
            for (int i = 0; i < 4; ++i) a[mt][i] = q_frag[kk][i];
          } else {
            ldmatrix_x4(a[mt], q_off[kk % 4] + mt * 16 * kRowBytes + kk / 4 * 128);
          }
        }
#pragma unroll
        for (int j = 0; j < Cfg::kMaxNTiles; j += 2) {
          if (j < ntiles) {
            uint32_t b[4];
            ldmatrix_x4(b, k_base + k_off[kk % 4] + j * 8 * kRowBytes + kk / 4 * 128);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
              mma_16816<T>(s[mt][j], a[mt], b[0], b[1]);
              mma_16816<T>(s[mt][j + 1], a[mt], b[2], b[3]);
            }
          }
        }
      }

      // The tile's row maxima in the log2 domain. A full prefix tile (no key masked) takes them
      // from the raw scores' extremes and scales while exponentiating (one FFMA per score); a
      // visible non-finite logit (an inf in q or k, or overflow) turns the row NaN, as in the
      // reference: NaN logits already propagate, an infinite one is an infinite extreme. Else
      // every score is scaled, a non-finite one made NaN, and keys past the end (last tile of a
      // range) and, in the tail, non-ancestors set to -inf.
      const bool full = !is_tail && base + kStageKeys <= end;
      const float mult = full ? qk_scale_log2 : 1.f;  // exponent: s * mult - max
      float tile_max[kMT][2], poison[kMT][2];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        if (full) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float hi = -INFINITY, lo = INFINITY;
#pragma unroll
            for (int j = 0; j < Cfg::kMaxNTiles; ++j) {
              if (j < ntiles) {
                hi = fmaxf(hi, fmaxf(s[mt][j][2 * h], s[mt][j][2 * h + 1]));
                lo = fminf(lo, fminf(s[mt][j][2 * h], s[mt][j][2 * h + 1]));
              }
            }
            const float a = hi * qk_scale_log2, b = lo * qk_scale_log2;  // either sign of the scale
            tile_max[mt][h] = fmaxf(a, b);
            poison[mt][h] = fabsf(a) < INFINITY && fabsf(b) < INFINITY ? 0.f : NAN;
          }
        } else {
          tile_max[mt][0] = tile_max[mt][1] = -INFINITY;
          poison[mt][0] = poison[mt][1] = 0.f;
          uint64_t words[2] = {~0ull, ~0ull};
          if (is_tail) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              if constexpr (Cfg::kMasksInSmem) {
                words[h] = s_mask[warp_row0 + mt * 16 + g + h * 8];
              } else {
                words[h] = reg_mask[mt][h];
              }
            }
          }
#pragma unroll
          for (int j = 0; j < Cfg::kMaxNTiles; ++j) {
            if (j >= ntiles) continue;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float x = finite_or_nan(s[mt][j][e] * qk_scale_log2);
              const int pos = base + key0 + j * 8 + t4 * 2 + (e & 1);
              bool visible = pos < end;
              // min(.., 63): n_b > 64 (invalid, unchecked on the GPU) must not shift by >= 64 (UB); as Triton.
              if (is_tail && visible) visible = (words[e >> 1] >> min(pos - prefix_len, 63)) & 1ull;
              x = visible ? x : -INFINITY;
              s[mt][j][e] = x;
              tile_max[mt][e >> 1] = fmaxf(tile_max[mt][e >> 1], x);
            }
          }
        }
      }

      // Online softmax (base 2) for the thread's rows; a quad of lanes shares a row. The running
      // max moves only when a tile's exceeds it by more than kLazyRescaleLog2: weights stay below
      // 2^kLazyRescaleLog2 (exact enough in fp32 sums and 16-bit P), l and O stay consistent with
      // the max they were weighted by, and the O rescale is skipped by a warp whose rows all kept
      // theirs (most tiles after the first). m_safe is finite: a row with no visible key so far
      // subtracts -FLT_MAX, so that 2^(-inf - m_safe) = 0 without a select.
      bool grow_any = false;
      float alpha[kMT][2];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float mx = tile_max[mt][h];
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const bool grow = mx > m_i[mt][h] + kLazyRescaleLog2;
          grow_any = grow_any || grow;
          alpha[mt][h] = grow ? ex2(m_i[mt][h] - mx) : 1.f;
          m_i[mt][h] = grow ? mx : m_i[mt][h];
          const float m_safe = fmaxf(m_i[mt][h], -FLT_MAX);
          float row_sum = poison[mt][h];
#pragma unroll
          for (int j = 0; j < Cfg::kMaxNTiles; ++j) {
            if (j < ntiles) {
              s[mt][j][2 * h] = ex2(fmaf(s[mt][j][2 * h], mult, -m_safe));
              s[mt][j][2 * h + 1] = ex2(fmaf(s[mt][j][2 * h + 1], mult, -m_safe));
              row_sum += s[mt][j][2 * h] + s[mt][j][2 * h + 1];
            }
          }
          l_i[mt][h] = l_i[mt][h] * alpha[mt][h] + row_sum;
        }
      }
      if (__any_sync(0xffffffffu, grow_any)) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
          for (int d = 0; d < Cfg::kDvTiles; ++d) {
            acc[mt][d][0] *= alpha[mt][0];
            acc[mt][d][1] *= alpha[mt][0];
            acc[mt][d][2] *= alpha[mt][1];
            acc[mt][d][3] *= alpha[mt][1];
          }
        }
      }

      // O += P V: the S accumulators of two key tiles are the A fragment of one k16 step; each V
      // fragment serves every m tile
#pragma unroll
      for (int j = 0; j < Cfg::kMaxNTiles; j += 2) {
        if (j < ntiles) {
          uint32_t a[kMT][4];
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            a[mt][0] = pack2<T>(s[mt][j][0], s[mt][j][1]);
            a[mt][1] = pack2<T>(s[mt][j][2], s[mt][j][3]);
            a[mt][2] = pack2<T>(s[mt][j + 1][0], s[mt][j + 1][1]);
            a[mt][3] = pack2<T>(s[mt][j + 1][2], s[mt][j + 1][3]);
          }
#pragma unroll
          for (int d = 0; d < Cfg::kDvTiles; d += 2) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, v_base + v_off[d % 8 / 2] + j * 8 * kRowBytes + d / 8 * 128);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
              mma_16816<T>(acc[mt][d], a[mt], b[0], b[1]);
              mma_16816<T>(acc[mt][d + 1], a[mt], b[2], b[3]);
            }
          }
        }
      }
    }
    __syncthreads();  // the stage is refilled by the next iteration's prefetch
  }
  cp_async_wait<0>();
  launch_dependents();  // the merge kernel may be scheduled now (it waits for this grid's end)

#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l_i[mt][h] += __shfl_xor_sync(0xffffffffu, l_i[mt][h], 1);
      l_i[mt][h] += __shfl_xor_sync(0xffffffffu, l_i[mt][h], 2);
    }
  }

  // ---- merge the warps that shared rows (warps_n > 1) into the wn == 0 warp: each other warp
  // hands over its accumulators and m, l (cell warp - warps_m)
  if (warps_n > 1) {
    __syncthreads();  // Q/K/V tiles are dead; reuse the memory
    float* s_merge = reinterpret_cast<float*>(smem);
    constexpr int kAcc = Cfg::kDvTiles * 4, kPerTile = kAcc + 4;
    if (wn != 0) {
      float* mine = s_merge + (warp - warps_m) * Cfg::kMergeFloats * 32;  // [value][lane]: conflict-free
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int d = 0; d < Cfg::kDvTiles; ++d) {
#pragma unroll
          for (int e = 0; e < 4; ++e) mine[(mt * kPerTile + d * 4 + e) * 32 + lane] = acc[mt][d][e];
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          mine[(mt * kPerTile + kAcc + h) * 32 + lane] = m_i[mt][h];
          mine[(mt * kPerTile + kAcc + 2 + h) * 32 + lane] = l_i[mt][h];
        }
      }
    }
    __syncthreads();
    if (wn != 0) return;
    for (int other = 1; other < warps_n; ++other) {
      const float* theirs = s_merge + ((other - 1) * warps_m + wm) * Cfg::kMergeFloats * 32;
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        const float* t_mt = theirs + mt * kPerTile * 32;
        float scale_mine[2], scale_theirs[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float m_o = t_mt[(kAcc + h) * 32 + lane];
          const float mx = fmaxf(m_i[mt][h], m_o);
          const float m_safe = mx == -INFINITY ? 0.f : mx;
          scale_mine[h] = exp2f(m_i[mt][h] - m_safe);
          scale_theirs[h] = exp2f(m_o - m_safe);
          l_i[mt][h] = l_i[mt][h] * scale_mine[h] + t_mt[(kAcc + 2 + h) * 32 + lane] * scale_theirs[h];
          m_i[mt][h] = mx;
        }
#pragma unroll
        for (int d = 0; d < Cfg::kDvTiles; ++d) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            acc[mt][d][e] = acc[mt][d][e] * scale_mine[e >> 1] + t_mt[(d * 4 + e) * 32 + lane] * scale_theirs[e >> 1];
          }
        }
      }
    }
  }

  // ---- epilogue: rows that saw no key get zeros and lse = -inf (selected, not 0 * acc: acc may hold
  // NaN from a V row of a draft slot the row does not see, weight 0 times NaN)
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp_row0 + mt * 16 + g + h * 8;
      if (r >= rows_here) continue;
      const int row = row0 + r;
      const int64_t token = q_start + row / group;
      if (token < 0 || token >= p.num_tokens) continue;  // never write outside out / lse / partials
      const int head = kv_head * group + row % group;
      // l is 0 iff the row saw no key; NaN (a NaN logit) counts as seen: NaN output and lse.
      const float l = l_i[mt][h];
      const bool seen = l != 0.f;
      const float inv_l = seen ? v_scale / l : 0.f;  // v_scale: 1 but for fp8 caches
      const float lse2 = seen ? m_i[mt][h] + log2f(l) : -INFINITY;
      if (p.num_splits > 1) {
        const int64_t idx = (static_cast<int64_t>(split) * p.num_tokens + token) * p.num_q_heads + head;
        float* dst = p.o_partial + idx * D;
#pragma unroll
        for (int d = 0; d < Cfg::kDvTiles; ++d) {
          *reinterpret_cast<float2*>(dst + d * 8 + t4 * 2) =
              make_float2(seen ? acc[mt][d][2 * h] * inv_l : 0.f, seen ? acc[mt][d][2 * h + 1] * inv_l : 0.f);
        }
        if (t4 == 0) p.lse_partial[idx] = lse2;
      } else {
        T* dst = static_cast<T*>(p.out) + token * p.o_stride_t + head * p.o_stride_h;
#pragma unroll
        for (int d = 0; d < Cfg::kDvTiles; ++d) {
          *reinterpret_cast<uint32_t*>(dst + d * 8 + t4 * 2) =
              pack2<T>(seen ? acc[mt][d][2 * h] * inv_l : 0.f, seen ? acc[mt][d][2 * h + 1] * inv_l : 0.f);
        }
        if (p.lse != nullptr && t4 == 0) p.lse[token * p.num_q_heads + head] = lse2 * 0.69314718055994531f;
      }
    }
  }
}

// One block per (token, head): the split-KV combine (spec_kernels/split_merge.cuh).
template <typename T>
__global__ void merge_splits_kernel(const TreeVerifyParams p) {
  const int64_t idx = blockIdx.x;  // token * Hq + head
  const int64_t token = idx / p.num_q_heads;
  const int head = static_cast<int>(idx % p.num_q_heads);
  merge_split_row(p.o_partial, p.lse_partial, p.num_splits, static_cast<int64_t>(p.num_tokens) * p.num_q_heads, idx,
                  p.head_dim, static_cast<T*>(p.out) + token * p.o_stride_t + head * p.o_stride_h, p.lse);
}

template <typename T, int D, int kRows, bool kFp8, int kMTiles>
cudaError_t launch_config(const TreeVerifyParams& p, int device, cudaStream_t stream) {
  using Cfg = TileConfig<D, kRows, kFp8, kMTiles>;
  static_assert(D % kMergeVec == 0, "the merge combines kMergeVec columns per load");
  const cudaError_t attr_err =
      opt_in_dynamic_smem_once<tree_verify_kernel<T, D, kRows, kFp8, kMTiles>, Cfg::kSmemBytes>(device);
  if (attr_err != cudaSuccess) return attr_err;
  const int m_blocks = (p.max_rows + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const dim3 grid(static_cast<unsigned>(p.num_requests) * p.num_kv_heads * m_blocks, p.num_splits);
  tree_verify_kernel<T, D, kRows, kFp8, kMTiles><<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.num_splits == 1) return err;
  return launch_dependent(merge_splits_kernel<T>, dim3(p.num_tokens * p.num_q_heads), dim3(kTreeVerifyMergeThreads), 0,
                          stream, p);
}

template <typename T>
cudaError_t launch(const TreeVerifyParams& p, cudaStream_t stream) {
  int device = 0, per_sm = 0, reserved = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = device_smem(device, per_sm, reserved);
  if (err != cudaSuccess) return err;
  const bool fp8 = p.kv_format != kKvLikeQ;
  const LaunchShape shape = tree_verify_launch_shape(p.head_dim, p.max_rows, per_sm, reserved, fp8);
#define SPEC_KERNELS_TV_LAUNCH(D, ROWS, MT, REGS, FP8_REGS)                                        \
  if (shape.head_dim == D && shape.block_m == ROWS && shape.warp_rows == 16 * MT) {                 \
    return fp8 ? launch_config<T, D, ROWS, true, MT>(p, device, stream)                              \
               : launch_config<T, D, ROWS, false, MT>(p, device, stream);                            \
  }
  SPEC_KERNELS_TREE_VERIFY_CONFIGS(SPEC_KERNELS_TV_LAUNCH)
#undef SPEC_KERNELS_TV_LAUNCH
  return cudaErrorInvalidValue;  // no configuration for this head dim
}

}  // namespace

cudaError_t launch_tree_verify_attention(const TreeVerifyParams& p, Dtype dtype, cudaStream_t stream) {
  if (p.num_requests == 0 || p.num_tokens == 0) return cudaSuccess;
  return dtype == Dtype::kBFloat16 ? launch<__nv_bfloat16>(p, stream) : launch<__half>(p, stream);
}

}  // namespace spec_kernels
