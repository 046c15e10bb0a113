"""tree_mask_from_parents: reference (and CUDA on a GPU) vs the definition, walked in Python."""
import pytest
import torch

import spec_kernels
from tree_cases import TREE_KINDS, ancestor_mask_bits, random_parents


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


@pytest.mark.gpu
@pytest.mark.parametrize("kind", TREE_KINDS)
def test_gpu_cuda_matches_reference(kind):
    parents, qo_indptr = _batch([1, 64, 0, 17, 5] * 40, kind, seed=3)
    want = ancestor_mask_bits(parents, qo_indptr)
    for dtype in (torch.int32, torch.int64):
        got = spec_kernels.tree_mask_from_parents(parents.to("cuda", dtype), qo_indptr.cuda(), impl="cuda")
        assert torch.equal(got.cpu(), want)
