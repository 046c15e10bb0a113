"""tree_mask_from_parents: reference (and CUDA on a GPU) vs the definition, walked in Python."""
import pytest
import torch

import spec_kernels
from spec_kernels.testing import TREE_KINDS, ancestor_mask_bits, random_parents


def _batch(ns, kind, seed, dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    parents = torch.tensor([p for n in ns for p in random_parents(n, kind, gen)], dtype=dtype)
    qo_indptr = torch.tensor([0] + list(ns), dtype=torch.int64).cumsum(0).to(torch.int32)
    return parents, qo_indptr


@pytest.mark.parametrize("kind", TREE_KINDS)
@pytest.mark.parametrize("ns", [[1], [64], [3, 0, 17, 64, 1], [0, 0]])
def test_reference_matches_definition(kind, ns):
    parents, qo_indptr = _batch(ns, kind, seed=sum(ns))
    got = spec_kernels.tree_mask_from_parents(parents, qo_indptr, impl="reference")
    assert torch.equal(got, ancestor_mask_bits(parents, qo_indptr))


def test_known_small_tree_and_int32_parents():
    # 0 -> {1, 2}, 1 -> 3: rows see themselves and their ancestors only.
    parents = torch.tensor([-1, 0, 0, 1], dtype=torch.int32)
    got = spec_kernels.tree_mask_from_parents(parents, torch.tensor([0, 4], dtype=torch.int32))
    assert got.tolist() == [0b0001, 0b0011, 0b0101, 0b1011]


def test_bit_63_is_set_for_the_64th_draft_of_a_chain():
    parents, qo_indptr = _batch([64], "chain", seed=0)
    got = spec_kernels.tree_mask_from_parents(parents, qo_indptr)
    assert got[63].item() == -1  # all 64 bits set, as a signed int64


@pytest.mark.parametrize("bad,match", [
    ([-1, 1], r"parents\[1\] = 1 \(request 0, draft 1\)"),  # points to itself
    ([-1, 0, 3], r"parents\[2\] = 3"),  # points forward
    ([-2, 0, 0], r"parents\[0\] = -2"),
])
def test_bad_parents_are_rejected(bad, match):
    parents = torch.tensor(bad)
    with pytest.raises(ValueError, match=match):
        spec_kernels.tree_mask_from_parents(parents, torch.tensor([0, len(bad)], dtype=torch.int32))


def test_bad_shapes_and_counts_are_rejected():
    with pytest.raises(ValueError, match="at most 64"):
        spec_kernels.tree_mask_from_parents(torch.full((65,), -1), torch.tensor([0, 65], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"qo_indptr\[-1\] must equal parents.shape\[0\]"):
        spec_kernels.tree_mask_from_parents(torch.full((3,), -1), torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="parents must have dtype int32, int64"):
        spec_kernels.tree_mask_from_parents(torch.zeros(3), torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="qo_indptr must have dtype int32"):
        spec_kernels.tree_mask_from_parents(torch.full((3,), -1), torch.tensor([0, 3]))


@pytest.mark.parametrize("qo,match", [
    ([-1, 3], r"qo_indptr\[0\] must be 0, got -1"),
    ([0, 2, 1, 3], r"qo_indptr must be non-decreasing, but qo_indptr\[2\]=1 < qo_indptr\[1\]=2"),
    ([0, 4], r"qo_indptr\[-1\] must equal parents.shape\[0\] = 3, got 4"),
])
def test_bad_qo_indptr_values_are_rejected(qo, match):
    with pytest.raises(ValueError, match=match):
        spec_kernels.tree_mask_from_parents(torch.tensor([-1, 0, 1]), torch.tensor(qo, dtype=torch.int32))


# Unchecked qo_indptr values (CUDA outside debug mode): every implementation cuts request b's rows
# to [lo, hi), lo = clamp(qo[b], 0, T), hi = clamp(qo[b+1], lo, T), and leaves rows no request
# claims unwritten; a request's rows are its drafts 0, 1, ... (more than 64: empty words).
UNCHECKED_QO = {
    "negative_start": [-3, 2, 5, 9],
    "past_the_end": [0, 3, 40],
    "unordered": [6, 9, 1, 5],  # rows 6-8, none, 1-4; rows 0 and 5 unclaimed
}


def _claimed_rows(qo, T):
    rows = []
    for b in range(len(qo) - 1):
        lo = min(max(qo[b], 0), T)
        rows.append((lo, min(max(qo[b + 1], lo), T)))
    return rows


@pytest.mark.parametrize("name", ["negative_start", "past_the_end", "unordered"])
def test_reference_on_unchecked_qo_indptr(name):
    from spec_kernels.tree_verify import reference

    T = 9
    parents = torch.tensor([-1, 0, 1, 0, -1, 4, 5, 5, 0])
    qo = torch.tensor(UNCHECKED_QO[name], dtype=torch.int32)
    with pytest.raises(ValueError, match="qo_indptr"):
        spec_kernels.tree_mask_from_parents(parents, qo)
    got = torch.full((T,), 12345, dtype=torch.int64)
    reference.tree_mask_from_parents(parents, qo, got)
    written = torch.zeros(T, dtype=torch.bool)
    for lo, hi in _claimed_rows(qo.tolist(), T):
        local = parents[lo:hi].clone()
        local[local >= torch.arange(hi - lo)] = -1  # a link that does not point backwards ends the walk
        want = ancestor_mask_bits(local, torch.tensor([0, hi - lo], dtype=torch.int32))
        assert torch.equal(got[lo:hi], want)
        written[lo:hi] = True
    assert torch.all(got[~written] == 12345) and (~written).any() == (name == "unordered")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["negative_start", "past_the_end", "unordered"])
def test_gpu_cuda_matches_reference_on_unchecked_qo_indptr(name):
    from spec_kernels.tree_verify import reference

    parents = torch.tensor([-1, 0, 1, 0, -1, 4, 5, 5, 0], device="cuda")
    qo = torch.tensor(UNCHECKED_QO[name], dtype=torch.int32, device="cuda")
    want = torch.full((9,), 12345, dtype=torch.int64, device="cuda")
    reference.tree_mask_from_parents(parents, qo, want)
    got = torch.full((9,), 12345, dtype=torch.int64, device="cuda")
    torch.ops.spec_kernels_cuda.tree_mask_from_parents(parents, qo, got)
    assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", TREE_KINDS)
def test_gpu_cuda_matches_reference(kind):
    parents, qo_indptr = _batch([1, 64, 0, 17, 5] * 40, kind, seed=3)
    want = ancestor_mask_bits(parents, qo_indptr)
    for dtype in (torch.int32, torch.int64):
        got = spec_kernels.tree_mask_from_parents(parents.to("cuda", dtype), qo_indptr.cuda(), impl="cuda")
        assert torch.equal(got.cpu(), want)
