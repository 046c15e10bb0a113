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
    "machine_info": {"spec_kernels": {"device": {"name": "NVIDIA H200"}, "preset": "gpu-quick"}},
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
    assert "warning: different devices" in capsys.readouterr().out


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
