"""Bad input to tree_verify_attention / decode_attention: a ValueError/TypeError/RuntimeError
that names the argument, never a crash or garbage."""
import pytest
import torch

import spec_kernels
from spec_kernels.testing import make_case


@pytest.fixture
def case():
    return make_case([4, 2], [10, 3], hq=4, hkv=2, seed=0)


def _call(case, **overrides):
    args = dict(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, kv_indptr=case.kv_indptr,
                kv_indices=case.kv_indices, qo_indptr=case.qo_indptr, tree_mask=case.tree_mask)
    kwargs = {k: overrides.pop(k) for k in list(overrides) if k not in args}
    args.update(overrides)
    return spec_kernels.tree_verify_attention(**args, impl=kwargs.pop("impl", "reference"), **kwargs)


def test_valid_case_runs(case):
    assert _call(case).shape == (6, 4, 64)


@pytest.mark.parametrize("make_bad,exc,match", [
    # dtypes
    (lambda c: dict(q=c.q.to(torch.int32)), ValueError, "q must have dtype float16, bfloat16, float32"),
    (lambda c: dict(k_cache=c.k_cache.half()), ValueError, "k_cache must have dtype float32"),
    (lambda c: dict(v_cache=c.v_cache.double()), ValueError, "v_cache must have dtype float32"),
    (lambda c: dict(kv_indptr=c.kv_indptr.long()), ValueError, "kv_indptr must have dtype int32"),
    (lambda c: dict(kv_indices=c.kv_indices.float()), ValueError, "kv_indices must have dtype int32, int64"),
    (lambda c: dict(qo_indptr=c.qo_indptr.long()), ValueError, "qo_indptr must have dtype int32"),
    (lambda c: dict(tree_mask=c.tree_mask.int()), ValueError, "tree_mask must have dtype int64"),
    # types, devices, ranks
    (lambda c: dict(q=c.q.numpy()), TypeError, "q must be a torch.Tensor"),
    (lambda c: dict(k_cache=c.k_cache.to("meta")), ValueError, "k_cache must be on cpu"),
    (lambda c: dict(q=c.q[0]), ValueError, r"q must be 3-D, got shape \(4, 64\)"),
    (lambda c: dict(kv_indptr=c.kv_indptr[None]), ValueError, "kv_indptr must be 1-D"),
    # shapes
    (lambda c: dict(k_cache=c.k_cache[:, :, :32].contiguous()), ValueError, "k_cache head dim must equal q's"),
    (lambda c: dict(q=torch.randn(6, 4, 48), k_cache=torch.randn(40, 2, 48)), ValueError, "q head dim must be one of"),
    (lambda c: dict(v_cache=c.v_cache[:, :1].contiguous()), ValueError, "v_cache must have shape"),
    (lambda c: dict(q=torch.randn(6, 3, 64)), ValueError, r"q heads \(3\) must be a multiple of k_cache heads \(2\)"),
    (lambda c: dict(qo_indptr=c.qo_indptr[:2]), ValueError, r"qo_indptr must have shape \(3,\)"),
    (lambda c: dict(tree_mask=c.tree_mask[:5]), ValueError, r"tree_mask must have shape \(6,\)"),
    (lambda c: dict(out=torch.empty(6, 4, 32)), ValueError, r"out must have shape \(6, 4, 64\)"),
    (lambda c: dict(out=torch.empty(6, 4, 64, dtype=torch.half)), ValueError, "out must have dtype float32"),
    # contiguity
    (lambda c: dict(q=c.q.transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "q must be contiguous"),
    (lambda c: dict(kv_indices=torch.arange(2 * 19, dtype=torch.int32)[::2]), ValueError, "kv_indices must be contiguous"),
    # values
    (lambda c: dict(qo_indptr=torch.tensor([0, 3, 2], dtype=torch.int32)), ValueError, "qo_indptr must be non-decreasing"),
    (lambda c: dict(qo_indptr=torch.tensor([1, 4, 6], dtype=torch.int32)), ValueError, r"qo_indptr\[0\] must be 0"),
    (lambda c: dict(qo_indptr=torch.tensor([-2, 4, 6], dtype=torch.int32)), ValueError, r"qo_indptr\[0\] must be 0"),
    (lambda c: dict(qo_indptr=torch.tensor([0, 4, 7], dtype=torch.int32)), ValueError,
     r"qo_indptr\[-1\] must equal q.shape\[0\] = 6"),
    (lambda c: dict(kv_indptr=torch.tensor([-3, 8, 10], dtype=torch.int32)), ValueError,
     r"kv_indptr\[0\] must be >= 0 \(an offset into kv_indices\), got -3"),
    (lambda c: dict(kv_indptr=torch.tensor([0, 14, 10], dtype=torch.int32)), ValueError,
     r"kv_indptr must be non-decreasing, but kv_indptr\[2\]=10 < kv_indptr\[1\]=14"),
    (lambda c: dict(kv_indptr=torch.tensor([0, 3, 8], dtype=torch.int32)), ValueError,
     "request 0 has 4 draft tokens but only 3 KV slots"),
    (lambda c: dict(kv_indptr=torch.tensor([0, 14, 99], dtype=torch.int32)), ValueError, "exceeds the length of kv_indices"),
    (lambda c: dict(kv_indices=c.kv_indices + 1000), ValueError, r"kv_indices values must be in \[0, k_cache.shape\[0\]"),
    (lambda c: dict(sm_scale=float("nan")), ValueError, "sm_scale must be finite"),
    (lambda c: dict(num_kv_splits=0), ValueError, "num_kv_splits must be in"),
    (lambda c: dict(max_draft_tokens=65), ValueError, "max_draft_tokens must be in"),
    # implementations
    (lambda c: dict(impl="fast"), ValueError, "impl must be one of"),
    (lambda c: dict(impl="cuda"), RuntimeError, "impl='cuda' is not available"),
])
def test_bad_input_names_the_argument(case, make_bad, exc, match):
    with pytest.raises(exc, match=match):
        _call(case, **make_bad(case))


def test_more_than_64_drafts_is_rejected():
    case = make_case([65], [3], hq=2, hkv=1, kind="chain", seed=1)
    with pytest.raises(ValueError, match="request 0 has 65 draft tokens, at most 64"):
        _call(case)


def test_decode_bad_input(case):
    q = case.q[:2].contiguous()
    with pytest.raises(ValueError, match="q must have one row per request"):
        spec_kernels.decode_attention(case.q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices)
    with pytest.raises(ValueError, match="kv_indptr must be non-decreasing"):
        spec_kernels.decode_attention(q, case.k_cache, case.v_cache, torch.tensor([0, 5, 2], dtype=torch.int32),
                                      case.kv_indices)
    with pytest.raises(ValueError, match="kv_indices values must be in"):
        spec_kernels.decode_attention(q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices - 100)


def test_decode_negative_kv_indptr_is_rejected(case):
    q = case.q[:2].contiguous()
    for bad, match in (([-3, 3, 6], r"kv_indptr\[0\] must be >= 0"), ([-2, -1, 6], r"kv_indptr\[0\] must be >= 0"),
                       ([0, -1, 6], "kv_indptr must be non-decreasing")):
        with pytest.raises(ValueError, match=match):
            spec_kernels.decode_attention(q, case.k_cache, case.v_cache, torch.tensor(bad, dtype=torch.int32),
                                          case.kv_indices)


# Tree-mask words: row qo[b] + i (draft i of request b) may set bits 0..i only (itself and
# earlier drafts). The case has requests of 4 and 2 drafts (rows 0-3 and 4-5).
@pytest.mark.parametrize("row,bits,match", [
    (0, 1 << 1, r"tree_mask\[0\] \(request 0, draft 0\) has bit 1 set: draft 1 comes later"),
    (2, 1 << 3, r"tree_mask\[2\] \(request 0, draft 2\) has bit 3 set: draft 3 comes later"),
    (3, 1 << 4, r"tree_mask\[3\] \(request 0, draft 3\) has bit 4 set, but request 0 has only 4 draft tokens"),
    (4, 1 << 2, r"tree_mask\[4\] \(request 1, draft 0\) has bit 2 set, but request 1 has only 2 draft tokens"),
    (5, -2**63, r"tree_mask\[5\] \(request 1, draft 1\) has bit 63 set"),
])
def test_tree_mask_bits_of_later_drafts_are_rejected(case, row, bits, match):
    mask = case.tree_mask.clone()
    mask[row] |= bits
    with pytest.raises(ValueError, match=match):
        _call(case, tree_mask=mask)


def test_tree_mask_may_leave_out_the_draft_itself_and_ancestors(case):
    # Fewer bits than the ancestors (even none: the row then sees only the prefix) are valid.
    mask = case.tree_mask.clone()
    mask[0] = 0
    mask[5] = 0b01  # request 1, draft 1: only draft 0
    assert torch.isfinite(_call(case, tree_mask=mask)).all()
    full = torch.tensor([0b1, 0b11, 0b111, 0b1111, 0b1, 0b11])  # chains: every earlier draft
    assert torch.isfinite(_call(case, tree_mask=full)).all()
