"""The test tiers stay what the README promises: `pytest -m quick` (tests/quick_tier.py) names only
collected tests and covers every op family and every CUDA kernel, plain `pytest` still selects
everything (quick is a marker), and the README's "Tiers and durations" table gives the counts the
suite has now: tests per tier, GPU-only tests, mutants."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import quick_tier
import tier_marks_plugin

ROOT = Path(__file__).resolve().parents[1]


def _collect() -> dict[str, set[str]]:
    """Every collected test id and its tier markers ("quick", "gpu"), from one collection."""
    env = {**os.environ, "SPEC_KERNELS_TEST_WORKERS": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-p", "tier_marks_plugin"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    marks = {}
    for line in out.stdout.splitlines():
        if line.startswith(tier_marks_plugin.PREFIX):
            nodeid, tiers = line[len(tier_marks_plugin.PREFIX):].split("\t")
            marks[nodeid] = set(filter(None, tiers.split(",")))
    listed = [line for line in out.stdout.splitlines() if line.startswith(("tests/", "tools/"))]
    assert sorted(listed) == sorted(marks), "the plugin's lines and pytest's own listing differ"
    return marks


# Without SGLang its test modules skip at import and are not collected, so the collection is not
# the one the README counts (the GPU server has no SGLang; CI installs it).
needs_the_whole_suite = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                           reason="SGLang is not installed: its test modules are not collected")


@pytest.fixture(scope="module")
def collected():
    marks = _collect()
    return list(marks), [n for n, m in marks.items() if "quick" in m], [n for n, m in marks.items() if "gpu" in m]


def _readme_row(command: str) -> list[str]:
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith(f"| `{command}` |"):
            return [c.strip() for c in line.strip("|").split("|")]
    raise AssertionError(f"README.md: no row for `{command}` in the tiers table")


def mutant_count(nodeids) -> int:
    """Mutants that the PTX tests must catch: one test case each."""
    return sum(bool(re.match(r"tests/ptx/test_mutants_\w+\.py::test_(host_)?mutant_is_caught\[", n)) for n in nodeids)


@needs_the_whole_suite
def test_readme_counts_are_the_suites(collected):
    everything, quick, gpu = collected
    assert _readme_row("pytest -m quick")[2] == str(len(quick))
    runs, tests = _readme_row("pytest")[1:3]
    assert tests == f"{len(everything)}, {len(gpu)} of them GPU-only (skipped here)"
    assert f"the PTX mutants ({mutant_count(everything)} deliberate bugs" in runs


@needs_the_whole_suite
def test_every_entry_names_a_collected_test(collected):
    everything, _, _ = collected
    for entry in quick_tier.NOT_QUICK + quick_tier.PTX_QUICK:
        assert any(quick_tier.matches(entry, n) for n in everything), f"tests/quick_tier.py: {entry} matches no test"


@needs_the_whole_suite
def test_every_family_and_every_cuda_kernel_has_quick_tests(collected):
    everything, quick, _ = collected
    assert 0 < len(quick) < len(everything)
    families = ["test_tree_verify.py", "test_tree_mask.py", "test_mla.py", "test_kv_slots.py",
                "test_fused_add_rmsnorm.py", "test_comm.py", "test_op_layer.py", "test_bad_input.py",
                "test_bad_input_fuzz.py", "test_sglang_backend.py", "test_sglang_mla.py", "test_policy.py"]
    for f in families:
        assert any(n.startswith(f"tests/{f}::") for n in quick), f"no quick test in tests/{f}"
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cu") if p.name != "build_info.cu")
    assert sorted(quick_tier.CUDA_KERNEL_TESTS) == sources, "a CUDA kernel source without its PTX test file"
    for source, test_file in quick_tier.CUDA_KERNEL_TESTS.items():
        assert any(n.startswith(test_file + "::") for n in quick), f"{source}: no quick case in {test_file}"
    assert not any("mutants" in n for n in quick)  # the mutants run in the full suite


def test_matching_rules():
    assert quick_tier.matches("tests/a.py", "tests/a.py::t[1]")
    assert quick_tier.matches("tests/a.py::t", "tests/a.py::t[1]")
    assert not quick_tier.matches("tests/a.py::t", "tests/a.py::tt")
    assert not quick_tier.matches("tests/a.py::t[1]", "tests/a.py::t[10]")
    assert not quick_tier.is_quick("tests/ptx/test_x.py::t", ())
    assert not quick_tier.is_quick("tests/test_x.py::t", ("e2e",))
    assert quick_tier.is_quick("tests/test_x.py::t", ())
