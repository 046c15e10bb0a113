"""`specfused` on MLA models (DeepSeek-V3 / Kimi K2.5 latent attention) against SGLang 0.5.23's
own triton MLA path, through SGLang's real classes.

The runner is SGLang's MLA attention test kit's (MockMLAModelRunner: a real ReqToTokenPool,
MLATokenToKVPool with kv_lora_rank 512 + qk_rope_head_dim 64, KVIndexTranslator); the layer is
a real RadixAttention of head dim 576 with one KV head and v_head_dim 512, as DeepSeek's
absorbed attention builds it; batches are real ForwardBatch / EagleVerifyInput objects built by
test_sglang_backend.Bench (pages of all requests shuffled over the pool). Both backends run
under the Triton interpreter in fp32 on CPU. Shapes are tiny: 576-wide rows are slow there.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang 0.5.23 is not installed "
                    "(pip install --no-deps -r requirements/sglang-cpu.txt)")

from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods.mla_attention import (  # noqa: E402
    MLAAttentionCase,
    MockMLAModelRunner,
    TinyMLAModelConfig,
)

from spec_kernels.sglang import plugin  # noqa: E402
from spec_kernels.sglang.backend import SpecFusedAttnBackend, SpecFusedUnsupported  # noqa: E402
from test_sglang_backend import _RESOLVE, ATOL, CTX, DEVICE, MAX_BS, ROOT, RTOL, Bench, _tree  # noqa: E402

RANK, ROPE = 512, 64  # DeepSeek-V3 / Kimi K2.5


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert plugin.register() is True


class MlaBench(Bench):
    """Bench's batches (ForwardBatch, EagleVerifyInput, scattered pages) on an MLA runner."""

    def __init__(self, *, page_size, num_draft=4, heads=4, rank=RANK, rope=ROPE, seed=0, kv_dtype=None,
                 dtype=torch.float32, k_scale=None):
        self.page_size, self.hq, self.rank, self.rope, self.dtype = page_size, heads, rank, rope, dtype
        self.gen = torch.Generator().manual_seed(seed)
        case = MLAAttentionCase(name="specfused-mla", backend=plugin.BACKEND_NAME,
                                forward_mode=ForwardMode.TARGET_VERIFY, num_heads=heads, page_size=page_size,
                                prefix_lens=(0,) * MAX_BS, extend_lens=(num_draft,) * MAX_BS)
        config = TinyMLAModelConfig(num_heads=heads, kv_lora_rank=rank, qk_rope_head_dim=rope, hidden_size=64,
                                    context_len=CTX)
        self.runner = MockMLAModelRunner(case=case, model_config=config, dtype=dtype, device=DEVICE,
                                         max_context_len=CTX, kv_lora_rank=rank, qk_rope_head_dim=rope)
        if kv_dtype is not None:  # --kv-cache-dtype fp8_*: an MLA pool of that dtype, as SGLang makes it
            old = self.runner.token_to_kv_pool
            self.runner.kv_cache_dtype = kv_dtype
            self.runner.token_to_kv_pool = MLATokenToKVPool(
                size=old.size, page_size=page_size, dtype=kv_dtype, kv_lora_rank=rank, qk_rope_head_dim=rope,
                layer_num=1, device=DEVICE, enable_memory_saver=False)
        self.triton = ATTENTION_BACKENDS["triton"](self.runner)
        self.specfused = ATTENTION_BACKENDS[plugin.BACKEND_NAME](self.runner)
        # DeepSeek's absorbed attention layer: one latent KV head, values = its first `rank` dims.
        self.layer = RadixAttention(num_heads=heads, head_dim=rank + rope, scaling=0.07, num_kv_heads=1,
                                    layer_id=0, v_head_dim=rank)
        if k_scale is not None:  # a checkpoint's kv scale (SGLang's MLA backends use k_scale for the row)
            self.layer.k_scale, self.layer.v_scale = torch.tensor(k_scale), torch.tensor(k_scale)
            self.layer.k_scale_float = self.layer.v_scale_float = k_scale
        kv = self.runner.token_to_kv_pool.get_key_buffer(0)
        kv.copy_(torch.randn(kv.shape, generator=self.gen))
        pages_per_req = CTX // page_size
        perm = torch.randperm(MAX_BS * pages_per_req, generator=self.gen) + 1
        self.page_of = perm.view(MAX_BS, pages_per_req).tolist()

    def qkv(self, num_tokens):
        """Absorbed queries [T, H * 576] and the tokens' latent rows k [T, 576] (v = its latent part)."""
        q = torch.randn(num_tokens, self.hq * (self.rank + self.rope), generator=self.gen).to(DEVICE, self.dtype)
        k = torch.randn(num_tokens, self.rank + self.rope, generator=self.gen).to(DEVICE, self.dtype)
        return q, k, k[:, : self.rank]

    def compare(self, fb_ours, qkv, fb_triton=None):
        ours = self.run(self.specfused, fb_ours, qkv)
        ref = self.run(self.triton, fb_triton or fb_ours, qkv)
        assert ours.shape == ref.shape == (qkv[0].shape[0], self.hq * self.rank)
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
        return ours


@pytest.fixture(params=[1, 16], ids=["page1", "page16"])
def bench(request):
    b = MlaBench(page_size=request.param, seed=request.param)
    yield b
    b.close()


@pytest.fixture
def mla_calls(monkeypatch):
    """Counts the attention the backend runs by kind (proof that the MLA plans, not the MHA ones,
    ran) and the plans it makes."""
    from test_sglang_backend import count_plan_runs

    calls = {"mla_decode_attention": 0, "mla_tree_verify_attention": 0, "decode_attention": 0,
             "tree_verify_attention": 0}
    count_plan_runs(monkeypatch, calls)
    return calls


def test_mla_decode(bench, mla_calls):
    seq_lens = [1, 17, 33, 5]  # crosses page boundaries at page 16
    bench.compare(bench.decode_batch(seq_lens), bench.qkv(len(seq_lens)))
    assert mla_calls == {"mla_decode_attention": 1, "mla_tree_verify_attention": 0, "decode_attention": 0,
                         "tree_verify_attention": 0, "plans": 1}


@pytest.mark.parametrize("kind", ["chain", "random"])
def test_mla_target_verify(bench, kind, mla_calls):
    prefix = [3, 16, 0, 21]
    blocks = [_tree(4, kind, bench.gen) for _ in prefix]
    qkv = bench.qkv(4 * len(prefix))
    ours = bench.compare(bench.verify_batch(prefix, blocks), qkv)
    assert mla_calls["mla_tree_verify_attention"] == 1 and mla_calls["tree_verify_attention"] == 0
    # The compact mask layout specfused offers the draft stage gives the same result.
    out_qlen = bench.run(bench.specfused, bench.verify_batch(prefix, blocks, custom_mask="qlen"), qkv)
    torch.testing.assert_close(out_qlen, ours, atol=0, rtol=0)


def test_mla_split_q_rope_k_rope_form_matches_the_absorbed_one():
    """SGLang's FlashInfer-MLA interface passes the latent and rope parts separately (q_rope=,
    k_rope=; k is then the latent part): same cache writes, same output."""
    b = MlaBench(page_size=1, heads=2, seed=5)
    try:
        seq_lens = [9, 2]
        q, k, v = b.qkv(2)
        absorbed = b.run(b.specfused, b.decode_batch(seq_lens), (q, k, v))
        kv = b.runner.token_to_kv_pool.get_key_buffer(0)
        written = kv[[b.slot(r, n - 1) for r, n in enumerate(seq_lens)], 0].clone()
        kv[[b.slot(r, n - 1) for r, n in enumerate(seq_lens)]] = 0  # the split call must write them again
        q3 = q.view(2, 2, RANK + ROPE)
        fb = b.decode_batch(seq_lens)
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=b.specfused)):
            b.specfused.init_forward_metadata(fb)
            split = b.layer(q3[..., :RANK].reshape(2, -1), k[:, :RANK], k[:, :RANK], fb,
                            q_rope=q3[..., RANK:].reshape(2, -1), k_rope=k[:, None, RANK:])
        torch.testing.assert_close(kv[[b.slot(r, n - 1) for r, n in enumerate(seq_lens)], 0], written, atol=0, rtol=0)
        torch.testing.assert_close(split, absorbed, atol=0, rtol=0)
    finally:
        b.close()


def test_mla_extend_is_delegated_to_sglang_triton(bench, mla_calls):
    assert type(bench.specfused.prefill_backend).__name__ == "TritonAttnBackend"
    prefix, extend = [0, 15, 3], [5, 2, 6]
    bench.compare(bench.extend_batch(prefix, extend), bench.qkv(sum(extend)))
    assert not any(mla_calls.values())


def test_mla_draft_counts_change_between_batches():
    """Adaptive speculation: verify widths 5, 1 (drafting off) and 3 on a backend built for 5."""
    b = MlaBench(page_size=16, num_draft=5, heads=8, seed=3)
    try:
        for n, kind, prefix in [(5, "random", [4, 30]), (1, "chain", [9, 0, 40]), (3, "wide", [16, 1, CTX - 3])]:
            blocks = [_tree(n, kind, b.gen) for _ in prefix]
            b.compare(b.verify_batch(prefix, blocks), b.qkv(n * len(prefix)))
    finally:
        b.close()


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("page_size,k_scale", [(1, 0.5), (16, None)], ids=["page1-scaled", "page16"])
def test_mla_fp8_kv_cache_decode_and_verify(kv_dtype, page_size, k_scale):
    """fp16 queries over an fp8 latent pool (the new rows written through it, divided by k_scale),
    against float64 attention over the pool's dequantised rows (SGLang's Triton kernels misread
    fp8 under the interpreter: see test_sglang_backend's fp8 tests)."""
    b = MlaBench(page_size=page_size, seed=5, kv_dtype=kv_dtype, dtype=torch.float16, k_scale=k_scale, rank=128,
                 rope=32)
    try:
        scale = k_scale or 1.0

        def want(qkv, rows):
            kv = b.runner.token_to_kv_pool.get_key_buffer(0).double().view(-1, b.rank + b.rope) * scale
            q = qkv[0].view(-1, b.hq, b.rank + b.rope).double()
            out = torch.zeros(q.shape[0], b.hq, b.rank, dtype=torch.float64)
            for t, (req, positions) in enumerate(rows):
                rows_kv = kv[torch.tensor([b.slot(req, p) for p in positions])]
                for h in range(b.hq):
                    out[t, h] = torch.softmax(rows_kv @ q[t, h] * 0.07, 0) @ rows_kv[:, :b.rank]
            return out.view(q.shape[0], -1)

        seq_lens = [1, 17, 33, 5]
        qkv = b.qkv(len(seq_lens))
        ours = b.run(b.specfused, b.decode_batch(seq_lens), qkv)
        torch.testing.assert_close(ours.double(), want(qkv, [(r, range(n)) for r, n in enumerate(seq_lens)]),
                                   atol=2e-3, rtol=2e-3)
        prefix = [3, 16, 0, 21]
        blocks = [_tree(4, "random", b.gen) for _ in prefix]
        qkv = b.qkv(4 * len(prefix))
        ours = b.run(b.specfused, b.verify_batch(prefix, blocks), qkv)
        rows = [(r, [*range(p), *(p + j for j in range(4) if blocks[r][i, j])])
                for r, p in enumerate(prefix) for i in range(4)]
        torch.testing.assert_close(ours.double(), want(qkv, rows), atol=2e-3, rtol=2e-3)
    finally:
        b.close()


def test_mla_dims_the_kernels_lack_are_refused():
    b = MlaBench(page_size=1, seed=0)
    try:
        b.runner.model_config.kv_lora_rank = 96
        with pytest.raises(SpecFusedUnsupported, match="kv_lora_rank in .* this model has 96 and 64"):
            SpecFusedAttnBackend(b.runner, prefill_backend=b.triton)
    finally:
        b.close()


def test_mla_sparse_attention_models_are_refused():
    b = MlaBench(page_size=1, seed=0)
    try:
        hf = b.runner.model_config.hf_config
        hf.architectures, hf.index_topk = ["DeepseekV32ForCausalLM"], 2048  # DeepSeek-V3.2 (DSA)
        with pytest.raises(SpecFusedUnsupported, match="DeepSeek sparse attention"):
            SpecFusedAttnBackend(b.runner, prefill_backend=b.triton)
    finally:
        b.close()


def test_server_arg_resolution_accepts_specfused_for_deepseek_v3(tmp_path):
    """SGLang's whole argument resolution (fresh process) accepts specfused for a DeepSeek-V3
    architecture with MTP/EAGLE chains and trees; a tiny local config stands in for the model."""
    config = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=256,
                  intermediate_size=512, moe_intermediate_size=128, num_attention_heads=16, num_key_value_heads=16,
                  num_hidden_layers=2, kv_lora_rank=RANK, q_lora_rank=128, qk_nope_head_dim=128,
                  qk_rope_head_dim=ROPE, v_head_dim=128, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                  first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0, scoring_func="sigmoid",
                  topk_method="noaux_tc", vocab_size=1000, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  torch_dtype="bfloat16", num_nextn_predict_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    base = ["--model-path", str(tmp_path), "--attention-backend", "specfused", "--device", "cuda",
            "--skip-tokenizer-init"]
    spec = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3"]
    cases = [[], spec + ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
             spec + ["--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"]]
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", _RESOLVE, json.dumps(cases), json.dumps(base)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["ok"] * 3
