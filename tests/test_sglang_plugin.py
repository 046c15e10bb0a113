"""The SGLang plugin pieces that need no SGLang: the verify-mask conversion, the entry point
declaration, and the plugin being a silent no-op without SGLang.

The conversion is checked against `tree_mask_from_parents` (an independent implementation of
the same ancestor words) on masks laid out exactly as SGLang lays them out.
"""
import sys
from pathlib import Path

import pytest
import torch

import spec_kernels
from spec_kernels.sglang import masks, plugin
from spec_kernels.testing import random_parents

ROOT = Path(__file__).resolve().parents[1]


def _ancestors(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: row i sees j iff j is i or an ancestor of i (SGLang's draft block)."""
    n = len(parents)
    rows = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            rows[i, j] = True
            j = parents[j]
    return rows


def _batch(bs, n, prefixes, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    parents = [random_parents(n, kind, gen) for _ in range(bs)]
    blocks = [_ancestors(p) for p in parents]
    flat = torch.tensor([x for p in parents for x in p], dtype=torch.int64)
    qo_indptr = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32)
    expected = spec_kernels.tree_mask_from_parents(flat, qo_indptr)
    qlen = torch.cat([b.flatten() for b in blocks])
    full = []
    for block, prefix in zip(blocks, prefixes):
        rows = torch.ones(n, prefix + n, dtype=torch.bool)  # prefix columns always visible
        rows[:, prefix:] = block
        full.append(rows.flatten())
    return expected, qlen, torch.cat(full)


@pytest.mark.parametrize("kind", ["chain", "random", "wide"])
@pytest.mark.parametrize("bs,n,prefixes", [(1, 1, [0]), (3, 4, [5, 0, 33]), (2, 64, [7, 1]), (4, 7, [0, 0, 0, 0])])
def test_both_layouts_give_the_ancestor_words(kind, bs, n, prefixes):
    expected, qlen, full = _batch(bs, n, prefixes, kind, seed=bs * 100 + n)
    assert torch.equal(masks.words_from_qlen_mask(qlen, bs, n), expected)
    got = masks.words_from_full_mask(full, torch.tensor(prefixes, dtype=torch.int32), n)
    assert torch.equal(got, expected)
    if kind == "chain":
        assert torch.equal(masks.chain_words(bs * n, n, torch.device("cpu")), expected)


def test_uint8_masks_and_masks_inside_larger_buffers():
    expected, qlen, full = _batch(2, 5, [3, 9], "random", seed=1)
    buffer = torch.ones(10 * 25, dtype=torch.uint8)  # SGLang's triton buffer is read as uint8
    buffer[: qlen.numel()] = qlen.to(torch.uint8)
    assert torch.equal(masks.words_from_qlen_mask(buffer, 2, 5), expected)
    padded = torch.cat([full, torch.ones(100, dtype=torch.bool)])  # over-allocated FULL mask
    assert torch.equal(masks.words_from_full_mask(padded, torch.tensor([3, 9]), 5), expected)


def test_rows_past_the_mask_stay_in_bounds():
    # CUDA-graph padding lanes: more rows than the mask holds; they must not fault.
    _, qlen, _ = _batch(1, 3, [0], "chain", seed=0)
    words = masks.words_from_qlen_mask(qlen, 4, 3)
    assert words.shape == (12,)
    words = masks.words_from_full_mask(qlen, torch.tensor([0, 1, 1, 1]), 3)
    assert words.shape == (12,)


def test_layout_detection():
    buf = torch.ones(64 * 16, dtype=torch.bool)
    assert masks.is_qlen_layout(buf[:48], 3, 4, buf)  # the buffer offered to the draft stage
    assert masks.is_qlen_layout(torch.ones(48, dtype=torch.bool), 3, 4, buf)  # bs*n*n, allocated
    assert not masks.is_qlen_layout(torch.ones(48 + 4 * 10, dtype=torch.bool), 3, 4, buf)  # FULL
    with pytest.raises(ValueError, match="at most 64"):
        masks.words_from_rows(torch.ones(2, 65, dtype=torch.bool))


def test_entry_point_is_declared():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    eps = project["project"]["entry-points"]["sglang.srt.plugins"]
    assert eps == {"specfused": "spec_kernels.sglang.plugin:register"}
    module, func = eps["specfused"].split(":")
    assert getattr(sys.modules[module], func) is plugin.register


def test_register_without_sglang_is_a_noop(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang now fails, find_spec says absent
    assert plugin.sglang_available() is False
    assert plugin.register() is False
