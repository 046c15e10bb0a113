"""The plugin's optional SGLang hooks (spec_kernels/sglang/hooks.py), against SGLang 0.5.23.

* Off by default: with the variables unset the plugin registers no hook and SGLang's functions
  stay as they are (checked in this process).
* SPEC_KERNELS_SGLANG_FUSED_ALLREDUCE: two ranks on a gloo group load the plugin through
  SGLang's own load_plugins (an entry point declared in a temporary dist-info), build SGLang's real
  tensor-parallel groups (init_distributed_environment / initialize_model_parallel) and a real
  3-layer LlamaModel (SGLang's layer boundaries, RMSNorms, MLPs, Row/QKV-parallel linears; the
  attention core is a stand-in built from SGLang's QKV and o_proj linears, since the rotary and
  attention kernels do not run here). The same model and batch run with the hooks taking the
  batches (FusedAllReduce's torch.distributed path, ``force``) and with them declining (SGLang's
  own allreduce + RMSNorm), for DECODE, EXTEND and TARGET_VERIFY in fp32 and DECODE in bf16.
  A sabotaged communicator must change the result (the output really is ours), ``auto`` must
  decline CPU tensors, and the communicators must close.
* The construction-time filters (which norms get a candidate) on SGLang's own norm classes.
"""
import logging
import os
import socket
import queue as queue_module
import sys
import time
import traceback
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang 0.5.23 is not installed (pip install --no-deps -r "
                    "requirements/sglang-cpu.txt)")

from spec_kernels.sglang import hooks, plugin  # noqa: E402

ENVS = (hooks.FUSED_ALLREDUCE_ENV, hooks.DRAFT_SLOTS_ENV, hooks.FUSED_ALLREDUCE_MAX_TOKENS_ENV)
WORLD = 2
TIMEOUT_S = 150


def _wrapped(dotted: str) -> bool:
    import pkgutil

    module, name = dotted.rsplit(".", 1)
    return hasattr(getattr(pkgutil.resolve_name(module), name), "__wrapped__")


# --------------------------------------------------------------------------- off by default
def test_unset_variables_patch_nothing(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    for env in ENVS:
        monkeypatch.delenv(env, raising=False)
    assert plugin.register() is True
    HookRegistry.apply_hooks()
    for target in hooks.HOOK_TARGETS:
        assert target not in HookRegistry._hooks
        assert not _wrapped(target), target
    assert hooks.active_fused_allreduce() is None
    assert hooks.install_from_env() == []


def test_draft_slots_variable_warns_and_patches_nothing(monkeypatch, caplog):
    from sglang.srt.plugins.hook_registry import HookRegistry

    for env in ENVS:
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv(hooks.DRAFT_SLOTS_ENV, "1")
    before = {k: list(v) for k, v in HookRegistry._hooks.items()}
    with caplog.at_level(logging.WARNING, logger=hooks.__name__):
        assert hooks.install_from_env() == []
    assert {k: list(v) for k, v in HookRegistry._hooks.items()} == before
    assert any(hooks.DRAFT_SLOTS_ENV in r.getMessage() and "kv_allocated_len" in r.getMessage()
               for r in caplog.records)


def test_mode_parsing(monkeypatch, caplog):
    assert hooks.fused_allreduce_mode("") is None
    assert hooks.fused_allreduce_mode("0") is None
    assert hooks.fused_allreduce_mode("1") == "auto"
    assert hooks.fused_allreduce_mode(" Auto ") == "auto"
    assert hooks.fused_allreduce_mode("force") == "force"
    with pytest.raises(ValueError, match=hooks.FUSED_ALLREDUCE_ENV):
        hooks.fused_allreduce_mode("yes please")
    monkeypatch.setenv(hooks.FUSED_ALLREDUCE_ENV, "sometimes")  # a bad value leaves it off, loudly
    with caplog.at_level(logging.ERROR, logger=hooks.__name__):
        assert hooks.install_from_env() == []
    assert hooks.active_fused_allreduce() is None
    assert any("sometimes" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- construction filters
def _plan(norm, scattered=False):
    from sglang.srt.layers.layer_boundary import TokenAxis

    rows = SimpleNamespace(sharded=frozenset({TokenAxis.ATTN_TP}) if scattered else frozenset())
    return SimpleNamespace(norm=norm, incoming_residual_rows=rows)


def test_candidates_only_for_norms_we_compute_exactly():
    from sglang.srt.layers.layer_boundary import FfnInputFusion
    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm

    h = hooks.FusedAllReduceHooks("force")
    sglangs = ("sglang's own",)
    for norm in (RMSNorm(8), GemmaRMSNorm(8)):
        attn = h.attn_input_fusions(lambda plan, read=None: sglangs, _plan(norm))
        ffn = h.ffn_input_fusions(lambda plan: sglangs, _plan(norm))
        assert len(attn) == 2 and attn[1:] == sglangs and callable(attn[0])  # ours first
        assert len(ffn) == 2 and isinstance(ffn[0], FfnInputFusion) and ffn[1:] == sglangs
    unsupported = [RMSNorm(8, var_hidden_size=4), RMSNorm(8, cast_x_before_out_mul=True),
                   RMSNorm(8, fp32_residual=True), RMSNorm(8, has_weight=False), torch.nn.LayerNorm(8), None]
    for norm in unsupported:
        assert h.attn_input_fusions(lambda plan, read=None: sglangs, _plan(norm)) == sglangs
        assert h.ffn_input_fusions(lambda plan: sglangs, _plan(norm)) == sglangs
    # A residual kept on attention-TP slices: the FFN input is left to SGLang.
    assert h.ffn_input_fusions(lambda plan: sglangs, _plan(RMSNorm(8), scattered=True)) == sglangs
    w, eps = hooks.norm_weight_and_eps(GemmaRMSNorm(8, eps=1e-5))
    assert torch.equal(w, torch.ones(8)) and eps == 1e-5  # weight 0 + 1, pre-folded by SGLang


# --------------------------------------------------------------------------- two TP ranks (gloo)
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_sglang_tp(rank: int, world: int, port: int) -> None:
    """SGLang's own TP groups on gloo (what sglang.test.layer_ut_utils does for one rank)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=world), role="test", ranks=SpawnRanks(world_rank=rank))
    import sglang.srt.distributed.device_communicators.pynccl as pynccl

    class NoNccl:  # GroupCoordinator builds a pynccl communicator unconditionally; none on a CPU
        def __init__(self, *args, **kwargs):
            self.disabled, self.available = True, False

    pynccl.PyNcclCommunicator = NoNccl
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo", timeout=60)
    initialize_model_parallel(backend="gloo")


def _tiny_llama(hidden=64):
    import sglang.srt.models.llama as llama
    from sglang.srt.layers.linear import QKVParallelLinear, RowParallelLinear
    from transformers import LlamaConfig

    class StandInAttention(torch.nn.Module):
        """LlamaAttention's TP structure (column-parallel QKV, row-parallel o_proj leaving its
        sum to the layer boundary) without rotary/attention kernels."""

        def __init__(self, config, hidden_size, num_heads, num_kv_heads, reduce_results=True, **_):
            super().__init__()
            self.qkv_proj = QKVParallelLinear(hidden_size, config.head_dim, num_heads, num_kv_heads, bias=False)
            self.o_proj = RowParallelLinear(num_heads * config.head_dim, hidden_size, bias=False,
                                            reduce_results=reduce_results)
            self.q_size = self.qkv_proj.num_heads * config.head_dim

        def forward(self, positions, hidden_states, forward_batch):
            qkv, _ = self.qkv_proj(hidden_states)
            return self.o_proj(torch.tanh(qkv[:, : self.q_size]))[0]

    llama.LlamaAttention = StandInAttention
    config = LlamaConfig(hidden_size=hidden, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_hidden_layers=3, vocab_size=100, rms_norm_eps=1e-5)
    model = llama.LlamaModel(config)
    rank = torch.distributed.get_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # replicated: the same on every rank
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
            else:  # sharded: each rank its own part
                p.copy_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + rank)))
    return model


def _batch(mode, tokens):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    return ForwardBatch(forward_mode=mode, batch_size=tokens, input_ids=torch.zeros(tokens, dtype=torch.int64),
                        req_pool_indices=torch.arange(tokens), seq_lens=torch.full((tokens,), 3),
                        out_cache_loc=torch.arange(tokens), seq_lens_sum=3 * tokens,
                        positions=torch.zeros(tokens, dtype=torch.int64))


def _tp_checks(rank: int, world: int, port: int, entry_point_dir: str) -> dict:
    os.environ[hooks.FUSED_ALLREDUCE_ENV] = "force"
    os.environ.pop("SGLANG_PLUGINS", None)  # a whitelist without specfused would skip us
    _init_sglang_tp(rank, world, port)
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.plugins import load_plugins

    from spec_kernels.comm import FusedAllReduce

    # SGLang's own discovery: our entry point (what `pip install -e .` declares), then the hooks.
    sys.path.insert(0, entry_point_dir)
    load_plugins()
    assert all(_wrapped(t) for t in hooks.HOOK_TARGETS)
    h = hooks.active_fused_allreduce()
    assert h is not None and h.mode == "force"
    model = _tiny_llama()
    layers = len(model.layers)
    emb = torch.randn(7, 64, generator=torch.Generator().manual_seed(3))  # the same on every rank
    report = {}

    def run(mode, tokens, dtype=torch.float32):
        with torch.no_grad():
            return model(None, torch.zeros(tokens, dtype=torch.int64), _batch(mode, tokens),
                         input_embeds=emb[:tokens].to(dtype)).float()

    def sglang_path(*args):
        h._why_not = lambda *a: ("test", "switched off by the test")
        try:
            return run(*args)
        finally:
            del h._why_not

    for mode, tokens in ((ForwardMode.DECODE, 5), (ForwardMode.EXTEND, 7), (ForwardMode.TARGET_VERIFY, 6)):
        before = dict(h.taken)
        ours = run(mode, tokens)
        taken = {k: v - before.get(k, 0) for k, v in h.taken.items()}
        # Every FFN input (one per layer) and every later layer's attention input ran on ours.
        assert taken == {("ffn_input", "torch"): layers, ("attn_input", "torch"): layers - 1}, taken
        ref = sglang_path(mode, tokens)
        report[f"fp32 {mode.name} max|diff|"] = (ours - ref).abs().max().item()
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        assert ref.abs().max() > 0.5

    # The result is really ours: a communicator that doubles its output changes it.
    real = FusedAllReduce.all_reduce_add_rmsnorm

    def doubled(self, *args, **kwargs):
        out, residual = real(self, *args, **kwargs)
        return out * 2, residual

    FusedAllReduce.all_reduce_add_rmsnorm = doubled
    try:
        sabotaged = run(ForwardMode.DECODE, 5)
    finally:
        FusedAllReduce.all_reduce_add_rmsnorm = real
    ref = sglang_path(ForwardMode.DECODE, 5)
    report["sabotaged max|diff|"] = (sabotaged - ref).abs().max().item()
    assert report["sabotaged max|diff|"] > 0.1

    # auto: on CPU tensors the communicator only has its torch.distributed path, so SGLang's own
    # path runs: with the fp32 communicator built, because algorithm_for says "torch"; in bf16
    # (none built yet) without building one.
    h.mode = "auto"
    before_taken = sum(h.taken.values())
    auto = run(ForwardMode.DECODE, 4)
    assert h.declined[("ffn_input", "torch")] == layers and h.declined[("attn_input", "torch")] == layers - 1
    torch.testing.assert_close(auto, sglang_path(ForwardMode.DECODE, 4), rtol=0, atol=0)
    model.to(torch.bfloat16)
    run(ForwardMode.DECODE, 4, torch.bfloat16)
    assert h.declined[("ffn_input", "communicator")] == layers
    assert sum(h.taken.values()) == before_taken and len(h.communicators()) == 1
    h.mode = "force"

    # bf16: the same rounding points as SGLang's (fp32 add and norm, residual stored in bf16).
    before = sum(h.taken.values())
    ours = run(ForwardMode.DECODE, 5, torch.bfloat16)
    assert sum(h.taken.values()) - before == 2 * layers - 1
    ref = sglang_path(ForwardMode.DECODE, 5, torch.bfloat16)
    report["bf16 DECODE max|diff|"] = (ours - ref).abs().max().item()
    torch.testing.assert_close(ours, ref, rtol=2e-2, atol=2e-2)

    comms = h.communicators()
    assert sorted(str(c.dtype) for c in comms) == ["torch.bfloat16", "torch.float32"]
    assert all(c.world_size == world and c.hidden_size == 64 for c in comms)
    assert any(key[0] == "taken" for key in h._logged)  # "... runs on FusedAllReduce ..." was logged
    h.close()
    assert all(c._closed for c in comms) and h.communicators() == []
    return report


def _tp_worker(rank, world, port, entry_point_dir, queue):
    try:
        queue.put((rank, None, _tp_checks(rank, world, port, entry_point_dir)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, traceback.format_exc(), None))


def test_fused_allreduce_hook_on_two_tp_ranks(tmp_path):
    import torch.multiprocessing as mp

    dist = tmp_path / "spec_kernels_hooks_check-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: spec-kernels-hooks-check\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[sglang.srt.plugins]\nspecfused = spec_kernels.sglang.plugin:register\n")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_tp_worker, args=(r, WORLD, port, str(tmp_path), queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    # Read before joining (a rank blocks until its report is read) and never wait unboundedly:
    # a rank that dies without reporting must fail the test, not hang it.
    results, deadline = [], time.monotonic() + TIMEOUT_S
    try:
        while len(results) < WORLD:
            results.append(queue.get(timeout=max(1.0, deadline - time.monotonic())))
    except queue_module.Empty:
        pass
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    assert len(results) == WORLD, f"{len(results)} of {WORLD} ranks reported within {TIMEOUT_S} s (exit codes {codes})"
    errors = [f"rank {r}:\n{err}" for r, err, _ in results if err]
    assert not errors, "\n".join(errors)
    reports = dict((r, rep) for r, _, rep in results)
    print(reports, file=sys.stderr)
    assert reports[0] == reports[1]  # both ranks computed the same
