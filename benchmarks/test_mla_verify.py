"""MLA tree verify (n = 16) vs MLA decode (n = 1): DeepSeek-V3 / Kimi K2.5 latent attention.

    pytest benchmarks/test_mla_verify.py --benchmark-only                       # preset by device
    SPEC_KERNELS_BENCH_PRESET=gpu pytest benchmarks/test_mla_verify.py --benchmark-only --benchmark-json=out.json

What is timed, per case (B requests, each with L prefix slots and n draft tokens; H query heads
per rank over ONE latent KV head of 576 = 512 latent + 64 rope values, V = the first 512):

* n > 1: ``spec_kernels.mla.mla_tree_verify_attention`` over a random tree per request;
* n = 1: ``spec_kernels.mla.mla_decode_attention``, plain decode at the same B, L and H;
* every implementation that runs here: ``cuda`` (once the extension has the kernel), ``triton``,
  and on CPU the ``reference`` (an oracle, not a contender).

Grid (per SPEC_KERNELS_BENCH_PRESET; dtype, rounds and the GPU requirement come from
benchmarks/_timing.py's preset of the same name):
  tiny       B 1, 2;  L 32, 96;  n 1, 4;  H 8          (default without a GPU: checks the harness
                                                         through the Triton interpreter, < 1 min)
  gpu-quick  B 1, 32; L 4k, 16k; n 1, 16; H 8          (scripts/gpu_check.sh: 4 Triton autotune keys)
  gpu        B 1, 8, 32, 64; L 1k, 4k, 16k; n 1, 16; H 8 (Kimi K2.5 at TP8), 16 (DeepSeek-V3 at TP8)
Inputs are random, slot ids a random permutation, and a GPU round rotates over input sets that
stream >= 4x the L2 cache; timing, CUDA-graph capture and the summary table are _timing's.
Each case is checked against the reference (where its host loop is cheap) before it is timed.

Bytes (extra_info["bytes"], the "GB/s" column): B*(L+n)*576*elt (every latent row read once:
the value is part of it) + B*n*H*(576+512)*elt (q read, out written).

GPU target: MLA verify at n = 16 <= 1.2 x MLA decode (the "/dec" column) at L >= 4k.
No GPU figure exists yet: nothing of this module has run on a GPU; the CPU runs of the tiny
preset go through the Triton interpreter and say nothing about GPU performance.

Why the target may be out of reach at H = 16: per 1152-byte latent row, verify does
2 * n * H * (576 + 512) FLOPs, 557 kFLOP at n = 16 and H = 16 (~480 FLOP/byte), 279 kFLOP at
H = 8 (~240 FLOP/byte); decode does 15-30 FLOP/byte. An H200 (~990 dense bf16 TFLOPS with wgmma,
less with the mma.sync this project uses; ~4.3-4.8 TB/s) is compute-bound above roughly 200
FLOP/byte, so at H = 16 verify needs >= ~2x the decode time even at peak tensor throughput, and
at H = 8 it sits at the ridge (~1.2x). On the RTX PRO 6000 (sm_120, ~1.8 TB/s) the ridge depends
on its mma.sync throughput: the measurement will tell.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch

import _timing
import spec_kernels
from spec_kernels._ops import op_impls
from spec_kernels.mla import mla_decode_attention, mla_tree_verify_attention

PRESET = _timing.active_preset()
DEVICE = _timing.bench_device()
DTYPE = getattr(torch, PRESET.dtype)
D, DV = 576, 512
CHECK_MAX_KV_ROWS = 1 << 18  # compare with the reference only where its host loop is cheap
SM_SCALE = 192 ** -0.5  # DeepSeek-V3's 1/sqrt(qk_nope + qk_rope), without the YaRN factor


@dataclass(frozen=True)
class Grid:
    batch_sizes: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    draft_counts: tuple[int, ...]
    heads: tuple[int, ...]


GRIDS = {
    "tiny": Grid((1, 2), (32, 96), (1, 4), (8,)),
    "gpu-quick": Grid((1, 32), (4096, 16384), (1, 16), (8,)),
    "gpu": Grid((1, 8, 32, 64), (1024, 4096, 16384), (1, 16), (8, 16)),
}
GRID = GRIDS[PRESET.name]


@dataclass(frozen=True)
class Case:
    B: int
    L: int
    n: int
    H: int

    @property
    def id(self) -> str:
        return f"mla-B{self.B}-L{self.L}-n{self.n}-h{self.H}-{PRESET.dtype}"

    @property
    def kv_rows(self) -> int:
        return self.B * (self.L + self.n)

    @property
    def bytes(self) -> int:
        return (self.kv_rows * D + self.B * self.n * self.H * (D + DV)) * DTYPE.itemsize


def mla_impls(device: torch.device) -> list[str]:
    op = op_impls("mla_tree_verify_attention")
    impls = [impl for impl in ("cuda", "triton") if op.unavailable_reason(impl, device) is None]
    return impls + (["reference"] if device.type == "cpu" else [])


def unsupported_reason(impl: str) -> Optional[str]:
    q = torch.empty(1, 1, D, dtype=DTYPE, device="meta")
    return op_impls("mla_tree_verify_attention").unavailable_reason(impl, DEVICE, args=(q, q[0], DV))


CASES = [Case(B, L, n, H) for H in GRID.heads for B in GRID.batch_sizes for L in GRID.prefix_lens
         for n in GRID.draft_counts]
IMPLS = mla_impls(DEVICE)


@dataclass
class InputSet:
    q: torch.Tensor  # [B*n, H, 576]
    kv_indices: torch.Tensor  # int32 [B*(L+n)]
    tree_mask: Optional[torch.Tensor]  # int64 [B*n]; None for decode


def make_inputs(case: Case, num_sets: int):
    """One latent cache holding `num_sets` disjoint input sets (random slot permutations)."""
    rows = case.kv_rows
    kv_cache = torch.randn(num_sets * rows, D, dtype=DTYPE, device=DEVICE)
    steps = torch.arange(case.B + 1, dtype=torch.int32, device=DEVICE)
    kv_indptr, qo_indptr = steps * (case.L + case.n), steps * case.n
    sets = []
    for s in range(num_sets):
        tree_mask = None
        if case.n > 1:  # one random tree per request: draft i's parent uniform in [0, i)
            parents = (torch.rand(case.B, case.n) * torch.arange(case.n)).long()
            parents[:, 0] = -1
            tree_mask = spec_kernels.tree_mask_from_parents(parents.flatten().to(DEVICE), qo_indptr)
        sets.append(InputSet(torch.randn(case.B * case.n, case.H, D, dtype=DTYPE, device=DEVICE),
                             (s * rows + torch.randperm(rows, device=DEVICE)).to(torch.int32), tree_mask))
    return kv_cache, kv_indptr, qo_indptr, sets


def launcher(impl, case, kv_cache, kv_indptr, qo_indptr, s: InputSet, out) -> Callable[[], None]:
    if case.n == 1:
        return lambda: mla_decode_attention(s.q, kv_cache, kv_indptr, s.kv_indices, sm_scale=SM_SCALE, out=out,
                                            impl=impl)
    return lambda: mla_tree_verify_attention(s.q, kv_cache, kv_indptr, s.kv_indices, qo_indptr, s.tree_mask,
                                             sm_scale=SM_SCALE, out=out, impl=impl, max_draft_tokens=case.n)


@pytest.mark.parametrize("case,impl", [pytest.param(c, i, id=f"{c.id}-{i}") for c in CASES for i in IMPLS])
def test_mla_attention(benchmark, bench_results, case, impl):
    benchmark.group = f"MLA B={case.B} L={case.L} H={case.H} {PRESET.dtype}"
    reason = unsupported_reason(impl)
    if reason is not None:
        pytest.skip(f"{impl}: {reason}")
    kv_cache, kv_indptr, qo_indptr, sets = make_inputs(case, _timing.input_sets_for(case.bytes, DEVICE))
    out = torch.empty(case.B * case.n, case.H, DV, dtype=DTYPE, device=DEVICE)
    if impl != "reference" and case.kv_rows <= CHECK_MAX_KV_ROWS:  # a wrong result is worth no timing
        expected = torch.empty_like(out)
        launcher("reference", case, kv_cache, kv_indptr, qo_indptr, sets[0], expected)()
        launcher(impl, case, kv_cache, kv_indptr, qo_indptr, sets[0], out)()
        tol = 1e-3 if DTYPE == torch.float32 else 2e-2
        torch.testing.assert_close(out, expected, atol=tol, rtol=tol, msg=lambda m: f"{impl} vs reference: {m}")
    calls = [launcher(impl, case, kv_cache, kv_indptr, qo_indptr, s, out) for s in sets]
    info = _timing.measure(benchmark, calls, DEVICE, PRESET.rounds)
    # Recorded as attention rows (one KV head of D = 576, Dv = 512), so _timing's summary puts
    # verify next to decode: its "/dec" column is the target ratio.
    _timing.record(benchmark, bench_results, case.bytes, kind="attention",
                   op="mla_decode" if case.n == 1 else "mla_verify", impl=impl, B=case.B, L=case.L, n=case.n,
                   Hq=case.H, Hkv=1, D=D, Dv=DV, dtype=PRESET.dtype, **info)
