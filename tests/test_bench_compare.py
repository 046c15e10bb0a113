"""python -m spec_kernels.bench compare: crafted pytest-benchmark JSON files."""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spec_kernels.bench.__main__ import main
from spec_kernels.bench.compare import load, parse_threshold

ROOT = Path(__file__).resolve().parents[1]


def bench(name, median, **extra_info):
    entry = {"name": name, "fullname": f"benchmarks/test_tree_verify.py::{name}", "stats": {"median": median}}
    if extra_info:
        entry["extra_info"] = extra_info
    return entry


OLD = {
    "machine_info": {"spec_kernels": {"device": {"type": "cuda", "name": "NVIDIA H200"}, "preset": "gpu-quick",
                                      "spec_kernels": "0.1.0", "extension_error": None, "extension_archs": [900],
                                      "extension_cuda": 13000, "torch": "2.14.1", "triton": "3.8.0"}},
    "commit_info": {"id": "0123456789abcdef0123456789abcdef01234567", "dirty": False},
    "datetime": "2026-01-01T00:00:00",
    "benchmarks": [
        bench("test_attention[B1-n16-cuda]", 100e-6, kind="attention", bytes=400_000_000, gbps=4000.0),
        bench("test_attention[B1-n1-cuda]", 80e-6, kind="attention", gbps=3000.0),  # gbps, no bytes
        bench("test_kv_alloc[B256]", 8e-6),  # no extra_info at all
        bench("test_removed", 1e-3),
    ],
}


def new_run(scale: dict) -> dict:
    """OLD with each named case's median multiplied by scale[name]; test_removed gone, one added."""
    doc = copy.deepcopy(OLD)
    doc["benchmarks"] = [b for b in doc["benchmarks"] if b["name"] != "test_removed"]
    for b in doc["benchmarks"]:
        b["stats"]["median"] *= scale.get(b["name"], 1.0)
    doc["benchmarks"].append(bench("test_added", 2e-3))
    return doc


def files(tmp_path, new_doc):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(OLD))
    new.write_text(json.dumps(new_doc))
    return str(old), str(new)


def test_slowdown_beyond_threshold_fails(tmp_path, capsys):
    old, new = files(tmp_path, new_run({"test_attention[B1-n16-cuda]": 1.20}))
    assert main(["compare", old, new, "--threshold", "5%"]) == 1
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if "test_attention[B1-n16-cuda]" in l)
    assert "+20.0%" in line and "SLOWER" in line
    assert "4000" in line and "3333" in line  # GB/s from bytes / median, old and new
    assert "only in old (1)" in out and "test_removed" in out
    assert "only in new (1)" in out and "test_added" in out
    kv = next(l for l in out.splitlines() if "test_kv_alloc" in l)
    assert kv.count(" - ") >= 1 and "ok" in kv  # no extra_info: no bandwidth, still compared


def test_noise_under_threshold_passes(tmp_path, capsys):
    noise = {"test_attention[B1-n16-cuda]": 1.03, "test_attention[B1-n1-cuda]": 0.97, "test_kv_alloc[B256]": 1.049}
    old, new = files(tmp_path, new_run(noise))
    assert main(["compare", old, new]) == 0  # default threshold 5%
    assert "0 slower than +5.0%" in capsys.readouterr().out
    assert main(["compare", old, new, "--threshold", "2"]) == 1  # "2" means 2%


def test_faster_is_reported_not_failed(tmp_path, capsys):
    old, new = files(tmp_path, new_run({"test_attention[B1-n1-cuda]": 0.5}))
    assert main(["compare", old, new]) == 0
    assert "faster" in capsys.readouterr().out


def test_different_devices_warn(tmp_path, capsys):
    doc = new_run({})
    doc["machine_info"]["spec_kernels"]["device"]["name"] = "NVIDIA RTX PRO 6000"
    old, new = files(tmp_path, doc)
    main(["compare", old, new])
    assert "WARNING: different devices" in capsys.readouterr().err


def test_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "benchmarks"}))
    old, _ = files(tmp_path, OLD)
    assert main(["compare", old, str(bad)]) == 2
    assert "not a pytest-benchmark JSON" in capsys.readouterr().err
    assert parse_threshold("5%") == pytest.approx(0.05) and parse_threshold("12.5") == pytest.approx(0.125)
    assert load(old).cases["benchmarks/test_tree_verify.py::test_attention[B1-n1-cuda]"].gbps == 3000.0


def test_cli_exit_status(tmp_path):
    old, new = files(tmp_path, new_run({"test_attention[B1-n16-cuda]": 1.20}))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "spec_kernels.bench", "compare", old, new, "--threshold", "5%"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "SLOWER" in proc.stdout


# --------------------------------------------------------------------------- provenance and noise
def with_spread(doc: dict, rel_iqr: float, rounds: int = 10) -> dict:
    """doc with every case measured over `rounds` rounds, IQR = rel_iqr x median."""
    doc = copy.deepcopy(doc)
    for b in doc["benchmarks"]:
        b["stats"].update(rounds=rounds, iqr=rel_iqr * b["stats"]["median"], stddev=0.0)
    return doc


def test_cpu_or_tiny_timings_warn_loudly_on_stderr(tmp_path, capsys):
    old, new = files(tmp_path, new_run({}))
    assert main(["compare", old, new]) == 0
    assert "WARNING" not in capsys.readouterr().err  # GPU runs of gpu-quick: nothing to say

    cpu = copy.deepcopy(OLD)
    cpu["machine_info"]["spec_kernels"].update(device={"type": "cpu", "name": "x86_64"}, preset="tiny")
    (tmp_path / "cpu.json").write_text(json.dumps(cpu))
    assert main(["compare", str(tmp_path / "cpu.json"), new]) == 0
    err = capsys.readouterr().err
    line = next(l for l in err.splitlines() if "cpu.json" in l)
    assert line.startswith("WARNING:") and "a CPU run (x86_64)" in line and "tiny preset" in line
    assert "new.json" not in err  # only the file that has the problem is named

    # a row's model preset alone (tiny-gqa) is enough, as in the decode-step benchmark
    rows = new_run({})
    rows["benchmarks"][0]["extra_info"]["preset"] = "tiny-gqa"
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    main(["compare", old, str(tmp_path / "rows.json")])
    err = capsys.readouterr().err
    assert "WARNING: " in err and "tiny preset (tiny-gqa)" in err and "CPU run" not in err


def test_change_within_the_runs_noise_is_not_a_regression(tmp_path, capsys):
    slow = {"test_attention[B1-n16-cuda]": 1.20}
    old = tmp_path / "old.json"
    old.write_text(json.dumps(with_spread(OLD, 0.30)))  # the old run scattered by 30%
    new = tmp_path / "new.json"
    new.write_text(json.dumps(with_spread(new_run(slow), 0.02)))
    assert main(["compare", str(old), str(new)]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if "test_attention[B1-n16-cuda]" in l)
    assert "+20.0%" in line and "30.0%" in line and line.endswith("| noise")
    assert "0 slower" in out and "1 beyond the threshold but within noise" in out

    old.write_text(json.dumps(with_spread(OLD, 0.02)))  # both runs steady: +20% is real
    assert main(["compare", str(old), str(new)]) == 1
    line = next(l for l in capsys.readouterr().out.splitlines() if "test_attention[B1-n16-cuda]" in l)
    assert "2.0%" in line and line.endswith("| SLOWER")


def test_same_build_beyond_noise_warns_that_the_measurements_are_noisy(tmp_path, capsys):
    old = tmp_path / "old.json"
    old.write_text(json.dumps(with_spread(OLD, 0.02)))
    same = with_spread(new_run({"test_attention[B1-n16-cuda]": 1.20, "test_kv_alloc[B256]": 0.99}), 0.02)
    new = tmp_path / "new.json"
    new.write_text(json.dumps(same))
    assert main(["compare", str(old), str(new)]) == 1  # still reported: the runs did differ
    err = capsys.readouterr().err
    line = next(l for l in err.splitlines() if "same build" in l)
    assert line.startswith("WARNING:") and "commit 0123456789ab" in line and "the measurements are noisy" in line
    assert "1 of 3 cases" in line and "up to 20.0%" in line and "--threshold 20%" in line

    # a different commit, or uncommitted changes: a code change may explain it, no noise warning
    for commit in ({"id": "fedcba9876543210fedcba9876543210fedcba98", "dirty": False},
                   {"id": OLD["commit_info"]["id"], "dirty": True}):
        new.write_text(json.dumps(dict(same, commit_info=commit)))
        assert main(["compare", str(old), str(new)]) == 1
        assert "same build" not in capsys.readouterr().err

    # the same build within noise: said on stdout, no warning
    new.write_text(json.dumps(with_spread(new_run({"test_kv_alloc[B256]": 1.01}), 0.02)))
    assert main(["compare", str(old), str(new)]) == 0
    captured = capsys.readouterr()
    assert "WARNING" not in captured.err and "every difference is within the runs' own noise" in captured.out


def test_zero_valued_counters_compare_equal_and_growth_from_zero_fails(tmp_path, capsys):
    """Interpreter counters (tools/ptx_harness/report.py) can be 0: 0 -> 0 is no change, 0 -> n is SLOWER."""
    doc = copy.deepcopy(OLD)
    doc["benchmarks"] = [bench("ptxsim::k[s]::bank_conflicts", 0), bench("ptxsim::k[s]::warp_instructions", 100)]
    old, same = files(tmp_path, doc)
    Path(old).write_text(json.dumps(doc))
    assert main(["compare", old, same, "--threshold", "5%"]) == 0
    grown = copy.deepcopy(doc)
    grown["benchmarks"][0]["stats"]["median"] = 3
    Path(same).write_text(json.dumps(grown))
    assert main(["compare", old, same, "--threshold", "5%"]) == 1
    line = next(l for l in capsys.readouterr().out.splitlines() if "bank_conflicts" in l and "SLOWER" in l)
    assert line
