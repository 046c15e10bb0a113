"""spec_kernels.serve_check without a server: argument checks, output comparison, and the JSON
it writes being readable by spec_kernels.policy (costs and acceptance from one file)."""
from __future__ import annotations

import json

import pytest

from spec_kernels import serve_check as sc
from spec_kernels.policy.model import load_acceptance, load_costs, predict, predict_adaptive


def test_parse_args_defaults_and_shared_server_args():
    args = sc.parse_args(["--model", "m", "--draft", "d", "--", "--tp", "8", "--dtype", "bfloat16"])
    assert args.concurrency == [1, 2, 5, 10, 30, 70, 100, 250]
    assert (args.steps, args.topk, args.draft_tokens) == (3, 1, 4)  # a chain verifies steps + 1 tokens
    assert args.shared == ["--tp", "8", "--dtype", "bfloat16"]
    cmds = sc.server_args(args)
    assert cmds["baseline"] == ["--model-path", "m", "--tp", "8", "--dtype", "bfloat16"]
    eagle = cmds["eagle"]
    assert eagle[eagle.index("--attention-backend") + 1] == "specfused"
    assert eagle[eagle.index("--speculative-num-draft-tokens") + 1] == "4"
    tree = sc.parse_args(["--model", "m", "--draft", "d", "--topk", "4", "--no-adaptive"])
    assert tree.draft_tokens == 16
    assert args.output_len == 512 and args.warmup == 250  # one round at the largest concurrency
    adaptive = sc.adaptive_server_args(args, "cfg.json", 0)
    assert adaptive[adaptive.index("--speculative-adaptive-config") + 1] == "cfg.json"
    assert adaptive[adaptive.index("--speculative-num-steps") + 1] == "0"
    assert adaptive[adaptive.index("--speculative-num-draft-tokens") + 1] == "1"
    assert adaptive[adaptive.index("--attention-backend") + 1] == "specfused"
    assert sc.adaptive_env(args) is None
    skip = sc.parse_args(["--model", "m", "--draft", "d", "--skip-off-draft-extend"])
    assert sc.adaptive_env(skip)["SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND"] == "1"


@pytest.mark.parametrize("argv", [
    ["--topk", "1", "--steps", "3", "--draft-tokens", "5"],  # a chain of 3 steps verifies at most 4
    ["--concurrency", "0,2"],
    ["--concurrency", "x"],
    ["--rounds", "0"],
    ["--topk", "4"],  # adaptive speculation runs chains only
    ["--steps", "3", "--draft-tokens", "3"],  # adaptive chains verify steps + 1 tokens
    ["--no-adaptive", "--measure-off"],
    ["--no-adaptive", "--skip-off-draft-extend"],
    ["--warmup", "-1"],
])
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit):
        sc.parse_args(["--model", "m", "--draft", "d", *argv])
    assert "error" in capsys.readouterr().err


def test_compare_outputs_reports_first_difference():
    rows = sc.compare_outputs([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 9, 6], [7, 8, 9]])
    assert rows == [{"equal": True, "first_difference": None}, {"equal": False, "first_difference": 1},
                    {"equal": False, "first_difference": 2}]


def test_load_prompts(tmp_path):
    assert sc.load_prompts(None) == list(sc.DEFAULT_PROMPTS)
    (tmp_path / "p.json").write_text(json.dumps(["a", "b"]))
    assert sc.load_prompts(str(tmp_path / "p.json")) == ["a", "b"]
    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    assert sc.load_prompts(str(tmp_path / "p.txt")) == ["first prompt", "second prompt"]
    (tmp_path / "bad.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError):
        sc.load_prompts(str(tmp_path / "bad.json"))


def test_cost_rows_feed_the_policy_model(tmp_path):
    # closed loop: baseline 100 tok/s at B=1 and 150 at B=2; EAGLE 180 and 200 tok/s with tau 2.5
    levels = {"baseline": [sc.Level(1, 4, 2.0, 200, [0.5] * 4), sc.Level(2, 8, 4.0, 600, [1.0] * 8)],
              "eagle": [sc.Level(1, 4, 2.0, 360, [0.3] * 4, verify_steps=144),
                        sc.Level(2, 8, 4.0, 800, [0.6] * 8, verify_steps=320)]}
    rows = sc.cost_rows(levels, n=4)
    path = tmp_path / "serve_check.json"
    path.write_text(json.dumps({"description": "t", "steps": rows,
                                "configs": [{"n": 4, "tau": 2.5, "topk": 1, "label": "eagle3-chain-4"}]}))
    costs = load_costs(str(path))
    (config,), _ = load_acceptance(str(path))
    for lv_b, lv_e in zip(levels["baseline"], levels["eagle"]):
        p = predict(costs, [config], lv_b.concurrency)
        # the model gives back the measured throughput at every measured concurrency
        assert p.baseline == pytest.approx(lv_b.tok_s)
        assert p.eagle[config.name] == pytest.approx(lv_e.tok_s)
    assert levels["eagle"][0].as_dict()["tau"] == pytest.approx(2.5)


def _levels():
    # baseline 100 / 150 tok/s at C = 1 / 2; EAGLE 180 / 140 (tau 2.5); the EAGLE worker with
    # drafting off 80 / 120; the adaptive server 175 / 118
    return {"baseline": [sc.Level(1, 4, 2.0, 200, [0.5] * 4), sc.Level(2, 8, 4.0, 600, [1.0] * 8)],
            "eagle": [sc.Level(1, 4, 2.0, 360, [0.3] * 4, verify_steps=144),
                      sc.Level(2, 8, 4.0, 560, [0.6] * 8, verify_steps=224)],
            "eagle_off": [sc.Level(1, 4, 2.0, 160, [0.6] * 4), sc.Level(2, 8, 4.0, 480, [1.2] * 8)]}


def test_policy_config_judges_drafting_off_by_the_eagle_off_run(tmp_path):
    levels = _levels()
    path = tmp_path / "serve_check.json"
    path.write_text(json.dumps({"description": "t", "steps": sc.cost_rows(levels, n=4),
                                "configs": [{"n": 4, "tau": 2.5, "topk": 1, "label": "eagle3-chain-4"}]}))
    config, predictions = sc.policy_config(str(path), 2, [1, 2])
    # C = 1: the chain (180) beats drafting off (80) and the plain server (100); C = 2: the chain
    # (140) beats drafting off (120), so the adaptive server keeps drafting, but a plain server (150)
    # is faster than either
    assert config == {"1": {"candidate_steps": [3]}}
    assert predictions[1] == {"policy_steps": 3, "predicted_tok_s": pytest.approx(180.0),
                              "predicted_plain_tok_s": pytest.approx(100.0), "faster_server": "adaptive"}
    assert predictions[2]["policy_steps"] == 3 and predictions[2]["faster_server"] == "plain"
    costs = load_costs(str(path))
    (config_,), _ = load_acceptance(str(path))
    assert predict_adaptive(costs, [config_], 2).off == pytest.approx(120.0)

    levels["adaptive"] = [sc.Level(1, 4, 2.0, 350, [0.3] * 4, verify_steps=140),
                          sc.Level(2, 8, 4.0, 472, [0.6] * 8, verify_steps=190)]
    rows = sc.adaptive_rows(levels, predictions)
    assert [r["prediction_error"] for r in rows] == [pytest.approx(180 / 175 - 1), pytest.approx(140 / 118 - 1)]
    assert [r["adaptive_over_best_static"] for r in rows] == [pytest.approx(175 / 180), pytest.approx(118 / 150)]
    assert [r["eagle_off_over_baseline"] for r in rows] == [pytest.approx(0.8), pytest.approx(0.8)]
    table = sc.format_table(levels, rows)
    assert len(table) == 3 and "pred err" in table[0] and "off/base" in table[0]
    assert table[1].endswith("adaptive") and table[2].endswith("plain")


def test_policy_config_without_eagle_off_compares_with_the_plain_server(tmp_path):
    levels = _levels()
    del levels["eagle_off"]
    path = tmp_path / "serve_check.json"
    path.write_text(json.dumps({"description": "t", "steps": sc.cost_rows(levels, n=4),
                                "configs": [{"n": 4, "tau": 2.5, "topk": 1, "label": "eagle3-chain-4"}]}))
    config, predictions = sc.policy_config(str(path), 2, [1, 2])
    assert config == {"1": {"candidate_steps": [3]}, "2": {"candidate_steps": [0]}}
    assert predictions[2]["policy_steps"] == 0 and predictions[2]["predicted_tok_s"] == pytest.approx(150.0)


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    levels = _levels()
    sc.write_plot(str(tmp_path / "p.png"), levels, {1: 180.0, 2: 150.0}, "t")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
