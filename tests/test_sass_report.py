"""tools/sass_report.py: the SASS figures of the CUDA tree-verify kernel (compiled with nvcc, read
with cuobjdump; no GPU needed), and its def-use walk on hand-written SASS."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools import sass_report  # noqa: E402
from tools.sass_report import Ins, chain_depth, kv_loop  # noqa: E402
from spec_kernels import _ops  # noqa: E402

KERNEL = "tree_verify_kernel<__half, 64, 64, false, 1>"


def _ins(addr, text, guard=""):
    op, _, rest = text.partition(" ")
    return Ins(addr, guard, op, sass_report._split_operands(rest))


def test_chain_depth_counts_a_load_whose_address_comes_from_a_global_load():
    body = [_ins(0x00, "LDG.E R2, desc[UR4][R4.64]"),
            _ins(0x10, "IMAD.WIDE R6, R2, 0x4, R8"),
            _ins(0x20, "LDGSTS.E.BYPASS.128 [R10+0x4000], desc[UR4][R6.64], P0")]
    assert chain_depth(body) == 2
    # The same index read from shared memory (copied there by an earlier cp.async): one trip.
    body[0] = _ins(0x00, "LDS R2, [R12]")
    assert chain_depth(body) == 1
    # A register overwritten with a value that no longer depends on the load breaks the chain.
    body = [_ins(0x00, "LDG.E R2, desc[UR4][R4.64]"), _ins(0x08, "MOV R2, RZ"),
            _ins(0x10, "IMAD.WIDE R6, R2, 0x4, R8"), _ins(0x20, "LDG.E R9, desc[UR4][R6.64]")]
    assert chain_depth(body) == 1


def test_spill_bytes_are_the_bytes_stl_stores():
    # ptxas spills into the stack frame (cuobjdump -res-usage LOCAL stays 0): count the STL stores.
    body = [_ins(0x00, "STL [R1+0x4], R3"), _ins(0x10, "STL.64 [R1+0x8], R4"), _ins(0x20, "STS [R2], R3"),
            _ins(0x30, "STG.E desc[UR4][R6.64], R3"), _ins(0x40, "LDL R5, [R1+0x4]")]
    assert sass_report.spill_store_bytes(body) == 12
    assert sass_report.spill_store_bytes(body[2:]) == 0


def test_chain_depth_carried_over_the_back_edge():
    # The index loaded at the end of one iteration feeds the next iteration's gather.
    body = [_ins(0x00, "IMAD.WIDE R6, R2, 0x4, R8"),
            _ins(0x10, "LDGSTS.E.BYPASS.128 [R10], desc[UR4][R6.64], P0"),
            _ins(0x20, "LDG.E R2, desc[UR4][R4.64]")]
    assert chain_depth(body, 1) == 1
    assert chain_depth(body, 2) == 2


def test_kv_loop_is_the_innermost_backward_branch_with_hmma_and_ldgsts():
    ins = [_ins(0x00, "MOV R1, RZ"),
           _ins(0x10, "LDGSTS.E [R3], desc[UR4][R4.64]"),   # outer loop start
           _ins(0x20, "HMMA.16816.F32 R8, R12, R16, R8"),  # inner loop start
           _ins(0x30, "LDGSTS.E [R3], desc[UR4][R4.64]"),
           _ins(0x40, "BRA 0x20", "P0"),
           _ins(0x50, "BRA 0x10", "P1"),
           _ins(0x60, "BRA 0x70"),                        # forward: not a loop
           _ins(0x70, "EXIT")]
    lp = kv_loop(ins)
    assert (lp.start, lp.end, lp.instructions, lp.hmma, lp.ldgsts) == (0x20, 0x40, 3, 1, 1)
    assert lp.per_hmma == 3.0


def _compiled(kernel):
    if _ops.extension_error() is not None:
        pytest.skip(f"the CUDA extension is not built: {_ops.extension_error()}")
    return [c for c in _ops.kernel_configs() if c.kernel == kernel]


def _run_report(tmp_path, source, kernel_filter, arch="sm_120a"):
    """tools/sass_report.py on one .cu for `arch` (comma-separated): (its rows from --json, its stdout)."""
    if sass_report.find_nvcc() is None:
        pytest.skip("nvcc not found (set CUDA_HOME): the report compiles csrc/ to cubins")
    if sass_report.find_cuobjdump() is None:
        pytest.skip("cuobjdump not found (shipped in the Triton wheel's backends/nvidia/bin, or a CUDA toolkit)")
    out = tmp_path / "sass.json"
    done = subprocess.run([sys.executable, os.path.join(REPO, "tools", "sass_report.py"), "--arch", arch,
                           "--source", source, "--filter", kernel_filter, "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def test_report_on_the_tree_verify_kernel(tmp_path):
    rows, stdout = _run_report(tmp_path, "csrc/tree_verify/tree_verify_attention.cu", "tree_verify_kernel<__half,",
                               "sm_90a,sm_120a")
    by_name = {r["kernel"]: r for r in rows if r["arch"] == "sm_120a"}
    # the instances: those of the configuration list (D = 64 / 256 with 64 rows per CTA, D = 128
    # with 32, 64 and 128, and sm_90's 128 with two m tiles per warp)
    assert set(by_name) == {f"tree_verify_kernel<__half, {c.template_args.replace(',', ', ')}>"
                            for c in _compiled("tree_verify_kernel")}
    assert len(by_name) >= 5
    assert KERNEL in stdout
    row = by_name[KERNEL]
    # TileConfig<64>: two K / V stages of 64 keys (Q staged in one) + the slot-id ring, under 99 KB.
    assert 64 * 64 * 2 < row["dynamic_smem"] <= 99 * 1024
    lp = row["loop"]
    assert lp is not None and lp["hmma"] > 0 and lp["ldgsts"] > 0
    assert lp["instructions"] > lp["hmma"] and lp["per_hmma"] > 1
    # The 128-row configuration runs 8 warps; one CTA per SM (registers), as the 64-row one on sm_120.
    wide = by_name["tree_verify_kernel<__half, 128, 128, false, 1>"]
    assert wide["threads"] == 256 and wide["resident_ctas"] == 1
    # fp8 caches: byte stages + one converted K and V tile, 82 KB at D = 128 (98 KB for 16-bit),
    # so that the 128-row configuration still keeps one CTA per SM on sm_120; the 32-row one 41 KB.
    assert by_name["tree_verify_kernel<__half, 128, 64, true, 1>"]["dynamic_smem"] == 82 * 1024
    assert by_name["tree_verify_kernel<__half, 128, 32, true, 1>"]["dynamic_smem"] == 41 * 1024
    for row in rows:
        assert 0 < row["registers"] <= 255
        assert row["spill_bytes"] == 0, row
        # two m tiles per warp: sm_90's configuration (227 KB per block; sm_120 never launches it)
        sm90_only = row["kernel"].endswith(", 2>")
        assert row["dynamic_smem"] <= (227 if sm90_only else 99) * 1024, row
        assert row["resident_ctas"] >= 1 or (sm90_only and row["arch"] == "sm_120a"), row
        # Slot ids reach shared memory by cp.async two tiles ahead: the K/V gather's address comes
        # from a shared load, so a tile waits for one global round trip, not an index load first.
        assert row["loop"]["round_trips"] == 1 and row["loop"]["carried"] == 1, row


def test_report_on_the_mla_kernel_meets_its_targets(tmp_path):
    """Regression guard on the MLA verify kernel's SASS (sm_120a): no spills, one dependent global
    round trip per KV tile, <= 99 KB of shared memory, and the inner loop tensor-core bound: at
    most 8 SASS instructions per HMMA (64-row CTAs of 8 warps: H = 16 heads x n = 16 drafts = 256
    rows in four CTAs; the 32-row and the 16-row decode CTAs too). The fp8-cache instances add
    the per-tile conversion of 16 x 576 or 32 x 576 bytes to the loop: at most 16 per HMMA (bf16
    converts through f32; the 64-row CTA amortises it over the most rows)."""
    rows, _ = _run_report(tmp_path, "csrc/mla/mla_tree_verify_attention.cu", "mla_tree_verify_kernel")
    by_name = {r["kernel"]: r for r in rows}
    assert set(by_name) >= {f"mla_tree_verify_kernel<__nv_bfloat16, {m}, {f}, {k}>" for m, k in ((1, 1), (2, 1), (4, 1), (4, 4))
                            for f in ("false", "true")}
    assert by_name["mla_tree_verify_kernel<__nv_bfloat16, 4, false, 1>"]["threads"] == 256
    for row in rows:
        assert row["spill_bytes"] == 0, row
        # k split 4: sm_90's configuration (227 KB per block there; the launch never takes it on sm_120)
        sm90_only = row["kernel"].endswith(", 4>")
        assert row["static_smem"] + row["dynamic_smem"] <= (227 if sm90_only else 99) * 1024, row
        lp = row["loop"]
        assert lp is not None and lp["hmma"] > 0 and lp["round_trips"] <= 1, row
        bound = 16.0 if ", true," in row["kernel"] else 8.0
        assert lp["per_hmma"] <= bound, f"{row['kernel']}: {lp['per_hmma']} SASS instructions per HMMA in the KV loop"


@pytest.mark.parametrize("source,kernel", [("csrc/tree_verify/tree_verify_attention.cu", "tree_verify_kernel"),
                                           ("csrc/mla/mla_tree_verify_attention.cu", "mla_tree_verify_kernel")])
def test_configuration_lists_state_the_compiled_resources(tmp_path, source, kernel):
    """Each configuration's registers (the list in csrc/include/spec_kernels/*_config.h, read by
    the planner) are the most ptxas gives the instance on sm_90a and sm_120a; its threads and
    shared memory are the launch's (the compiler-evaluated TileConfig / MlaTile constants)."""
    configs = _compiled(kernel)
    rows, _ = _run_report(tmp_path, source, kernel + "<", "sm_90a,sm_120a")
    by_instance = {}
    for r in rows:
        args = r["kernel"][r["kernel"].index(",") + 1:-1].replace(" ", "")  # after the element type
        by_instance.setdefault(args, []).append(r)
    assert set(by_instance) == {c.template_args for c in configs}
    for c in configs:
        got = by_instance[c.template_args]
        assert max(r["registers"] for r in got) == c.regs, (c, [(r["kernel"], r["arch"], r["registers"]) for r in got])
        assert {(r["threads"], r["dynamic_smem"]) for r in got} == {(c.threads, c.smem_bytes)}, c
