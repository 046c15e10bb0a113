"""`specfused` against SGLang 0.5.23's own triton backend, through SGLang's real classes.

Each test builds a real ModelRunner stand-in from SGLang's attention unit-test kit (real
ReqToTokenPool, MHATokenToKVPool, KVIndexTranslator), a real RadixAttention layer and real
ForwardBatch / EagleVerifyInput objects, runs the same batch through `specfused` and through
SGLang's TritonAttnBackend (both under the Triton interpreter, fp32, on CPU), and compares.
Every request's KV pages are scattered over the pool, so index mistakes show.

Needs SGLang (CI installs requirements/sglang-cpu.txt); without it this module is skipped,
which is reported, not counted as a pass. Shapes are tiny: the interpreter is slow.
"""
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang 0.5.23 is not installed "
                    "(pip install --no-deps -r requirements/sglang-cpu.txt)")

from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import (  # noqa: E402
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleVerifyInput  # noqa: E402
from sglang.srt.speculative.eagle_utils import TreeMaskMode  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (  # noqa: E402
    DenseAttentionCase,
    MockModelRunner,
    TinyModelConfig,
)

from spec_kernels.sglang import plugin  # noqa: E402
from spec_kernels.sglang.backend import SpecFusedAttnBackend, SpecFusedUnsupported  # noqa: E402
from spec_kernels.testing import random_parents  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Without a GPU both backends run under the Triton interpreter (conftest.py sets it).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 throughout: the same math up to summation order (on a GPU SGLang's kernels may use tf32).
ATOL = RTOL = 2e-5 if DEVICE == "cpu" else 2e-3
CTX = 64  # max context per request
MAX_BS = 4


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert plugin.register() is True
    assert plugin.register() is True  # idempotent


# --------------------------------------------------------------------------- harness
class Bench:
    """One runner (pools, translator), a triton and a specfused backend on it, one layer."""

    def __init__(self, *, page_size, num_draft=4, hq=4, hkv=2, d=64, seed=0, kv_dtype=None, dtype=torch.float32,
                 kv_scales=None):
        self.page_size, self.hq, self.hkv, self.d, self.dtype = page_size, hq, hkv, d, dtype
        self.gen = torch.Generator().manual_seed(seed)
        # The kit's case only sizes the runner and publishes the server args it needs
        # (speculative_num_draft_tokens comes from the TARGET_VERIFY extend lengths).
        case = DenseAttentionCase(name="specfused", backend=plugin.BACKEND_NAME,
                                  forward_mode=ForwardMode.TARGET_VERIFY, num_heads=hq, num_kv_heads=hkv,
                                  page_size=page_size, prefix_lens=(0,) * MAX_BS,
                                  extend_lens=(num_draft,) * MAX_BS)
        model_config = TinyModelConfig(num_heads=hq, num_kv_heads=hkv, head_dim=d, hidden_size=hq * d,
                                       context_len=CTX)
        self.runner = MockModelRunner(case=case, model_config=model_config, dtype=dtype, device=DEVICE,
                                      max_context_len=CTX, head_dim=d)
        if kv_dtype is not None:  # --kv-cache-dtype fp8_e4m3 / fp8_e5m2: a pool of that dtype, as SGLang makes it
            old = self.runner.token_to_kv_pool
            self.runner.kv_cache_dtype = kv_dtype
            self.runner.token_to_kv_pool = MHATokenToKVPool(
                size=old.size, page_size=page_size, dtype=kv_dtype, head_num=hkv, head_dim=d, layer_num=1,
                device=DEVICE, enable_memory_saver=False, enable_alt_stream=False)
        try:
            self.triton = ATTENTION_BACKENDS["triton"](self.runner)
            self.specfused = ATTENTION_BACKENDS[plugin.BACKEND_NAME](self.runner)
        except Exception:
            self.close()  # the runner's server-args override, for the tests after this one
            raise
        self.layer = RadixAttention(num_heads=hq, head_dim=d, scaling=d ** -0.5, num_kv_heads=hkv, layer_id=0)
        if kv_scales is not None:  # what a checkpoint's kv scales leave on the layer
            self.layer.k_scale, self.layer.v_scale = (torch.tensor(x) for x in kv_scales)
            self.layer.k_scale_float, self.layer.v_scale_float = kv_scales
        k_cache, v_cache = self.runner.token_to_kv_pool.get_kv_buffer(0)
        k_cache.copy_(torch.randn(k_cache.shape, generator=self.gen))
        v_cache.copy_(torch.randn(v_cache.shape, generator=self.gen))
        # Request b's logical page p lives on physical page page_of[b][p]: pages of all
        # requests are shuffled together over the pool (page 0 is SGLang's padding page).
        pages_per_req = CTX // page_size
        perm = torch.randperm(MAX_BS * pages_per_req, generator=self.gen) + 1
        self.page_of = perm.view(MAX_BS, pages_per_req).tolist()

    def close(self):
        self.runner._server_args_override.restore()

    def slot(self, req: int, pos: int) -> int:
        return self.page_of[req][pos // self.page_size] * self.page_size + pos % self.page_size

    def _batch(self, mode, seq_lens, new_tokens, prefix_lens):
        """A ForwardBatch whose requests 0..bs-1 hold seq_lens[b] tokens in req_to_token, the
        last new_tokens[b] of them being this forward's (their slots are out_cache_loc)."""
        bs = len(seq_lens)
        out_loc, positions = [], []
        for b in range(bs):
            self.runner.req_to_token_pool.req_to_token[b, : seq_lens[b]] = torch.tensor(
                [self.slot(b, p) for p in range(seq_lens[b])])
            start = seq_lens[b] - new_tokens[b]
            out_loc += [self.slot(b, p) for p in range(start, seq_lens[b])]
            positions += list(range(start, seq_lens[b]))
        fb = ForwardBatch(
            forward_mode=mode, batch_size=bs,
            input_ids=torch.zeros(len(out_loc), dtype=torch.int64, device=DEVICE),
            req_pool_indices=torch.arange(bs, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=DEVICE),
            seq_lens_cpu=torch.tensor(prefix_lens, dtype=torch.int32),
            out_cache_loc=torch.tensor(out_loc, dtype=torch.int64, device=DEVICE),
            seq_lens_sum=sum(prefix_lens),
            positions=torch.tensor(positions, dtype=torch.int64, device=DEVICE),
        )
        self.runner.kv_index_translator.bind_own_plan(fb)  # what ForwardBatch.init_new does
        return fb

    def decode_batch(self, seq_lens):
        return self._batch(ForwardMode.DECODE, seq_lens, [1] * len(seq_lens), seq_lens)

    def extend_batch(self, prefix_lens, extend_lens):
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        fb = self._batch(ForwardMode.EXTEND, seq_lens, extend_lens, seq_lens)
        fb.extend_prefix_lens = torch.tensor(prefix_lens, dtype=torch.int32, device=DEVICE)
        fb.extend_prefix_lens_cpu = list(prefix_lens)
        fb.extend_seq_lens = torch.tensor(extend_lens, dtype=torch.int32, device=DEVICE)
        fb.extend_seq_lens_cpu = list(extend_lens)
        fb.extend_num_tokens = sum(extend_lens)
        return fb

    def verify_batch(self, prefix_lens, blocks, *, custom_mask="full"):
        """TARGET_VERIFY: request b has prefix_lens[b] cached tokens and n drafts whose
        draft-to-draft visibility is blocks[b] ([n, n] bool). seq_lens exclude the drafts,
        as in SGLang. custom_mask: "full" (n x (prefix + n) per request, what SGLang's own
        backends get), "qlen" (n x n in the buffer specfused offers), or None."""
        n = blocks[0].shape[0]
        seq_lens = [p + n for p in prefix_lens]
        fb = self._batch(ForwardMode.TARGET_VERIFY, seq_lens, [n] * len(prefix_lens), prefix_lens)
        if custom_mask == "full":
            rows = []
            for prefix, block in zip(prefix_lens, blocks):
                r = torch.ones(n, prefix + n, dtype=torch.bool)
                r[:, prefix:] = block
                rows.append(r.flatten())
            mask = torch.cat(rows).to(DEVICE)
        elif custom_mask == "qlen":
            vm = self.specfused.verify_mask
            assert vm.mode == TreeMaskMode.QLEN_ONLY and vm.fits(len(blocks))
            mask = vm.buffer
            mask.fill_(True)  # as the draft stage does before writing the tree cells
            mask[: len(blocks) * n * n] = torch.cat([b.flatten() for b in blocks]).to(DEVICE)
        else:
            mask = None
        fb.spec_info = EagleVerifyInput(
            draft_token=fb.input_ids, custom_mask=mask, positions=fb.positions, retrieve_index=None,
            retrieve_next_token=None, retrieve_next_sibling=None, retrieve_cum_len=None, spec_steps=n - 1,
            topk=1, draft_token_num=n, capture_hidden_mode=CaptureHiddenMode.FULL,
            seq_lens_sum=fb.seq_lens_sum, seq_lens_cpu=fb.seq_lens_cpu)
        return fb

    def qkv(self, num_tokens):
        g = self.gen
        return tuple(torch.randn(num_tokens, heads * self.d, generator=g).to(DEVICE, self.dtype)
                     for heads in (self.hq, self.hkv, self.hkv))

    def run(self, backend, fb, qkv, *, init=True):
        q, k, v = qkv
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
            if init:
                backend.init_forward_metadata(fb)
            return self.layer(q, k, v, fb)

    def compare(self, fb_ours, qkv, fb_triton=None, tol=None):
        ours = self.run(self.specfused, fb_ours, qkv)
        ref = self.run(self.triton, fb_triton or fb_ours, qkv)
        assert ours.shape == ref.shape == (qkv[0].shape[0], self.hq * self.d)
        torch.testing.assert_close(ours, ref, **(tol or dict(atol=ATOL, rtol=RTOL)))
        return ours


@pytest.fixture(params=[1, 16], ids=["page1", "page16"])
def bench(request):
    b = Bench(page_size=request.param, seed=request.param)
    yield b
    b.close()


def _tree(n, kind, gen):
    parents = random_parents(n, kind, gen)
    block = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            block[i, j] = True
            j = parents[j]
    return block


# --------------------------------------------------------------------------- modes
@pytest.fixture
def op_calls(monkeypatch):
    """Counts the attention the backend runs, by kind: its plans' runs (one per layer call) and the
    plans it makes (once per batch and layer geometry)."""
    calls = {"decode_attention": 0, "tree_verify_attention": 0, "plans": 0}
    count_plan_runs(monkeypatch, calls)
    return calls


def count_plan_runs(monkeypatch, calls):
    """Wraps TreeVerifyPlan / MlaPlan: calls[<one-call op name>] += 1 per run() of that kind,
    calls["plans"] += 1 per plan made."""
    from spec_kernels.mla import MlaPlan
    from spec_kernels.tree_verify import TreeVerifyPlan

    for cls, prefix in ((TreeVerifyPlan, ""), (MlaPlan, "mla_")):
        run, init = cls.run, cls.__init__

        def counted_run(self, *args, _run=run, _prefix=prefix, **kwargs):
            kind = "decode_attention" if self.layout.decode else "tree_verify_attention"
            calls[_prefix + kind] = calls.get(_prefix + kind, 0) + 1
            return _run(self, *args, **kwargs)

        def counted_init(self, *args, _init=init, **kwargs):
            calls["plans"] = calls.get("plans", 0) + 1
            _init(self, *args, **kwargs)

        monkeypatch.setattr(cls, "run", counted_run)
        monkeypatch.setattr(cls, "__init__", counted_init)


def test_decode(bench, op_calls):
    seq_lens = [1, 17, 33, 5]  # crosses page boundaries at page 16
    bench.compare(bench.decode_batch(seq_lens), bench.qkv(len(seq_lens)))
    assert op_calls == {"decode_attention": 1, "tree_verify_attention": 0, "plans": 1}


def test_plans_once_per_batch_then_in_init_forward_metadata(bench, op_calls):
    """The batch is planned once for all layers: the first step at its first layer (the head
    geometry is not known before), every later step in init_forward_metadata; layers only run."""
    fb, qkv = bench.decode_batch([4, 9, 30]), bench.qkv(3)
    be = bench.specfused
    first = bench.run(be, fb, qkv)
    assert op_calls == {"decode_attention": 1, "tree_verify_attention": 0, "plans": 1}
    again = bench.run(be, fb, qkv, init=False)  # a second layer over the same batch
    assert op_calls == {"decode_attention": 2, "tree_verify_attention": 0, "plans": 1}
    be.init_forward_metadata(fb)  # the next step: planned before any layer runs
    assert op_calls["plans"] == 2 and len(be.forward_metadata.plans) == 1
    third = bench.run(be, fb, qkv, init=False)
    assert op_calls == {"decode_attention": 3, "tree_verify_attention": 0, "plans": 2}
    torch.testing.assert_close(first, again, atol=0, rtol=0)
    torch.testing.assert_close(first, third, atol=0, rtol=0)


def test_extend_is_delegated(bench, op_calls):
    assert type(bench.specfused.prefill_backend).__name__ == "TritonAttnBackend"
    prefix, extend = [0, 15, 3], [5, 2, 13]
    bench.compare(bench.extend_batch(prefix, extend), bench.qkv(sum(extend)))
    assert op_calls == {"decode_attention": 0, "tree_verify_attention": 0, "plans": 0}


@pytest.mark.parametrize("kind", ["chain", "random"])
def test_target_verify(bench, kind, op_calls):
    prefix = [3, 16, 0, 21]
    blocks = [_tree(4, kind, bench.gen) for _ in prefix]
    qkv = bench.qkv(4 * len(prefix))
    ours = bench.compare(bench.verify_batch(prefix, blocks), qkv)
    assert op_calls == {"decode_attention": 0, "tree_verify_attention": 1, "plans": 1}
    # The compact layout specfused asks the draft stage for gives the same result.
    out_qlen = bench.run(bench.specfused, bench.verify_batch(prefix, blocks, custom_mask="qlen"), qkv)
    torch.testing.assert_close(out_qlen, ours, atol=0, rtol=0)
    if kind == "random":  # the mask matters: everything-visible drafts give another answer
        everything = [torch.ones(4, 4, dtype=torch.bool)] * len(prefix)
        assert not torch.allclose(bench.run(bench.specfused, bench.verify_batch(prefix, everything), qkv), ours)


def test_verify_without_mask_is_causal(bench):
    prefix = [7, 2]
    blocks = [torch.ones(3, 3, dtype=torch.bool).tril()] * 2
    qkv = bench.qkv(6)
    bench.compare(bench.verify_batch(prefix, blocks, custom_mask=None), qkv)


def test_draft_counts_change_between_batches():
    """Adaptive speculation: the verify width changes from step to step, down to 1 (drafting
    off). The backend was built for 5 drafts per request."""
    b = Bench(page_size=16, num_draft=5, seed=3)
    try:
        for n, kind, prefix in [(5, "random", [4, 30]), (1, "chain", [9, 0, 40]), (3, "wide", [16, 1, 2, 0]),
                                (2, "chain", [CTX - 2])]:  # the last: a full context
            blocks = [_tree(n, kind, b.gen) for _ in prefix]
            qkv = b.qkv(n * len(prefix))
            b.compare(b.verify_batch(prefix, blocks), qkv)
            b.compare(b.verify_batch(prefix, blocks, custom_mask="qlen"), qkv, b.verify_batch(prefix, blocks))
    finally:
        b.close()


# --------------------------------------------------------------------------- fp8 KV cache
# fp16 queries; the new tokens' K / V are written through the pool (divided by the layer's scales).
# On the CPU the result is checked against float64 attention over the pool's dequantised values:
# SGLang's own Triton decode kernel misreads fp8 caches under the interpreter (max error 0.32
# against that float64 result on the decode batch below, 6e-4 with an fp16 pool), so the
# comparison with it on the same fp8 pool runs on a GPU (test_gpu_fp8_kv_cache_matches_triton).
FP8_TOL = dict(atol=2e-3, rtol=2e-3)


def _float64_attention(b, qkv, rows):
    """rows: per query token, (request, visible positions). Attention in float64 over the pool's
    dequantised K / V (pool value * the layer's scale), after the forward wrote the new tokens."""
    k, v = b.runner.token_to_kv_pool.get_kv_buffer(0)
    ks = float(b.layer.k_scale_float) if b.layer.k_scale is not None else 1.0
    vs = float(b.layer.v_scale_float) if b.layer.v_scale is not None else 1.0
    q = qkv[0].view(-1, b.hq, b.d).double()
    group = b.hq // b.hkv
    out = torch.zeros(q.shape[0], b.hq, b.d, dtype=torch.float64)
    for t, (req, positions) in enumerate(rows):
        slots = torch.tensor([b.slot(req, p) for p in positions])
        kk, vv = k[slots].double() * ks, v[slots].double() * vs
        for h in range(b.hq):
            out[t, h] = torch.softmax((kk[:, h // group] @ q[t, h]) * b.d ** -0.5, 0) @ vv[:, h // group]
    return out.view(q.shape[0], -1)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("page_size,scales", [(1, (0.5, 2.0)), (16, None)], ids=["page1-scaled", "page16"])
def test_fp8_kv_cache_decode_and_verify(kv_dtype, page_size, scales):
    b = Bench(page_size=page_size, seed=9, kv_dtype=kv_dtype, dtype=torch.float16, kv_scales=scales)
    try:
        assert b.runner.token_to_kv_pool.k_buffer[0].dtype == torch.uint8  # SGLang keeps the bytes
        seq_lens = [1, 17, 33, 5]
        qkv = b.qkv(len(seq_lens))
        ours = b.run(b.specfused, b.decode_batch(seq_lens), qkv)
        want = _float64_attention(b, qkv, [(r, range(n)) for r, n in enumerate(seq_lens)])
        torch.testing.assert_close(ours.double(), want, **FP8_TOL)
        prefix = [3, 16, 0, 21]
        blocks = [_tree(4, "random", b.gen) for _ in prefix]
        qkv = b.qkv(4 * len(prefix))
        ours = b.run(b.specfused, b.verify_batch(prefix, blocks), qkv)
        rows = [(r, [*range(p), *(p + j for j in range(4) if blocks[r][i, j])])
                for r, p in enumerate(prefix) for i in range(4)]
        torch.testing.assert_close(ours.double(), _float64_attention(b, qkv, rows), **FP8_TOL)
    finally:
        b.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["fp8_e4m3", "fp8_e5m2"])
def test_gpu_fp8_kv_cache_matches_triton(kv_dtype):
    b = Bench(page_size=16, seed=9, kv_dtype=kv_dtype, dtype=torch.bfloat16, kv_scales=(0.5, 2.0))
    try:
        b.compare(b.decode_batch([1, 17, 33, 5]), b.qkv(4), tol=dict(atol=2e-2, rtol=2e-2))
        prefix = [3, 16, 0, 21]
        blocks = [_tree(4, "random", b.gen) for _ in prefix]
        b.compare(b.verify_batch(prefix, blocks), b.qkv(16), tol=dict(atol=2e-2, rtol=2e-2))
    finally:
        b.close()


def test_fp8_kv_cache_with_float32_queries_is_refused():
    with pytest.raises(SpecFusedUnsupported, match="fp8 KV cache with float16/bfloat16 queries"):
        Bench(page_size=1, kv_dtype=torch.float8_e4m3fn, dtype=torch.float32)


# --------------------------------------------------------------------------- CUDA-graph path
def test_graph_metadata_capture_then_replay_with_padding(bench):
    """The CUDA-graph protocol, run eagerly: static buffers from init_cuda_graph_state, metadata
    made at capture (in_capture=True), then refilled in place for a replay batch padded to the
    captured size (padded lanes: seq_len = fill value, request slot 0, as SGLang pads them).
    The forward after the replay refill reuses the capture-time metadata object, as the graph
    does, and must match triton on the real rows."""
    ours = bench.specfused
    n, bs = 4, 3
    ours.init_cuda_graph_state(MAX_BS, MAX_BS * n)
    buffers = dict(ours._graph)
    ours.init_cuda_graph_state(1, n)  # a second graph runner: captured graphs keep their buffers
    assert all(ours._graph[k] is buffers[k] for k in buffers)
    fill = ours.get_cuda_graph_seq_len_fill_value()

    capture = bench.verify_batch([fill] * MAX_BS, [torch.ones(n, n, dtype=torch.bool)] * MAX_BS)
    ours.init_forward_metadata_out_graph(capture, in_capture=True)
    captured = ours.forward_metadata
    bench.run(ours, capture, bench.qkv(MAX_BS * n), init=False)

    prefix = [12, 31, 5]
    blocks = [_tree(n, "random", bench.gen) for _ in prefix]
    real = bench.verify_batch(prefix, blocks, custom_mask="qlen")
    padded = bench.verify_batch(prefix + [fill], blocks + [blocks[0]], custom_mask="qlen")
    padded.req_pool_indices[bs:] = 0
    padded.spec_info.custom_mask = real.spec_info.custom_mask
    ours.init_forward_metadata_out_graph(padded)
    assert ours.forward_metadata is captured  # replay only refills the buffers
    qkv = bench.qkv(MAX_BS * n)
    got = bench.run(ours, padded, qkv, init=False)[: bs * n]
    ref = bench.run(bench.triton, bench.verify_batch(prefix, blocks), tuple(t[: bs * n] for t in qkv))
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)

    # A decode graph on the same buffers.
    dec = bench.decode_batch([fill] * MAX_BS)
    ours.init_forward_metadata_out_graph(dec, in_capture=True)
    captured_decode = ours.forward_metadata
    seq_lens = [40, 1, 16]
    replay = bench.decode_batch(seq_lens + [fill])
    replay.req_pool_indices[bs:] = 0
    ours.init_forward_metadata_out_graph(replay)
    assert ours.forward_metadata is captured_decode
    qkv = bench.qkv(MAX_BS)
    got = bench.run(ours, replay, qkv, init=False)[:bs]
    ref = bench.run(bench.triton, bench.decode_batch(seq_lens), tuple(t[:bs] for t in qkv))
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------- errors
def test_mla_model_with_unsupported_latent_dims_is_refused(bench):
    # The dense bench model has no kv_lora_rank / qk_rope_head_dim: MLA dims the kernels lack.
    bench.runner.use_mla_backend = True
    with pytest.raises(SpecFusedUnsupported, match="kv_lora_rank in .* not implement yet"):
        SpecFusedAttnBackend(bench.runner, prefill_backend=bench.triton)


def test_draft_runner_gets_a_clear_error(bench):
    bench.runner.is_draft_worker = True
    with pytest.raises(ValueError, match="--speculative-draft-attention-backend"):
        ATTENTION_BACKENDS[plugin.BACKEND_NAME](bench.runner)


def test_unsupported_layer_features_raise(bench):
    bench.layer.logit_cap = 30.0
    with pytest.raises(SpecFusedUnsupported, match="logit soft-capping"):
        bench.run(bench.specfused, bench.decode_batch([3]), bench.qkv(1))


def test_draft_runner_is_steered_off_specfused(monkeypatch):
    """With the target on specfused and no draft backend named, the hook hands the draft
    runner a backend SGLang's EAGLE draft worker supports; a named one is kept."""
    from sglang.srt.model_executor import model_runner as mr
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import get_context

    HookRegistry.apply_hooks()
    assert mr.resolve_draft_attention_backend.__wrapped__ is not None
    monkeypatch.setattr("sglang.srt.runtime_context.attention_backends", lambda: ("specfused", "specfused"))
    resolve = mr.resolve_draft_attention_backend
    with get_context().override_server_args(speculative_draft_attention_backend=None):
        assert resolve(draft_attention_backend=None, is_draft_worker=True) == "triton"  # no GPU here
        assert resolve(draft_attention_backend="fa3", is_draft_worker=True) == "fa3"
        assert resolve(draft_attention_backend=None, is_draft_worker=False) is None
    with get_context().override_server_args(speculative_draft_attention_backend="flashinfer"):
        assert resolve(draft_attention_backend=None, is_draft_worker=True) == "flashinfer"


# --------------------------------------------------------------------------- CLI
def test_server_args_accept_specfused():
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", "dummy", "--attention-backend", "specfused",
                                "--speculative-algorithm", "EAGLE3"])
    assert args.attention_backend == "specfused"


_RESOLVE = """
import json, sys
import spec_kernels.sglang
spec_kernels.sglang.register()
from sglang.srt.server_args import prepare_server_args
results = []
for extra in json.loads(sys.argv[1]):
    args = prepare_server_args(json.loads(sys.argv[2]) + extra)
    try:
        args.resolve_once()  # SGLang's whole argument resolution and its cross-checks
        results.append("ok")
    except ValueError as exc:
        results.append(str(exc))
print(json.dumps(results))
"""


def test_server_arg_resolution_with_eagle3(tmp_path):
    """SGLang's argument checks accept specfused as an EAGLE3 target (fresh process: resolution
    publishes process-wide state). Tiny local configs stand in for the checkpoints; --device
    cuda only tells resolution what to plan for, nothing runs. SGLang itself refuses topk > 1
    with page_size > 1 for backends outside its own list (documented in docs/sglang.md)."""
    import json

    config = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, num_hidden_layers=2, vocab_size=1000,
                  max_position_embeddings=2048, rms_norm_eps=1e-5, torch_dtype="bfloat16")
    for name, arch in [("target", "LlamaForCausalLM"), ("draft", "LlamaForCausalLMEagle3")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(dict(config, architectures=[arch])))
    base = ["--model-path", str(tmp_path / "target"), "--speculative-draft-model-path", str(tmp_path / "draft"),
            "--attention-backend", "specfused", "--speculative-algorithm", "EAGLE3", "--device", "cuda",
            "--skip-tokenizer-init", "--speculative-num-steps", "3"]
    cases = [
        ["--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"],  # tree, page 1
        ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4", "--page-size", "16",
         "--speculative-adaptive"],  # chain, paged, adaptive
        ["--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8", "--page-size", "16"],
    ]
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", _RESOLVE, json.dumps(cases), json.dumps(base)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results[:2] == ["ok", "ok"], results
    assert "page_size > 1" in results[2] and "specfused" in results[2], results


def test_launch_server_help_lists_specfused(tmp_path):
    """The real discovery path: a dist-info declaring our entry point (what `pip install -e .`
    writes) on sys.path, and `python -m sglang.launch_server --help` in a fresh process."""
    dist = tmp_path / "spec_kernels_entry_point_check-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: spec-kernels-entry-point-check\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent("""\
        [sglang.srt.plugins]
        specfused = spec_kernels.sglang.plugin:register
        """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    env.pop("SGLANG_PLUGINS", None)
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    help_text = "".join(proc.stdout.split())  # argparse wraps the choices list anywhere
    choices = re.findall(r"--attention-backend\{([^}]*)\}", help_text)
    assert choices and all("specfused" in c.split(",") for c in choices), choices
