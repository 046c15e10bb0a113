// Launch configurations of MLA tree-verify attention, for host and device code: the list of
// compiled instances, their tile constants (the shapes are explained at the top of
// csrc/mla/mla_tree_verify_attention.cu) and the launch's choice, exported by the binding
// (torch.ops.spec_kernels_cuda.mla_launch_config / kernel_configs) for the Python planner, the PTX
// interpreter's glue and the SASS report.
#pragma once

#include "spec_kernels/launch_shape.h"
#include "spec_kernels/mla.h"

namespace spec_kernels {

// X(m tiles of 16 rows per CTA, registers per thread, registers of its fp8-cache instance):
// every compiled configuration; each has an instance for caches of q's dtype and one for fp8
// caches. Registers are what ptxas reports (the larger of sm_90a and sm_120a), checked by
// tests/test_sass_report.py.
#define SPEC_KERNELS_MLA_CONFIGS(X) \
  X(1, 252, 254)                    \
  X(2, 235, 239)                    \
  X(4, 255, 255)

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
template <int kMTiles, bool kFp8 = false>
struct MlaTile {
  static constexpr int kBlockM = 16 * kMTiles;
  static constexpr int kWarps = kMTiles == 4 ? 8 : 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kDvTiles = mla::kDv / kWarps / 8;  // O += P V: n8 tiles (512 / kWarps columns) per warp
  static constexpr int kBlockN = 8 * kWarps / kMTiles;    // one 16 x 8 unit of S per warp
  static constexpr int kNWarps = kBlockN / 8;             // warps sharing one m tile's rows
  static constexpr int kStageElems = kBlockN * mla::kD;
  // KV stages: 3 (two tiles in flight, two barriers per tile) where they fit, else 2 (three barriers)
  static constexpr int kStages = kMTiles == 2 ? 3 : 2;
  // P rows padded by 16 bytes: the 8 rows one ldmatrix reads fall in 8 different bank groups.
  static constexpr int kPStride = kBlockN * 2 + 16;
  static constexpr int kIdxStages = 4;  // slot ids of 4 tiles in flight, 8 bytes each
  // Q fragments of the first kQRegSteps k16 steps stay in registers: 16-row CTAs (a 64-register O
  // accumulator) 24, saving ldmatrix; 64-row CTAs 8, so that Q fits: only the other 28 steps'
  // columns (kQChunks) stay in shared memory, the first ones are staged in KV stage 0 at the start.
  static constexpr int kQRegSteps = kMTiles == 1 ? 24 : kMTiles == 4 ? 8 : 0;
  static constexpr int kQStagedChunks = kMTiles == 4 ? 2 * kQRegSteps : 0;  // not in the Q tile
  static constexpr int kQChunks = mla::kChunks - kQStagedChunks;
  static constexpr int kKvElemBytes = kFp8 ? 1 : 2;
  static constexpr int kStageBytes = kStageElems * kKvElemBytes;  // one KV stage
  static constexpr int kConvertedElems = kFp8 ? kStageElems : 0;  // the converted tile (fp8), q's dtype
  // [Q tile] + [converted tile] + KV stages + P + row cells + slot ids: with fp8 the same or less
  // than with a 16-bit cache (3 stages: 46 KB of tiles instead of 54 KB).
  static constexpr int kSmemBytes = (kBlockM * kQChunks * 8 + kConvertedElems) * 2 + kStages * kStageBytes +
                                    kBlockM * kPStride + kNWarps * kBlockM * 4 + kIdxStages * kBlockN * 8;
  static_assert(kBlockM * kBlockN == 128 * kWarps && kBlockN % 16 == 0, "one S unit per warp, whole k16 steps");
  static_assert(kDvTiles % 8 == 0, "a warp's output columns are whole 64-column blocks");
  static_assert(kBlockN * 8 % kThreads == 0 || kThreads % (kBlockN * 8) == 0,
                "the gather gives each of its threads whole rows of 8 chunks");
  static_assert(kQStagedChunks % 8 == 0 && kQRegSteps % 4 == 0, "the Q split keeps the swizzle and q_off");
  // ... in KV stage 0, or in the converted tile (fp8), which holds as many 16-bit values
  static_assert(kBlockM * kQStagedChunks * 16 <= kStageElems * 2, "the staged Q columns fit in KV stage 0");
  static_assert(kSmemBytes <= 99 * 1024, "sm_120 allows 99 KB of shared memory per block");
};

// Threads of the split-combine kernel (one block per (token, head)): 4 columns each
// (split_merge.cuh's kMergeVec) cover the 512-column latent row in one step.
constexpr int kMlaMergeThreads = 128;

template <int kMTiles, bool kFp8, int kRegs>
constexpr LaunchShape mla_instance_shape() {
  using Tile = MlaTile<kMTiles, kFp8>;
  return LaunchShape{kMlaHeadDim, Tile::kBlockM, Tile::kThreads, Tile::kSmemBytes, kRegs, 0, kFp8 ? 1 : 0};
}

// The compiled configuration of block_m rows per CTA (fp8: its fp8-cache instance); block_m 0
// when there is none.
constexpr LaunchShape mla_config_shape(int block_m, bool fp8) {
#define SPEC_KERNELS_MLA_SHAPE(M_TILES, REGS, FP8_REGS)                                            \
  if (block_m == 16 * M_TILES)                                                                      \
    return fp8 ? mla_instance_shape<M_TILES, true, FP8_REGS>() : mla_instance_shape<M_TILES, false, REGS>();
  SPEC_KERNELS_MLA_CONFIGS(SPEC_KERNELS_MLA_SHAPE)
#undef SPEC_KERNELS_MLA_SHAPE
  return LaunchShape{kMlaHeadDim, 0, 0, 0, 0, 0, fp8 ? 1 : 0};
}

// The configuration a launch of max_rows takes (mla_block_m: the same on every device and for
// either cache kind).
constexpr LaunchShape mla_launch_shape(int max_rows, bool fp8) { return mla_config_shape(mla_block_m(max_rows), fp8); }

}  // namespace spec_kernels
