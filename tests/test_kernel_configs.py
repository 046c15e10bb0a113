"""The CUDA attention kernels' launch configurations are defined once, in the C++
(csrc/include/spec_kernels/tree_verify_config.h, mla_config.h), and Python reads them from the
built extension: every compiled configuration is reachable by the launch rule the planner asks
for, the planner's resources are the compiled ones, the exported launch rule refuses bad
arguments, and the parameter structs the PTX glue parses from the headers have the extension's
sizes."""
import ctypes
import sys
from pathlib import Path

import pytest
import torch

from spec_kernels import _ops
from spec_kernels.attention.plan import DEVICES
from spec_kernels.mla import cuda as mla_cuda
from spec_kernels.tree_verify import cuda as tv_cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.ptx_harness.shipped import header_struct  # noqa: E402

ROWS = range(1, 1025)  # every max_rows up to 16 drafts x 64 heads


@pytest.fixture(scope="module", autouse=True)
def _extension():
    if _ops.extension_error() is not None:
        pytest.skip(f"the CUDA extension is not built: {_ops.extension_error()}")


def unreachable(configs, choose) -> set:
    """The (head_dim, block_m, warp_rows, kv_fp8) of `configs` that the launch configuration
    `choose(head_dim, rows, limits, kv_fp8)` never is over ROWS and the named GPUs."""
    reached = {(c.head_dim, s.block_m, s.warp_rows, c.kv_fp8)
               for c in configs for rows in ROWS for limits in DEVICES.values()
               for s in [choose(c.head_dim, rows, limits, bool(c.kv_fp8))]}
    return {(c.head_dim, c.block_m, c.warp_rows, c.kv_fp8) for c in configs} - reached


def _configs(kernel):
    return [c for c in _ops.kernel_configs() if c.kernel == kernel]


def test_every_tree_verify_configuration_is_reachable_from_the_planner():
    configs = _configs(tv_cuda.KERNEL)
    kinds = {(64, 64, 16), (128, 64, 16), (256, 64, 16), (128, 32, 16), (128, 128, 16), (128, 128, 32)}
    assert {(c.head_dim, c.block_m, c.warp_rows, c.kv_fp8) for c in configs} == {
        (*k, fp8) for k in kinds for fp8 in (0, 1)}
    assert unreachable(configs, tv_cuda.cuda_tree_verify_launch) == set()


def mla_reached() -> dict:
    """{(block_m, block_n, kv_fp8): the named GPUs whose launches take that MLA configuration}."""
    reached = {}
    for name, limits in DEVICES.items():
        for rows in ROWS:
            for fp8 in (False, True):
                s = mla_cuda.launch_config(rows, limits, fp8)
                reached.setdefault((s.block_m, s.block_n, s.kv_fp8), set()).add(name)
    return reached


def test_every_mla_configuration_is_reachable_from_the_planner():
    configs = _configs(mla_cuda.KERNEL)
    assert {(c.block_m, c.block_n) for c in configs} == {(16, 32), (32, 16), (64, 16), (64, 32)}
    reached = mla_reached()
    assert set(reached) == {(c.block_m, c.block_n, c.kv_fp8) for c in configs}
    # sm_90's k-split configuration (64 rows, 32-key tiles) only where its shared memory fits
    assert reached[(64, 32, 0)] == reached[(64, 32, 1)] == {"h200"}
    assert reached[(64, 16, 0)] == {"rtx-pro-6000"}


def test_the_reachability_check_catches_a_configuration_no_launch_takes():
    # A configuration compiled into the list but never chosen by the launch rule (here: 64 rows
    # at D = 96, a head dim the rule has no configuration for) is reported.
    extra = _ops.LaunchShape(96, 64, 128, 1024, 128, 1, 0, 64, 16, kernel=tv_cuda.KERNEL, template_args="96,64,false,1")
    assert unreachable(_configs(tv_cuda.KERNEL) + [extra], tv_cuda.cuda_tree_verify_launch) == {(96, 64, 16, 0)}


def test_the_planner_uses_the_compiled_resources():
    for c in _configs(tv_cuda.KERNEL):
        for name, limits in DEVICES.items():
            s = tv_cuda.cuda_tree_verify_launch(c.head_dim, c.block_m, limits, bool(c.kv_fp8))
            if (s.block_m, s.warp_rows) != (c.block_m, c.warp_rows):
                continue  # another configuration of block_m rows runs on that device
            r = tv_cuda.cuda_tree_verify_resources(c.head_dim, c.block_m, bool(c.kv_fp8), limits)
            assert (r.threads, r.regs_per_thread, r.smem_bytes) == (c.threads, c.regs, c.smem_bytes)
            assert c.smem_bytes <= limits.max_smem_per_cta, (c, name)
    reached = mla_reached()
    for c in _configs(mla_cuda.KERNEL):
        for name in reached[(c.block_m, c.block_n, c.kv_fp8)]:
            r = mla_cuda.cuda_mla_resources(c.block_m, bool(c.kv_fp8), DEVICES[name])
            assert (r.threads, r.regs_per_thread, r.smem_bytes) == (c.threads, c.regs, c.smem_bytes)
            assert c.smem_bytes <= DEVICES[name].max_smem_per_cta, (c, name)
    for c in _ops.kernel_configs():
        assert c.threads % 32 == 0 and 0 < c.regs <= 255
        # sm_90-only configurations (reached on the H200 alone, above) may take up to 227 KB
        assert c.smem_bytes <= 227 * 1024, c


def test_a_head_dim_without_a_configuration():
    assert _ops.tree_verify_launch_config(96, 8, 100 * 1024, 1024).block_m == 0
    with pytest.raises(ValueError, match="head_dim=96"):
        tv_cuda.cuda_tree_verify_resources(96)
    q = torch.zeros(1, 1, 96, dtype=torch.float16)
    assert "head dim 96" in tv_cuda.supports(q, torch.zeros_like(q), torch.zeros_like(q))


@pytest.mark.parametrize("args,name", [((128, 0, 1024, 0), "max_rows"), ((128, 8, -1, 0), "smem_per_sm"),
                                       ((128, 8, 1024, -5), "smem_reserved_per_cta"), ((-1, 8, 0, 0), "head_dim")])
def test_the_exported_launch_rule_refuses_bad_arguments(args, name):
    with pytest.raises(RuntimeError, match=name):
        torch.ops.spec_kernels_cuda.tree_verify_launch_config(*args)
    with pytest.raises(RuntimeError, match="max_rows"):
        torch.ops.spec_kernels_cuda.mla_launch_config(0, 0, 0)
    if name != "head_dim":
        with pytest.raises(RuntimeError, match=name):
            torch.ops.spec_kernels_cuda.mla_launch_config(*args[1:])


def test_the_launch_smem_limit_is_set_restored_and_checked():
    """spec_kernels.testing.launch_rule_as_on (the GPU tests' way to reach every configuration):
    the cap is process-wide, returned on each set, restored on exit; a refused value leaves it."""
    from spec_kernels.testing import launch_rule_as_on

    ops = torch.ops.spec_kernels_cuda
    before = ops.set_launch_smem_limit(50 * 1024)
    try:
        assert ops.set_launch_smem_limit(60 * 1024) == 50 * 1024
        with launch_rule_as_on(100 * 1024):
            assert ops.set_launch_smem_limit(100 * 1024) == 100 * 1024
        with pytest.raises(RuntimeError, match="smem_per_sm"):
            ops.set_launch_smem_limit(-1)
        assert ops.set_launch_smem_limit(0) == 60 * 1024
    finally:
        ops.set_launch_smem_limit(before)


@pytest.mark.parametrize("name", ["TreeVerifyParams", "MlaParams", "IndexTensor", "KvSlotBatch", "KvCommitArgs"])
def test_parsed_parameter_structs_have_the_compiled_size(name):
    assert ctypes.sizeof(header_struct(name)) == _ops.compiled_constants()[f"sizeof({name})"]


# --------------------------------------------------------------------------- the launch rule, compiled
_DRIVER = r"""
#include <cstdio>
#include "spec_kernels/tree_verify_config.h"
#include "spec_kernels/mla_config.h"
#include "spec_kernels/launch_once.cuh"
int main() {
  const int caps[][2] = {{233472, 0}, {233472, 102400}, {102400, 233472}, {102400, 102400}};
  for (const auto& c : caps)
    std::printf("cap %d %d 0 0 0 %d 0 0\n", c[0], c[1], spec_kernels::capped_smem_per_sm(c[0], c[1]));
  const int dims[] = {64, 96, 128, 256};
  const int smem[][2] = {%SMEM%};
  for (int d : dims)
    for (int rows = 1; rows <= 130; ++rows)
      for (const auto& s : smem)
        for (int fp8 = 0; fp8 < 2; ++fp8) {
          const auto c = spec_kernels::tree_verify_launch_shape(d, rows, s[0], s[1], fp8 != 0);
          std::printf("tv %d %d %d %d %d %d %d %d\n", d, rows, s[0], s[1], fp8, c.block_m, c.threads, c.smem_bytes);
          std::printf("tv_w %d %d %d %d %d %d 0 0\n", d, rows, s[0], s[1], fp8, c.warp_rows);
        }
  for (int rows = 1; rows <= 130; ++rows)
    for (const auto& s : smem)
      for (int fp8 = 0; fp8 < 2; ++fp8) {
        const auto c = spec_kernels::mla_launch_shape(rows, s[0], s[1], fp8 != 0);
        std::printf("mla %d %d %d %d %d %d %d %d\n", 576, rows, s[0], s[1], fp8, c.block_m, c.threads, c.smem_bytes);
        std::printf("mla_n %d %d %d %d %d %d 0 0\n", 576, rows, s[0], s[1], fp8, c.block_n);
      }
}
"""
SMEM_CASES = [(0, 0)] + [(d.smem_per_sm, d.smem_reserved_per_cta) for d in DEVICES.values()]
REPO = Path(__file__).resolve().parents[1]


def launch_rule_table(tmp_path, patch=None) -> dict:
    """The launch rule of the configuration headers compiled with the host C++ compiler, over
    head dims x rows 1..130 x the named GPUs' shared memory x cache kind: {("tv", d, rows, per_sm,
    reserved, fp8) or
    reserved, fp8) or ("mla", 576, rows, per_sm, reserved, fp8): (block_m, threads, smem_bytes), and
    ("mla_n", ...): (block_n, 0, 0), ("tv_w", ...): (warp_rows, 0, 0)}. patch = (header, old, new)
    compiles a mutant."""
    import shutil
    import subprocess

    from tools.ptx_harness.build import find_nvcc

    cxx, nvcc = shutil.which("c++") or shutil.which("g++"), find_nvcc()
    if cxx is None or nvcc is None:
        pytest.skip("needs a host C++ compiler and the CUDA headers (nvcc)")
    include = tmp_path / "include"
    shutil.copytree(REPO / "csrc" / "include", include)
    if patch is not None:
        header, old, new = patch
        text = (include / "spec_kernels" / header).read_text()
        assert text.count(old) == 1, f"{header}: the mutated text must occur once"
        (include / "spec_kernels" / header).write_text(text.replace(old, new))
    src = tmp_path / "rule.cpp"
    src.write_text(_DRIVER.replace("%SMEM%", ", ".join(f"{{{a}, {b}}}" for a, b in SMEM_CASES)))
    cuda_include = Path(nvcc).resolve().parent.parent / "include"
    subprocess.run([cxx, "-std=c++17", "-O0", f"-I{include}", f"-I{cuda_include}", str(src), "-o",
                    str(tmp_path / "rule")], check=True, capture_output=True, text=True)
    out = subprocess.run([str(tmp_path / "rule")], check=True, capture_output=True, text=True).stdout
    table = {}
    for line in out.splitlines():
        kind, *vals = line.split()
        vals = [int(v) for v in vals]
        table[(kind, *vals[:5])] = tuple(vals[5:])
    return table


def check_launch_rule(table) -> None:
    """What the launch rule promises (docs/design.md, tree_verify_config.h), on the table."""
    h200, rtx = [(d.smem_per_sm, d.smem_reserved_per_cta) for d in (DEVICES["h200"], DEVICES["rtx-pro-6000"])]
    bm = {k: v[0] for k, v in table.items()}
    for rows in range(1, 131):
        for smem in SMEM_CASES:
            for fp8 in (0, 1):  # the same choice for either cache kind
                assert bm[("tv", 64, rows, *smem, fp8)] == bm[("tv", 256, rows, *smem, fp8)] == 64  # one configuration
                assert bm[("tv", 96, rows, *smem, fp8)] == 0  # no configuration
                # sm_120 (one 64-row CTA per SM): 32 rows up to 16, the 8-warp 128-row one for 17-64
                want = 128 if rows > 64 else (32 if rows <= 16 else 128) if smem == rtx else 64
                assert bm[("tv", 128, rows, *smem, fp8)] == want, (rows, smem, fp8)
                # two m tiles per warp: > 64 rows where that 128-row configuration fits (sm_90)
                want_w = 32 if rows > 64 and smem == h200 else 16
                assert bm[("tv_w", 128, rows, *smem, fp8)] == want_w, (rows, smem, fp8)
            for fp8 in (0, 1):
                mla = (576, rows, *smem, fp8)
                assert bm[("mla", *mla)] == (16 if rows <= 16 else 32 if rows <= 32 else 64)
                # 64 rows: 32-key tiles (k split) where the configuration fits (sm_90), else 16
                want_n = 32 if rows <= 16 else 16 if rows <= 32 else 32 if smem == h200 else 16
                assert bm[("mla_n", *mla)] == want_n, (rows, smem, fp8)
    # the test-only cap (launch_rule_as_on) lowers a device's shared memory, never raises it
    assert [bm[("cap", *c, 0, 0, 0)] for c in ((233472, 0), (233472, 102400), (102400, 233472), (102400, 102400))] \
        == [233472, 102400, 102400, 102400]
    assert table[("tv", 128, 65, *rtx, 0)][1:] == (256, 98 * 1024)  # 8 warps, the 64-row stages
    # fp8: byte stages (48 KB) and one converted K and V tile (32 KB) + the slot ids
    assert table[("tv", 128, 65, *rtx, 1)][1:] == (256, 82 * 1024)
    # sm_90, two m tiles per warp: + the Q tile (32 KB) and the rows' ancestor words (1 KB)
    assert table[("tv", 128, 65, *h200, 0)][1:] == (256, 131 * 1024)
    assert table[("tv", 128, 65, *h200, 1)][1:] == (256, 115 * 1024)


def test_the_compiled_launch_rule_is_the_extensions(tmp_path):
    table = launch_rule_table(tmp_path)
    check_launch_rule(table)
    for key, (block_m, threads, smem) in table.items():
        if key[0] == "cap":
            continue
        if key[0] == "mla_n":
            assert _ops.mla_launch_config(*key[2:-1], bool(key[-1])).block_n == block_m, key
            continue
        if key[0] == "tv_w":
            assert _ops.tree_verify_launch_config(*key[1:]).warp_rows == block_m, key
            continue
        got = (_ops.tree_verify_launch_config(*key[1:]) if key[0] == "tv"
               else _ops.mla_launch_config(*key[2:-1], bool(key[-1])))
        assert (got.block_m, got.threads if block_m else 0, got.smem_bytes if block_m else 0) == (
            block_m, threads if block_m else 0, smem if block_m else 0), key


LAUNCH_RULE_MUTANTS = {
    "wide_at_64_rows": ("tree_verify_config.h", "max_rows > kTreeVerifyBlockM", "max_rows >= kTreeVerifyBlockM"),
    "small_up_to_32_rows": ("tree_verify_config.h", "max_rows <= 16", "max_rows <= 32"),
    "small_everywhere": ("tree_verify_config.h", "one_large_per_sm && 2 * small", "2 * small"),
    "wide_on_sm90_too": ("tree_verify_config.h", "(head_dim == 128 && one_large_per_sm)", "(head_dim == 128)"),
    "wide_from_33_rows": ("tree_verify_config.h", "(head_dim == 128 && one_large_per_sm)",
                          "(head_dim == 128 && one_large_per_sm && max_rows > 32)"),
    "unknown_smem_counts_as_small": ("tree_verify_config.h", "smem_per_sm > 0 && 2 * large", "2 * large"),
    "paired_on_sm120": ("tree_verify_config.h", "paired <= smem_per_sm", "paired <= 2 * smem_per_sm"),
    "paired_never": ("tree_verify_config.h", "paired <= smem_per_sm) m_tiles = 2", "paired <= smem_per_sm) m_tiles = 1"),
    "mla_k_split_on_sm120": ("mla_config.h", "wide <= smem_per_sm", "wide <= 2 * smem_per_sm"),
    "mla_k_split_for_32_rows": ("mla_config.h", "block_m == 64 && smem_per_sm", "block_m >= 32 && smem_per_sm"),
    "smem_cap_raises_it": ("launch_once.cuh", "limit > 0 && limit < per_sm ? limit", "limit > 0 ? limit"),
    "mla_rows_swapped": ("mla.h", "max_rows <= 16 ? 16 : max_rows <= 32 ? 32 : 64",
                         "max_rows <= 16 ? 16 : max_rows <= 48 ? 32 : 64"),
}


@pytest.mark.parametrize("name", sorted(LAUNCH_RULE_MUTANTS))
def test_launch_rule_mutant_is_caught(tmp_path, name):
    with pytest.raises(AssertionError):
        check_launch_rule(launch_rule_table(tmp_path, LAUNCH_RULE_MUTANTS[name]))
