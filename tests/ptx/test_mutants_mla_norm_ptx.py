"""Deliberate bugs in the MLA and fused add + RMSNorm kernel sources must make their PTX tests fail.

Each device-code mutant is a one-expression edit of a .cu file or of a header it includes (the
text must occur exactly once, so a refactor that moves it fails here loudly instead of testing
nothing). The edited source is compiled to sm_120a PTX and one small case runs on the
interpreter; the mutant is caught by a mismatch with the reference, a shared-memory race /
cp.async hazard, an out-of-bounds access or a trap. Each mutant names the check it must be
caught by (a removed barrier must be caught as a race, not by a wrong number), so a case that
stops reaching the bug's path fails here too.

launch_typed()'s choice of the vector kernel is host code: it is not in the PTX, and the glue
(cuda_glue.PtxCudaOps.fused_add_rmsnorm) re-expresses it. Its mutant checks that the .cu still
holds the test it removes and applies the same edit to the glue's copy of that test.
"""
from __future__ import annotations

import os
import types

import pytest
import torch

from tools.ptx_harness import build
from ptxsim.memory import SimError

from tools.ptx_harness import cuda_glue
from tools.ptx_harness.cuda_glue import REPO, PtxCudaOps
import spec_kernels.mla.cuda as mla_cuda
import spec_kernels.norm.api as norm_api
import test_mla_ptx as mla
import test_norm_ptx as norm

pytestmark = [
    pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not found (set CUDA_HOME): the kernels' PTX cannot "
                       "be produced"),
    pytest.mark.filterwarnings("ignore:invalid value encountered"),
]

MLA = "mla/mla_tree_verify_attention.cu"
NORM = "norm/fused_add_rmsnorm.cu"
ROW = "norm/rmsnorm_row.cuh"

# What catches a mutant: "mismatch" (AssertionError against the reference) or a part of the
# interpreter's error message (a race, a cp.async read before its wait, a misaligned access).
RACE = "shared-memory race"
# name: (file, what, old text, new text, caught by)
MUTANTS = {
    # ---- MLA
    "mla_k_rows_chunks_swapped": (
        MLA, "K B-fragment ldmatrix: key-row and chunk lane mappings swapped",
        "pinned((nw * 8 + x7) * kRowBytes + (((4 * j + lane / 8) ^ x7) << 4))",
        "pinned((nw * 8 + lane / 8) * kRowBytes + (((4 * j + (lane & 3)) ^ x7) << 4))", "mismatch"),
    "mla_q_chunk_half": (
        MLA, "Q A-fragment ldmatrix: lanes 16-31 read the first 8 dims of the k16 step, not the second",
        "q_off[j] = pinned(q_lane + (((2 * j + lane / 16) ^ x7) << 4));",
        "q_off[j] = pinned(q_lane + (((2 * j) ^ x7) << 4));", "mismatch"),
    "mla_v_not_transposed": (
        MLA, "V read with ldmatrix without .trans",
        "ldmatrix_x4_trans(b, kv_s + v_off", "ldmatrix_x4(b, kv_s + v_off", "mismatch"),
    "mla_p_fragment_order": (
        MLA, "P as A fragment: the ldmatrix lanes' row half and key half swapped",
        "((lane / 8 % 2) * 8 + x7) * Tile::kPStride + (lane / 16) * 16",
        "((lane / 16) * 8 + x7) * Tile::kPStride + (lane / 8 % 2) * 16", "mismatch"),
    "mla_one_accumulator_chain": (
        MLA, "S = Q K^T: the odd k16 steps' chain is dropped",
        "s[0][e] = s2[0][e] + s2[1][e];", "s[0][e] = s2[0][e];", "mismatch"),
    "mla_owner_max_only": (
        MLA, "every warp rescales O with its own units' row maxima only (no exchange)",
        "for (int n = 0; n < kNWarps; ++n) mx = fmaxf(mx, cells[n]);",
        "for (int n = 0; n < kNWarps; ++n) mx = n == nw ? fmaxf(mx, cells[n]) : mx;", "mismatch"),
    "mla_row_sum_own_share": (
        MLA, "the epilogue takes one warp's share of the row sum",
        "for (int n = 0; n < kNWarps; ++n) l += cells[n];", "l += cells[0];", "mismatch"),
    "mla_m_safe_unclamped_latekey": (
        MLA, "the softmax offset of a row with no visible key yet is -inf (not clamped to -FLT_MAX)",
        "m_safe[mt][h] = fmaxf(mx, -FLT_MAX);", "m_safe[mt][h] = mx;", "mismatch"),
    "mla_no_rescale": (
        MLA, "O is not rescaled when the row max grows",
        "acc[mt][d][e] *= alpha[mt][e >> 1];", "acc[mt][d][e] *= 1.f;", "mismatch"),
    "mla_mask_row_swapped": (
        MLA, "tail tiles: rows g + 8 use the ancestor word of rows g",
        "bits[h] = static_cast<uint32_t>(row_mask[h] >> shift) & 3u;",
        "bits[h] = static_cast<uint32_t>(row_mask[0] >> shift) & 3u;", "mismatch"),
    "mla_gather_chunk_stride": (
        MLA, "the gather copies chunk j of 8 from the wrong column",
        "cp_async_16(dst + j * 128, src + j * 64, valid);", "cp_async_16(dst + j * 128, src + j * 8, valid);",
        "mismatch"),
    "mla_wait_group_1": (
        MLA, "cp.async.wait_group 1 instead of 0 at the top of the tile loop",
        "      cp_async_wait<0>();\n      __syncthreads();  // tile t",
        "      cp_async_wait<1>();\n      __syncthreads();  // tile t",
        "that a cp.async has not completed"),
    "mla_no_loop_top_sync": (
        MLA, "no __syncthreads after the wait",
        "    __syncthreads();  // tile t (and", "    // tile t (and", RACE),
    "mla_no_max_sync": (
        MLA, "no __syncthreads between publishing and reading the row maxima",
        "    __syncthreads();  // row maxima published", "    // row maxima published", RACE),
    "mla_no_p_sync": (
        MLA, "no __syncthreads between writing and reading P",
        "    __syncthreads();  // P written", "    // P written", RACE),
    # the 3-stage ring of 32-row CTAs (run_mla32; names end in _bm32)
    "mla_wait_group_2_bm32": (
        MLA, "3 stages: wait_group 2 instead of 1 before the P barrier (tile t + 1 not waited for)",
        "cp_async_wait<1>();  // tile t + 1", "cp_async_wait<2>();  // tile t + 1", "that a cp.async has not completed"),
    "mla_prologue_sync_bm32": (
        MLA, "3 stages: no __syncthreads after the prologue's wait for tile 0",
        "    __syncthreads();  // tile 0 (and tile 2's ids) visible", "    // tile 0 (and tile 2's ids) visible", RACE),
    "mla_gather_into_current_stage_bm32": (
        MLA, "3 stages: tile t + 2 gathered into the stage of tile t",
        "load_tile(t + 2, stage == 0 ? 2 : stage - 1);", "load_tile(t + 2, stage);",
        "that a cp.async has not completed"),
    "mla_no_p_sync_bm32": (
        MLA, "3 stages: no __syncthreads between writing P and P V (nor for tile t + 1)",
        "    __syncthreads();  // P written", "    // P written", RACE),
    "mla_no_row_sum_sync": (
        MLA, "no __syncthreads between publishing and reading the row sums",
        "  __syncthreads();\n\n  // ---- epilogue", "\n  // ---- epilogue", RACE),
    # ---- MLA, 64-row CTAs (8 warps, Q split between registers and shared memory)
    "mla_q_staged_no_sync_bm64": (
        MLA, "64 rows: no __syncthreads between reading the staged Q columns and gathering tile 0 over them",
        "    __syncthreads();  // the staged Q columns are KV stage 0",
        "    // the staged Q columns are KV stage 0", RACE),
    "mla_q_tile_step_offset_bm64": (
        MLA, "64 rows: Q tile read at the step's full-row column, not past the columns held in registers",
        "((kk - kQStagedChunks / 2) / 4) * 128", "(kk / 4) * 128", "that a cp.async has not completed"),
    "mla_gather_all_threads_bm64": (
        MLA, "64 rows: all 8 warps gather, the last 4 past the 16-key stage",
        "    if (kBlockN * 8 < kThreads && threadIdx.x >= kBlockN * 8) return;\n", "", "outside the"),
    "mla_v_columns_bm64": (
        MLA, "64 rows: a warp's V columns at 128 per warp (the 4-warp width), not 64",
        "warp * kDvTiles * 16 +", "warp * 16 * 16 +", "that a cp.async has not completed"),
    # ---- MLA, sm_90's 64-row configuration (k split 4: 32 x 32 units over a quarter of the dims,
    # partial sums through shared memory); run on the sm_90a PTX (run_mla_ksplit)
    "mla_exchange_cell_ksplit": (
        MLA, "k split: a partial sum handed to the next owner's cell",
        "cell = (kq - part - 1 + kKSplit) % kKSplit;", "cell = (kq - part + kKSplit) % kKSplit;", "outside the"),
    "mla_no_exchange_sync_ksplit": (
        MLA, "k split: no __syncthreads between handing over and adding the partial sums",
        "      __syncthreads();  // partial sums handed over", "      // partial sums handed over", RACE),
    "mla_unit_steps_ksplit": (
        MLA, "k split: every warp of a unit sums the first quarter of the dims",
        "const int k0 = kq * Tile::kUnitSteps;", "const int k0 = 0;", "mismatch"),
    "mla_unit_key_halves_ksplit": (
        MLA, "k split: the K fragments' second 8 keys read the first 8 again",
        "const int key = unit_n0 * 8 + (lane / 16) * 8 + x7;", "const int key = unit_n0 * 8 + x7;", "mismatch"),
    "mla_own_part_not_kept_ksplit": (
        MLA, "k split: every warp keeps part 0 of the unit instead of its own",
        "s[j][e] = part == kq || part == 0 ? v[e] : s[j][e];", "s[j][e] = part == 0 ? v[e] : s[j][e];", "mismatch"),
    # ---- fused add + RMSNorm (MUTANTS["norm"]); warp_sum is in the header the .cu includes
    "norm_warp_sum_missing_lane": (
        ROW, "warp_sum: the butterfly stops at offset 2 (lane l + l^1 never added)",
        "for (int offset = 16; offset > 0; offset >>= 1)", "for (int offset = 16; offset > 1; offset >>= 1)",
        "mismatch"),
}

# Host code (not in the PTX): (file, what, the .cu text the glue mirrors, glue old text, glue new text, caught by)
# Mutants of the fp8-cache instances (byte stages converted per tile), run on the fp8 cases of
# every configuration (run_mla_fp8).
MUTANTS.update({
    "mla_v_scale_dropped_fp8": (MLA, "the output is not multiplied by v_scale",
                                "seen ? v_scale / l : 0.f", "seen ? 1.f / l : 0.f", "mismatch"),
    "mla_k_scale_tensor_ignored_fp8": (MLA, "k_scale_tensor ignored (the host k_scale is used)",
                                       "qk_scale_log2 *= p.k_scale_ptr != nullptr ? *p.k_scale_ptr : p.k_scale;",
                                       "qk_scale_log2 *= p.k_scale;", "mismatch"),
    "mla_e5m2_read_as_e4m3_fp8": (MLA, "an e5m2 cache converted as e4m3",
                                  "const bool e5m2 = p.kv_format == kKvE5M2;", "const bool e5m2 = false;", "mismatch"),
    "mla_no_barrier_after_conversion_fp8": (MLA, "no __syncthreads between converting a tile and reading it",
                                            "convert_tile(stage);\n      __syncthreads();", "convert_tile(stage);",
                                            RACE),
    "mla_no_barrier_before_conversion_fp8": (MLA, "3 stages: the conversion overwrites the tile tile t - 1's P V reads",
                                             "if constexpr (Tile::kStages == 3) __syncthreads();", "", RACE),
    "mla_conversion_reads_the_neighbour_fp8": (MLA, "a converted chunk reads the bytes of its neighbour chunk",
                                               "src + r * kD + c * 8);", "src + r * kD + (c ^ 1) * 8);", "mismatch"),
    "mla_gather_half_row_stride_fp8": (MLA, "fp8 rows gathered kD / 2 bytes apart in the stage",
                                     "s_kv + stage * Tile::kStageElems + r * kD + c * 16",
                                     "s_kv + stage * Tile::kStageElems + r * (kD / 2) + c * 16", RACE),
})

HOST_MUTANTS = {
    "norm_vector_path_any_hidden": (
        NORM, "launch_typed: vector path without the hidden % kVec == 0 test",
        "const bool vec_ok = hidden % kVec == 0 && aligned16(x) &&",
        "vec_ok = (hidden % vec == 0 and all(", "vec_ok = (all(", "misaligned"),
}


def patched(path, old, new, root=os.path.join(REPO, "csrc")):
    with open(os.path.join(root, path), encoding="utf-8") as f:
        text = f.read()
    assert text.count(old) == 1, f"mutant text found {text.count(old)} times in {path}: {old!r}"
    return text.replace(old, new)


def run_mla(ops, monkeypatch):
    # bf16, 3 drafts x 4 heads (12 rows: a 16-row CTA, 32-key tiles, whose rows g + 8 are partly
    # real, so both halves of every fragment reach the output) after 40 prefix keys, one split: 2
    # prefix tiles (the second a partial one, 8 keys) and a tail tile, so tile 2 is gathered into
    # the stage tile 0 was read from (the loop-top barrier matters) while tile 1 is computed, and
    # the four warps' S units share every row (the row maxima and row sums are exchanged).
    monkeypatch.setattr(mla_cuda, "cuda_ops", lambda: ops)
    c = mla.make_case([3], [40], 4, torch.bfloat16, seed=5)
    out, lse, ref, ref_lse = mla.run_both(c, splits=1)
    mla.assert_matches(c, out, lse, ref, ref_lse)


def run_norm(ops, monkeypatch, dtype=torch.bfloat16, hidden=40, rows=3):
    # bf16, hidden 40: the vector kernel (5 vectors of 8: lanes 0-4 of one warp hold the row, so
    # every butterfly step of warp_sum adds a nonzero lane)
    monkeypatch.setattr(norm_api, "cuda_ops", lambda: ops)
    x, residual, weight = norm.inputs(rows, hidden, dtype, seed=hidden)
    out, res, ref_out, ref_res = norm.run_both(ops, x, residual, weight)
    norm.assert_matches(out, res, ref_out, ref_res)


def run_mla32(ops, monkeypatch):
    # bf16, 3 drafts x 7 heads (21 rows: a 32-row CTA, 16-key tiles, 3 KV stages) after 40 prefix
    # keys: 3 prefix tiles (the third a partial one, 8 keys) and a tail tile, so tile 3 is gathered
    # into the stage tile 0 was read from while tiles 1 and 2 are in flight.
    monkeypatch.setattr(mla_cuda, "cuda_ops", lambda: ops)
    c = mla.make_case([3], [40], 7, torch.bfloat16, seed=6)
    out, lse, ref, ref_lse = mla.run_both(c, splits=1)
    mla.assert_matches(c, out, lse, ref, ref_lse)


def _run_mla_64_rows(ops, monkeypatch, prefix, instance):
    """bf16, 5 drafts x 9 heads (45 rows: one 64-row CTA of 8 warps, rows 45-63 empty) after
    `prefix` keys, one split; the launched instance's mangled template arguments end in `instance`."""
    monkeypatch.setattr(mla_cuda, "cuda_ops", lambda: ops)
    c = mla.make_case([5], [prefix], 9, torch.bfloat16, seed=8)
    out, lse, ref, ref_lse = mla.run_both(c, splits=1)
    assert [name for name, *_ in ops.launches][0].endswith(instance)
    mla.assert_matches(c, out, lse, ref, ref_lse)


def run_mla64(ops, monkeypatch):
    # 16-key tiles, 2 KV stages; 40 prefix keys: 3 prefix tiles (the third a partial one, 8 keys)
    # and a tail tile, so tiles 2 and 3 are gathered into the stages tiles 0 and 1 were read from.
    _run_mla_64_rows(ops, monkeypatch, 40, "Li4ELb0ELi1E")


def run_mla_ksplit(ops, monkeypatch):
    # the sm_90a PTX: sm_90's configuration (32-key tiles, 3 stages); 70 prefix keys: 3 prefix
    # tiles (the third a partial one, 6 keys) and a tail tile, so tile 3 is gathered into the
    # stage of tile 0.
    _run_mla_64_rows(ops, monkeypatch, 70, "Li4ELb0ELi4E")


def run_mla_late_first_key(ops, monkeypatch):
    # bf16, 18 drafts x 1 head after an empty prefix (a 32-row CTA, 16-key tiles): draft 17 is a root
    # (it sees only itself), so its row has no visible key in the first tile and its first one in
    # the second: the online softmax must carry a row that has seen nothing yet.
    monkeypatch.setattr(mla_cuda, "cuda_ops", lambda: ops)
    c = mla.make_case([18], [0], 1, torch.bfloat16, seed=9)
    c["tree_mask"][17] = 1 << 17
    out, lse, ref, ref_lse = mla.run_both(c, splits=1)
    mla.assert_matches(c, out, lse, ref, ref_lse)


def run_mla_fp8(ops, monkeypatch):
    # fp8 caches on each configuration: 12 rows (16-row CTA, 2 stages), e4m3 with tensor scales;
    # 21 rows (32-row CTA, 3 stages), e5m2; 45 rows (64-row CTA, Q columns staged in the converted
    # tile), e4m3; each with several prefix tiles and a tail tile
    import test_mla_fp8_ptx as fp8

    monkeypatch.setattr(mla_cuda, "cuda_ops", lambda: ops)
    fp8.check(mla.make_case([3], [40], 4, torch.bfloat16, seed=5), fp8.E4, splits=1, tensor_scales=True)
    fp8.check(mla.make_case([3], [40], 7, torch.float16, seed=6), fp8.E5, splits=1)
    fp8.check(mla.make_case([5], [40], 9, torch.bfloat16, seed=8), fp8.E4, splits=2)


RUNNERS = {MLA: run_mla, ROW: run_norm, NORM: run_norm}


def runner(name, path):
    special = {"_bm32": run_mla32, "_bm64": run_mla64, "_latekey": run_mla_late_first_key, "_fp8": run_mla_fp8,
               "_ksplit": run_mla_ksplit}
    return next((run for end, run in special.items() if name.endswith(end)), RUNNERS[path])


def _caught(name, what, expect, run):
    with pytest.raises((AssertionError, SimError)) as info:
        run()
    err = info.value
    first = (str(err).strip().splitlines() or [""])[0][:200]
    got = type(err).__name__ if isinstance(err, SimError) else "mismatch"  # SimError is an AssertionError
    print(f"{name} ({what}) caught by {got}: {first}")
    assert got == expect or (got != "mismatch" and expect in first), \
        f"{name}: expected to be caught by {expect}, got {got}: {first}"


def arch_of(name):
    """The PTX a mutant's case runs: sm_90a for sm_90's configuration, else the default."""
    return {"arch": "sm_90a"} if name.endswith("_ksplit") else {}


@pytest.mark.parametrize("run", [run_mla, run_mla32, run_mla64, run_mla_ksplit, run_mla_late_first_key, run_mla_fp8,
                                 run_norm],
                         ids=["mla", "mla32", "mla64", "mla-ksplit", "mla-late-key", "mla-fp8", "norm"])
def test_unmutated_case_passes(run, monkeypatch):
    run(PtxCudaOps(**arch_of(run.__name__.replace("run_mla_ksplit", "_ksplit"))), monkeypatch)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_caught(name, monkeypatch):
    path, what, old, new, expect = MUTANTS[name]
    ops = PtxCudaOps(patched={path: patched(path, old, new)}, **arch_of(name))
    _caught(name, what, expect, lambda: runner(name, path)(ops, monkeypatch))


@pytest.mark.parametrize("name", sorted(HOST_MUTANTS))
def test_host_mutant_is_caught(name, monkeypatch):
    path, what, cu_text, old, new, expect = HOST_MUTANTS[name]
    patched(path, cu_text, cu_text)  # the statement the glue mirrors is still in the .cu
    glue = types.ModuleType("cuda_glue_mutant")
    glue.__file__ = cuda_glue.__file__
    exec(compile(patched(cuda_glue.__file__, old, new, root=""), f"cuda_glue.py [mutant {name}]", "exec"),
         glue.__dict__)
    # bf16, hidden 37: not a multiple of the 8-element vector (the scalar kernel must run)
    _caught(name, what, expect, lambda: run_norm(glue.PtxCudaOps(), monkeypatch, hidden=37))
