"""A real SGLang server with EAGLE-3 trees and ``--attention-backend specfused``, on the CPU.

One ``python -m sglang.launch_server`` (see conftest.py for the CPU set-up): EAGLE-3, topk 4,
3 steps, 8 draft tokens, page size 1 (SGLang refuses trees on larger pages for backends it does
not know), verify on ``spec_kernels.tree_verify_attention``. Greedy outputs (temperature 0, EOS
ignored, MAX_NEW_TOKENS tokens) must equal transformers' own greedy generation of the same
checkpoint, one request alone (batch 1) and all three prompts in one request (batch 3).

The draft shares the target's embedding and lm_head and is built to agree with it often
(tiny_models.py), so the acceptance length read from each response's ``meta_info`` must exceed
MIN_ACCEPT_LENGTH tokens per verify step. The negative control switches the server's verify
mask to "every earlier draft visible" (siblings included) through a test-only plugin
(verify_sabotage/): its outputs must then differ from transformers', or these checks could not
see a wrong mask.

The MLA path (``mla_tree_verify_attention`` on SGLang's MLATokenToKVPool) gets the same batch-3
check on a DeepSeek-V2 style target (``mla-tree``: latent 128 + rope 32, EAGLE-3 topk 2, 3 steps,
6 draft tokens, page size 1).

Plain decoding on specfused and EAGLE-3 chains (topk 1) on page size 16 are checked the same
way (batch 1 and 3, against transformers) by test_serve_check.py, whose two servers are exactly
those configurations: each server start costs about a minute of CPU, so no configuration is
started twice.
"""
from __future__ import annotations

import os
import time

import pytest

from spec_kernels.serve_check import ServerError
from e2e_support import (
    MAX_NEW_TOKENS,
    REQUEST_TIMEOUT_S,
    ServerPool,
    base_server_args,
    server_env,
    write_sabotage_dist_info,
)

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("e2e-servers")]  # one server at a time

HERE = os.path.dirname(os.path.abspath(__file__))
MIN_ACCEPT_LENGTH = 1.3


def eagle_args(draft: str, topk: int, steps: int, draft_tokens: int, page_size: int) -> list[str]:
    return ["--attention-backend", "specfused", "--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", draft, "--speculative-num-steps", str(steps),
            "--speculative-eagle-topk", str(topk), "--speculative-num-draft-tokens", str(draft_tokens),
            "--page-size", str(page_size)]


@pytest.fixture(scope="module")
def servers(models, mla_models, tmp_path_factory):
    work = str(tmp_path_factory.mktemp("e2e_servers"))
    plugin_dir = os.path.join(work, "plugin_path")
    write_sabotage_dist_info(plugin_dir)
    flag = os.path.join(work, "sabotage.flag")
    base = base_server_args(models["target"])
    configs = {
        "tree": (base + eagle_args(models["draft"], topk=4, steps=3, draft_tokens=8, page_size=1),
                 server_env([os.path.join(HERE, "verify_sabotage"), plugin_dir],
                            SPEC_KERNELS_E2E_SABOTAGE_FLAG=flag)),
        "mla-tree": (base_server_args(mla_models["target"])
                     + eagle_args(mla_models["draft"], topk=2, steps=3, draft_tokens=6, page_size=1), server_env()),
    }
    pool = ServerPool(configs, work)
    pool.sabotage_flag = flag
    try:
        yield pool
    finally:
        pool.stop()


def greedy(server, input_ids):
    payload = {"input_ids": input_ids,
               "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}}
    out = server.generate(payload, timeout=REQUEST_TIMEOUT_S)
    return out if isinstance(out, list) else [out]


def assert_accepts(outs, name):
    for i, o in enumerate(outs):
        meta = o["meta_info"]
        accept = meta.get("spec_accept_length")
        assert accept is not None and meta.get("spec_verify_ct", 0) > 0, \
            f"{name}: request {i} has no speculative-decoding info: {meta}"
        assert accept > MIN_ACCEPT_LENGTH, \
            f"{name}: request {i}: acceptance length {accept:.2f} <= {MIN_ACCEPT_LENGTH} ({meta})"


def test_greedy_batch1_matches_transformers(servers, models, name="tree"):
    server = servers.get(name)
    outs = greedy(server, models["prompt_ids"][0])
    assert outs[0]["output_ids"] == models["hf_greedy"][0], f"{name}: batch 1 differs from transformers"
    assert_accepts(outs, name)


def test_greedy_batch3_matches_transformers(servers, models, name="tree"):
    server = servers.get(name)
    outs = greedy(server, models["prompt_ids"])
    got = [o["output_ids"] for o in outs]
    for i, (g, want) in enumerate(zip(got, models["hf_greedy"])):
        assert g == want, f"{name}: batch 3, prompt {i} differs from transformers:\n{g}\n{want}"
    assert_accepts(outs, name)


def _flush_cache(server, tries: int = 20) -> None:
    """POST /flush_cache until the scheduler takes it: SGLang refuses a flush ("Flush cache
    failed.", status 400) while it still holds requests, which it can for a moment after their
    responses arrived (seen on a loaded 2-core machine)."""
    for attempt in range(tries):
        try:
            server.post("/flush_cache", timeout=REQUEST_TIMEOUT_S)
            return
        except ServerError:
            if attempt == tries - 1:
                raise
            time.sleep(0.5)


def test_negative_control_wrong_tree_mask_breaks_equality(servers, models, name="tree"):
    """The same tree server with every draft seeing all earlier drafts: the outputs must change."""
    server = servers.get(name)
    open(servers.sabotage_flag, "w").close()
    try:
        outs = greedy(server, models["prompt_ids"])
    finally:
        os.remove(servers.sabotage_flag)
        _flush_cache(server)  # drop KV written under the wrong mask
    got = [o["output_ids"] for o in outs]
    differing = [i for i, (g, want) in enumerate(zip(got, models["hf_greedy"])) if g != want]
    assert len(differing) == len(got), (
        f"with a wrong tree mask only prompts {differing} changed: the equality checks cannot see "
        "a wrong verify mask on the others")


def test_mla_greedy_batch3_matches_transformers(servers, mla_models, name="mla-tree"):
    server = servers.get(name)
    outs = greedy(server, mla_models["prompt_ids"])
    got = [o["output_ids"] for o in outs]
    for i, (g, want) in enumerate(zip(got, mla_models["hf_greedy"])):
        assert g == want, f"{name}: batch 3, prompt {i} differs from transformers:\n{g}\n{want}"
    assert_accepts(outs, name)
