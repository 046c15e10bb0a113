"""The fp8-cache instances of the MLA tree-verify kernel (MlaTile<m tiles, true>: byte stages, one
conversion per tile into a tile of q's dtype) run by the PTX interpreter against the reference
through the real binding. Every configuration (16, 32 and 64 rows per CTA) has cases in
float8_e4m3fn and float8_e5m2, fp16 and bf16 queries, host and tensor scales, tree verify and
decode, with splits.

The reference dequantises the same bytes (byte * k_scale in the logits, byte * v_scale in the
value); the tolerances are test_mla_ptx.py's, with max|v| of the dequantised values: an fp8 value
converts exactly to fp16 and bf16, so the kernel rounds what it rounds on a 16-bit cache.
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import spec_kernels.mla.cuda as mla_cuda  # noqa: E402
from spec_kernels.attention.checks import KvScales  # noqa: E402
from spec_kernels.mla import reference  # noqa: E402

import test_mla_ptx as base  # noqa: E402
from test_mla_ptx import D, DV, make_case  # noqa: E402

pytestmark = base.pytestmark
ops = base.ops  # the fixture: mla_cuda's cuda_ops is the interpreter

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4: 448.0, E5: 57344.0}


def quantised(c, fp8, tensor_scales=False):
    """c with its cache in `fp8` (k_scale from the amax, so that the values fill the format;
    v_scale a different value, so that each scale is seen on its own), and the scales."""
    kv = c["kv_cache"].float()
    ks = float(kv.abs().max()) / FP8_MAX[fp8]
    vs = 0.75 * ks
    c8 = {**c, "kv_cache": (kv / ks).to(fp8)}
    scales = KvScales(k_tensor=torch.tensor([ks]), v_tensor=torch.tensor([vs])) if tensor_scales else KvScales(ks, vs)
    return c8, scales


def run_both(c8, scales, *, splits, max_draft_tokens=0):
    q = c8["q"]
    T, H, _ = q.shape
    args = (q, c8["kv_cache"], c8["kv_indptr"], c8["kv_indices"], c8["qo_indptr"], c8["tree_mask"],
            1 / math.sqrt(D), DV)
    out = torch.full((T, H, DV), float("nan"), dtype=q.dtype)
    lse = torch.full((T, H), float("nan"))
    mla_cuda.mla_tree_verify_attention(*args, out, lse, num_kv_splits=splits, max_draft_tokens=max_draft_tokens,
                                       scales=scales)
    ref = torch.empty(T, H, DV, dtype=q.dtype)
    ref_lse = torch.empty(T, H)
    k_scale, v_scale = scales.values()
    reference.mla_tree_verify_attention(*args, ref, ref_lse, max_draft_tokens, k_scale, v_scale)
    return out, lse, ref, ref_lse


def check(c, fp8, *, splits, max_draft_tokens=0, tensor_scales=False):
    c8, scales = quantised(c, fp8, tensor_scales)
    out, lse, ref, ref_lse = run_both(c8, scales, splits=splits, max_draft_tokens=max_draft_tokens)
    v = c8["kv_cache"].float() * scales.values()[1]
    base.assert_matches({**c, "kv_cache": v}, out, lse, ref, ref_lse)
    return c8


@pytest.mark.parametrize(
    "dtype,fp8,ns,prefixes,heads,splits,max_draft,tensor_scales,block_m",
    [
        # 12 rows: 16-row CTAs (32-key tiles); 3 splits, an empty prefix
        pytest.param(torch.bfloat16, E4, [3, 0, 2], [70, 4, 0], 4, 3, 3, False, 16, id="bf16-e4m3-bm16-split3"),
        pytest.param(torch.float16, E5, [2, 1], [45, 0], 4, 1, 2, True, 16, id="f16-e5m2-bm16"),
        # 20 rows: one 32-row CTA (3 stages); 2 splits
        pytest.param(torch.float16, E4, [2, 0, 3], [40, 3, 0], 4, 2, 0, True, 32, id="f16-e4m3-bm32-split2"),
        pytest.param(torch.bfloat16, E5, [5, 2], [50, 9], 4, 1, 0, False, 32, id="bf16-e5m2-bm32"),
        # 48 and 80 rows: 64-row CTAs (8 warps, Q columns staged in the converted tile)
        pytest.param(torch.bfloat16, E4, [3], [40], 16, 2, 0, False, 64, id="bf16-e4m3-bm64-split2"),
        pytest.param(torch.float16, E5, [5, 2], [20, 9], 16, 1, 0, True, 64, id="f16-e5m2-bm64-two-row-blocks"),
    ],
)
def test_fp8_tree_verify_matches_reference(ops, dtype, fp8, ns, prefixes, heads, splits, max_draft, tensor_scales,
                                           block_m):
    c = make_case(ns, prefixes, heads, dtype, seed=sum(prefixes) + heads + 1)
    check(c, fp8, splits=splits, max_draft_tokens=max_draft, tensor_scales=tensor_scales)
    (launch,) = [name for name, *_ in ops.launches if "mla_tree_verify_kernel" in name]
    assert launch.endswith(f"Li{block_m // 16}ELb1ELi1E"), launch  # <T, m tiles, fp8 cache, no k split>
    assert any("mla_merge_splits_kernel" in n for n, *_ in ops.launches) == (splits > 1)


@pytest.mark.parametrize("dtype,fp8,ns,prefixes,heads,splits,tensor_scales", [
    # sm_90's 64-row configuration (k split 4, 32-key byte stages, one converted tile)
    pytest.param(torch.bfloat16, E4, [3], [40], 16, 2, False, id="bf16-e4m3-split2"),
    pytest.param(torch.float16, E5, [5, 2], [20, 9], 16, 1, True, id="f16-e5m2-two-row-blocks"),
])
def test_fp8_sm90_k_split_matches_reference(monkeypatch, dtype, fp8, ns, prefixes, heads, splits, tensor_scales):
    from tools.ptx_harness.cuda_glue import PtxCudaOps

    ops = PtxCudaOps(arch="sm_90a")
    monkeypatch.setattr(mla_cuda, "cuda_ops", lambda: ops)
    c = make_case(ns, prefixes, heads, dtype, seed=sum(prefixes) + heads + 1)
    check(c, fp8, splits=splits, tensor_scales=tensor_scales)
    (launch,) = [name for name, *_ in ops.launches if "mla_tree_verify_kernel" in name]
    assert launch.endswith("Li4ELb1ELi4E"), launch


@pytest.mark.parametrize("dtype,fp8,prefixes,heads,splits,tensor_scales", [
    pytest.param(torch.bfloat16, E4, [0, 1, 40], 16, 2, True, id="bf16-e4m3-decode-h16-split2"),
    pytest.param(torch.float16, E5, [20, 3], 40, 2, False, id="f16-e5m2-decode-h40-bm64"),
])
def test_fp8_decode_matches_reference(ops, dtype, fp8, prefixes, heads, splits, tensor_scales):
    c = make_case(None, prefixes, heads, dtype, decode=True, seed=7 + heads)
    check(c, fp8, splits=splits, tensor_scales=tensor_scales)


def test_every_fp8_configuration_has_a_case():
    from spec_kernels import _ops

    compiled = {(c.block_m, c.block_n) for c in _ops.kernel_configs() if c.kernel == mla_cuda.KERNEL and c.kv_fp8}
    # (64, 32): test_fp8_sm90_k_split_matches_reference; the others: the sm_120a cases above
    assert compiled == {(16, 32), (32, 16), (64, 16), (64, 32)}


def test_fp8_cache_reads_each_byte_once_per_row_block(ops):
    """Each (request, row block) CTA reads the request's fp8 rows once, one byte per value (half
    a 16-bit cache's bytes), with no shared-memory bank conflict (byte stages, conversion,
    ldmatrix of the converted tile)."""
    c = make_case([3, 2], [40, 9], 4, torch.bfloat16, seed=5)  # 12 and 8 rows: one 16-row block each
    c8 = check(c, E4, splits=1)
    (stats,) = [st for name, *_, st in ops.launches if "mla_tree_verify_kernel" in name]
    assert stats.region_read["kv_cache"] == (43 + 11) * D, stats.region_read
    conflicts = {k: int(v) for k, v in stats.bank_conflicts.items() if v}
    assert not conflicts, conflicts
    assert c8["kv_cache"].dtype == E4


def test_nan_byte_in_a_seen_row_gives_nan_rows(ops):
    """An e4m3fn NaN byte in the K part (column 530, rope) of draft 1's slot: the rows that see it
    are NaN (output and lse); draft 0's row, which does not, stays finite (the rope columns are
    not part of V)."""
    c = make_case([3], [2], 2, torch.bfloat16, seed=3)
    c["tree_mask"] = torch.tensor([0b1, 0b11, 0b111], dtype=torch.int64)
    c8, scales = quantised(c, E4)
    c8["kv_cache"].view(torch.uint8)[int(c["kv_indices"][2 + 1]), 530] = 0x7F
    out, lse, _, _ = run_both(c8, scales, splits=1)
    assert torch.isnan(out[1:].float()).all() and torch.isnan(lse[1:]).all()
    assert torch.isfinite(out[0].float()).all() and torch.isfinite(lse[0]).all()
