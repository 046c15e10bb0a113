"""The compiled tree-mask kernel (csrc/tree_verify/tree_mask.cu) against the reference, through
the real binding with cuda_ops pointing at the PTX interpreter: random trees of every kind, draft
counts 0..64 mixed, and parents that are not valid (unchecked on a GPU: the walk must stop, never
read out of bounds)."""

import pytest
import torch

from spec_kernels.tree_verify import api as tv_api  # noqa: E402
from spec_kernels.tree_verify import reference  # noqa: E402
from spec_kernels.testing import random_parents  # noqa: E402

from tools.ptx_harness.cuda_glue import PtxCudaOps  # noqa: E402


def run(parents, qo_indptr):
    ops = PtxCudaOps()
    out = torch.full((parents.numel(),), -7, dtype=torch.int64)
    saved = tv_api.cuda_ops
    tv_api.cuda_ops = lambda: ops
    try:
        tv_api._tree_mask_cuda(parents, qo_indptr, out)
    finally:
        tv_api.cuda_ops = saved
    assert [l[0] for l in ops.launches] == ["tree_mask_from_parents_kernel"]
    want = torch.full_like(out, -7)
    reference.tree_mask_from_parents(parents, qo_indptr, want)
    return out, want


@pytest.mark.parametrize("seed", [0, 1])
def test_random_trees(seed):
    gen = torch.Generator().manual_seed(seed)
    counts = [0, 1, 5, 64, 17, 3]
    kinds = ["chain", "wide", "random", "forest", "random", "forest"]
    parents = [p for n, k in zip(counts, kinds) for p in random_parents(n, k, gen)]
    qo = torch.tensor([0] + counts).cumsum(0).to(torch.int32)
    out, want = run(torch.tensor(parents, dtype=torch.int64), qo)
    assert torch.equal(out, want)


def test_invalid_parents_stop_the_walk():
    # a parent pointing forward, at itself, far away, and a cycle: the kernel must not loop or read
    # outside parents, and must agree with the reference's documented cut
    parents = torch.tensor([-1, 0, 5, 2, 100, -9, 3, 6], dtype=torch.int64)
    qo = torch.tensor([0, 4, 8], dtype=torch.int32)
    out, want = run(parents, qo)
    assert torch.equal(out, want)
