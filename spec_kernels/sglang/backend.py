"""`SpecFusedAttnBackend`: SGLang 0.5.23's attention-backend interface on spec-kernels' ops.

Who runs what:

* DECODE          -> `spec_kernels.decode_attention` (one query per request, all its KV);
* TARGET_VERIFY   -> `spec_kernels.tree_verify_attention`: the request's prefix plus its n
                     draft slots, drafts masked by 64-bit ancestor words converted on device
                     from SGLang's verify mask (see masks.py);
* everything else (EXTEND, MIXED, DLLM/draft extend) -> an ordinary SGLang backend built here
  (`prefill_backend`: triton, or flashinfer when installed and on a GPU), so prefill keeps
  its tuned kernels and prefix-cache handling.

MLA models (DeepSeek-V3, Kimi K2.5: `model_runner.use_mla_backend`) take the same routes with
the MLA ops, `mla_decode_attention` / `mla_tree_verify_attention`, over SGLang's
MLATokenToKVPool buffer ([slots, 1, kv_lora_rank + qk_rope_head_dim], the value being its
first kv_lora_rank values). The model hands an unknown backend name like ours the triton
backend's conventions (`AttentionBackendRegistry.get_handler` falls back to triton's handler):
queries arrive absorbed, [tokens, H * 576], and k is the 576-wide latent row to cache. The
split form of SGLang's FlashInfer-MLA interface (q_rope / k_rope keyword arguments) is
accepted too. For the same reason MLA prefill defaults to SGLang's triton backend.

Metadata is built from the batch's KV-index plan (`KVIndexTranslator.pack_read_stream`,
the same stream SGLang's own backends read) with device ops only. In eager mode the
buffers are fresh tensors; after `init_cuda_graph_state` they are static buffers that
`init_forward_metadata_out_graph` refills before capture and before every replay, so the
captured kernels read new indices from the same addresses and nothing syncs with the host.

This module imports SGLang; the plugin imports it only when SGLang builds the backend.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
from sglang.srt.configs.model_config import is_deepseek_dsa
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.verify_mask import VerifyMask
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.runtime_context import get_parallel, get_spec
from sglang.srt.speculative.eagle_utils import TreeMaskMode

from ..attention.checks import KV_FP8_DTYPES
from ..mla import MlaPlan
from ..tree_verify import TreeVerifyPlan
from ..mla.api import LATENT_DIMS as MLA_LATENT_DIMS
from ..mla.api import ROPE_DIMS as MLA_ROPE_DIMS
from . import masks
from .hooks import active_fused_allreduce

logger = logging.getLogger(__name__)

BACKEND_NAME = "specfused"
HEAD_DIMS = (64, 128, 256)
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# --kv-cache-dtype fp8_e4m3 / fp8_e5m2 (KV_FP8_DTYPES): the pool keeps the bytes (uint8) and hands
# out fp8 views; the layer's k_scale / v_scale (1.0 when the checkpoint has none) dequantise on the fly.
EXTEND_BACKEND_ENV = "SPEC_KERNELS_SGLANG_EXTEND_BACKEND"


class SpecFusedUnsupported(NotImplementedError):
    """A model or layer feature the specfused backend does not implement (yet)."""


@dataclass
class _Metadata:
    """What one DECODE / TARGET_VERIFY forward reads, built once per batch for all layers."""

    kv_indptr: torch.Tensor  # int32 [bs + 1]
    kv_indices: torch.Tensor  # int32 slot ids: each request's prefix, then its drafts
    qo_indptr: Optional[torch.Tensor]  # int32 [bs + 1], verify only
    tree_mask: Optional[torch.Tensor]  # int64 [bs * n], verify only
    num_draft: int  # tokens per request (1 for decode)
    # TreeVerifyPlan / MlaPlan per layer geometry: planned once per batch, run by every layer.
    plans: dict = field(default_factory=dict)


def extend_backend_name(device: str, mla: bool = False) -> str:
    """The SGLang backend that runs prefill: $SPEC_KERNELS_SGLANG_EXTEND_BACKEND, or for MLA
    models triton (whose conventions the model follows for our backend name, see the module
    docstring), else flashinfer on a GPU when it is installed, else triton."""
    name = os.environ.get(EXTEND_BACKEND_ENV, "auto").strip() or "auto"
    if name != "auto":
        if name == BACKEND_NAME or name not in ATTENTION_BACKENDS:
            raise ValueError(f"{EXTEND_BACKEND_ENV}={name!r} must name an SGLang attention backend "
                             f"other than {BACKEND_NAME!r} (e.g. triton, flashinfer)")
        return name
    if not mla and str(device).startswith("cuda") and torch.cuda.is_available():
        import importlib.util

        if importlib.util.find_spec("flashinfer") is not None:
            return "flashinfer"
    return "triton"


def check_model_supported(model_runner) -> None:
    """Raise SpecFusedUnsupported (or ValueError) naming what this model needs that specfused lacks."""
    hint = "use --attention-backend triton or flashinfer for this model"
    if getattr(model_runner, "is_draft_worker", False):
        raise ValueError(
            "specfused serves the target model only; the draft model needs a backend SGLang's draft "
            "worker supports: pass --speculative-draft-attention-backend triton (or flashinfer), "
            "or keep the spec_kernels plugin's draft hook enabled (see docs/sglang.md)")
    cfg = model_runner.model_config
    if getattr(cfg, "is_encoder_decoder", False):
        raise SpecFusedUnsupported(f"specfused does not support encoder-decoder (cross-attention) models; {hint}")
    if getattr(model_runner, "sliding_window_size", None) is not None:
        raise SpecFusedUnsupported(f"specfused does not support sliding-window attention yet; {hint}")
    if get_parallel().attn_dcp_size > 1:
        raise SpecFusedUnsupported("specfused does not support decode context parallelism (DCP)")
    if getattr(model_runner, "use_mla_backend", False):
        _check_mla_model(model_runner, hint)
    else:
        head_dim, v_head_dim = cfg.head_dim, getattr(cfg, "v_head_dim", cfg.head_dim)
        if head_dim not in HEAD_DIMS or v_head_dim not in HEAD_DIMS:
            raise SpecFusedUnsupported(
                f"specfused supports head dims {HEAD_DIMS}, this model has q/k {head_dim}, v {v_head_dim}; {hint}")
    kv_dtype = model_runner.kv_cache_dtype
    if kv_dtype not in KV_DTYPES + KV_FP8_DTYPES:
        raise SpecFusedUnsupported(
            f"specfused reads fp16/bf16/fp32 and fp8 (e4m3, e5m2) KV caches, got {kv_dtype} "
            "(--kv-cache-dtype auto keeps the model dtype)")
    if kv_dtype in KV_FP8_DTYPES and getattr(model_runner, "dtype", None) not in (torch.float16, torch.bfloat16):
        raise SpecFusedUnsupported(
            f"specfused reads an fp8 KV cache with float16/bfloat16 queries; the model runs in "
            f"{getattr(model_runner, 'dtype', None)}")
    num_draft = get_spec().speculative_num_draft_tokens or 0
    if num_draft > masks.MAX_DRAFT_TOKENS:
        raise SpecFusedUnsupported(
            f"specfused verifies at most {masks.MAX_DRAFT_TOKENS} draft tokens per request, "
            f"--speculative-num-draft-tokens is {num_draft}")


def _check_mla_model(model_runner, hint: str) -> None:
    cfg = model_runner.model_config
    rank, rope = getattr(cfg, "kv_lora_rank", None), getattr(cfg, "qk_rope_head_dim", None)
    if rank not in MLA_LATENT_DIMS or rope not in MLA_ROPE_DIMS:
        raise SpecFusedUnsupported(
            f"specfused supports MLA models (DeepSeek-V3, Kimi K2.5) with kv_lora_rank in {MLA_LATENT_DIMS} and "
            f"qk_rope_head_dim in {MLA_ROPE_DIMS}; this model has {rank} and {rope}, which the MLA kernels do "
            f"not implement yet; {hint}")
    if getattr(model_runner.token_to_kv_pool, "use_dsa", False) or is_deepseek_dsa(getattr(cfg, "hf_config", {})):
        raise SpecFusedUnsupported(
            f"specfused does not support DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5); {hint}")


def _check_layer(layer, sinks=None, score_mod=None, fp8_cache: bool = False) -> None:
    # Per-layer features the fused kernel has no code for; failing loudly beats wrong output.
    unsupported = []
    if layer.logit_cap and layer.logit_cap > 0:
        unsupported.append("logit soft-capping")
    if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
        unsupported.append("sliding-window attention")
    if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
        unsupported.append(f"attention type {layer.attn_type} / cross-attention")
    if not fp8_cache and (layer.k_scale is not None or layer.v_scale is not None):
        unsupported.append("KV scales (k_scale/v_scale) without an fp8 KV cache")
    if getattr(layer, "xai_temperature_len", -1) > 0:
        unsupported.append("xai temperature scaling")
    if sinks is not None:
        unsupported.append("attention sinks")
    if score_mod is not None:
        unsupported.append("score_mod")
    if unsupported:
        raise SpecFusedUnsupported(
            f"specfused: layer {layer.layer_id} uses {', '.join(unsupported)}, which the fused "
            "decode/verify kernel does not implement; use --attention-backend triton for this model")


class SpecFusedAttnBackend(AttentionBackend):
    """DECODE and TARGET_VERIFY on spec-kernels; other modes on an internal SGLang backend."""

    # Reads seq_lens_sum only to size eager buffers, with an upper-bound fallback.
    needs_cpu_seq_lens: bool = False

    def __init__(self, model_runner, prefill_backend: Optional[AttentionBackend] = None):
        super().__init__()
        check_model_supported(model_runner)
        self.device = torch.device(model_runner.device)
        self.page_size = getattr(model_runner, "page_size", 1) or 1
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.kv_index_translator = model_runner.kv_index_translator
        self.max_context_len = model_runner.model_config.context_len
        self.data_type = model_runner.kv_cache_dtype
        self.kv_cache_dtype = model_runner.kv_cache_dtype
        self.num_draft_tokens = get_spec().speculative_num_draft_tokens or 0
        self.use_mla = bool(getattr(model_runner, "use_mla_backend", False))

        if prefill_backend is None:
            name = extend_backend_name(self.device.type, mla=self.use_mla)
            prefill_backend = ATTENTION_BACKENDS[name](model_runner)
            logger.info("specfused: DECODE/TARGET_VERIFY on spec-kernels, prefill on SGLang's %s backend", name)
        self.prefill_backend = prefill_backend
        self.attn_backend_list = [prefill_backend]

        # A compact (n x n per request) verify mask: offered to the draft stage through
        # `verify_mask`, so SGLang never builds the n x (prefix + n) mask for us. Sized for
        # every request slot, so every verify batch fits it.
        self._verify_mask = None
        if self.num_draft_tokens > 0:
            max_bs = self.req_to_token_pool.size
            self._verify_mask = VerifyMask(
                buffer=torch.ones(max_bs * self.num_draft_tokens ** 2, dtype=torch.bool, device=self.device),
                mode=TreeMaskMode.QLEN_ONLY,
                max_bs=max_bs,
                is_read=True,
            )
        self.forward_metadata: Optional[_Metadata] = None
        self._graph = None  # static buffers, set by init_cuda_graph_state
        # Layer geometries (mla, heads, kv heads, head dim, v head dim, dtype, scale) seen in
        # forward_*: init_forward_metadata plans each of them for the batch.
        self._geometries: set = set()

    # ------------------------------------------------------------------ routing
    @staticmethod
    def _is_ours(mode: ForwardMode) -> bool:
        return mode.is_decode_or_idle() or mode.is_target_verify()

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        _check_fused_allreduce()
        if self._is_ours(forward_batch.forward_mode):
            self.forward_metadata = self._planned(self._build_metadata(forward_batch, static=False))
        else:
            self.prefill_backend.init_forward_metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        _check_fused_allreduce()  # before every replay: the captured allreduces never check
        if self._is_ours(forward_batch.forward_mode):
            # Capture and replay run the same body: refill the static buffers. The metadata
            # object made at capture points at them, and the captured kernels keep reading there.
            metadata = self._build_metadata(forward_batch, static=True)
            if in_capture:  # the captured launches keep the plans' split buffers
                self.forward_metadata = self._planned(metadata)
        else:
            self.prefill_backend.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch):
        if not self._is_ours(forward_batch.forward_mode):
            self.prefill_backend.init_forward_metadata_in_graph(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        # Every request's KV (prefix + its tokens) fits max_context_len + its tokens.
        sizes = dict(kv_indptr=max_bs + 1, qo_indptr=max_bs + 1,
                     kv_indices=max_bs * self.max_context_len + max_num_tokens, tree_mask=max_num_tokens)
        if self._graph is not None and all(self._graph[k].numel() >= v for k, v in sizes.items()):
            return  # graphs captured earlier keep reading these very buffers
        dtypes = dict(kv_indptr=torch.int32, qo_indptr=torch.int32, kv_indices=torch.int32, tree_mask=torch.int64)
        self._graph = {k: torch.zeros(v, dtype=dtypes[k], device=self.device) for k, v in sizes.items()}

    def get_cuda_graph_seq_len_fill_value(self):
        # Padded lanes of a graph batch get one KV slot, so no query is left without keys.
        return 1

    @property
    def verify_mask(self) -> Optional[VerifyMask]:
        return self._verify_mask

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs):
        # The mask is converted in init_forward_metadata*, after the draft stage wrote it.
        pass

    def get_fused_kv_write_buffers(self, layer, forward_batch):
        if self._is_ours(forward_batch.forward_mode):
            return None
        return self.prefill_backend.get_fused_kv_write_buffers(layer, forward_batch)

    # Prefill-side properties and hooks that SGLang's graph runners and scheduler read.
    @property
    def dllm_attention(self):
        return self.prefill_backend.dllm_attention

    @property
    def extend_dummy_seqs_capped_by_req_pool(self) -> bool:
        return getattr(self.prefill_backend, "extend_dummy_seqs_capped_by_req_pool", False)

    @property
    def extend_attention_block_m(self):
        return self.prefill_backend.extend_attention_block_m  # AttributeError -> hasattr False

    @property
    def use_captured_forward_metadata_for_breakable_cuda_graph(self) -> bool:
        return self.prefill_backend.use_captured_forward_metadata_for_breakable_cuda_graph

    @property
    def prefill_cuda_graph_max_batch_size(self):
        return self.prefill_backend.prefill_cuda_graph_max_batch_size

    @property
    def supports_full_cuda_graph_chunked_prefix(self) -> bool:
        return self.prefill_backend.supports_full_cuda_graph_chunked_prefix

    @property
    def supports_prefill_cuda_graph_max_context_size(self) -> bool:
        return self.prefill_backend.supports_prefill_cuda_graph_max_context_size

    @property
    def prefill_cuda_graph_default_max_seq_len(self):
        return self.prefill_backend.prefill_cuda_graph_default_max_seq_len

    def prepare_full_cuda_graph_chunked_prefix(self, forward_batch, *, in_capture: bool) -> None:
        self.prefill_backend.prepare_full_cuda_graph_chunked_prefix(forward_batch, in_capture=in_capture)

    def init_forward_metadata_for_breakable_cuda_graph_capture(self, forward_batch):
        return self.prefill_backend.init_forward_metadata_for_breakable_cuda_graph_capture(forward_batch)

    def prepare_forward_metadata_for_breakable_cuda_graph_replay(self, capture_metadata, forward_batch, *,
                                                                 static_forward_batch=None):
        self.prefill_backend.prepare_forward_metadata_for_breakable_cuda_graph_replay(
            capture_metadata, forward_batch, static_forward_batch=static_forward_batch)

    def _snapshot_prefill_shared_reads(self, forward_batch, *, num_qo_tokens: int):
        return self.prefill_backend._snapshot_prefill_shared_reads(forward_batch, num_qo_tokens=num_qo_tokens)

    def on_after_cuda_graph_warmup(self):
        self.prefill_backend.on_after_cuda_graph_warmup()

    # ------------------------------------------------------------------ metadata
    def _build_metadata(self, fb: ForwardBatch, static: bool) -> Optional[_Metadata]:
        mode = fb.forward_mode
        bs = fb.batch_size
        if mode.is_idle() or bs == 0:
            return None
        if static and self._graph is None:
            raise RuntimeError("specfused: init_cuda_graph_state must run before CUDA-graph metadata")
        req_pool_indices = fb.req_pool_indices[:bs]
        seq_lens = fb.seq_lens[:bs]
        if mode.is_target_verify():
            n = self._tokens_per_request(fb.spec_info)
            kv_lens = seq_lens + n  # TARGET_VERIFY seq_lens exclude the drafts
        else:
            n = 1
            kv_lens = seq_lens
        if static:
            buffers = self._graph
            kv_indptr = buffers["kv_indptr"][: bs + 1]
            kv_indices = buffers["kv_indices"]
        else:
            kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=self.device)
            # seq_lens_sum is a host int (None in gpu_only mode: then an upper bound).
            total = fb.seq_lens_sum if fb.seq_lens_sum is not None else bs * self.max_context_len
            kv_indices = torch.empty(total + bs * n, dtype=torch.int32, device=self.device)
        kv_indptr[1:] = torch.cumsum(kv_lens, 0)
        # The slots come from SGLang's own KV-index plan: virtual->physical translation and
        # page tables are its business; the drafts' slots follow the prefix in req_to_token.
        self.kv_index_translator.pack_read_stream(
            fb.kv_loc_plan, req_pool_indices=req_pool_indices, seq_lens=kv_lens, indptr=kv_indptr,
            out=kv_indices)
        if not mode.is_target_verify():
            return _Metadata(kv_indptr, kv_indices, None, None, 1)

        if static:
            qo_indptr = buffers["qo_indptr"][: bs + 1]
            torch.arange(0, (bs + 1) * n, n, dtype=torch.int32, device=self.device, out=qo_indptr)
            tree_mask = buffers["tree_mask"][: bs * n]
            tree_mask.copy_(self._draft_words(fb.spec_info, seq_lens, bs, n))
        else:
            qo_indptr = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32, device=self.device)
            tree_mask = self._draft_words(fb.spec_info, seq_lens, bs, n)
        return _Metadata(kv_indptr, kv_indices, qo_indptr, tree_mask, n)

    def _planned(self, md: Optional[_Metadata]) -> Optional[_Metadata]:
        """md with a plan for every layer geometry seen so far (all of them after the first step),
        so that forward_* only runs."""
        if md is not None:
            for key in self._geometries:
                self._plan(md, key)
        return md

    def _plan(self, md: _Metadata, key: tuple):
        plan = md.plans.get(key)
        if plan is None:
            mla, heads, kv_heads, head_dim, v_head_dim, dtype, scaling, kv_dtype = key
            layout = (md.kv_indptr, md.kv_indices, md.qo_indptr, md.tree_mask)
            draft = dict(max_draft_tokens=md.num_draft) if md.qo_indptr is not None else {}
            kv = dict(kv_dtype=kv_dtype) if kv_dtype in KV_FP8_DTYPES else {}
            if mla:
                plan = MlaPlan(*layout, num_heads=heads, head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype,
                               sm_scale=scaling, **draft, **kv)
            else:
                plan = TreeVerifyPlan(*layout, num_q_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                      v_head_dim=v_head_dim, dtype=dtype, sm_scale=scaling, **draft, **kv)
            md.plans[key] = plan
            self._geometries.add(key)
        return plan

    def _tokens_per_request(self, spec_info) -> int:
        # `--speculative-adaptive` verifies with draft_token_num = 1 when it turns drafting
        # off; num_tokens_per_req is the per-batch width (a host int).
        n = getattr(spec_info, "num_tokens_per_req", -1) if spec_info is not None else -1
        if n is None or n <= 0:
            n = getattr(spec_info, "draft_token_num", None) or self.num_draft_tokens
        if not 1 <= n <= masks.MAX_DRAFT_TOKENS:
            raise SpecFusedUnsupported(f"specfused verifies 1..{masks.MAX_DRAFT_TOKENS} tokens per request, got {n}")
        return int(n)

    def _draft_words(self, spec_info, prefix_lens: torch.Tensor, bs: int, n: int) -> torch.Tensor:
        mask = getattr(spec_info, "custom_mask", None)
        if n == 1:
            return torch.ones(bs, dtype=torch.int64, device=self.device)
        if mask is None:  # no mask: SGLang's backends run the drafts causally (a chain)
            return masks.chain_words(bs * n, n, self.device)
        qlen_buffer = self._verify_mask.buffer if self._verify_mask is not None else None
        if masks.is_qlen_layout(mask, bs, n, qlen_buffer):
            return masks.words_from_qlen_mask(mask, bs, n)
        return masks.words_from_full_mask(mask, prefix_lens, n)

    # ------------------------------------------------------------------ forward
    def _save_kv(self, layer, forward_batch, k, v, save_kv_cache: bool, k_rope=None) -> None:
        if not save_kv_cache or k is None or v is None:
            return
        loc = KVWriteLoc.for_batch(forward_batch)
        fp8 = self.kv_cache_dtype in KV_FP8_DTYPES
        if self.use_mla:
            # The MLA pool takes no scales (as SGLang's own MLA backends do): divide here.
            if fp8 and layer.k_scale is not None:
                k = k / layer.k_scale
                k_rope = k_rope / layer.k_scale if k_rope is not None else None
            if k_rope is not None:  # split form: k is the latent part
                self.token_to_kv_pool.set_mla_kv_buffer(layer, loc, k, k_rope)
            else:  # k is the whole latent row
                self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
        elif fp8 and (layer.k_scale is not None or layer.v_scale is not None):
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v, layer.k_scale, layer.v_scale)
        else:
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)

    def _scales(self, layer) -> dict:
        """The layer's dequantisation scales for an fp8 cache (as SGLang's triton backend reads
        them: both or neither, 1.0 without), none otherwise."""
        if self.kv_cache_dtype not in KV_FP8_DTYPES:
            return {}
        if self.use_mla:  # the latent row (K, and V = its first columns) was stored / k_scale
            k = float(layer.k_scale_float if layer.k_scale_float is not None else layer.k_scale) \
                if layer.k_scale is not None else 1.0
            return dict(k_scale=k, v_scale=k)
        if layer.k_scale is not None and layer.v_scale is not None:
            return dict(k_scale=float(layer.k_scale_float), v_scale=float(layer.v_scale_float))
        return dict(k_scale=1.0, v_scale=1.0)

    def _kv_buffers(self, layer):
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        if k_cache.dim() != 3 or v_cache.dim() != 3:
            raise SpecFusedUnsupported(
                f"specfused reads token-major [slots, heads, dim] KV buffers, got {tuple(k_cache.shape)}; "
                "the HND / vectorized KV layouts are not supported")
        return k_cache, v_cache

    def _attend(self, q, k, v, layer, forward_batch, save_kv_cache, sinks, score_mod, verify: bool,
                q_rope=None, k_rope=None):
        _check_layer(layer, sinks, score_mod, self.kv_cache_dtype in KV_FP8_DTYPES)
        self._save_kv(layer, forward_batch, k, v, save_kv_cache, k_rope)
        md = self.forward_metadata
        heads = layer.tp_q_head_num
        if q_rope is not None:  # MLA, split form: q is the latent part, q_rope the rope part
            q3 = torch.cat([q.view(-1, heads, layer.v_head_dim),
                            q_rope.view(-1, heads, layer.qk_head_dim - layer.v_head_dim)], dim=-1)
        else:
            q3 = q.reshape(-1, heads, layer.qk_head_dim).contiguous()
        o = q.new_empty((q3.shape[0], heads * layer.v_head_dim))
        out = o.view(-1, heads, layer.v_head_dim)
        if verify != (md.qo_indptr is not None):
            raise RuntimeError("specfused: the forward metadata was built for another forward mode")
        # The batch's plan for this layer's geometry (made in init_forward_metadata after the
        # first step; the first step plans at its first layer), then only the launch.
        kv_heads = 1 if self.use_mla else layer.tp_k_head_num
        plan = self._plan(md, (self.use_mla, heads, kv_heads, layer.qk_head_dim, layer.v_head_dim, q3.dtype,
                               float(layer.scaling), self.kv_cache_dtype))
        if self.use_mla:
            # One latent head [slots, 1, 576]; the ops read the value as its first v_head_dim values.
            plan.run(q3, self.token_to_kv_pool.get_key_buffer(layer.layer_id), out=out, **self._scales(layer))
        else:
            k_cache, v_cache = self._kv_buffers(layer)
            plan.run(q3, k_cache, v_cache, out=out, **self._scales(layer))
        return o

    # q_rope / k_rope: SGLang's MLA backends' split form (FlashInfer-MLA's forward_decode/extend).
    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True,
                       sinks=None, score_mod=None, q_rope=None, k_rope=None, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, sinks, score_mod, verify=False,
                            q_rope=q_rope, k_rope=k_rope)

    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True,
                       sinks=None, score_mod=None, q_rope=None, k_rope=None, **kwargs):
        if forward_batch.forward_mode.is_target_verify():
            return self._attend(q, k, v, layer, forward_batch, save_kv_cache, sinks, score_mod, verify=True,
                                q_rope=q_rope, k_rope=k_rope)
        extra = dict(sinks=sinks, score_mod=score_mod, q_rope=q_rope, k_rope=k_rope)
        kwargs.update({name: value for name, value in extra.items() if value is not None})
        return self.prefill_backend.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)


def _check_fused_allreduce() -> None:
    """Raise a failure the fused TP allreduce kernels reported (host memory, no device sync), so a
    step never runs on the NaN a failed allreduce leaves; nothing when the hook is not installed."""
    hooks = active_fused_allreduce()
    if hooks is not None:
        hooks.check_device_errors()
