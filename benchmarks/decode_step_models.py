"""Model presets of the decode-step benchmark (benchmarks/test_decode_step.py): per-rank shapes.

A preset is one transformer layer as ONE tensor-parallel rank runs it: the attention (GQA or MLA)
and its KV cache layout, and the GEMMs of the layer at T rows (T = B tokens for plain decode,
B x n for an EAGLE verify step). Shapes are the models' published configs divided by the TP
degree the way SGLang shards them (column/row parallel projections; MLA's fused q/kv "a"
projection and the MoE router are replicated, every rank computes them in full; under TP the MoE
experts' intermediate dimension is split across ranks, no expert parallelism).

    llama-3.1-8b-tp1    Llama-3.1-8B, one GPU: 32 layers, hidden 4096, 32/8 heads x 128, MLP 14336
    llama-3.3-70b-tp8   Llama-3.3-70B, TP8: 80 layers, hidden 8192, 64/8 heads -> 8/1 per rank, MLP 28672/8
    deepseek-v3-tp8     DeepSeek-V3, TP8: 61 layers, hidden 7168, MLA 128 heads -> 16 per rank, MoE 256 x top-8
    kimi-k2.5-tp8       Kimi K2.5 (the Kimi K2 architecture), TP8: as DeepSeek-V3 with 64 heads -> 8 per
                        rank, MoE 384 x top-8: the deployment of docs/design.md
    tiny-gqa, tiny-mla  CPU presets (the harness runs, no meaning to the times)

MoE proxy (the MLA presets). A rank runs, per layer, the router, the shared expert (a dense MLP of
2048/8 = 256 columns) and the routed experts as one batched matmul (torch.matmul on [E_t, m, K])
over the E_t distinct experts the T tokens touch, m = ceil(T * top_k / E_t) rows each. E_t is the
expectation under uniform routing, E * (1 - (1 - top_k / E) ** T): the weight bytes a step reads
grow with its token count until every expert is touched (Kimi K2.5: 8 of 384 experts for a
1-token step, ~110 at 16 tokens, nearly all from ~250: one reason a verify step of a MoE costs
far more than a decode step even where both are memory-bound). Real routing is skewed (fewer distinct experts:
this is an upper bound of the weight traffic) and a fused MoE kernel also gathers, scatters and
weights the rows (not timed). Expert weights are bf16 here: the deployment's INT4 experts read a
quarter of these bytes. The first 1 (Kimi) / 3 (DeepSeek) dense layers are timed like MoE layers.

Not in the GEMM list: elementwise work (RoPE, SiLU-and-mul, MLA's q/kv "a" layernorms, MoE top-k
and weighting), the embedding and lm_head (once per step, not per layer).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Union

# MLA's cached latent: 512 compressed dims + 64 rope dims in one head shared by all query heads;
# V is the first 512 of the same row (docs/design.md).
MLA_KV_DIM = 576
MLA_V_DIM = 512


@dataclass(frozen=True)
class GQA:
    """Per-rank attention heads: Hq query heads of D dims reading Hkv cached K/V heads."""

    q_heads: int
    kv_heads: int
    head_dim: int = 128


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention with absorbed projections, per rank: `heads` query heads of
    MLA_KV_DIM dims over ONE cached latent head."""

    heads: int
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    rope_dim: int = 64
    nope_dim: int = 128
    v_head_dim: int = 128


@dataclass(frozen=True)
class MoE:
    """Routed experts per rank (each expert's intermediate split across the TP ranks)."""

    experts: int
    top_k: int
    inter: int  # per rank
    shared_inter: int  # the shared expert's intermediate, per rank (0: none)

    def touched(self, tokens: int) -> int:
        """Expected distinct experts T tokens route to (uniform routing, top_k distinct each)."""
        if tokens <= 0:
            return 0
        expected = self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** tokens)
        return max(min(self.top_k, self.experts), min(self.experts, math.ceil(expected - 1e-9)))


@dataclass(frozen=True)
class Gemm:
    """out[batch, m, n] = a[batch, m, k] @ w[batch, k, n]; a plain 2-D matmul unless grouped."""

    name: str
    m: int
    k: int
    n: int
    batch: int = 1
    stage: str = "mlp"  # where in the layer: "pre" (before attention), "post" (after it), "mlp"
    grouped: bool = False  # one weight matrix per batch entry (MLA's per-head absorption, experts)

    def weight_elems(self) -> int:
        return self.batch * self.k * self.n

    def io_elems(self) -> int:
        return self.batch * self.m * (self.k + self.n)


@dataclass(frozen=True)
class ModelPreset:
    name: str  # the key: extra_info["preset"], --select preset=...
    model: str  # the model it stands for
    tp: int
    layers: int  # repeats of the timed layer per decode step
    hidden: int
    attention: Union[GQA, MLA]
    mlp_inter: int = 0  # dense MLP intermediate per rank (GQA presets)
    moe: Optional[MoE] = None

    @property
    def is_mla(self) -> bool:
        return isinstance(self.attention, MLA)

    def gemms(self, T: int) -> list[Gemm]:
        """The layer's GEMMs at T rows, in execution order (per rank)."""
        h, a = self.hidden, self.attention
        if isinstance(a, GQA):
            out = [Gemm("qkv", T, h, (a.q_heads + 2 * a.kv_heads) * a.head_dim, stage="pre"),
                   Gemm("o", T, a.q_heads * a.head_dim, h, stage="post")]
        else:
            out = [Gemm("qkv_a", T, h, a.q_lora_rank + a.kv_lora_rank + a.rope_dim, stage="pre"),  # replicated
                   Gemm("q_b", T, a.q_lora_rank, a.heads * (a.nope_dim + a.rope_dim), stage="pre"),
                   # absorbed: q_nope -> the latent space before attention, latent out -> v heads after
                   Gemm("w_kc", T, a.nope_dim, a.kv_lora_rank, a.heads, "pre", grouped=True),
                   Gemm("w_vc", T, a.kv_lora_rank, a.v_head_dim, a.heads, "post", grouped=True),
                   Gemm("o", T, a.heads * a.v_head_dim, h, stage="post")]
        if self.moe is None:
            out += [Gemm("gate_up", T, h, 2 * self.mlp_inter), Gemm("down", T, self.mlp_inter, h)]
            return out
        moe = self.moe
        out.append(Gemm("router", T, h, moe.experts))  # replicated
        if moe.shared_inter:
            out += [Gemm("shared_gate_up", T, h, 2 * moe.shared_inter), Gemm("shared_down", T, moe.shared_inter, h)]
        e_t = moe.touched(T)
        rows = math.ceil(T * moe.top_k / e_t)
        out += [Gemm("experts_gate_up", rows, h, 2 * moe.inter, e_t, grouped=True),
                Gemm("experts_down", rows, moe.inter, h, e_t, grouped=True)]
        return out


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("llama-3.1-8b-tp1", "Llama-3.1-8B", tp=1, layers=32, hidden=4096,
                    attention=GQA(32, 8), mlp_inter=14336),  # TP1: no allreduce in a server either
        ModelPreset("llama-3.3-70b-tp8", "Llama-3.3-70B", tp=8, layers=80, hidden=8192,
                    attention=GQA(8, 1), mlp_inter=28672 // 8),
        ModelPreset("deepseek-v3-tp8", "DeepSeek-V3", tp=8, layers=61, hidden=7168,
                    attention=MLA(heads=128 // 8), moe=MoE(256, 8, 2048 // 8, 2048 // 8)),
        ModelPreset("kimi-k2.5-tp8", "Kimi-K2.5", tp=8, layers=61, hidden=7168,
                    attention=MLA(heads=64 // 8), moe=MoE(384, 8, 2048 // 8, 2048 // 8)),
        # CPU presets: tiny shapes through the Triton interpreter; they check the harness only.
        ModelPreset("tiny-gqa", "tiny GQA model (CPU)", tp=1, layers=2, hidden=256,
                    attention=GQA(4, 2, 64), mlp_inter=512),
        ModelPreset("tiny-mla", "tiny MLA + MoE model (CPU)", tp=1, layers=2, hidden=256,
                    attention=MLA(heads=2, q_lora_rank=64, nope_dim=32, v_head_dim=32),
                    moe=MoE(8, 2, 64, 64)),
    )
}


@dataclass(frozen=True)
class Grid:
    """What one benchmark preset (SPEC_KERNELS_BENCH_PRESET) runs."""

    models: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    draft_counts: tuple[int, ...]  # n of the EAGLE steps (baseline is n = 1)
    contexts: tuple[int, ...]  # L: KV slots of each request before this step's tokens
    rounds: int


GRIDS = {
    # CPU: a few tiny cases, each through the interpreter; ~30 s on 2 idle cores.
    "tiny": Grid(("tiny-gqa", "tiny-mla"), batch_sizes=(1, 3), draft_counts=(4, 16), contexts=(64,), rounds=3),
    # scripts/gpu_check.sh: the deployment's model and a dense one, a coarse B grid (not measured yet).
    "gpu-quick": Grid(("kimi-k2.5-tp8", "llama-3.3-70b-tp8"), batch_sizes=(1, 10, 70, 250),
                      draft_counts=(4, 16), contexts=(2048,), rounds=5),
    # The full grid: the deployment table's concurrencies and four tree sizes.
    "gpu": Grid(tuple(p for p in PRESETS if not p.startswith("tiny")),
                batch_sizes=(1, 2, 5, 10, 30, 70, 100, 250), draft_counts=(4, 8, 16, 32), contexts=(2048,),
                rounds=10),
}


def grid_for(bench_preset: str, models: Optional[str] = None, contexts: Optional[str] = None) -> Grid:
    """The grid of a benchmark preset, with the model presets and/or contexts replaced by
    comma-separated overrides (SPEC_KERNELS_DECODE_MODELS, SPEC_KERNELS_DECODE_L)."""
    grid = GRIDS[bench_preset]
    if models:
        names = tuple(m.strip() for m in models.split(",") if m.strip())
        unknown = [m for m in names if m not in PRESETS]
        if unknown:
            raise ValueError(f"unknown model preset(s) {unknown}; known: {', '.join(PRESETS)}")
        grid = replace(grid, models=names)
    if contexts:
        grid = replace(grid, contexts=tuple(int(v) for v in contexts.split(",") if v.strip()))
    return grid
