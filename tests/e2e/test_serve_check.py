"""`python -m spec_kernels.serve_check` once, at tiny scale, with the CPU servers of conftest.py.

The tool starts its two servers itself, one after the other:

* baseline: no speculation, ``--attention-backend specfused`` (decode on
  ``spec_kernels.decode_attention``), page size 16;
* EAGLE-3 chain: topk 1, 3 steps, 4 draft tokens, specfused, page size 16 (verify on
  ``spec_kernels.tree_verify_attention`` through paged KV);

runs its greedy check on both (the first prompt alone, then all three in one request;
CHECK_LEN tokens, temperature 0) and two load levels (concurrency 1 and 2), and writes the JSON.
Asserted here: every greedy output of both servers equals transformers' own greedy generation,
the acceptance length exceeds 1.3, the levels and cost rows are there, and
``python -m spec_kernels.policy`` accepts the file as costs and acceptance.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from e2e_support import STARTUP_TIMEOUT_S, TIMINGS, base_server_args, server_env

import tiny_models

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("e2e-servers")]  # one server at a time

CHECK_LEN = 32


def test_serve_check_tiny(models, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(tiny_models.PROMPTS))
    out = tmp_path / "serve_check.json"
    # The shared server arguments, minus --model-path (serve_check passes --model itself).
    shared = base_server_args(models["target"])[2:]
    cmd = [sys.executable, "-m", "spec_kernels.serve_check", "--model", models["target"], "--draft", models["draft"],
           "--steps", "3", "--topk", "1", "--draft-tokens", "4", "--baseline-attention-backend", "specfused",
           "--concurrency", "1,2", "--rounds", "1", "--output-len", "8", "--check-len", str(CHECK_LEN),
           "--prompts", str(prompts), "--out", str(out), "--startup-timeout", str(STARTUP_TIMEOUT_S),
           "--request-timeout", "300", "--", *shared, "--page-size", "16"]
    proc = subprocess.run(cmd, env=server_env(), capture_output=True, text=True, timeout=1200)
    logs = "".join(f"\n--- {p.name} (tail) ---\n" + "".join(p.read_text(errors="replace").splitlines(True)[-40:])
                   for p in sorted(tmp_path.glob("serve_check.*.log")))
    assert proc.returncode == 0, f"serve_check exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}{logs}"

    result = json.loads(out.read_text())
    for name, srv in result["servers"].items():
        TIMINGS[f"serve_check {name}"] = (srv["startup_s"], srv["cpu_s"] or 0.0)
    check = result["greedy_check"]
    assert check["all_equal"], check["per_prompt"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["target"])
    ids = [tok.encode(p) for p in tiny_models.PROMPTS]
    want = tiny_models.hf_greedy(models["target"], ids, CHECK_LEN)
    assert check["baseline_output_ids"] == want, "baseline (no speculation), batch 3, differs from transformers"
    assert check["eagle_output_ids"] == want, "EAGLE-3 chain, batch 3, differs from transformers"
    assert check["baseline_batch1_output_ids"] == want[0], "baseline, batch 1, differs from transformers"
    assert check["eagle_batch1_output_ids"] == want[0], "EAGLE-3 chain, batch 1, differs from transformers"
    assert check["eagle_tau"] > 1.3

    assert [lv["concurrency"] for lv in result["levels"]["baseline"]] == [1, 2]
    assert [lv["concurrency"] for lv in result["levels"]["eagle"]] == [1, 2]
    for lv in result["levels"]["eagle"]:
        assert lv["output_tokens"] == 8 * lv["requests"] and lv["tau"] >= 1.0
    (config,) = result["configs"]
    assert config["n"] == 4 and config["topk"] == 1 and 1.0 < config["tau"] <= 4
    assert {(r["mode"], r["B"]) for r in result["steps"]} == {("baseline", 1), ("baseline", 2), ("eagle", 1),
                                                               ("eagle", 2)}

    from spec_kernels.policy.__main__ import main as policy_main

    assert policy_main(["--costs", str(out), "--acceptance", str(out), "--out-dir", str(tmp_path / "policy")]) == 0
    assert os.path.exists(tmp_path / "policy" / "sglang_adaptive_config.json")
