"""The fp8-cache instances of the tree-verify / decode kernel (TileConfig<D, rows, true>: byte
stages, one conversion per tile into K and V tiles of q's dtype) run by the PTX interpreter
against the reference on the dequantised values, through the real binding. Every configuration
the launch can pick has a case here, in float8_e4m3fn and float8_e5m2, fp16 and bf16 queries,
host and tensor scales.

Tolerances: as for 16-bit caches (test_tree_verify_ptx.py): an fp8 value converts exactly to fp16
and bf16, k_scale folds into the fp32 softmax scale and v_scale into the fp32 normalisation, so
the only roundings are P to q's dtype for the PV mma and the output's, as on the 16-bit path.
"""
import re

import pytest
import torch

import spec_kernels
from spec_kernels.attention.checks import KvScales
from spec_kernels.testing import make_case

from tools.ptx_harness.cuda_glue import PtxCudaOps
from tools.ptx_harness.cuda_glue import run_tree_verify as run_ptx

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def quantised(case, fp8, tensor_scales=False):
    """`case` with its caches in `fp8` (per-tensor scales from the amax, so the values fill the
    format), the scales, and the dequantised fp32 caches the reference reads."""
    k, v = case.k_cache.float(), case.v_cache.float()
    ks, vs = float(k.abs().max()) / FP8_MAX[fp8], float(v.abs().max()) / FP8_MAX[fp8]
    k8, v8 = (k / ks).to(fp8), (v / vs).to(fp8)
    scales = (KvScales(k_tensor=torch.tensor([ks]), v_tensor=torch.tensor([vs])) if tensor_scales
              else KvScales(ks, vs))
    q_case = type(case)(**{**vars(case), "k_cache": k8, "v_cache": v8})
    return q_case, scales, k8.float() * ks, v8.float() * vs


def reference(case, k, v, decode=False):
    if decode:
        T = case.kv_indptr.numel() - 1
        return spec_kernels.decode_attention(case.q[:T].float(), k, v, case.kv_indptr, case.kv_indices,
                                             impl="reference", return_lse=True)
    return spec_kernels.tree_verify_attention(case.q.float(), k, v, case.kv_indptr, case.kv_indices, case.qo_indptr,
                                              case.tree_mask, impl="reference", return_lse=True)


def check(case, fp8, dtype, *, arch="sm_120a", tensor_scales=False, ops=None, **kw):
    case8, scales, k, v = quantised(case, fp8, tensor_scales)
    ops = ops or PtxCudaOps(arch=arch)
    out, lse = run_ptx(case8, ops, scales=scales, **kw)
    ref, ref_lse = reference(case, k, v, kw.get("decode", False))
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-4, rtol=1e-4, equal_nan=True)
    return ops


def kernel_launch(ops):
    return [l for l in ops.launches if l[0].startswith("tree_verify_kernel")][0]


E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
# (draft counts, prefixes, hq, hkv, d, q dtype, fp8, tree kind, splits, tensor scales, decode,
#  configuration suffix of the mangled name: <D, rows, fp8, m tiles>, the arch the PTX is compiled for)
CASES = [
    ([5, 0, 17], [70, 3, 0], 4, 2, 64, torch.bfloat16, E4, "random", 2, False, False, "Li64ELi64ELb1ELi1E", "sm_120a"),
    ([3, 9], [0, 130], 2, 2, 64, torch.float16, E5, "forest", 0, True, False, "Li64ELi64ELb1ELi1E", "sm_120a"),
    # D = 128, 17-64 rows: sm_90 (two CTAs per SM) the 64-row configuration, sm_120 (one) the
    # 8-warp 128-row one, two warps per 16 rows (36 rows: warps_m 4 x warps_n 2; 18: 2 x 4)
    ([7, 2], [40, 200], 4, 1, 128, torch.float16, E4, "wide", 3, True, False, "Li128ELi64ELb1ELi1E", "sm_90a"),
    ([7, 2], [40, 200], 4, 1, 128, torch.float16, E4, "wide", 3, True, False, "Li128ELi128ELb1ELi1E", "sm_120a"),
    ([9, 2], [380, 3], 2, 1, 128, torch.bfloat16, E5, "random", 0, False, False, "Li128ELi128ELb1ELi1E", "sm_120a"),
    ([4], [70], 2, 1, 256, torch.bfloat16, E4, "random", 0, False, False, "Li256ELi64ELb1ELi1E", "sm_120a"),
    ([3], [40], 2, 1, 256, torch.float16, E5, "chain", 2, True, False, "Li256ELi64ELb1ELi1E", "sm_120a"),
    # > 64 rows at D = 128: the 128-row configuration; an empty request; 2 splits
    ([16, 5, 0], [300, 70, 3], 8, 1, 128, torch.float16, E4, "random", 2, False, False, "Li128ELi128ELb1ELi1E", "sm_120a"),
    ([16, 3], [130, 20], 8, 1, 128, torch.bfloat16, E5, "random", 0, True, False, "Li128ELi128ELb1ELi1E", "sm_120a"),
    # sm_90a, > 64 rows: two m tiles per warp (warps_m 4 x warps_n 2; 5 x 8 = 40 rows: 2 x 4)
    ([16, 5, 0], [300, 70, 3], 8, 1, 128, torch.float16, E4, "random", 2, False, False, "Li128ELi128ELb1ELi2E", "sm_90a"),
    ([16, 3], [130, 20], 8, 1, 128, torch.bfloat16, E5, "random", 0, True, False, "Li128ELi128ELb1ELi2E", "sm_90a"),
    # decode at D = 128 on sm_120: the 32-row configuration (two 41 KB CTAs per SM)
    ([1, 1, 1], [9, 66, 260], 8, 2, 128, torch.bfloat16, E4, "random", 2, True, True, "Li128ELi32ELb1ELi1E", "sm_120a"),
    ([1, 1], [300, 40], 8, 2, 128, torch.float16, E5, "random", 0, False, True, "Li128ELi32ELb1ELi1E", "sm_120a"),
]


@pytest.mark.parametrize("ns,prefixes,hq,hkv,d,dtype,fp8,kind,splits,tensor_scales,decode,config,arch", CASES,
                         ids=[f"case{i}" for i in range(len(CASES))])
def test_fp8_cache_matches_reference(ns, prefixes, hq, hkv, d, dtype, fp8, kind, splits, tensor_scales, decode,
                                     config, arch):
    case = make_case(ns, prefixes, hq=hq, hkv=hkv, d=d, dtype=dtype, kind=kind, seed=sum(ns) + d + len(prefixes))
    ops = check(case, fp8, dtype, arch=arch, splits=splits, tensor_scales=tensor_scales, decode=decode,
                max_draft_tokens=max(ns) if not decode else 0)
    assert kernel_launch(ops)[0].endswith(config), [l[0] for l in ops.launches]
    assert any("merge_splits" in l[0] for l in ops.launches) == (splits > 1)


def test_every_fp8_configuration_has_a_case():
    """The cases above reach every compiled fp8 instance (the X-macro list of the extension)."""
    from spec_kernels import _ops

    compiled = {c.template_args for c in _ops.kernel_configs() if c.kernel == "tree_verify_kernel" and c.kv_fp8}
    reached = {"{},{},true,{}".format(*re.fullmatch(r"Li(\d+)ELi(\d+)ELb1ELi(\d+)E", c[-2]).groups()) for c in CASES}
    assert compiled == reached


def test_sm90a_fp8_decode_takes_the_large_configuration():
    """sm_90a (228 KB per SM): D = 128 decode on an fp8 cache keeps the 64-row configuration."""
    case = make_case([1, 1], [300, 5], hq=8, hkv=1, d=128, dtype=torch.bfloat16, seed=4)
    ops = check(case, E4, torch.bfloat16, arch="sm_90a", decode=True, splits=2)
    assert kernel_launch(ops)[0].endswith("Li128ELi64ELb1ELi1E")


def test_fp8_cache_reads_half_the_bytes():
    """n = 16 drafts on a 240-key prefix at D = 128: every K and V byte is read once, one byte per
    element (half of a 16-bit cache), and no shared-memory access (the byte stages' cp.async
    writes, the conversion's reads and writes, the converted tiles' ldmatrix) has a bank
    conflict."""
    case = make_case([16], [240], hq=4, hkv=1, d=128, dtype=torch.bfloat16, kind="random", seed=7)
    ops = check(case, E4, torch.bfloat16)
    stats = kernel_launch(ops)[4]
    kv_bytes = 256 * 128 * 1  # keys x D x 1 byte, per cache
    assert stats.region_read["k_cache"] == kv_bytes, stats.region_read
    assert stats.region_read["v_cache"] == kv_bytes, stats.region_read
    # (cp.async.ca: the 8-byte slot-id copies, as in the 16-bit instances)
    conflicts = {k: int(v) for k, v in stats.bank_conflicts.items() if v and k != "cp.async.ca.shared.global"}
    assert not conflicts, conflicts


def test_nan_byte_in_a_visible_key_gives_nan_rows_only():
    """An e4m3fn NaN byte (0x7f) in request 1's first prefix K row: every row of request 1 is NaN
    (output and lse), as for a NaN in a 16-bit cache; request 0 is untouched."""
    case = make_case([3, 2], [20, 4], hq=2, hkv=1, d=64, dtype=torch.bfloat16, kind="chain", seed=5)
    case8, scales, k, v = quantised(case, E4)
    slot = int(case.kv_indices[int(case.kv_indptr[1])])
    case8.k_cache.view(torch.uint8)[slot, 0, 3] = 0x7F
    out, lse = run_ptx(case8, PtxCudaOps(), scales=scales)
    assert torch.isnan(out[3:].float()).all() and torch.isnan(lse[3:]).all()
    assert torch.isfinite(out[:3].float()).all() and torch.isfinite(lse[:3]).all()


def test_tensor_scales_are_read_on_the_device():
    """Scale tensors win over the host floats (which the binding then leaves at 1.0): the same
    bytes with k_scale_tensor / v_scale_tensor doubled give the reference of the doubled values."""
    case = make_case([4, 2], [50, 10], hq=4, hkv=2, d=64, dtype=torch.float16, seed=17)
    case8, scales, k, v = quantised(case, E4, tensor_scales=True)
    doubled = KvScales(k_tensor=scales.k_tensor * 2, v_tensor=scales.v_tensor * 2)
    out, lse = run_ptx(case8, PtxCudaOps(), scales=doubled)
    ref, ref_lse = reference(case, k * 2, v * 2)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=5e-3)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-4, rtol=1e-4)
