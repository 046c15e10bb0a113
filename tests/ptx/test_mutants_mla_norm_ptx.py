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

from tools.ptxsim import build
from tools.ptxsim.memory import SimError

import cuda_glue
from cuda_glue import REPO, PtxCudaOps
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
    # ---- MLA (the former MLA hand emulator's mutants)
    "mla_k_rows_chunks_swapped": (
        MLA, "K B-fragment ldmatrix: key-row and chunk lane mappings swapped",
        "swizzled<kChunks>((lane / 16) * 8 + lane % 8, kk * 2 + lane / 8 % 2)",
        "swizzled<kChunks>((lane / 8 % 2) * 8 + lane % 8, kk * 2 + lane / 16)", "mismatch"),
    "mla_v_not_transposed": (
        MLA, "V read with ldmatrix without .trans",
        "ldmatrix_x4_trans(b, smem_addr(kv_s", "ldmatrix_x4(b, smem_addr(kv_s", "mismatch"),
    "mla_p_fragment_order": (
        MLA, "P as A fragment: register a1 takes n-tile 1's rows g",
        "a_p[mt][1] = pack2<T>(s[mt][0][2], s[mt][0][3]);",
        "a_p[mt][1] = pack2<T>(s[mt][1][0], s[mt][1][1]);", "mismatch"),
    "mla_own_partial_only": (
        MLA, "each warp sums its own S partial four times",
        "x += s_part[w * Tile::kPartialFloats", "x += s_part[warp * Tile::kPartialFloats", "mismatch"),
    "mla_wait_group_2": (
        MLA, "cp.async.wait_group 2 instead of 1", "cp_async_wait<1>();", "cp_async_wait<2>();", "that a cp.async has not completed"),
    "mla_no_loop_top_sync": (
        MLA, "no __syncthreads after the wait",
        "      cp_async_wait<0>();\n    }\n    __syncthreads();", "      cp_async_wait<0>();\n    }\n", RACE),
    "mla_no_publish_sync": (
        MLA, "no __syncthreads between publishing and summing the S partials",
        "= s[mt][j][e];\n      }\n    }\n    __syncthreads();", "= s[mt][j][e];\n      }\n    }\n", RACE),
    "mla_no_loop_end_sync": (
        MLA, "no __syncthreads at the end of the tile loop",
        "    __syncthreads();  // the stage and the partials", "    // the stage and the partials", RACE),
    # ---- fused add + RMSNorm (MUTANTS["norm"]); warp_sum is in the header the .cu includes
    "norm_warp_sum_missing_lane": (
        ROW, "warp_sum: the butterfly stops at offset 2 (lane l + l^1 never added)",
        "for (int offset = 16; offset > 0; offset >>= 1)", "for (int offset = 16; offset > 1; offset >>= 1)",
        "mismatch"),
}

# Host code (not in the PTX): (file, what, the .cu text the glue mirrors, glue old text, glue new text, caught by)
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
    # bf16, 3 drafts x 4 heads (12 rows: a 16-row CTA whose rows g + 8 are partly real, so both
    # halves of every fragment reach the output) after 40 prefix keys, one split: 3 prefix tiles (the third a partial one, 8 keys) and a tail tile, so tile 2
    # is prefetched into the stage tile 0 was read from (the loop-end barrier matters) and every
    # iteration but the last has two cp.async groups in flight (wait_group 1 matters).
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


RUNNERS = {MLA: run_mla, ROW: run_norm, NORM: run_norm}


def _caught(name, what, expect, run):
    with pytest.raises((AssertionError, SimError)) as info:
        run()
    err = info.value
    first = (str(err).strip().splitlines() or [""])[0][:200]
    got = type(err).__name__ if isinstance(err, SimError) else "mismatch"  # SimError is an AssertionError
    print(f"{name} ({what}) caught by {got}: {first}")
    assert got == expect or (got != "mismatch" and expect in first), \
        f"{name}: expected to be caught by {expect}, got {got}: {first}"


@pytest.mark.parametrize("run", [run_mla, run_norm], ids=["mla", "norm"])
def test_unmutated_case_passes(run, monkeypatch):
    run(PtxCudaOps(), monkeypatch)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_caught(name, monkeypatch):
    path, what, old, new, expect = MUTANTS[name]
    ops = PtxCudaOps(patched={path: patched(path, old, new)})
    _caught(name, what, expect, lambda: RUNNERS[path](ops, monkeypatch))


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
