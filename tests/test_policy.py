"""The speculation policy (spec_kernels.policy): synthetic costs with known answers, the input
formats, the worked example's files, SGLang's config format and the CLI."""
import copy
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from spec_kernels.policy import (
    AllReduceCost,
    CostModel,
    Curve,
    SpecConfig,
    crossovers,
    load_acceptance,
    load_costs,
    predict,
    predict_adaptive,
    sglang_adaptive_config,
)
from spec_kernels.policy.model import break_even_tau

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "spec_kernels" / "policy" / "examples"
# docs/design.md: concurrency -> (EAGLE-3 tok/s, baseline tok/s)
DESIGN_TABLE = {1: (77.5, 92.6), 2: (125.1, 159.7), 5: (183.2, 292.5), 10: (239.6, 457.2),
                30: (299.5, 711.0), 70: (337.7, 784.2), 100: (338.8, 761.6), 250: (340.9, 772.1)}


def model(baseline: dict, eagle: dict, **kw) -> CostModel:
    return CostModel(Curve(baseline), {n: [Curve(pts)] for n, pts in eagle.items()}, **kw)


def write(path: Path, doc) -> str:
    path.write_text(json.dumps(doc))
    return str(path)


# --------------------------------------------------------------------------- interpolation
def test_curve_is_linear_between_points_monotone_held_below_and_extended_above():
    c = Curve({2: 1.0, 4: 3.0, 8: 2.0})  # the dip at 8 is noise: raised to 3.0
    assert c.ts == [1.0, 3.0, 3.0]
    assert c(1) == 1.0 and c(2) == 1.0
    assert c(3) == pytest.approx(2.0)
    assert c(16) == pytest.approx(3.0)  # last segment is flat after the fix
    assert Curve({1: 1.0, 3: 2.0})(5) == pytest.approx(3.0)  # continues the last slope
    assert Curve({4: 0.5})(100) == 0.5
    with pytest.raises(ValueError):
        Curve({1: 0.0})


# --------------------------------------------------------------------------- known answers
def test_constant_step_time_makes_speculation_always_win():
    costs = model({1: 0.01, 1000: 0.01}, {4: {1: 0.01, 1000: 0.01}})
    chain = SpecConfig(4, 2.0)
    for B in (1, 7, 64, 999):
        p = predict(costs, [chain], B)
        assert p.best == chain.name and p.eagle[chain.name] == pytest.approx(2 * p.baseline)
    assert crossovers(costs, [chain], 300) == {chain.name: [(1, 300, True)]}
    assert sglang_adaptive_config(costs, [chain], 300) == {"1": {"candidate_steps": [3]}}


def test_cost_linear_in_tokens_loses_above_the_computed_batch_size():
    # step = a + c * tokens, tokens = B (baseline) or B * n (EAGLE). EAGLE is ahead iff
    # B * tau / (a + c B n) > B / (a + c B)  <=>  B < a (tau - 1) / (c (n - tau)).
    a, c, n, tau = 0.010, 0.0001, 4, 2.4
    b_star = a * (tau - 1) / (c * (n - tau))  # = 87.5
    assert b_star == pytest.approx(87.5)
    costs = model({1: a + c, 300: a + c * 300}, {n: {1: a + c * n, 300: a + c * 300 * n}})
    chain = SpecConfig(n, tau)
    assert crossovers(costs, [chain], 200) == {chain.name: [(1, 87, True), (88, 200, False)]}
    assert sglang_adaptive_config(costs, [chain], 200) == {"1": {"candidate_steps": [3]},
                                                           "88": {"candidate_steps": [0]}}
    # break-even tau = one EAGLE step in decode steps; at B* it equals tau
    assert break_even_tau(costs, chain, 1) == pytest.approx((a + c * n) / (a + c))
    assert (a + c * b_star * n) / (a + c * b_star) == pytest.approx(tau)


def test_policy_never_predicts_slower_than_the_better_of_baseline_and_eagle():
    rng = random.Random(8)
    for _ in range(50):
        bs = sorted(rng.sample(range(1, 300), 4))
        sizes = sorted(rng.sample([2, 3, 4, 8, 16, 32], 3))
        base = {b: rng.uniform(0.005, 0.5) for b in bs}
        eagle = {n: {b: rng.uniform(0.005, 1.0) for b in bs} for n in sizes}
        costs = model(base, eagle)
        configs = [SpecConfig(n, rng.uniform(1, n), topk=rng.choice([1, None]), label=f"c{n}") for n in sizes]
        chains = [c for c in configs if c.topk == 1]
        slots = {int(k): v["candidate_steps"] for k, v in sglang_adaptive_config(costs, configs, 300).items()}
        for B in range(1, 301, 7):
            p = predict(costs, configs, B)
            assert p.best_tok_s == max([p.baseline, *p.eagle.values()])
            # what SGLang would run at B (the slot with the largest key <= B) is the best of what it can run
            steps = slots[max(k for k in slots if k <= B)][0]
            chosen = p.baseline if steps == 0 else p.eagle[next(c.name for c in chains if c.n - 1 == steps)]
            assert chosen == max([p.baseline] + [p.eagle[c.name] for c in chains])


def test_drafting_off_is_judged_by_its_measured_cost():
    # plain 10 ms/step, the EAGLE worker with drafting off 15 ms, a chain of 4 (tau 2) 25 ms:
    # the chain beats drafting off (2 / 25 > 1 / 15) but not the plain server (2 / 25 < 1 / 10).
    costs = model({1: 0.010, 64: 0.010}, {4: {1: 0.025, 64: 0.025}}, eagle_off=Curve({1: 0.015, 64: 0.015}))
    chain = SpecConfig(4, 2.0)
    p = predict_adaptive(costs, [chain], 8)
    assert p.best == chain.name and p.off_measured
    assert p.best_tok_s == pytest.approx(8 * 2 / 0.025) and p.off == pytest.approx(8 / 0.015)
    assert p.plain == pytest.approx(8 / 0.010) and p.plain > p.best_tok_s  # a plain server is faster
    assert predict(costs, [chain], 8).best == "baseline"  # the plain-server comparison is unchanged
    assert sglang_adaptive_config(costs, [chain], 64) == {"1": {"candidate_steps": [3]}}
    # without the measurement, drafting off is taken to cost a plain step: the config turns it off
    plain_off = model({1: 0.010, 64: 0.010}, {4: {1: 0.025, 64: 0.025}})
    assert not predict_adaptive(plain_off, [chain], 8).off_measured
    assert sglang_adaptive_config(plain_off, [chain], 64) == {"1": {"candidate_steps": [0]}}


def test_eagle_off_rows_load_from_a_cost_file(tmp_path):
    doc = {"description": "t", "steps": [
        {"mode": "baseline", "B": 1, "n": 1, "step_s": 0.01}, {"mode": "baseline", "B": 4, "n": 1, "step_s": 0.02},
        {"mode": "eagle", "B": 1, "n": 4, "step_s": 0.03}, {"mode": "eagle_off", "B": 1, "n": 1, "step_s": 0.012},
        {"mode": "eagle_off", "B": 4, "n": 1, "step_s": 0.03}]}
    costs = load_costs(write(tmp_path / "c.json", doc))
    assert costs.off_step_time(1) == pytest.approx(0.012) and costs.off_step_time(4) == pytest.approx(0.03)
    assert costs.step_time(4) == pytest.approx(0.02)  # the plain server's curve is its own
    doc["steps"].append({"mode": "eagle_off", "B": 2, "n": 4, "step_s": 0.02})
    with pytest.raises(ValueError, match="eagle_off are n = 1"):
        load_costs(write(tmp_path / "bad.json", doc))


def test_interpolate_n_is_linear_between_decode_and_measured_sizes():
    costs = model({1: 1.0, 10: 2.0}, {16: {1: 2.5, 10: 5.0}}, interpolate_n=True)
    assert costs.step_time(1, 6) == pytest.approx(1.0 + (2.5 - 1.0) * 5 / 15)
    assert costs.step_time(10, 16) == 5.0
    with pytest.raises(ValueError, match="no extrapolation"):
        costs.step_time(1, 32)
    with pytest.raises(ValueError, match="--interpolate-n"):
        model({1: 1.0}, {16: {1: 2.5}}).step_time(1, 6)


def test_overhead_is_added_to_both_modes():
    costs = model({1: 0.01}, {4: {1: 0.02}}, overhead_s=0.01)
    assert costs.step_time(1) == pytest.approx(0.02) and costs.step_time(1, 4) == pytest.approx(0.03)


def test_draft_fixed_cost_moves_only_the_interpolated_sizes():
    costs = model({1: 1.0}, {16: {1: 2.5}}, interpolate_n=True, draft_fixed_s=0.3)
    assert costs.step_time(1, 16) == 2.5  # measured: already contains its drafting
    assert costs.step_time(1, 6) == pytest.approx(1.3 + (2.5 - 1.3) * 5 / 15)


# --------------------------------------------------------------------------- input formats
def bench_result(mode, B, n, median, **extra):
    return {"name": f"test_step[{mode}-B{B}-n{n}]", "fullname": f"benchmarks/test_decode_step.py::test_step[{mode}-B{B}-n{n}]",
            "stats": {"median": median},
            "extra_info": dict(kind="decode_step", mode=mode, B=B, n=n, preset="tiny", layers=10, **extra)}


def test_decode_step_benchmark_json_is_read_scaled_by_layers_with_draft_added(tmp_path):
    doc = {"machine_info": {"spec_kernels": {"device": {"name": "NVIDIA H200"}}},
           "benchmarks": [
               bench_result("baseline", 1, 1, 1e-3, impl="cuda"),
               bench_result("baseline", 8, 1, 2e-3, impl="cuda"),
               bench_result("eagle", 1, 4, 3e-3, impl="cuda"),
               bench_result("eagle", 8, 4, 4e-3, impl="cuda"),
               bench_result("eagle", 1, 4, 9e-3, impl="triton"),  # left out by --select impl=cuda
               bench_result("draft", 1, 4, 1e-4, impl="cuda"),
               {"name": "other", "fullname": "x::other", "stats": {"median": 1.0}, "extra_info": {"kind": "attention"}},
               {"name": "no-extra-info", "fullname": "x::y", "stats": {"median": 1.0}},
           ]}
    path = write(tmp_path / "bench.json", doc)
    costs = load_costs(path, select={"impl": "cuda"})
    assert "NVIDIA H200" in costs.description and "tiny" in costs.description
    assert costs.step_time(1) == pytest.approx(0.010)
    assert costs.step_time(8) == pytest.approx(0.020)
    assert costs.step_time(1, 4) == pytest.approx(0.030 + 0.001)  # verify + draft, x 10 layers
    with pytest.raises(ValueError, match="differ in impl"):
        load_costs(path)


def test_cpu_or_tiny_costs_warn_loudly_and_hand_written_costs_do_not(tmp_path, capsys):
    from spec_kernels.policy.__main__ import main

    acceptance = write(tmp_path / "acc.json", {"configs": [{"n": 4, "tau": 2.0}]})
    rows = [bench_result("baseline", 1, 1, 1e-3), bench_result("eagle", 1, 4, 2e-3)]
    gpu = {"machine_info": {"spec_kernels": {"device": {"type": "cuda", "name": "NVIDIA H200"}, "preset": "gpu"}},
           "benchmarks": copy.deepcopy(rows)}
    for r in gpu["benchmarks"]:
        r["extra_info"]["preset"] = "kimi-k2.5-tp8"
    cpu = {"machine_info": {"spec_kernels": {"device": {"type": "cpu", "name": "x86_64"}, "preset": "tiny"}},
           "benchmarks": rows}
    for doc, expect in ((gpu, None), (cpu, "a CPU run (x86_64) and the tiny preset"),
                        (json.loads((EXAMPLES / "design_table_costs.json").read_text()), None)):
        path = write(tmp_path / "costs.json", doc)
        out = str(tmp_path / "out")
        assert main(["--costs", path, "--acceptance", acceptance, "--interpolate-n", "--out-dir", out]) == 0
        err = capsys.readouterr().err
        if expect is None:
            assert "WARNING" not in err and not load_costs(path).caveats
        else:
            line = next(l for l in err.splitlines() if "WARNING" in l)
            assert line.startswith(f"WARNING: {path}: timings from {expect}") and "GPU" in line
    # a GPU run of a tiny model preset is still flagged, from the rows that are used
    gpu["benchmarks"].append(bench_result("eagle", 1, 8, 3e-3))  # preset="tiny-gqa" below
    gpu["benchmarks"][-1]["extra_info"]["preset"] = "tiny-gqa"
    path = write(tmp_path / "costs.json", gpu)
    assert load_costs(path).caveats == ["the tiny preset (tiny-gqa)"]
    assert load_costs(path, select={"preset": "kimi-k2.5-tp8"}).caveats == []


def test_allreduce_cost_is_added_per_layer_and_can_flip_the_choice(tmp_path):
    # One layer timed, 10 layers; the verify step's allreduce message is n = 4 times decode's.
    doc = {"benchmarks": [bench_result("baseline", 8, 1, 1e-3, allreduce_bytes=8 * 1024),
                          bench_result("eagle", 8, 4, 1.5e-3, allreduce_bytes=32 * 1024)]}
    path = write(tmp_path / "bench.json", doc)
    plain = load_costs(path)
    ar = AllReduceCost(latency_s=10e-6, bytes_per_s=1e8)  # 10 us + bytes / 100 MB/s
    costs = load_costs(path, allreduce=ar)
    # 10 layers x 2 allreduces x (10 us + bytes / 1e8)
    assert costs.step_time(8) == pytest.approx(0.010 + 20 * (10e-6 + 8 * 1024 / 1e8))
    assert costs.step_time(8, 4) == pytest.approx(0.015 + 20 * (10e-6 + 32 * 1024 / 1e8))
    chain = SpecConfig(n=4, tau=1.6, topk=1, label="chain-4")
    assert predict(plain, [chain], 8).best == "chain-4"  # 1.6 tokens for 1.5x the time: wins
    assert predict(costs, [chain], 8).best == "baseline"  # the 4x larger messages cost more than it gains


def test_cost_file_and_acceptance_validation(tmp_path):
    costs = write(tmp_path / "c.json", {"steps": [{"mode": "baseline", "B": 1, "n": 1, "step_s": 0.01},
                                                  {"mode": "eagle", "B": 1, "n": 4, "step_s": 0.02, "note": "kept"}]})
    assert load_costs(costs).step_time(1, 4) == 0.02
    with pytest.raises(ValueError, match="no baseline"):
        load_costs(write(tmp_path / "e.json", {"steps": [{"mode": "eagle", "B": 1, "n": 4, "step_s": 0.02}]}))
    with pytest.raises(ValueError, match="neither"):
        load_costs(write(tmp_path / "x.json", {"rows": []}))
    with pytest.raises(ValueError, match="tau"):
        SpecConfig(4, 4.5)
    with pytest.raises(ValueError, match="n = 1 is baseline"):
        SpecConfig(1, 1.0)
    configs, _ = load_acceptance(write(tmp_path / "a.json", {"configs": [{"n": 4, "tau": 2.0},
                                                                         {"n": 16, "tau": 3.0, "topk": None}]}))
    assert [(c.name, c.sglang_steps) for c in configs] == [("n=4", 3), ("n=16", None)]


# --------------------------------------------------------------------------- the worked example
def test_design_table_costs_reproduce_the_deployment_table():
    costs = load_costs(str(EXAMPLES / "design_table_costs.json"))
    configs, _ = load_acceptance(str(EXAMPLES / "design_acceptance.json"))
    (tree,) = configs
    for B, (eagle_tok_s, base_tok_s) in DESIGN_TABLE.items():
        p = predict(costs, configs, B)
        assert p.baseline == pytest.approx(base_tok_s, abs=0.05)
        assert p.eagle[tree.name] == pytest.approx(eagle_tok_s, abs=0.05)
        assert p.best == "baseline"  # baseline ahead at every concurrency
    assert all(335 <= predict(costs, configs, B).eagle[tree.name] <= 345 for B in (70, 100, 150, 250))
    assert crossovers(costs, configs, 250) == {tree.name: [(1, 250, False)]}
    # the tree cannot run in SGLang's adaptive mode; baseline everywhere = speculation off
    assert sglang_adaptive_config(costs, configs, 250) == {"1": {"candidate_steps": [0]}}


def test_design_table_costs_follow_their_stated_derivation():
    doc = json.loads((EXAMPLES / "design_table_costs.json").read_text())
    for row in doc["steps"]:
        tau = row.get("tau_assumed", 1.0)
        assert row["step_s"] == pytest.approx(row["B"] * tau / row["tok_s"], abs=1e-7)
        assert row["tok_s"] == DESIGN_TABLE[row["B"]][0 if row["mode"] == "eagle" else 1]


def test_sglang_loads_and_routes_the_written_config(tmp_path):
    try:
        from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams
    except Exception as exc:  # noqa: BLE001  absent or not importable here
        pytest.skip(f"SGLang's adaptive_spec_params is not importable: {exc}")
    a, c, n, tau = 0.010, 0.0001, 4, 2.4  # EAGLE ahead below B = 87.5 (see above)
    costs = model({1: a + c, 300: a + c * 300}, {n: {1: a + c * n, 300: a + c * 300 * n}})
    path = write(tmp_path / "adaptive.json", sglang_adaptive_config(costs, [SpecConfig(n, tau)], 200))
    params = AdaptiveSpeculativeParams(initial_steps=3, cfg_path=path)
    assert [params.get_steps_for_batch(B) for B in (1, 87, 88, 500)] == [3, 3, 0, 0]


# --------------------------------------------------------------------------- the CLI
def test_cli_writes_the_config_and_the_plot(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "spec_kernels.policy",
         "--costs", str(EXAMPLES / "design_table_costs.json"),
         "--acceptance", str(EXAMPLES / "eagle3_illustrative_acceptance.json"),
         "--interpolate-n", "--concurrency", "1,10,250", "--out-dir", str(out)],
        capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "crossover" in proc.stdout and "break-even tau" in proc.stdout
    config = json.loads((out / "sglang_adaptive_config.json").read_text())
    assert config["1"]["candidate_steps"] and all(k.isdigit() for k in config)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot skipped" in proc.stdout
    else:
        assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_a_tree_size_without_costs(tmp_path, capsys):
    from spec_kernels.policy.__main__ import main

    rc = main(["--costs", str(EXAMPLES / "design_table_costs.json"),
               "--acceptance", str(EXAMPLES / "eagle3_illustrative_acceptance.json"), "--out-dir", str(tmp_path)])
    assert rc == 2 and "--interpolate-n" in capsys.readouterr().err
