"""spec_kernels.serve_check without a server: argument checks, output comparison, and the JSON
it writes being readable by spec_kernels.policy (costs and acceptance from one file)."""
from __future__ import annotations

import json

import pytest

from spec_kernels import serve_check as sc
from spec_kernels.policy.model import load_acceptance, load_costs, predict


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
    tree = sc.parse_args(["--model", "m", "--draft", "d", "--topk", "4"])
    assert tree.draft_tokens == 16


@pytest.mark.parametrize("argv", [
    ["--topk", "1", "--steps", "3", "--draft-tokens", "5"],  # a chain of 3 steps verifies at most 4
    ["--concurrency", "0,2"],
    ["--concurrency", "x"],
    ["--rounds", "0"],
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
