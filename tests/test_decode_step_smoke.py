"""Smoke run of the decode-step benchmark (benchmarks/test_decode_step.py) on the tiny preset,
its JSON fed to the speculation policy: the benchmark and the policy fit together.

It runs pytest in a subprocess, as a user would (the benchmarks have their own conftest), and
takes ~50 s on 2 idle cores (benchmark ~30 s, then the policy twice). The times mean nothing;
what is checked is the contract: every case and component is there, carries the keys the
policy selects on, the summary and plots are written, and the policy turns the file into
SGLang's adaptive config.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("tiny-gqa", "tiny-mla")
BATCHES, DRAFTS = (1, 3), (4, 16)  # decode_step_models.GRIDS["tiny"]


def _run(args, tmp_path, **env):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           **env}
    for key in ("SPEC_KERNELS_DECODE_MODELS", "SPEC_KERNELS_DECODE_L"):  # the tiny grid, unchanged
        env.pop(key, None)
    for key in [k for k in env if k.startswith("PYTEST_XDIST")]:  # under xdist, pytest-benchmark would
        env.pop(key)                                                # disable the child's benchmarks
    proc = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{args[:3]} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_decode_step_benchmark_feeds_the_policy(tmp_path):
    # The JSON goes to a folder that does not exist yet, given relative to the cwd, as a user types
    # `--benchmark-json=OUT/x.json`: the folder is created and the plots land next to the JSON,
    # not in the cwd.
    out_dir = tmp_path / "out" / "run1"
    result = out_dir / "decode_step.json"
    out = _run(["-m", "pytest", str(ROOT / "benchmarks" / "test_decode_step.py"), "--benchmark-only",
                f"--benchmark-json={result.relative_to(tmp_path)}", "-q", "-p", "no:cacheprovider",
                f"--rootdir={ROOT}"],
               tmp_path, SPEC_KERNELS_BENCH_PRESET="tiny")

    data = json.loads(result.read_text())
    machine = data["machine_info"]["spec_kernels"]
    assert machine["preset"] == "tiny" and machine["device"]["type"] in ("cpu", "cuda")
    assert machine["torch"] and machine["triton"]
    rows = [b["extra_info"] for b in data["benchmarks"]]
    steps = {(r["preset"], r["mode"], r["B"], r["n"]): r for r in rows if r["kind"] == "decode_step"}
    expected = {(m, "baseline", B, 1) for m in MODELS for B in BATCHES}
    expected |= {(m, "eagle", B, n) for m in MODELS for B in BATCHES for n in DRAFTS}
    assert set(steps) == expected
    for r in steps.values():
        assert r["layers"] == 2 and r["L"] == 64 and r["impl"] and r["tokens"] == r["B"] * r["n"]
    assert steps[("tiny-mla", "eagle", 1, 4)]["attention"] in ("mla", "mla-proxy")
    parts = {(r["preset"], r["B"], r["n"], r["component"]) for r in rows if r["kind"] == "decode_component"}
    for m, _, B, n in expected:
        assert {(m, B, n, c) for c in ("attention", "gemm", "norm", "kv")} <= parts

    # the end-of-session summary and the plots next to the JSON
    assert "decode step: tiny GQA model (CPU) (tiny-gqa)" in out and "x base" in out
    assert "where a layer's time goes" in out
    for m in MODELS:
        assert (out_dir / f"decode_step-{m}-L64.png").stat().st_size > 0
    assert not list(tmp_path.glob("*.png")), "plots written into the cwd instead of next to the JSON"

    acceptance = tmp_path / "acceptance.json"
    acceptance.write_text(json.dumps({"description": "smoke: chains", "configs": [
        {"n": 4, "tau": 2.2, "topk": 1}, {"n": 16, "tau": 3.0, "topk": 1}]}))
    for m in MODELS:
        policy_out = tmp_path / f"policy-{m}"
        printed = _run(["-m", "spec_kernels.policy", "--costs", str(result), "--acceptance", str(acceptance),
                        "--select", f"preset={m}", "--out-dir", str(policy_out)], tmp_path)
        assert "predicted output tok/s" in printed
        config = json.loads((policy_out / "sglang_adaptive_config.json").read_text())
        assert "1" in config and all(v["candidate_steps"][0] in (0, 3, 15) for v in config.values())
        assert (policy_out / "throughput.png").stat().st_size > 0
