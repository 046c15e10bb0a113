"""One transformer layer's decode step, plain decoding vs an EAGLE verify step, side by side.

    pytest benchmarks/test_decode_step.py --benchmark-only                      # preset by device
    SPEC_KERNELS_BENCH_PRESET=gpu pytest benchmarks/test_decode_step.py --benchmark-only \\
        --benchmark-json=OUT/decode_step.json                                   # + OUT/decode_step-*.png
    python -m spec_kernels.policy --costs OUT/decode_step.json --acceptance ACC.json \\
        --select preset=kimi-k2.5-tp8                                           # when does EAGLE pay?

Why: the deployment in docs/design.md (Kimi K2.5, TP8) lost 16-58% throughput with EAGLE-3 under
load. An EAGLE step pushes B x n tokens through the target model where plain decoding pushes B;
whether that pays depends on how each part of a layer's time grows with its token count. This
module measures exactly that, per layer and per part, on one GPU rank.

What is timed, per model preset (benchmarks/decode_step_models.py: per-rank shapes of
Llama-3.1-8B TP1, Llama-3.3-70B TP8, DeepSeek-V3 TP8, Kimi K2.5 TP8; tiny ones on CPU), context L
(KV slots per request before the step) and batch B, for plain decode (mode "baseline", n = 1) and
for EAGLE verify with n draft tokens per request (mode "eagle"), with T = B x n rows:

* ``test_decode_step``: one layer, its kernels back to back, T rows: the layer's GEMMs as
  torch.matmul (QKV / MLA projections, O, the MLP or the MoE proxy); attention: the step's new
  K/V rows written into the paged cache (index_copy_, page size 1) and then
  ``spec_kernels.decode_attention`` (baseline) or ``spec_kernels.tree_verify_attention`` over a
  random tree per request (eagle), for the MLA presets ``spec_kernels.mla``'s
  ``mla_decode_attention`` / ``mla_tree_verify_attention`` on the 576-dim latent cache; two
  ``spec_kernels.fused_add_rmsnorm`` (after attention, after the MLP). Once per step, not per
  layer: ``spec_kernels.alloc_draft_slots`` (baseline: 1 slot per request; eagle: n) and, for
  eagle, ``commit_draft_slots`` of a random accepted path. A round
  runs ``layers`` layers (the preset's count, rotating over input sets) and one alloc/commit, so
  the per-call median is one layer plus 1/layers of the step's KV work and
  ``median x layers`` (extra_info "layers") is the step: what ``python -m spec_kernels.policy``
  reads (kind "decode_step").
* ``test_decode_component``: the same parts alone (kind "decode_component": attention, gemm,
  norm per layer; kv per step), so the summary shows where the time goes; and the anchors beside
  ours when importable, else reported as skipped: SGLang 0.5.23's Triton extend attention with
  its full n x (L + n) custom mask (``sglang.kernels.ops.attention.extend_attention``, through
  benchmarks/_sglang_kernels.py, which also loads it on the GPU machine without SGLang installed;
  on CPU it runs under the interpreter in fp32), FlashInfer's paged prefill with a custom mask
  (``BatchPrefillWithPagedKVCacheWrapper``; plan() outside the timing, as a server plans once per
  step) and FlashInfer's fused_add_rmsnorm. Each anchor's output is checked against ours first
  where both compute the same thing. Our attention also runs on an fp8 (e4m3) cache of the same
  shape (impl ``<impl>+kv_fp8_e4m3``, extra_info ``kv_cache``; SGLang's ``--kv-cache-dtype
  fp8_e4m3``): the store quantises the step's rows, q and out are in the preset's dtype (fp16 on
  the fp32 CPU presets), and bytes / GB/s count one byte per cached value. The steps stay on the
  model-dtype cache, so the policy's inputs do not change.
* ``test_allreduce_anchor``: always skipped here. This module runs ONE process: the allreduce
  before each norm is NOT timed (only its local part, the fused add + RMSNorm), and plain
  torch.distributed all_reduce means nothing on a world of one. Multi-rank allreduce (ours and
  NCCL/gloo) is benchmarks/test_allreduce_rmsnorm.py; extra_info "allreduce_bytes" is the
  per-call message a TP>1 server would reduce twice per layer, for adding a measured cost.

MLA presets: attention is spec_kernels.mla's op (576-dim latent, V = its first 512). Where
``spec_kernels.mla`` does not import (it is new), a PROXY runs instead, labelled
``attention: mla-proxy`` in extra_info: tree_verify_attention with 2H query heads of 256 dims over
ONE KV head (K and V of 256 each): 1024 bytes per cached token (bf16) against MLA's 1152 and about
the same FLOPs (H x 1024 vs H x 1088 multiply-adds per query token per key). MoE layers use the
grouped-GEMM proxy of decode_step_models.py (bf16 experts, uniform routing: an upper bound of the
expert weights read).

NOT timed: the draft model (EAGLE's draft passes: add them as mode "draft" results or as the
policy's --draft-fixed-s), sampling and the acceptance check, the scheduler and other host work,
embedding and lm_head, elementwise ops (RoPE, SiLU-and-mul, MLA layernorms, MoE routing and
gather/scatter), the tensor-parallel allreduce (see above). Data do not flow between the kernels
(each reads its own random input); sizes and order are those of a layer. Timing method:
benchmarks/_timing.py (GPU: a round captured in one CUDA graph, eager if capture fails; per-call
statistics; input sets rotated so that weights and KV are not served from L2).

Grids (decode_step_models.GRIDS, by SPEC_KERNELS_BENCH_PRESET): ``tiny`` (CPU default: tiny-gqa
and tiny-mla, B 1, 3, n 4, 16, L 64; ~30 s through the interpreter on 2 idle cores; checks the
harness, its times mean nothing), ``gpu-quick`` (scripts/gpu_check.sh: Kimi K2.5 and
Llama-3.3-70B TP8, B 1, 10, 70, 250, n 4, 16, L 2048; steps run before components, so a run cut
short by its time limit still saved the steps), ``gpu`` (GPU default: every GPU preset, B in
{1, 2, 5, 10, 30, 70, 100, 250}, n in {4, 8, 16, 32}, L 2048). Override with
SPEC_KERNELS_DECODE_MODELS=kimi-k2.5-tp8,... and SPEC_KERNELS_DECODE_L=1024,8192 (comma lists;
then select one L in the policy: --select L=1024).

Output: the end-of-session summary (benchmarks/_timing.py: step time baseline vs EAGLE per B and
n, tok/s of plain decoding, the EAGLE/baseline ratio = the accepted tokens per request an EAGLE
step needs to tie; then the components and the anchors), and with --benchmark-json=PATH one PNG
per (preset, L) next to PATH: decode_step-<preset>-L<L>.png (also: python benchmarks/_timing.py
--plots DIR PATH).

GPU targets (docs/design.md): the decode-step benchmarks reproduce the deployment table
qualitatively (EAGLE's step growing much faster with B than plain decoding's; add the allreduce
measured on the target machine), and the policy built from them never predicts a configuration
slower than the better of baseline and EAGLE. The anchor rows say what the anchors' attention
would cost in the same step (step - ours + anchor). No GPU figure exists yet: the only runs so far
are CPU runs of the tiny presets, whose times say nothing about a GPU.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch

import _sglang_kernels
import _timing
import decode_step_models as models
import spec_kernels
from spec_kernels._ops import REGISTRY, op_impls

PRESET = _timing.active_preset()
DEVICE = _timing.bench_device()
DTYPE = getattr(torch, PRESET.dtype)
GRID = models.grid_for(PRESET.name, os.environ.get("SPEC_KERNELS_DECODE_MODELS"),
                       os.environ.get("SPEC_KERNELS_DECODE_L"))
EPS = 1e-6
PROXY_DIM = 256  # the MLA proxy's head dim (see the module docstring)
# The attention component's fp8-cache rows (SGLang's --kv-cache-dtype fp8_e4m3): the cache in
# e4m3 with one per-layer scale for K and V; q and out in the preset's dtype, fp16 where that is
# fp32 (fp8 caches are read with fp16 / bf16 queries).
KV_FP8 = torch.float8_e4m3fn
KV_FP8_SCALE = 0.05
FP8_Q_DTYPE = DTYPE if DTYPE in (torch.float16, torch.bfloat16) else torch.float16
KV_PAGE_SIZE = 1  # SGLang's default for EAGLE trees


def _mla_ops() -> tuple[Optional[Callable], Optional[Callable]]:
    """spec_kernels' MLA tree-verify and decode ops (None, None while spec_kernels.mla does not
    import or lacks them: the MLA presets then time the proxy)."""
    try:
        import spec_kernels.mla as mla
    except Exception:  # noqa: BLE001  written concurrently by another engineer: any failure means "not yet"
        return None, None
    return getattr(mla, "mla_tree_verify_attention", None), getattr(mla, "mla_decode_attention", None)


MLA_OP, MLA_DECODE = _mla_ops()


# --------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One step: B requests with L cached slots each push n tokens each (n = 1: plain decode)."""

    model: models.ModelPreset
    B: int
    n: int
    L: int

    @property
    def mode(self) -> str:
        return "baseline" if self.n == 1 else "eagle"

    @property
    def T(self) -> int:
        return self.B * self.n

    @property
    def id(self) -> str:
        return f"{self.model.name}-L{self.L}-B{self.B}-n{self.n}"

    @property
    def attention(self) -> str:
        """The attention ours runs: "gqa", "mla" (the MLA op) or "mla-proxy"."""
        if not self.model.is_mla:
            return "gqa"
        return "mla" if MLA_OP is not None else "mla-proxy"

    def info(self) -> dict:
        """extra_info every result of this case carries (selection keys of the policy)."""
        return dict(preset=self.model.name, model=self.model.model, tp=self.model.tp, mode=self.mode, B=self.B,
                    n=self.n, L=self.L, tokens=self.T, layers=self.model.layers, attention=self.attention,
                    dtype=PRESET.dtype, bench_preset=PRESET.name, kv_page_size=KV_PAGE_SIZE,
                    allreduce="not timed: one process (the norm is the local add + RMSNorm)",
                    allreduce_bytes=self.T * self.model.hidden * DTYPE.itemsize if self.model.tp > 1 else 0)


CASES = [Case(models.PRESETS[m], B, n, L) for m in GRID.models for L in GRID.contexts for B in GRID.batch_sizes
         for n in (1,) + GRID.draft_counts]


# --------------------------------------------------------------------------- inputs
def _randn(*shape, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE).mul_(scale)


def random_parents(B: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """One random tree per request: draft 0 is the root, draft i's parent is uniform in [0, i)."""
    parents = (torch.rand(B, n, generator=gen) * torch.arange(n)).long()
    parents[:, 0] = -1
    return parents


def random_paths(parents: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random accepted path per request (root to a random node): accept_index [B, n] padded
    with -1, accept_len [B]."""
    B, n = parents.shape
    index = torch.full((B, n), -1, dtype=torch.int64)
    length = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        node, path = int(torch.randint(n, (1,), generator=gen)), []
        while node >= 0:
            path.append(node)
            node = int(parents[b, node])
        index[b, :len(path)] = torch.tensor(path[::-1])
        length[b] = len(path)
    return index.to(DEVICE), length.to(DEVICE)


def attention_dims(case: Case, form: str) -> tuple[int, int, int, int]:
    """(query heads, KV heads, QK dim, V dim) of the attention in `form` for this case."""
    a = case.model.attention
    if form == "gqa":
        return a.q_heads, a.kv_heads, a.head_dim, a.head_dim
    if form == "mla":
        return a.heads, 1, models.MLA_KV_DIM, models.MLA_V_DIM
    return 2 * a.heads, 1, PROXY_DIM, PROXY_DIM  # mla-proxy


@dataclass
class AttnSet:
    """One input set's cache and indices. caches: (k, v) with [S, Hkv, D]; MLA: (latent [S, 576],)."""

    caches: tuple[torch.Tensor, ...]
    kv_indices: torch.Tensor  # int32 [B*(L+n)]: each request's L prefix slots, then its n new ones
    new_loc: torch.Tensor  # int64 [T]: the slots of this step's tokens (where their K/V are written)
    tree_mask: Optional[torch.Tensor]  # int64 [T]; None for decode (unless MLA decode runs as n = 1 trees)
    parents: Optional[torch.Tensor]  # [B, n] (CPU), for the anchors' dense masks


@dataclass
class Attention:
    """The attention inputs of a case in one form: shared q/new rows/out, `sets` caches."""

    case: Case
    form: str
    q: torch.Tensor
    new: tuple[torch.Tensor, ...]  # this step's K/V rows, like caches: ([T, Hkv, D], [T, Hkv, Dv]) or ([T, 576],)
    out: torch.Tensor
    kv_indptr: torch.Tensor
    qo_indptr: torch.Tensor
    sets: list[AttnSet]
    scales: dict  # k_scale / v_scale of an fp8 cache (the store quantises with them), else empty

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one slot's cached rows, in the cache's dtype (fp8: one per value)."""
        return sum(c[0].numel() * c.element_size() for c in self.sets[0].caches)

    @property
    def bytes(self) -> int:
        """KV rows read + new rows written + q read + out written, per call."""
        c = self.case
        return (c.B * (c.L + c.n) + c.T) * self.kv_row_bytes + self.q.numel() * self.q.element_size() \
            + self.out.numel() * self.out.element_size()


def make_attention(case: Case, form: str, num_sets: int, seed: int = 0, fp8: bool = False) -> Attention:
    """The attention inputs of `case` in `form`; fp8: an e4m3 cache (KV_FP8_SCALE) read with
    FP8_Q_DTYPE queries, this step's rows quantised by the store."""
    B, n, L, T = case.B, case.n, case.L, case.T
    Hq, Hkv, D, Dv = attention_dims(case, form)
    gen = torch.Generator().manual_seed(seed)
    rows = B * (L + n)
    steps = torch.arange(B + 1, dtype=torch.int32, device=DEVICE)
    kv_indptr, qo_indptr = steps * (L + n), steps * n
    sets = []
    for s in range(num_sets):
        if form == "mla":
            caches = (_randn(rows, models.MLA_KV_DIM),)
        else:
            caches = (_randn(rows, Hkv, D), _randn(rows, Hkv, Dv))
        if fp8:
            caches = tuple((c / KV_FP8_SCALE).to(KV_FP8) for c in caches)
        kv_indices = torch.randperm(rows, generator=gen).to(DEVICE, torch.int32)  # scattered rows, page size 1
        new_loc = kv_indices.view(B, L + n)[:, L:].flatten().long()
        parents = tree_mask = None
        if n > 1 or (form == "mla" and MLA_DECODE is None):  # no MLA decode op: n = 1 trees
            parents = random_parents(B, n, gen)
            tree_mask = spec_kernels.tree_mask_from_parents(parents.flatten().to(DEVICE), qo_indptr)
        sets.append(AttnSet(caches, kv_indices, new_loc, tree_mask, parents))
    new = (_randn(T, models.MLA_KV_DIM),) if form == "mla" else (_randn(T, Hkv, D), _randn(T, Hkv, Dv))
    q_dtype = FP8_Q_DTYPE if fp8 else DTYPE
    scales = dict(k_scale=KV_FP8_SCALE, v_scale=KV_FP8_SCALE) if fp8 else {}
    return Attention(case, form, _randn(T, Hq, D).to(q_dtype), new,
                     torch.empty(T, Hq, Dv, dtype=q_dtype, device=DEVICE), kv_indptr, qo_indptr, sets, scales)


def _store(att: Attention, s: AttnSet) -> None:
    """set_kv_buffer: this step's K/V rows into their slots (every backend does it first); an fp8
    cache gets the rows divided by the scale and rounded to fp8, as SGLang's pool stores them."""
    for cache, rows in zip(s.caches, att.new):
        if cache.dtype == KV_FP8:
            cache.view(torch.uint8).index_copy_(0, s.new_loc, (rows / KV_FP8_SCALE).to(KV_FP8).view(torch.uint8))
        else:
            cache.index_copy_(0, s.new_loc, rows)


_MLA_TAKES_MAX_DRAFT = MLA_OP is not None and "max_draft_tokens" in inspect.signature(MLA_OP).parameters


def ours(att: Attention, s: AttnSet, impl: Optional[str]) -> Callable[[], None]:
    """Store + our attention kernel on set `s` (impl None: the dispatch's choice)."""
    c = att.case
    if att.form == "mla":
        extra = {"max_draft_tokens": c.n} if _MLA_TAKES_MAX_DRAFT else {}
        if c.n == 1 and MLA_DECODE is not None:
            def call():
                _store(att, s)
                MLA_DECODE(att.q, s.caches[0], att.kv_indptr, s.kv_indices, out=att.out, impl=impl, **att.scales)
            return call

        def call():
            _store(att, s)
            MLA_OP(att.q, s.caches[0], att.kv_indptr, s.kv_indices, att.qo_indptr, s.tree_mask, out=att.out,
                   impl=impl, **extra, **att.scales)
        return call
    k, v = s.caches
    if c.n == 1:
        def call():
            _store(att, s)
            spec_kernels.decode_attention(att.q, k, v, att.kv_indptr, s.kv_indices, out=att.out, impl=impl,
                                          **att.scales)
        return call

    def call():
        _store(att, s)
        # max_draft_tokens: the server knows its tree size; it sizes the launch for n, not 64.
        spec_kernels.tree_verify_attention(att.q, k, v, att.kv_indptr, s.kv_indices, att.qo_indptr, s.tree_mask,
                                           out=att.out, impl=impl, max_draft_tokens=c.n, **att.scales)
    return call


def attention_op(form: str) -> str:
    return "mla_tree_verify_attention" if form == "mla" else "tree_verify_attention"


def _select_args(case: Case, form: str, fp8: bool = False) -> tuple:
    """Meta tensors shaped like the call, for the ops' per-call `supports` predicates."""
    Hq, Hkv, D, Dv = attention_dims(case, form)
    q = torch.empty(1, Hq, D, dtype=FP8_Q_DTYPE if fp8 else DTYPE, device="meta")
    meta = lambda *shape: torch.empty(*shape, dtype=KV_FP8 if fp8 else DTYPE, device="meta")  # noqa: E731
    return (q, meta(1, D), Dv) if form == "mla" else (q, meta(1, Hkv, D), meta(1, Hkv, Dv))


def our_attention_impl(case: Case) -> str:
    """The implementation the dispatch picks for this case's attention (recorded as impl)."""
    op = REGISTRY.get(attention_op(case.attention))
    return op.select(DEVICE, None, args=_select_args(case, case.attention))[0] if op is not None else "default"


def dense_mask(case: Case, parents: torch.Tensor) -> torch.Tensor:
    """The anchors' custom mask, as SGLang builds it: per request n x (L + n) booleans, row-major
    (prefix all visible, drafts by ancestry), requests concatenated."""
    B, n, L = case.B, case.n, case.L
    qo = torch.arange(B + 1, dtype=torch.int32) * n
    bits = spec_kernels.tree_mask_from_parents(parents.flatten(), qo, impl="reference").view(B, n, 1)
    drafts = ((bits >> torch.arange(n)) & 1).bool()
    return torch.cat([torch.ones(B, n, L, dtype=torch.bool), drafts], dim=2).flatten().to(DEVICE)


def sglang_anchor(att: Attention, s: AttnSet) -> Callable[[], None]:
    """Store + SGLang's Triton extend attention as its triton backend calls it for TARGET_VERIFY:
    prefix from the cache (kv_indptr/indices over the L prefix slots), drafts from the step's
    contiguous K/V, the full n x (L + n) mask per request."""
    extend_attention_fwd = _sglang_kernels.extend_attention_fwd()
    c = att.case
    steps = torch.arange(c.B + 1, device=DEVICE)
    prefix_indptr = (steps * c.L).to(torch.int32)
    prefix_indices = s.kv_indices.view(c.B, c.L + c.n)[:, :c.L].flatten().long()
    mask = dense_mask(c, s.parents)
    mask_indptr = steps * (c.n * (c.L + c.n))
    if att.form == "mla":  # one latent head: K = all 576 dims, V = the first 512 (views, as SGLang's MLA pool)
        k_buf = s.caches[0].unsqueeze(1)
        v_buf = k_buf[..., :models.MLA_V_DIM]
        k_new = att.new[0].unsqueeze(1)
        v_new = k_new[..., :models.MLA_V_DIM].contiguous()
    else:
        (k_buf, v_buf), (k_new, v_new) = s.caches, att.new

    def call():
        _store(att, s)
        extend_attention_fwd(att.q, k_new, v_new, att.out, k_buf, v_buf, att.qo_indptr, prefix_indptr,
                             prefix_indices, mask, True, mask_indptr, c.n, 1.0, 1.0)
    return call


_FLASHINFER_WORKSPACE: list[torch.Tensor] = []


def flashinfer_anchor(att: Attention, s: AttnSet) -> Callable[[], None]:
    """Store + FlashInfer's paged prefill with a custom mask, as SGLang's flashinfer backend runs
    TARGET_VERIFY (page size 1, kv over L + n slots, the drafts read back from the cache)."""
    import flashinfer

    c = att.case
    Hq, Hkv, D, _ = attention_dims(c, att.form)
    if not _FLASHINFER_WORKSPACE:
        _FLASHINFER_WORKSPACE.append(torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE))
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_FLASHINFER_WORKSPACE[0], "NHD")
    wrapper.plan(att.qo_indptr, att.kv_indptr, s.kv_indices, torch.ones(c.B, dtype=torch.int32, device=DEVICE),
                 Hq, Hkv, D, KV_PAGE_SIZE, custom_mask=dense_mask(c, s.parents), q_data_type=DTYPE,
                 kv_data_type=DTYPE)
    paged = tuple(t.unsqueeze(1) for t in s.caches)  # [pages, page_size = 1, Hkv, D]

    def call():
        _store(att, s)
        att.out.copy_(wrapper.run(att.q, paged))
    return call


ANCHORS = {"sglang-triton": sglang_anchor, "flashinfer": flashinfer_anchor}  # attention; norm: "flashinfer"


def flashinfer_unavailable() -> Optional[str]:
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # noqa: BLE001  not installed, or a broken install: either way absent
        return f"not importable ({type(exc).__name__}: {exc})"
    return None if DEVICE.type == "cuda" else "FlashInfer's kernels take CUDA tensors only"


def anchor_unavailable(anchor: str, case: Case) -> Optional[str]:
    if anchor == "sglang-triton":
        return _sglang_kernels.unavailable_reason()
    if case.model.is_mla:
        return "FlashInfer's paged prefill has no 576/512 MLA head dims (its MLA wrapper takes no custom mask)"
    return flashinfer_unavailable()


# --------------------------------------------------------------------------- GEMMs, norm, KV slots
_WEIGHTS: dict[tuple[str, int], dict[str, torch.Tensor]] = {}


def layer_weights(model: models.ModelPreset, s: int) -> dict[str, torch.Tensor]:
    """Weights of input set `s` of a model, kept across its cases (one model's at a time).
    Experts: all of them; a step multiplies the first E_t (a contiguous slice)."""
    key = (model.name, s)
    if key not in _WEIGHTS:
        if any(name != model.name for name, _ in _WEIGHTS):
            _WEIGHTS.clear()
        weights = {}
        for g in model.gemms(1):
            batch = model.moe.experts if g.name.startswith("experts_") else g.batch
            weights[g.name] = _randn(*((batch,) if g.grouped else ()), g.k, g.n, scale=g.k ** -0.5)
        _WEIGHTS[key] = weights
    return _WEIGHTS[key]


@dataclass
class Gemms:
    """The layer's GEMMs at T rows: one input and output per GEMM, weights per input set."""

    specs: list[models.Gemm]
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    weights: list[dict[str, torch.Tensor]]

    def call(self, s: int, stage: Optional[str] = None) -> Callable[[], None]:
        todo = [(self.inputs[g.name], self.weights[s][g.name][:g.batch] if g.grouped else self.weights[s][g.name],
                 self.outputs[g.name]) for g in self.specs if stage is None or g.stage == stage]

        def call():
            for a, w, o in todo:
                torch.matmul(a, w, out=o)
        return call

    @property
    def bytes(self) -> int:
        return sum(g.weight_elems() + g.io_elems() for g in self.specs) * DTYPE.itemsize


def make_gemms(case: Case, num_sets: int) -> Gemms:
    specs = case.model.gemms(case.T)
    lead = lambda g: (g.batch,) if g.grouped else ()  # noqa: E731
    return Gemms(specs, {g.name: _randn(*lead(g), g.m, g.k) for g in specs},
                 {g.name: torch.empty(*lead(g), g.m, g.n, dtype=DTYPE, device=DEVICE) for g in specs},
                 [layer_weights(case.model, s) for s in range(num_sets)])


@dataclass
class Norm:
    """The local part of the layer's two allreduce + residual add + RMSNorm: add + RMSNorm at T rows."""

    x: torch.Tensor
    residual: torch.Tensor
    weight: torch.Tensor
    out: torch.Tensor
    residual_out: torch.Tensor

    def call(self, impl: Optional[str]) -> Callable[[], None]:
        def call():
            spec_kernels.fused_add_rmsnorm(self.x, self.residual, self.weight, EPS, impl, out=self.out,
                                           residual_out=self.residual_out)
        return call

    @property
    def bytes(self) -> int:  # x, residual read; out, residual_out written; weight read
        return (4 * self.x.numel() + self.weight.numel()) * DTYPE.itemsize


def make_norm(case: Case) -> Norm:
    T, h = case.T, case.model.hidden
    x = _randn(T, h)
    return Norm(x, _randn(T, h), 1 + _randn(h, scale=0.1), torch.empty_like(x), torch.empty_like(x))


class KvSlots:
    """Allocator state for the step's draft slots (page size 1). Baseline: alloc 1 slot per
    request (every decode token is kept). EAGLE: alloc n, then commit a random accepted path
    (the rest go back). seq_lens never advance, so every call is the same step; the free stack
    is sized for `steps` calls without refilling (accepted slots are not returned)."""

    def __init__(self, case: Case, steps: int, seed: int = 0):
        B, n, L = case.B, case.n, case.L
        gen = torch.Generator().manual_seed(seed)
        pages = B * n * (steps + 1)
        free_pages = torch.randperm(pages, generator=gen).to(DEVICE)
        num_free = torch.tensor([pages], device=DEVICE)
        self.args = dict(req_to_token=torch.zeros(B, L + n, dtype=torch.int32, device=DEVICE),
                         req_pool_indices=torch.arange(B, device=DEVICE),
                         seq_lens=torch.full((B,), L, device=DEVICE), num_draft=torch.full((B,), n, device=DEVICE),
                         free_pages=free_pages, num_free=num_free,
                         page_state=spec_kernels.kv_slots.page_state_from_free_stack(free_pages, num_free),
                         page_size=KV_PAGE_SIZE)
        self.B, self.n = B, n
        self.accept = random_paths(random_parents(B, n, gen), gen) if n > 1 else None

    def call(self) -> Callable[[], None]:
        def call():
            spec_kernels.alloc_draft_slots(**self.args, max_draft=self.n, check_free=False,
                                           total_draft=self.B * self.n)
            if self.accept is not None:
                spec_kernels.commit_draft_slots(**self.args, accept_index=self.accept[0],
                                                accept_len=self.accept[1], max_draft=self.n)
        return call

    @property
    def bytes(self) -> int:  # index traffic, approximate: free stack, req_to_token, out slots, paths
        return 40 * self.B * self.n


def kv_steps(calls_per_round: int) -> int:
    """Upper bound of the alloc calls one measure() makes: side-stream warm-up, warm-up round,
    timed rounds, `calls_per_round` each."""
    return calls_per_round * (GRID.rounds + 3)


def default_impl(op: str) -> str:
    return op_impls(op).select(DEVICE)[0]


# --------------------------------------------------------------------------- benchmarks
@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    """On a CPU, one torch thread: with two cores shared by the Triton interpreter (and other
    processes), intra-op threads wait for each other in scheduler ticks (ms per tiny matmul)."""
    if DEVICE.type != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _record(benchmark, bench_results, case: Case, nbytes: int, info: dict, **extra) -> None:
    _timing.record(benchmark, bench_results, nbytes, **{**case.info(), **extra, **info})


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_decode_step(benchmark, bench_results, case):
    """One layer (x layers per round, with the step's KV alloc/commit once): kind decode_step."""
    benchmark.group = f"decode step {case.model.name} L={case.L} B={case.B}"
    model = case.model
    att = make_attention(case, case.attention, 1)
    gemms = make_gemms(case, 1)
    set_bytes = att.bytes + gemms.bytes
    num_sets = _timing.input_sets_for(set_bytes, DEVICE)
    if num_sets > 1:
        att, gemms = make_attention(case, case.attention, num_sets), make_gemms(case, num_sets)
    norm = make_norm(case)
    # measure() runs at least MIN_GPU_CALLS_PER_ROUND calls a round on a GPU: with fewer layers
    # than that (the tiny presets) a round holds the step more than once
    per_round = max(model.layers, _timing.MIN_GPU_CALLS_PER_ROUND if DEVICE.type == "cuda" else 1)
    kv = KvSlots(case, kv_steps(-(-per_round // model.layers)))
    norm_call, kv_call = norm.call(None), kv.call()

    def layer(i: int) -> Callable[[], None]:
        s = i % num_sets
        parts = [gemms.call(s, "pre"), ours(att, att.sets[s], None), gemms.call(s, "post"), norm_call,
                 gemms.call(s, "mlp"), norm_call]
        if i == 0:
            parts = [kv_call] + parts  # alloc (+ commit) once per step: once every `layers` calls

        def call():
            for p in parts:
                p()
        return call

    info = _timing.measure(benchmark, [layer(i) for i in range(model.layers)], DEVICE, GRID.rounds)
    info["input_sets"] = num_sets
    nbytes = set_bytes + 2 * norm.bytes + kv.bytes // model.layers
    _record(benchmark, bench_results, case, nbytes, info, kind="decode_step", impl=our_attention_impl(case),
            norm_impl=default_impl("fused_add_rmsnorm"), kv_impl=default_impl("alloc_draft_slots"))


def _our_impls(op: str) -> list[str]:
    """Our implementations timed side by side: each that runs here on a GPU; on CPU the
    dispatch's choice only (the interpreter: times mean nothing, one is enough)."""
    if DEVICE.type != "cuda":
        return [default_impl(op)]
    return [i for i in ("cuda", "triton") if op_impls(op).unavailable_reason(i, DEVICE) is None]


def _component_params() -> list:
    params = []
    norm_ours = _our_impls("fused_add_rmsnorm")
    for c in CASES:
        attn = _our_impls(attention_op(c.attention)) if attention_op(c.attention) in REGISTRY else ["default"]
        variants = [("attention", i) for i in attn]
        if c.attention != "mla-proxy":  # ours on an fp8 cache, beside the model-dtype rows
            variants += [("attention", f"{i}{FP8_IMPL_SUFFIX}") for i in attn]
        variants += [("attention", a) for a in ANCHORS if c.n > 1]
        variants += [("gemm", "torch")] + [("norm", i) for i in norm_ours] + [("norm", "flashinfer")]
        variants += [("kv", default_impl("alloc_draft_slots"))]
        params += [pytest.param(c, comp, impl, id=f"{c.id}-{comp}-{impl}") for comp, impl in variants]
    return params


# The impl label of the attention component's fp8-cache rows: "<impl>+kv_fp8_e4m3".
FP8_IMPL_SUFFIX = "+kv_fp8_e4m3"


def _attention_calls(case: Case, impl: str) -> tuple[list, int, dict]:
    anchor = ANCHORS.get(impl)
    form = case.attention
    fp8 = impl.endswith(FP8_IMPL_SUFFIX)
    ours_impl = impl[: -len(FP8_IMPL_SUFFIX)] if fp8 else impl
    if anchor is not None:
        why = anchor_unavailable(impl, case)
        form = "mla" if case.model.is_mla else "gqa"  # anchors compute the real MLA, never the proxy
    else:
        why = None if ours_impl == "default" else op_impls(attention_op(form)).unavailable_reason(
            ours_impl, DEVICE, args=_select_args(case, form, fp8))
    if why is not None:
        pytest.skip(f"{impl}: {why}")
    att = make_attention(case, form, 1, fp8=fp8)
    num_sets = _timing.input_sets_for(att.bytes, DEVICE)
    att = make_attention(case, form, num_sets, fp8=fp8) if num_sets > 1 else att
    extra = {"attention": form, "kv_cache": "fp8_e4m3" if fp8 else PRESET.dtype}
    if fp8:
        extra.update(q_dtype=str(FP8_Q_DTYPE).replace("torch.", ""), kv_scale=KV_FP8_SCALE)
    if anchor is None:
        return [ours(att, s, None if ours_impl == "default" else ours_impl) for s in att.sets], att.bytes, extra
    calls = [anchor(att, s) for s in att.sets]
    extra["checked_against_ours"] = form == case.attention
    if form == case.attention:  # an anchor must compute what ours computes: compare set 0 once
        ours(att, att.sets[0], None)()
        expected = att.out.clone()
        att.out.zero_()
    try:  # an anchor that cannot run here (another Triton, no kernel for the arch) is absent, not a failure
        calls[0]()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"{impl}: the anchor does not run here ({type(exc).__name__}: {str(exc)[:300]})")
    if form == case.attention:
        tol = 1e-3 if DTYPE == torch.float32 else 3e-2
        torch.testing.assert_close(att.out, expected, atol=tol, rtol=tol, msg=lambda m: f"{impl} vs ours: {m}")
    return calls, att.bytes, extra


def _gemm_calls(case: Case) -> tuple[list, int, dict]:
    gemms = make_gemms(case, 1)
    num_sets = _timing.input_sets_for(gemms.bytes, DEVICE)
    gemms = make_gemms(case, num_sets) if num_sets > 1 else gemms
    shapes = ", ".join(f"{g.name} {g.batch}x{g.m}x{g.k}x{g.n}" if g.grouped else f"{g.name} {g.m}x{g.k}x{g.n}"
                       for g in gemms.specs)
    return [gemms.call(s) for s in range(num_sets)], gemms.bytes, {"gemms": shapes}


def _norm_calls(case: Case, impl: str) -> tuple[list, int, dict]:
    norm = make_norm(case)
    if impl == "flashinfer":
        why = flashinfer_unavailable()
        if why is not None:
            pytest.skip(f"flashinfer: {why}")
        import flashinfer

        # in place: x becomes the output, residual the sum
        one = lambda: flashinfer.fused_add_rmsnorm(norm.x, norm.residual, norm.weight, EPS)  # noqa: E731
    else:
        one = norm.call(impl)

    def two():  # a layer has two
        one()
        one()
    return [two], 2 * norm.bytes, {}


def _kv_calls(case: Case) -> tuple[list, int, dict]:
    per_round = _timing.MIN_GPU_CALLS_PER_ROUND if DEVICE.type == "cuda" else 1
    kv = KvSlots(case, kv_steps(per_round))
    return [kv.call()], kv.bytes, {"per": "step"}


@pytest.mark.parametrize("case,component,impl", _component_params())
def test_decode_component(benchmark, bench_results, case, component, impl):
    """One part of the layer alone (kv: the step's alloc/commit), ours and the anchors: kind
    decode_component."""
    benchmark.group = f"decode components {case.model.name} L={case.L} B={case.B} n={case.n}"
    if component == "attention":
        calls, nbytes, extra = _attention_calls(case, impl)
    elif component == "gemm":
        calls, nbytes, extra = _gemm_calls(case)
    elif component == "norm":
        calls, nbytes, extra = _norm_calls(case, impl)
    else:
        calls, nbytes, extra = _kv_calls(case)
    info = _timing.measure(benchmark, calls, DEVICE, GRID.rounds)
    _record(benchmark, bench_results, case, nbytes, info, kind="decode_component", component=component,
            impl=impl, anchor=impl in ANCHORS, **extra)


def test_allreduce_anchor(benchmark):
    """Plain torch.distributed all_reduce beside ours: not here (see the module docstring)."""
    pytest.skip("torch.distributed all_reduce: only meaningful with > 1 rank and this module runs one process "
                "(a world of one moves no bytes); the allreduce is not timed here. Multi-rank ours vs NCCL/gloo: "
                "benchmarks/test_allreduce_rmsnorm.py::test_allreduce (algorithm torch)")
