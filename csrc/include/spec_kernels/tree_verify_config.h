// Launch configurations of tree-verify attention, for host and device code: the list of compiled
// instances, their tile constants, and the launch's choice among them as a pure function of the
// batch's max_rows and the device's shared memory. tree_verify_attention.cu instantiates and
// dispatches from the list; the binding exports the choice and the list
// (torch.ops.spec_kernels_cuda.tree_verify_launch_config / kernel_configs), which the Python
// planner, the PTX interpreter's glue and the SASS report read instead of copies.
#pragma once

#include "spec_kernels/launch_shape.h"
#include "spec_kernels/tree_verify.h"

namespace spec_kernels {

// X(head_dim, rows per CTA, m16 tiles per warp, registers per thread, registers of its fp8-cache
// instance): every compiled configuration; each has an instance for caches of q's dtype and one
// for fp8 caches.
//  64 rows: the default, 4 warps.
//  32 rows (D = 128): the decode one (at most 16 rows): 32-key stages, 49 KB, so that two CTAs
//      share an SM whose shared memory holds one of the 98 KB configuration (sm_120).
// 128 rows (D = 128): 8 warps, for more than 64 rows (n = 16 drafts x GQA 8): each K/V tile is
//      gathered once for all of them instead of once per 64-row block; same stages as 64 rows.
// 128 rows, 2 m tiles per warp (D = 128, sm_90 only: 130 KB): a warp takes 32 rows and half of
//      every tile's keys, so each K and V fragment it loads serves two m tiles (the 8 warps read
//      192 KB of shared memory per tile instead of 256); Q stays in its own tile, not registers.
// Registers are what ptxas reports for the instance (the larger of sm_90a and sm_120a, fp16 and
// bf16): the planner's occupancy model reads them, tests/test_sass_report.py checks them
// against the compiled cubins.
#define SPEC_KERNELS_TREE_VERIFY_CONFIGS(X) \
  X(64, 64, 1, 167, 162)                    \
  X(128, 64, 1, 232, 217)                   \
  X(256, 64, 1, 255, 255)                   \
  X(128, 32, 1, 216, 216)                   \
  X(128, 128, 1, 221, 217)                  \
  X(128, 128, 2, 255, 255)

// kFp8: the cache holds 8-bit floats. The pipeline stages then hold the cache bytes (half the
// global reads and cp.async traffic), and each tile is converted once into one K and one V tile of
// q's dtype with the 16-bit layout, from which the mma fragments are loaded as for a 16-bit cache:
// the V operand needs a transposed 16-bit fragment (ldmatrix .trans has no 8-bit form on sm_90 /
// sm_120), and fp8 mma would round P and Q to fp8 as well.
template <int D, int kRows = kTreeVerifyBlockM, bool kFp8 = false, int kMTiles = 1>
struct TileConfig {
  static constexpr bool kSmall = kRows == 32, kWide = kRows == 128;
  static_assert(kRows == kTreeVerifyBlockM || (D == 128 && (kSmall || kWide)),
                "32 and 128 rows per CTA are D = 128 configurations");
  static_assert(kMTiles == 1 || (kMTiles == 2 && kWide), "two m tiles per warp: a 128-row configuration");
  static constexpr int kBlockM = kRows;  // query rows of a CTA
  static constexpr int kWarpRows = 16 * kMTiles;  // query rows of a warp
  static constexpr int kWarps = kWide ? 8 : 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kChunks = D / 8;                            // 16-byte chunks per row
  static constexpr int kStageKeys = kSmall || D >= 256 ? 32 : 64;   // keys per pipeline stage
  static constexpr int kMaxWarpsN = kStageKeys / 16;               // a warp takes >= 16 keys of a stage
  // Warps side by side over the rows (the most the launch arranges: kBlockM / kWarpRows), and the
  // n8 key tiles of one warp at the fewest warps per row (their S accumulators are registers).
  static constexpr int kMaxWarpsM = kBlockM / kWarpRows < kWarps ? kBlockM / kWarpRows : kWarps;
  static constexpr int kMaxNTiles = kStageKeys / 8 / (kWarps / kMaxWarpsM);
  static_assert(kMaxNTiles >= 2 && kMaxNTiles % 2 == 0, "a warp takes n8 key tiles in pairs (one k16 step of P V)");
  static constexpr int kDvTiles = D / 8;                           // n8 tiles of the output row
  // Q fragments stay in registers across tiles where they fit (D / 4 registers per thread); the
  // Q tile is then only staged once, in the last K stage.
  static constexpr bool kQInRegs = D <= 128 && kMTiles == 1;
  // K/V pipeline stages: three where sm_120's 99 KB hold them.
  static constexpr int kStages = D == 128 ? 3 : 2;
  // Slot ids of 4 tiles (8 bytes each, int32 or int64 as given): those of the kStages - 1 tiles
  // being gathered and of the next kStages (the prologue waits at a barrier before reusing a cell).
  static constexpr int kIdxStages = 4;
  static constexpr int kIdxBytes = kIdxStages * kStageKeys * 8;
  // The rows' 64-bit ancestor words in shared memory instead of registers (2 m tiles per warp).
  static constexpr bool kMasksInSmem = kMTiles > 1;
  static constexpr int kMaskBytes = kMasksInSmem ? kBlockM * 8 : 0;
  static constexpr int kQElems = kQInRegs ? 0 : kBlockM * D;
  static constexpr int kKvElemBytes = kFp8 ? 1 : 2;
  static constexpr int kStageBytes = kStageKeys * D * kKvElemBytes;  // one K or V stage
  // The converted K and V tiles (fp8 only), in q's dtype.
  static constexpr int kConvertedElems = kFp8 ? 2 * kStageKeys * D : 0;
  // [Q tile] + [converted K, V] + kStages K + kStages V stages + slot ids [+ ancestor words].
  // 16-bit caches: 34 KB (D=64), 98 KB (D=128; small: 49 KB; 2 m tiles: 131 KB), 97 KB (D=256);
  // fp8: 34 KB, 82 KB (41 KB; 115 KB), 97 KB.
  static constexpr int kSmemBytes =
      (kQElems + kConvertedElems) * 2 + 2 * kStages * kStageBytes + kIdxBytes + kMaskBytes;
  // ... in the last K stage (rows 0-63) and the last V stage (rows 64-127; kWide), or in the
  // converted K and V tiles (fp8), which hold as many rows.
  static_assert(!kQInRegs || kBlockM <= 2 * kStageKeys, "the Q tile is staged in the last K and V stages");
  static_assert(kIdxStages >= kStages + 1, "the ids of kStages tiles are pending while a tile's are read");
  // CTAs per SM the registers must allow (__launch_bounds__): 3 at D=64 (4 would cap it at 128
  // registers and spill); 2 for the small configuration; else 1, where shared memory allows 1-2
  // anyway and a lower register target makes ptxas recompute tile addresses in the KV loop
  // (kWide: 8 warps of up to 255 registers fill the register file).
  static constexpr int kMinCtasPerSm = D == 64 ? 3 : kSmall ? 2 : 1;
  // The end-of-loop merge reuses that memory: per warp that hands its rows over (all but the
  // kWarps / kMaxWarpsN or more of wn = 0), per lane, the accumulators + m, l of each m tile.
  static constexpr int kMergeFloats = kMTiles * (kDvTiles * 4 + 4);
  static_assert((kWarps - kWarps / kMaxWarpsN) * kMergeFloats * 32 * 4 <= kSmemBytes, "merge buffer must fit");
  static_assert(kSmemBytes <= (kMTiles == 1 ? 99 : 227) * 1024,
                "sm_120 allows 99 KB of shared memory per block, sm_90 227 KB (its configurations only)");
};

// Threads of the split-combine kernel (one block per (token, head)): one warp, 4 columns each
// (split_merge.cuh's kMergeVec), covers a 128-column row in one step.
constexpr int kTreeVerifyMergeThreads = 32;

template <int D, int kRows, bool kFp8, int kMTiles, int kRegs>
constexpr LaunchShape tree_verify_instance_shape() {
  using Cfg = TileConfig<D, kRows, kFp8, kMTiles>;
  return LaunchShape{D, kRows, Cfg::kThreads, Cfg::kSmemBytes, kRegs, Cfg::kMinCtasPerSm, kFp8 ? 1 : 0,
                     Cfg::kStageKeys, Cfg::kWarpRows};
}

// The compiled configuration (head_dim, rows per CTA, m tiles per warp, fp8 cache); block_m 0
// when there is none.
constexpr LaunchShape tree_verify_config_shape(int head_dim, int block_m, int m_tiles, bool fp8) {
#define SPEC_KERNELS_TV_SHAPE(D, ROWS, MT, REGS, FP8_REGS)                                 \
  if (head_dim == D && block_m == ROWS && m_tiles == MT)                                  \
    return fp8 ? tree_verify_instance_shape<D, ROWS, true, MT, FP8_REGS>()                \
               : tree_verify_instance_shape<D, ROWS, false, MT, REGS>();
  SPEC_KERNELS_TREE_VERIFY_CONFIGS(SPEC_KERNELS_TV_SHAPE)
#undef SPEC_KERNELS_TV_SHAPE
  return LaunchShape{head_dim, 0, 0, 0, 0, 0, fp8 ? 1 : 0, 0, 0};
}

// The configuration a launch takes (block_m 0: head_dim has none). At D = 128: 128 rows per CTA
// for more than 64 rows (each K/V tile read once for all of them), with two m tiles per warp
// where one such CTA fits an SM's shared memory (sm_90). Where two 64-row CTAs do not fit on an
// SM (sm_120; smem_per_sm: the device's shared memory per SM, smem_reserved_per_cta: what the
// runtime keeps of it per CTA): 32 rows for at most 16 rows, where two such CTAs fit, and 128
// rows for 17-64, whose 8 warps (same shared memory; two warps share each 16 rows and take half
// of every tile's keys) give each warp scheduler two warps instead of one to hide its latencies.
// Else 64.
constexpr LaunchShape tree_verify_launch_shape(int head_dim, int max_rows, int smem_per_sm,
                                               int smem_reserved_per_cta, bool fp8) {
  int block_m = kTreeVerifyBlockM, m_tiles = 1;
  const int large = (fp8 ? TileConfig<128, 64, true>::kSmemBytes : TileConfig<128>::kSmemBytes) +
                    smem_reserved_per_cta;
  const int small = (fp8 ? TileConfig<128, 32, true>::kSmemBytes : TileConfig<128, 32>::kSmemBytes) +
                    smem_reserved_per_cta;
  const int paired = (fp8 ? TileConfig<128, 128, true, 2>::kSmemBytes : TileConfig<128, 128, false, 2>::kSmemBytes) +
                     smem_reserved_per_cta;
  const bool one_large_per_sm = smem_per_sm > 0 && 2 * large > smem_per_sm;  // 0: not known, 64 rows
  if (head_dim == 128 && max_rows > kTreeVerifyBlockM) {
    block_m = 128;
    if (paired <= smem_per_sm) m_tiles = 2;  // never for 0 (not known)
  } else if (head_dim == 128 && max_rows <= 16) {
    if (one_large_per_sm && 2 * small <= smem_per_sm) block_m = 32;
  } else if (head_dim == 128 && one_large_per_sm) {
    block_m = 128;
  }
  return tree_verify_config_shape(head_dim, block_m, m_tiles, fp8);
}

}  // namespace spec_kernels
