"""Deliberate bugs in the kernel sources must make the PTX tests fail.

Each mutant is a one-expression edit of a .cu file (the text must occur exactly once, so a
refactor that moves it fails here loudly instead of testing nothing). The edited source is
compiled to sm_120a PTX (sm_90a for sm_90's configurations) and run on one small case by the
interpreter; the mutant is caught by a mismatch with the reference, a shared-memory race /
cp.async hazard, an out-of-bounds access or a trap. Other kernels' mutants live next to their own
PTX tests.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spec_kernels.testing import make_case  # noqa: E402

from tools.ptx_harness.cuda_glue import REPO, PtxCudaOps  # noqa: E402
from ptxsim.memory import SimError  # noqa: E402
import test_tree_verify_ptx as tv  # noqa: E402

TV = "tree_verify/tree_verify_attention.cu"
SM = "include/spec_kernels/split_merge.cuh"  # the split merge of both attention families

# name: (file, what, old text, new text)
MUTANTS = {
    "v_not_transposed": (TV, "V read with ldmatrix without .trans",
                         "ldmatrix_x4_trans(b, v_base", "ldmatrix_x4(b, v_base"),
    "v_rows_from_lane16": (TV, "V ldmatrix: key row block from lane / 16 instead of lane / 8 % 2",
                           "v_off[i] = pinned((key0 + lane / 8 % 2 * 8 + x7)",
                           "v_off[i] = pinned((key0 + lane / 16 * 8 + x7)"),
    "k_chunk_from_lane16": (TV, "K ldmatrix: k chunk from lane / 16 instead of lane / 8 % 2",
                            "(((2 * i + lane / 8 % 2) ^ x7) << 4));", "(((2 * i + lane / 16) ^ x7) << 4));"),
    "p_fragment_order": (TV, "P as A fragment: registers a1 and a2 swapped",
                         "a[mt][1] = pack2<T>(s[mt][j][2], s[mt][j][3]);\n            a[mt][2] = pack2<T>(s[mt][j + 1][0], s[mt][j + 1][1]);",
                         "a[mt][1] = pack2<T>(s[mt][j + 1][0], s[mt][j + 1][1]);\n            a[mt][2] = pack2<T>(s[mt][j][2], s[mt][j][3]);"),
    "prefetch_into_current_stage": (TV, "the prefetch of tile t + stages - 1 goes to stage t",
                                    "load_tile(t + kStages - 1, (t + kStages - 1) % kStages);",
                                    "load_tile(t + kStages - 1, t % kStages);"),
    "wait_group_stages": (TV, "cp.async.wait_group kStages instead of kStages - 1",
                          "cp_async_wait<kStages - 1>();", "cp_async_wait<kStages>();"),
    "no_loop_top_sync": (TV, "no __syncthreads after the wait",
                         "  // tile t has landed\n    __syncthreads();", "  // tile t has landed\n"),
    "no_sync_after_q_fragments": (TV, "no __syncthreads between reading Q into registers and refilling its stage",
                                  "    __syncthreads();  // the Q tile is in stage", "    // the Q tile is in stage"),
    "no_prologue_id_barrier": (TV, "three stages: the prologue reuses tile 0's id cells with no barrier",
                               "if constexpr (2 * kStages - 1 > Cfg::kIdxStages) __syncthreads();", ""),
    "ids_one_tile_late": (TV, "tile u's slot ids travel with tile u - stages + 1's K/V",
                          "load_indices(t + 2 * kStages - 1);", "load_indices(t + 2 * kStages - 2);"),
    "no_loop_end_sync": (TV, "no __syncthreads at the end of the tile loop",
                         "    __syncthreads();  // the stage is refilled", "    // the stage is refilled"),
    "tail_mask_off_by_one": (TV, "tail mask bit pos - prefix_len + 1",
                             "min(pos - prefix_len, 63)", "min(pos - prefix_len + 1, 63)"),
    "live_only_when_full": (TV, "a warp skips a tile unless all its keys of it are before the end",
                            "const bool live = end - base > key0 &&",
                            "const bool live = end - base >= key0 + keys_per_warp &&"),
    "live_rows_off_by_16": (TV, "a warp skips its tiles when its first row is within 16 of rows_here",
                            "warp_row0 < rows_here;", "warp_row0 + 16 < rows_here;"),
    # Caught because the glue poisons the partial buffers (NaN): the skipped values are 0 in the
    # reference and weighted 0 by the merge (lse -inf), so a zero-filled buffer would pass. The
    # request without a prefix sees nothing in split 0.
    "unseen_split_rows_not_written": (TV, "a split's rows that saw no key write no partial output",
                                      "for (int d = 0; d < Cfg::kDvTiles; ++d) {\n          *reinterpret_cast<float2*>",
                                      "for (int d = 0; seen && d < Cfg::kDvTiles; ++d) {\n"
                                      "          *reinterpret_cast<float2*>"),
}


# Mutants of sm_90's 128-row configuration with two m tiles per warp, run on its sm_90a PTX.
PAIRED_MUTANTS = {
    "paired_k_fragment_for_m_tile_0_only": (TV, "both m tiles' S from m tile 0's Q fragment",
                                            "mma_16816<T>(s[mt][j], a[mt], b[0], b[1]);",
                                            "mma_16816<T>(s[mt][j], a[0], b[0], b[1]);"),
    "paired_p_of_m_tile_0": (TV, "both m tiles' O from m tile 0's P",
                             "mma_16816<T>(acc[mt][d + 1], a[mt], b[2], b[3]);",
                             "mma_16816<T>(acc[mt][d + 1], a[0], b[2], b[3]);"),
    "paired_q_m_tile_stride_8_rows": (TV, "the second m tile's Q fragment 8 rows down instead of 16",
                                      "q_off[kk % 4] + mt * 16 * kRowBytes", "q_off[kk % 4] + mt * 8 * kRowBytes"),
    "paired_masks_of_m_tile_0": (TV, "the tail reads m tile 0's ancestor words for both m tiles",
                                 "words[h] = s_mask[warp_row0 + mt * 16 + g + h * 8];",
                                 "words[h] = s_mask[warp_row0 + g + h * 8];"),
    "paired_merge_cell_of_m_tile_0": (TV, "the key-half merge hands over m tile 0's accumulators twice",
                                      "mine[(mt * kPerTile + d * 4 + e) * 32 + lane] = acc[mt][d][e];",
                                      "mine[(mt * kPerTile + d * 4 + e) * 32 + lane] = acc[0][d][e];"),
    "paired_rows_per_warp_16": (TV, "warps_m from 16-row units (a warp's second m tile overlaps the next warp)",
                                "ceil_div(rows_here, Cfg::kWarpRows)", "ceil_div(rows_here, 16)"),
}


def run_tree_verify_paired(ops):
    # 128 rows (warps 4 x 2, merged), 40 rows (2 x 4) and none; a tree tail; 2 splits
    case = make_case([16, 5, 0], [300, 70, 3], hq=8, hkv=1, d=128, dtype=torch.bfloat16, kind="random", seed=15)
    matches_reference(case, ops, launched="Li128ELi128ELb0ELi2E", splits=2)


# Mutants of the online softmax (the full-tile fast path, lazy rescaling), run on the cases that
# reach them: scores growing tile by tile, an infinite logit in a full tile, a negative scale.
SOFTMAX_MUTANTS = {
    "o_rescale_skipped": (TV, "O never rescaled when the running max moves",
                          "if (__any_sync(0xffffffffu, grow_any)) {", "if (false) {"),
    "l_not_rescaled": (TV, "l keeps its old weighting when the running max moves",
                       "l_i[mt][h] = l_i[mt][h] * alpha[mt][h] + row_sum;", "l_i[mt][h] = l_i[mt][h] + row_sum;"),
    "max_moves_without_rescale": (TV, "the running max follows every tile's max, rescaling only past the threshold",
                                  "m_i[mt][h] = grow ? mx : m_i[mt][h];", "m_i[mt][h] = fmaxf(mx, m_i[mt][h]);"),
    "rescale_threshold_negative": (TV, "the threshold test inverted (rescale only when the max falls behind)",
                                   "const bool grow = mx > m_i[mt][h] + kLazyRescaleLog2;",
                                   "const bool grow = mx < m_i[mt][h] + kLazyRescaleLog2;"),
    "full_tile_unscaled": (TV, "the full-tile path exponentiates raw scores",
                           "const float mult = full ? qk_scale_log2 : 1.f;", "const float mult = 1.f;"),
    "full_tile_poison_dropped": (TV, "an infinite logit in a full tile is not turned into NaN",
                                 "poison[mt][h] = fabsf(a) < INFINITY && fabsf(b) < INFINITY ? 0.f : NAN;",
                                 "poison[mt][h] = 0.f;"),
    "full_tile_max_of_raw_max_only": (TV, "the row max from the raw maximum alone (wrong for a negative scale)",
                                      "tile_max[mt][h] = fmaxf(a, b);", "tile_max[mt][h] = a;"),
}


def run_softmax_edges(ops):
    for splits in (0, 2):
        matches_reference(tv.growing_scores_case(), ops, splits=splits)
    out, lse = tv.run_ptx(tv.infinite_logit_case(), ops)
    assert torch.isnan(out[3:].float()).all() and torch.isnan(lse[3:]).all()
    case = make_case([6, 2], [300, 70], hq=4, hkv=2, d=64, dtype=torch.bfloat16, kind="random", seed=9)
    matches_reference(case, ops, sm_scale=-4.0)


# Not a mutant any more: "no __syncthreads before the warps_n merge reuses the tiles' memory".
# Since the slot ids are prefetched, a barrier follows the Q load in every CTA and each tile
# iteration ends with one, so that barrier orders nothing the others do not; removing it is an
# equivalent program (kept in the kernel as a guard for future edits).


def patched(path, old, new):
    with open(os.path.join(REPO, "csrc", path), encoding="utf-8") as f:
        text = f.read()
    assert text.count(old) == 1, f"mutant text found {text.count(old)} times in {path}: {old!r}"
    return text.replace(old, new)


def matches_reference(case, ops, launched=None, decode=False, sm_scale=None, **kw):
    """`case` through the binding with `ops`: output and lse match the reference (bf16 tolerances);
    `launched`: the first launch's mangled name ends with it."""
    out, lse = tv.run_ptx(case, ops, decode=decode, sm_scale=sm_scale, **kw)
    if launched is not None:
        assert [l[0] for l in ops.launches][0].endswith(launched)
    ref, ref_lse = tv.reference(case, decode=decode, sm_scale=sm_scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2, equal_nan=True)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-4, rtol=1e-4, equal_nan=True)


def run_tree_verify(ops):
    # More KV tiles per split than stages (prefetch into a stage read before; D = 64: two stages,
    # D = 128: three, and 5 tiles in each split to wrap the 4-tile slot-id ring), a tree tail,
    # 4 query heads per KV head (warps_n > 1 so the merge runs), forced 2 splits (the combine); the
    # third request has no prefix, so its first split has no tile at all and goes from the Q load
    # straight to the merge
    for d, prefix in ((128, 520), (64, 200)):
        case = make_case([6, 3, 2], [prefix, 20, 0], hq=4, hkv=1, d=d, dtype=torch.bfloat16, kind="random", seed=11)
        matches_reference(case, ops, splits=2)
    # Decode at D = 128: sm_120's small configuration (32-key stages), 9 tiles in the last split
    matches_reference(make_case([1, 1], [300, 40], hq=8, hkv=2, d=128, dtype=torch.bfloat16, seed=12), ops,
                      decode=True, splits=2)


# Mutants of the 128-row configuration (8 warps, D = 128), run on a case that takes it.
WIDE_MUTANTS = {
    "q_rows_64_up_in_k_stage": (TV, "Q rows 64-127 staged over rows 0-63 (last K stage) instead of the last V stage",
                                "return (r < kStageKeys ? s_k : s_v)", "return (r < kStageKeys ? s_k : s_k)"),
    "wide_warps_m_4": (TV, "the 8 warps take at most 64 rows (warps_m capped at 4)",
                       "!Cfg::kWide || units <= 4 ? 4 : 8", "4"),
}


def run_tree_verify_wide(ops):
    # 16 drafts x GQA 8 = 128 rows (warps_m 8) and 5 x 8 = 40 rows (warps_m 4 x warps_n 2, merged),
    # 3 tiles each (the 3-stage ring), a tree tail
    case = make_case([16, 5], [130, 20], hq=8, hkv=1, d=128, dtype=torch.bfloat16, kind="random", seed=13)
    matches_reference(case, ops, launched="Li128ELi128ELb0ELi1E")


# Mutants of the fp8-cache instances (byte stages converted per tile), run on fp8 cases.
FP8_MUTANTS = {
    "fp8_v_scale_dropped": (TV, "the output is not multiplied by v_scale",
                            "seen ? v_scale / l : 0.f", "seen ? 1.f / l : 0.f"),
    "fp8_k_scale_tensor_ignored": (TV, "k_scale_tensor ignored (the host k_scale is used)",
                                   "qk_scale_log2 *= p.k_scale_ptr != nullptr ? *p.k_scale_ptr : p.k_scale;",
                                   "qk_scale_log2 *= p.k_scale;"),
    "fp8_e5m2_read_as_e4m3": (TV, "an e5m2 cache converted as e4m3",
                              "const bool e5m2 = p.kv_format == kKvE5M2;", "const bool e5m2 = false;"),
    "fp8_no_barrier_after_conversion": (TV, "no __syncthreads between converting a tile and reading it",
                                        "convert_tile(t % kStages);\n      __syncthreads();",
                                        "convert_tile(t % kStages);"),
    "fp8_converted_from_stage_0": (TV, "every tile converted from stage 0",
                                   "convert_tile(t % kStages);", "convert_tile(0);"),
    "fp8_conversion_reads_the_neighbour": (TV, "a converted chunk reads the bytes of its neighbour chunk",
                                           "src + r * D + c * 8);", "src + r * D + (c ^ 1) * 8);"),
    "fp8_byte_stage_row_stride_halved": (TV, "fp8 stage rows D / 2 bytes apart",
                                         "return stage + r * D + c * 16;", "return stage + r * (D / 2) + c * 16;"),
}


def run_tree_verify_fp8(ops):
    # D = 128 (3 stages, 5 tiles per split), a tree tail, 2 splits, tensor scales, e4m3; then
    # D = 64 e5m2 with host scales; then sm_120's 32-row decode configuration (e4m3)
    import test_tree_verify_fp8_ptx as fp8

    case = make_case([6, 3, 2], [520, 20, 0], hq=4, hkv=1, d=128, dtype=torch.bfloat16, kind="random", seed=11)
    fp8.check(case, fp8.E4, torch.bfloat16, ops=ops, tensor_scales=True, splits=2)
    case = make_case([5, 4], [200, 30], hq=4, hkv=2, d=64, dtype=torch.float16, kind="random", seed=12)
    fp8.check(case, fp8.E5, torch.float16, ops=ops)
    case = make_case([1, 1], [300, 40], hq=8, hkv=2, d=128, dtype=torch.bfloat16, seed=12)
    fp8.check(case, fp8.E4, torch.bfloat16, ops=ops, decode=True, splits=2)


# Mutants of the split merge (vectorised: 4 columns and one 16-byte load per split and step).
MERGE_MUTANTS = {
    "merge_one_column_per_thread": (SM, "a merge thread starts at column threadIdx.x, not 4 x threadIdx.x",
                                    "for (int d = threadIdx.x * kMergeVec; d < dim;", "for (int d = threadIdx.x; d < dim;"),
    "merge_weights_of_split_0": (SM, "every split's partial weighted by split 0's lse",
                                 "const float w = exp2f(lse_partial[s * num_rows + idx] - m_safe);",
                                 "const float w = exp2f(lse_partial[idx] - m_safe);"),
    "merge_reads_split_0": (SM, "every split reads split 0's partial row",
                            "o_partial + (s * num_rows + idx) * dim + d", "o_partial + idx * dim + d"),
    "merge_packed_columns_swapped": (SM, "the 8-byte store swaps columns 1 and 2",
                                     "pack.v[1] = from_float<T>(b);\n    pack.v[2] = from_float<T>(c);",
                                     "pack.v[1] = from_float<T>(c);\n    pack.v[2] = from_float<T>(b);"),
    "merge_unaligned_store_drops_column_3": (SM, "the one-at-a-time store (unaligned rows) skips column 3",
                                             "    dst[3] = from_float<T>(d);\n", ""),
    "merge_always_packed": (SM, "the 8-byte store also for rows that are not 8-byte aligned",
                            "const bool aligned8 = (reinterpret_cast<uintptr_t>(out_row) & 7) == 0;",
                            "const bool aligned8 = true;"),
    # the merge is launched as a programmatic dependent: without the wait it reads the partials
    # before the attention kernel has written them (the glue runs it as a GPU may, from the start)
    "merge_does_not_wait_for_the_partials": (SM, "the merge reads the partials without griddepcontrol.wait",
                                             "  grid_dependency_wait();\n", ""),
}


def run_merge(ops):
    # 3 splits of a 900-key prefix (D = 128 and D = 64, a tree), into an aligned `out` and one
    # that starts 1 element into its buffer (rows 2 bytes off 8-byte alignment)
    for d, offset in ((128, 0), (128, 1), (64, 1)):
        case = make_case([4, 2], [900, 300], hq=4, hkv=2, d=d, dtype=torch.bfloat16, kind="random", seed=14)
        matches_reference(case, ops, splits=3, out_offset=offset)


def test_unmutated_case_passes():
    run_tree_verify(PtxCudaOps())
    run_tree_verify_wide(PtxCudaOps())
    run_tree_verify_fp8(PtxCudaOps())
    run_merge(PtxCudaOps())
    run_softmax_edges(PtxCudaOps())
    run_tree_verify_paired(PtxCudaOps(arch="sm_90a"))


# Each mutant with the case that runs its configuration.
CASES = {**{name: (MUTANTS[name], run_tree_verify) for name in MUTANTS},
         **{name: (WIDE_MUTANTS[name], run_tree_verify_wide) for name in WIDE_MUTANTS},
         **{name: (FP8_MUTANTS[name], run_tree_verify_fp8) for name in FP8_MUTANTS},
         **{name: (MERGE_MUTANTS[name], run_merge) for name in MERGE_MUTANTS},
         **{name: (SOFTMAX_MUTANTS[name], run_softmax_edges) for name in SOFTMAX_MUTANTS},
         **{name: (PAIRED_MUTANTS[name], run_tree_verify_paired) for name in PAIRED_MUTANTS}}


@pytest.mark.parametrize("name", sorted(CASES))
def test_mutant_is_caught(name):
    (path, what, old, new), run = CASES[name]
    arch = {"arch": "sm_90a"} if run is run_tree_verify_paired else {}  # sm_90's configuration
    ops = PtxCudaOps(patched={path: patched(path, old, new)}, **arch)
    with pytest.raises((AssertionError, SimError)) as info:
        run(ops)
    print(f"{name} ({what}) caught: {str(info.value).splitlines()[0][:200]}")
