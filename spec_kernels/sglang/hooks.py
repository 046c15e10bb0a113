"""Optional SGLang hooks of the spec-kernels plugin. Off by default.

``SPEC_KERNELS_SGLANG_FUSED_ALLREDUCE`` (unset / ``0``: off; ``1`` or ``auto``; ``force``)
    SGLang 0.5.23 completes a tensor-parallel layer's output sum at the NEXT stage's input, in its
    "layer boundary" code, and asks two functions for the fused kernels that may do the
    allreduce + residual add + RMSNorm in one go:

    * ``sglang.srt.layers.layer_boundary.fusions.allreduce.attn_input_fusions`` (the FFN/MoE output
      of layer i, carried as an ``UnreducedOutput``, completed at the attention input of layer
      i + 1), and
    * ``...fusions.allreduce.ffn_input_fusions`` (the attention output, completed at the FFN input
      of the same layer; ``FfnInputFusion`` candidates).

    Both run once per stage when the model is built; the candidates they return are tried per
    batch, in order, and each may decline (return None before touching anything), after which
    SGLang's own path runs: its other fused kernels (FlashInfer / aiter, where they apply), else
    its allreduce followed by ``RMSNorm(x, residual)``. With the variable set, HookRegistry AROUND
    hooks on those two functions put one more candidate FIRST: it runs
    ``FusedAllReduce.all_reduce_add_rmsnorm(partial, residual, norm_weight, eps)`` and returns
    (normed, new residual), as SGLang's FlashInfer fusion does. A ``FusedAllReduce`` is built lazily
    on the first batch per (TP group, hidden size, dtype, device) and closed at exit.

    ``auto`` (``1``) takes a batch only when the communicator would run one of its CUDA algorithms
    (one-shot push/pull, two-shot) on it; where it would fall back to torch.distributed (CPU
    tensors, fp32, no P2P, an unbuilt extension, ...), SGLang's own path is at least as fast, so
    the candidate declines. ``force`` also takes those batches (tests, debugging).

    The candidate declines (SGLang's path runs) for: norms other than a plain ``RMSNorm`` (weight,
    no variance override, no HF cast, no fp32 residual) or ``GemmaRMSNorm``; a norm weight whose
    dtype differs from the activations; dtypes other than fp16/bf16/fp32; non-contiguous or
    non-2-D tensors; 0 or more than max_tokens rows; hidden > 16384; a group of one rank; owed
    work that is not a plain group sum (attention-DP redistribution, a model's custom sum, a MoE
    finalize); attention DP; two-batch overlap; breakable CUDA graphs; batch-invariant mode;
    quantized communication; input-scattered attention TP; a first batch seen inside CUDA-graph
    capture (the communicator's construction is collective and cannot be captured). Every
    condition depends only on what all TP ranks share (shapes, dtypes, configuration), so the
    ranks always agree on taking a batch.

``SPEC_KERNELS_SGLANG_DRAFT_SLOTS``
    Not implemented, on purpose: SGLang 0.5.23's allocator and EAGLE bookkeeping cannot be
    mapped onto alloc_draft_slots / commit_draft_slots without replacing SGLang's spec-decode
    memory management (see docs/sglang.md, "Draft KV slots"). Setting it logs that and patches
    nothing.

SGLang is imported only inside the functions here.
"""
from __future__ import annotations

import atexit
import logging
import os
from collections import Counter
from functools import partial
from types import SimpleNamespace
from typing import Optional

import torch

logger = logging.getLogger(__name__)

FUSED_ALLREDUCE_ENV = "SPEC_KERNELS_SGLANG_FUSED_ALLREDUCE"
FUSED_ALLREDUCE_MAX_TOKENS_ENV = "SPEC_KERNELS_SGLANG_FUSED_ALLREDUCE_MAX_TOKENS"
DRAFT_SLOTS_ENV = "SPEC_KERNELS_SGLANG_DRAFT_SLOTS"

ATTN_INPUT_TARGET = "sglang.srt.layers.layer_boundary.fusions.allreduce.attn_input_fusions"
FFN_INPUT_TARGET = "sglang.srt.layers.layer_boundary.fusions.allreduce.ffn_input_fusions"
HOOK_TARGETS = (ATTN_INPUT_TARGET, FFN_INPUT_TARGET)

# SGLang's FlashInfer fusion takes up to 2048 rows (FUSE_ALLREDUCE_MAX_BATCH_SIZE); the same bound
# sizes our communicator's buffers (max_tokens x hidden per rank).
DEFAULT_MAX_TOKENS = 2048
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HIDDEN = 16384

_OFF = ("", "0", "off", "false", "no")
_AUTO = ("1", "on", "true", "yes", "auto")

DRAFT_SLOTS_REASON = (
    "SGLang 0.5.23 keeps each request's KV slots up to a host-side kv_allocated_len (committed + "
    "2 x max(steps x topk, draft tokens), allocated by eagle_prepare_for_decode in the scheduler "
    "before the forward) and frees them only when the request is released; its allocator's free "
    "list is a host-sized tensor queue. alloc_draft_slots / commit_draft_slots keep the free-page "
    "stack on the device and free rejected drafts every step, which SGLang's bookkeeping would "
    "double-free. See docs/sglang.md, 'Draft KV slots', for the functions that would have to change")


def fused_allreduce_mode(value: Optional[str] = None) -> Optional[str]:
    """None (off), "auto" or "force", from ``value`` or $SPEC_KERNELS_SGLANG_FUSED_ALLREDUCE."""
    if value is None:
        value = os.environ.get(FUSED_ALLREDUCE_ENV, "")
    v = value.strip().lower()
    if v in _OFF:
        return None
    if v in _AUTO:
        return "auto"
    if v == "force":
        return "force"
    raise ValueError(f"{FUSED_ALLREDUCE_ENV}={value!r}: expected unset, 0, 1/auto or force")


def max_tokens_from_env() -> int:
    value = os.environ.get(FUSED_ALLREDUCE_MAX_TOKENS_ENV, "").strip()
    if not value:
        return DEFAULT_MAX_TOKENS
    n = int(value)
    if n < 1:
        raise ValueError(f"{FUSED_ALLREDUCE_MAX_TOKENS_ENV} must be >= 1, got {value!r}")
    return n


# --------------------------------------------------------------------------- the norm
def norm_weight_and_eps(norm) -> Optional[tuple[torch.Tensor, float]]:
    """The multiplier and eps of a norm our fused add + RMSNorm computes exactly, else None.

    RMSNorm: x + residual in fp32, residual stored in the activation dtype, the norm of the fp32
    sum times weight (what SGLang's forward_native and sgl-kernel's fused_add_rmsnorm do).
    GemmaRMSNorm: the same with weight + 1 (SGLang keeps it pre-folded as ``gemma_weight``), as
    its CUDA path (sgl-kernel gemma_fused_add_rmsnorm) computes it; its forward_native normalises
    the sum after rounding it to the activation dtype (a difference within that rounding)."""
    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm

    if type(norm) is RMSNorm:
        if (not norm.has_weight or norm.variance_size_override is not None or norm.cast_x_before_out_mul
                or norm.fp32_residual or norm.override_orig_dtype is not None):
            return None
        return norm.weight, float(norm.variance_epsilon)
    if type(norm) is GemmaRMSNorm:
        return norm.gemma_weight, float(norm.variance_epsilon)
    return None


# --------------------------------------------------------------------------- the hooks
def _sglang_names() -> SimpleNamespace:
    """The SGLang 0.5.23 names the per-batch checks use, imported once (not per layer call)."""
    from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.layers.layer_boundary import (FfnInputFusion, SumGroup, TokenAxis, UnreducedOutput,
                                                  get_attn_tp_context)
    from sglang.srt.layers.layer_boundary.layout import _sum_group
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import is_in_breakable_cuda_graph
    from sglang.srt.runtime_context import get_exec

    return SimpleNamespace(
        is_batch_invariant_mode_enabled=is_batch_invariant_mode_enabled,
        is_dp_attention_enabled=is_dp_attention_enabled,
        FfnInputFusion=FfnInputFusion, SumGroup=SumGroup, TokenAxis=TokenAxis, UnreducedOutput=UnreducedOutput,
        get_attn_tp_context=get_attn_tp_context, sum_group=_sum_group,
        is_in_breakable_cuda_graph=is_in_breakable_cuda_graph, get_exec=get_exec)


class FusedAllReduceHooks:
    """The two HookRegistry AROUND hooks and the communicators they build (one per process)."""

    def __init__(self, mode: str, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if mode not in ("auto", "force"):
            raise ValueError(f"mode must be 'auto' or 'force', got {mode!r}")
        self.mode = mode
        self.max_tokens = int(max_tokens)
        self._comms: dict = {}  # (ranks, hidden, dtype, device) -> FusedAllReduce, or why not (str)
        self._logged: set = set()
        self.taken: Counter = Counter()  # (site, algorithm) -> batches
        self.declined: Counter = Counter()  # (site, reason kind) -> batches
        self._sg = _sglang_names()

    # ---- construction-time hooks (HookRegistry AROUND: original first, ours prepended)
    def attn_input_fusions(self, original, plan, *args, **kwargs):
        given = original(plan, *args, **kwargs)
        if not self._plan_supported(plan, "attn_input"):
            return given
        return (partial(self._attn_input, plan), *given)

    def ffn_input_fusions(self, original, plan, *args, **kwargs):
        given = original(plan, *args, **kwargs)
        sg = self._sg
        if not self._plan_supported(plan, "ffn_input"):
            return given
        if sg.TokenAxis.ATTN_TP in plan.incoming_residual_rows.sharded:
            self._log_once(("plan", "ffn_input", "scattered"), "spec_kernels fused allreduce: the FFN input "
                           "keeps its residual on attention-TP slices; SGLang's own path stays in use")
            return given
        # preserves_residual=None: we never mutate the residual (a new one is returned), but a
        # candidate that may decline cannot promise it is the one selected.
        return (sg.FfnInputFusion(completes=sg.SumGroup.ATTN_TP, run=partial(self._ffn_input, plan)), *given)

    def _plan_supported(self, plan, site: str) -> bool:
        if norm_weight_and_eps(getattr(plan, "norm", None)) is None:
            kind = type(getattr(plan, "norm", None)).__name__
            self._log_once(("plan", site, kind), f"spec_kernels fused allreduce: {site} norm {kind} is not a "
                           "plain RMSNorm/GemmaRMSNorm; SGLang's own path stays in use there")
            return False
        return True

    # ---- per-batch candidates
    def _attn_input(self, plan, owed, residual, forward_batch, post_residual_addition):
        if (not isinstance(owed, self._sg.UnreducedOutput) or owed.group is None or owed.complete_sum is not None
                or owed.reduce_to_dp_local is not None):
            return self._decline("attn_input", "owed", "the carried output is not a plain group sum "
                                 f"({type(owed).__name__})")
        return self._run("attn_input", plan, owed.partial, residual, forward_batch, owed.group,
                         post_residual_addition)

    def _ffn_input(self, plan, hidden_states, residual, forward_batch):
        group = self._sg.sum_group(self._sg.SumGroup.ATTN_TP)
        return self._run("ffn_input", plan, hidden_states, residual, forward_batch, group, None)

    def _run(self, site, plan, x, residual, forward_batch, group, post_residual_addition):
        norm = norm_weight_and_eps(plan.norm)
        why = self._why_not(plan, x, residual, norm, forward_batch, group)
        if why is not None:
            return self._decline(site, *why)
        comm = self._comm(group, x)
        if isinstance(comm, str):
            return self._decline(site, "communicator", comm)
        algorithm = comm.algorithm_for(x.shape[0])
        if self.mode == "auto" and algorithm == "torch":
            return self._decline(site, "torch", f"FusedAllReduce would use torch.distributed ({algorithm.reason}); "
                                 "SGLang's own allreduce + RMSNorm is at least as fast (force to use it anyway)")
        if post_residual_addition is not None:
            residual = residual + post_residual_addition
        weight, eps = norm
        out, residual_out = comm.all_reduce_add_rmsnorm(x, residual, weight.detach(), eps)
        self.taken[(site, str(algorithm))] += 1
        self._log_once(("taken", site, str(algorithm), comm.hidden_size, comm.dtype),
                       f"spec_kernels fused allreduce: {site} allreduce + residual + RMSNorm runs on "
                       f"FusedAllReduce ({algorithm}: {algorithm.reason}) for {comm!r}")
        return out, residual_out

    def _why_not(self, plan, x, residual, norm, forward_batch, group) -> Optional[tuple[str, str]]:
        """Why the batch stays on SGLang's path (kind, message), or None. Only rank-shared facts."""
        sg = self._sg
        if norm is None:
            return "norm", f"norm {type(plan.norm).__name__} is not supported"
        weight, _ = norm
        if residual is None or not isinstance(x, torch.Tensor):
            return "shape", "no residual to add"
        if x.dim() != 2 or residual.shape != x.shape:
            return "shape", f"x {tuple(x.shape)} / residual {tuple(residual.shape)} are not the same [tokens, hidden]"
        if x.dtype not in _DTYPES or residual.dtype != x.dtype or weight.dtype != x.dtype:
            return "dtype", (f"dtypes x {x.dtype}, residual {residual.dtype}, norm weight {weight.dtype} "
                             "(need one of fp16/bf16/fp32 for all three)")
        if weight.device != x.device or residual.device != x.device:
            return "device", "x, residual and norm weight are not on one device"
        if not (x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous()):
            return "layout", "non-contiguous tensors"
        if not 0 < x.shape[0] <= self.max_tokens:
            return "rows", f"{x.shape[0]} rows (takes 1..{self.max_tokens}, {FUSED_ALLREDUCE_MAX_TOKENS_ENV})"
        if x.shape[1] > _MAX_HIDDEN:
            return "hidden", f"hidden {x.shape[1]} > {_MAX_HIDDEN}"
        if group is None or group.world_size < 2:
            return "group", "a group of one rank has nothing to reduce"
        if sg.is_dp_attention_enabled():
            return "config", "attention DP"
        if getattr(forward_batch, "can_run_tbo", False):
            return "config", "two-batch overlap"
        if sg.is_in_breakable_cuda_graph():
            return "config", "breakable CUDA graph"
        if sg.is_batch_invariant_mode_enabled():
            return "config", "batch-invariant mode"
        if sg.get_exec().comm.enable_quant_communications:
            return "config", "quantized communication"
        if sg.get_attn_tp_context().input_scattered:
            return "config", "input-scattered attention TP"
        if sg.TokenAxis.ATTN_TP in plan.fused_input_rows(forward_batch).sharded:
            return "config", "the stage reads its input on attention-TP slices"
        return None

    def _comm(self, group, x: torch.Tensor):
        """The communicator for (group, hidden, dtype, device), built on first use; or why not."""
        key = (tuple(group.ranks), x.shape[1], x.dtype, str(x.device))
        comm = self._comms.get(key)
        if comm is not None:
            return comm
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return "first seen inside CUDA-graph capture (construction is a collective)"
        if self.mode == "auto" and not x.is_cuda:
            return "CPU tensors: FusedAllReduce has only its torch.distributed path there"
        from spec_kernels.comm import FusedAllReduce

        pg = group.device_group if x.is_cuda else group.cpu_group
        try:
            comm = FusedAllReduce(pg, max_tokens=self.max_tokens, hidden_size=x.shape[1], dtype=x.dtype,
                                  device=x.device)
        except Exception as exc:  # noqa: BLE001 - collective checks raise on every rank alike
            comm = f"building FusedAllReduce failed: {exc}"
            logger.warning("spec_kernels fused allreduce: %s; SGLang's own path stays in use for group %s, "
                           "hidden %d, %s", comm, list(group.ranks), x.shape[1], x.dtype)
        else:
            usable = {a: ("usable" if why is None else why) for a, why in comm.available.items()}
            logger.info("spec_kernels fused allreduce: built %r (algorithms: %s)", comm, usable)
        self._comms[key] = comm
        return comm

    def _decline(self, site: str, kind: str, message: str):
        self.declined[(site, kind)] += 1
        self._log_once(("declined", site, kind), f"spec_kernels fused allreduce: {site} stays on SGLang's own "
                       f"path: {message} (logged once per reason)")
        return None

    def _log_once(self, key, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.info(message)

    def communicators(self) -> list:
        return [c for c in self._comms.values() if not isinstance(c, str)]

    def check_device_errors(self) -> None:
        """Raise the RuntimeError of a failure one of this process's fused-allreduce kernels has
        reported (rank, algorithm, device call number). Host memory only, no device sync: the
        attention backend calls it before every forward step, CUDA graph replays included, where
        no per-call host code of the captured allreduces runs."""
        for comm in self.communicators():
            try:
                comm.check_device_errors()
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}\n{RECOVERY}") from exc

    def reset(self) -> None:
        """FusedAllReduce.reset() on every communicator of this process, in construction order:
        collective, so every TP rank calls it (see RECOVERY)."""
        for comm in self.communicators():
            comm.reset()

    def close(self) -> None:
        """Close every communicator (registered with atexit)."""
        for comm in self.communicators():
            try:
                comm.close()
            except Exception:  # noqa: BLE001 - at exit, nothing left to do about it
                logger.exception("spec_kernels fused allreduce: closing %r failed", comm)
        self._comms.clear()


RECOVERY = ("To recover without a restart: once every TP rank has stopped stepping, call "
            "spec_kernels.sglang.hooks.active_fused_allreduce().reset() on every rank (collective; it "
            "re-arms the fused allreduce's buffers in place, CUDA graphs stay valid). Otherwise restart the "
            "server. A timeout means a rank was dead, stalled past timeout_s (a long JIT or graph capture) "
            "or not making the same calls.")


# --------------------------------------------------------------------------- installation
_active: Optional[FusedAllReduceHooks] = None


def active_fused_allreduce() -> Optional[FusedAllReduceHooks]:
    """The installed hooks object (its ``taken`` / ``declined`` counters), or None."""
    return _active


def install_from_env() -> list[str]:
    """Register the hooks the environment asks for with SGLang's HookRegistry (applied by
    ``load_plugins`` after all plugins ran). Idempotent. Returns the targets registered now."""
    global _active
    registered: list[str] = []
    try:
        mode = fused_allreduce_mode()
        max_tokens = max_tokens_from_env() if mode else DEFAULT_MAX_TOKENS
    except ValueError as exc:
        logger.error("spec_kernels: %s; the fused allreduce hook stays off", exc)
        mode = None
    if mode is not None and _active is None:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        hooks = FusedAllReduceHooks(mode, max_tokens)
        HookRegistry.register(ATTN_INPUT_TARGET, hooks.attn_input_fusions, HookType.AROUND)
        HookRegistry.register(FFN_INPUT_TARGET, hooks.ffn_input_fusions, HookType.AROUND)
        atexit.register(hooks.close)
        _active = hooks
        registered += list(HOOK_TARGETS)
        logger.info("spec_kernels: %s=%s: TP allreduce + residual + RMSNorm hooks registered on %s "
                    "(max_tokens %d)", FUSED_ALLREDUCE_ENV, mode, ", ".join(HOOK_TARGETS), max_tokens)
    if os.environ.get(DRAFT_SLOTS_ENV, "").strip().lower() not in _OFF:
        logger.warning("spec_kernels: %s is set, but no draft KV-slot hook is installed: %s. SGLang's own "
                       "allocation stays in use.", DRAFT_SLOTS_ENV, DRAFT_SLOTS_REASON)
    return registered
