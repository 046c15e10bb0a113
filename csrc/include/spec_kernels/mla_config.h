// Launch configurations of MLA tree-verify attention, for host and device code: the list of
// compiled instances, their tile constants (the shapes are explained at the top of
// csrc/mla/mla_tree_verify_attention.cu) and the launch's choice, exported by the binding
// (torch.ops.spec_kernels_cuda.mla_launch_config / kernel_configs) for the Python planner, the PTX
// interpreter's glue and the SASS report.
#pragma once

#include "spec_kernels/launch_shape.h"
#include "spec_kernels/mla.h"

namespace spec_kernels {

// X(m tiles of 16 rows per CTA, k split, registers per thread, registers of its fp8-cache
// instance): every compiled configuration; each has an instance for caches of q's dtype and one
// for fp8 caches. k split 4: the sm_90 configuration (MlaTile's comment). Registers are what
// ptxas reports (the larger of sm_90a and sm_120a), checked by tests/test_sass_report.py.
#define SPEC_KERNELS_MLA_CONFIGS(X) \
  X(1, 1, 252, 254)                 \
  X(2, 1, 235, 239)                 \
  X(4, 1, 255, 255)                 \
  X(4, 4, 253, 250)

namespace mla {
constexpr int kD = kMlaHeadDim;
constexpr int kDv = kMlaVHeadDim;
constexpr int kChunks = kD / 8;    // 16-byte chunks per row: 72
constexpr int kRowBytes = kD * 2;  // 1152
constexpr int kKSteps = kD / 16;   // 36 k16 steps of S = Q K^T
static_assert(kKSteps % 4 == 0 && kChunks % 8 == 0, "head dims must split evenly");
}  // namespace mla

// kFp8: the cache holds 8-bit floats. The KV stages then hold the cache bytes (half the global
// reads), and each tile is converted once into one tile of q's dtype with the 16-bit layout, from
// which K and V^T fragments are loaded as for a 16-bit cache (as in tree_verify_config.h: ldmatrix
// .trans has no 8-bit form on sm_90 / sm_120, and fp8 mma would round P and Q to fp8 as well).
//
// kKSplit 1: a warp's unit of S is 16 rows x 8 keys over all 576 dims, and it owns it (scales,
// masks, writes P). kKSplit 4 (64 rows, sm_90 only: 210 KB of shared memory): 32-key tiles; a
// warp's unit is 32 rows x 32 keys over a quarter of the dims (9 k16 steps), so each Q fragment
// serves 4 n8 key groups and each K fragment 2 m tiles (half the ldmatrix bytes per key of the
// 16 x 8 unit); the 4 warps of a unit add their partial sums through shared memory, each then
// owns 16 rows x 16 keys of it. All of Q stays in shared memory.
template <int kMTiles, bool kFp8 = false, int kKSplit = 1>
struct MlaTile {
  static constexpr int kBlockM = 16 * kMTiles;
  static constexpr int kWarps = kMTiles == 4 ? 8 : 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kDvTiles = mla::kDv / kWarps / 8;  // O += P V: n8 tiles (512 / kWarps columns) per warp
  static constexpr bool kSplit = kKSplit > 1;
  static constexpr int kBlockN = kSplit ? 32 : 8 * kWarps / kMTiles;  // one 16 x 8 unit of S per warp
  // A warp's unit of S (m tiles x n8 key groups) over kKSteps / kKSplit k16 steps, and the part
  // of it the warp owns for the softmax: one m tile x kOwnN n8 groups.
  static constexpr int kUnitM = kSplit ? 2 : 1, kUnitN = kSplit ? 4 : 1, kOwnN = kSplit ? 2 : 1;
  static constexpr int kUnitSteps = mla::kKSteps / kKSplit;
  static constexpr int kNWarps = kBlockN / (8 * kOwnN);  // warps owning parts of one row
  static constexpr int kStageElems = kBlockN * mla::kD;
  // KV stages: 3 (two tiles in flight, two barriers per tile) where they fit, else 2 (three barriers)
  static constexpr int kStages = kMTiles == 2 || kSplit ? 3 : 2;
  // P rows padded by 16 bytes: the 8 rows one ldmatrix reads fall in 8 different bank groups.
  static constexpr int kPStride = kBlockN * 2 + 16;
  static constexpr int kIdxStages = 4;  // slot ids of 4 tiles in flight, 8 bytes each
  // Q fragments of the first kQRegSteps k16 steps stay in registers: 16-row CTAs (a 64-register O
  // accumulator) 24, saving ldmatrix; 64-row CTAs 8, so that Q fits: only the other 28 steps'
  // columns (kQChunks) stay in shared memory, the first ones are staged in KV stage 0 at the start.
  static constexpr int kQRegSteps = kSplit ? 0 : kMTiles == 1 ? 24 : kMTiles == 4 ? 8 : 0;
  static constexpr int kQStagedChunks = kMTiles == 4 ? 2 * kQRegSteps : 0;  // not in the Q tile
  static constexpr int kQChunks = mla::kChunks - kQStagedChunks;
  static constexpr int kKvElemBytes = kFp8 ? 1 : 2;
  static constexpr int kStageBytes = kStageElems * kKvElemBytes;  // one KV stage
  static constexpr int kConvertedElems = kFp8 ? kStageElems : 0;  // the converted tile (fp8), q's dtype
  // The partial sums a warp hands each other warp of its unit: the other's 16 x (8 kOwnN) part, in
  // float4s per lane (kKSplit - 1 cells per owner).
  static constexpr int kExchangeBytes = kSplit ? kWarps * (kKSplit - 1) * kOwnN * 32 * 16 : 0;
  // [Q tile] + [converted tile] + KV stages + P + row cells + slot ids + [exchange]: with fp8 the
  // same or less than with a 16-bit cache (3 stages: 46 KB of tiles instead of 54 KB).
  static constexpr int kSmemBytes = (kBlockM * kQChunks * 8 + kConvertedElems) * 2 + kStages * kStageBytes +
                                    kBlockM * kPStride + kNWarps * kBlockM * 4 + kIdxStages * kBlockN * 8 +
                                    kExchangeBytes;
  static_assert((kMTiles / kUnitM) * (kBlockN / (8 * kUnitN)) * kKSplit == kWarps,
                "the warps' units cover the tile once per k split");
  static_assert(kKSplit * kOwnN == kUnitM * kUnitN && mla::kKSteps % kKSplit == 0,
                "each warp of a unit owns one part of it, whole k16 steps each");
  static_assert(kSplit || kBlockM * kBlockN == 128 * kWarps, "kKSplit 1: one S unit per warp");
  static_assert(kBlockN % 16 == 0, "whole k16 steps of P V");
  static_assert(kDvTiles % 8 == 0, "a warp's output columns are whole 64-column blocks");
  static_assert(kBlockN * 8 % kThreads == 0 || kThreads % (kBlockN * 8) == 0,
                "the gather gives each of its threads whole rows of 8 chunks");
  static_assert(kQStagedChunks % 8 == 0 && kQRegSteps % 4 == 0, "the Q split keeps the swizzle and q_off");
  // ... in KV stage 0, or in the converted tile (fp8), which holds as many 16-bit values
  static_assert(kBlockM * kQStagedChunks * 16 <= kStageElems * 2, "the staged Q columns fit in KV stage 0");
  static_assert(kSmemBytes <= (kSplit ? 227 : 99) * 1024,
                "sm_120 allows 99 KB of shared memory per block; the sm_90-only configuration 227 KB");
};

// Threads of the split-combine kernel (one block per (token, head)): 4 columns each
// (split_merge.cuh's kMergeVec) cover the 512-column latent row in one step.
constexpr int kMlaMergeThreads = 128;

template <int kMTiles, int kKSplit, bool kFp8, int kRegs>
constexpr LaunchShape mla_instance_shape() {
  using Tile = MlaTile<kMTiles, kFp8, kKSplit>;
  return LaunchShape{kMlaHeadDim, Tile::kBlockM, Tile::kThreads, Tile::kSmemBytes, kRegs, 0, kFp8 ? 1 : 0,
                     Tile::kBlockN, Tile::kSplit ? 32 : 16};
}

// The compiled configuration of block_m rows per CTA and k split (fp8: its fp8-cache instance);
// block_m 0 when there is none.
constexpr LaunchShape mla_config_shape(int block_m, int k_split, bool fp8) {
#define SPEC_KERNELS_MLA_SHAPE(M_TILES, K_SPLIT, REGS, FP8_REGS)                                  \
  if (block_m == 16 * M_TILES && k_split == K_SPLIT)                                              \
    return fp8 ? mla_instance_shape<M_TILES, K_SPLIT, true, FP8_REGS>()                           \
               : mla_instance_shape<M_TILES, K_SPLIT, false, REGS>();
  SPEC_KERNELS_MLA_CONFIGS(SPEC_KERNELS_MLA_SHAPE)
#undef SPEC_KERNELS_MLA_SHAPE
  return LaunchShape{kMlaHeadDim, 0, 0, 0, 0, 0, fp8 ? 1 : 0, 0, 0};
}

// The configuration a launch of max_rows takes: mla_block_m rows per CTA (the same on every
// device, so the caller sizes the KV splits like the launch does); for 64 rows, the k-split
// configuration where its shared memory fits one CTA on an SM (sm_90; smem_per_sm: the device's
// shared memory per SM, smem_reserved_per_cta: what the runtime keeps of it per CTA; 0: not
// known), else the 16 x 8-unit one.
constexpr LaunchShape mla_launch_shape(int max_rows, int smem_per_sm, int smem_reserved_per_cta, bool fp8) {
  const int block_m = mla_block_m(max_rows);
  const int wide = (fp8 ? MlaTile<4, true, 4>::kSmemBytes : MlaTile<4, false, 4>::kSmemBytes) + smem_reserved_per_cta;
  const bool k_split = block_m == 64 && smem_per_sm > 0 && wide <= smem_per_sm;
  return mla_config_shape(block_m, k_split ? 4 : 1, fp8);
}

}  // namespace spec_kernels
