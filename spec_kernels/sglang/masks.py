"""SGLang's verify masks -> the per-row 64-bit ancestor words of `tree_verify_attention`.

SGLang hands a TARGET_VERIFY batch one flat boolean mask (``EagleVerifyInput.custom_mask``)
in one of two layouts (``sglang.srt.speculative.eagle_utils.TreeMaskMode``):

* ``QLEN_ONLY``: per request an n x n block, row i = draft i, column j = draft j;
* ``FULL_MASK``: per request an n x (prefix + n) block; the first ``prefix`` columns of each
  row are the (always visible) prefix, the last n are the same draft-to-draft block.

Either way only the n x n draft block matters to us: it becomes one int64 word per draft
(bit j set iff the draft sees draft j). Everything here is a handful of device ops whose
shapes depend only on host ints (batch size, n, the mask's numel), so nothing syncs with
the host and the ops can run right before a CUDA-graph replay.

No SGLang import: this module is testable on its own.
"""
from __future__ import annotations

import torch

from .._limits import MAX_DRAFT_TOKENS


# Bit weights 2^j as int64; bit 63 is the sign bit, so its weight is -2^63. A sum of distinct
# weights never overflows, and the result has exactly those bits set.
_BIT_WEIGHTS = [1 << j for j in range(63)] + [-(1 << 63)]


_weights_on: dict[torch.device, torch.Tensor] = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    # Made once per device: a host-to-device copy on every batch would stall the host.
    device = torch.device(device)
    if device not in _weights_on:
        _weights_on[device] = torch.tensor(_BIT_WEIGHTS, dtype=torch.int64, device=device)
    return _weights_on[device][:n]


def words_from_rows(rows: torch.Tensor) -> torch.Tensor:
    """[T, n] bool (or 0/1 integers) -> int64 [T], bit j of row t = rows[t, j] for j <= t % n.
    Row t is draft t % n of its request; bits of later drafts are dropped (the ops refuse them,
    and SGLang's all-ones placeholder masks for graph capture and warm-up set them)."""
    n = rows.shape[-1]
    if n > MAX_DRAFT_TOKENS:
        raise ValueError(f"at most {MAX_DRAFT_TOKENS} draft tokens per request, got {n}")
    words = ((rows != 0).to(torch.int64) * _weights(n, rows.device)).sum(-1)
    return words & chain_words(rows.shape[0], n, rows.device)


def chain_words(num_tokens: int, n: int, device: torch.device) -> torch.Tensor:
    """Words of n-token chains (draft i sees drafts 0..i), for `num_tokens` = bs * n rows."""
    prefix_sums = torch.cumsum(_weights(n, device), 0)  # 2^(i+1) - 1, and -1 (all bits) at i = 63
    return prefix_sums[torch.arange(num_tokens, device=device) % n]


def _gather_rows(mask: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    # Rows of CUDA-graph padding lanes may point past a mask sized for the real batch;
    # clamping keeps the gather in bounds (those rows' outputs are discarded).
    return mask.reshape(-1)[index.clamp_(0, max(mask.numel() - 1, 0))]


def words_from_qlen_mask(mask: torch.Tensor, bs: int, n: int) -> torch.Tensor:
    """QLEN_ONLY layout (bs x n x n, possibly inside a larger buffer) -> int64 [bs * n]."""
    index = torch.arange(bs * n * n, device=mask.device).view(bs * n, n)
    return words_from_rows(_gather_rows(mask, index))


def words_from_full_mask(mask: torch.Tensor, prefix_lens: torch.Tensor, n: int) -> torch.Tensor:
    """FULL_MASK layout -> int64 [bs * n]; `prefix_lens` [bs] (device) are the requests'
    prefix lengths, i.e. the TARGET_VERIFY batch's ``seq_lens``."""
    device = mask.device
    bs = prefix_lens.shape[0]
    row_len = prefix_lens.to(torch.int64) + n  # columns per row of each request
    block = row_len * n
    req_start = torch.cumsum(block, 0) - block  # exclusive prefix sum
    t = torch.arange(bs * n, device=device)
    req, draft = t // n, t % n
    first = req_start[req] + draft * row_len[req] + prefix_lens.to(torch.int64)[req]
    index = first[:, None] + torch.arange(n, device=device)[None, :]
    return words_from_rows(_gather_rows(mask, index))


def is_qlen_layout(mask: torch.Tensor, bs: int, n: int, qlen_buffer: torch.Tensor | None) -> bool:
    """Which layout `mask` is in, from metadata only (no device read).

    The draft stage writes QLEN_ONLY into the buffer the backend offers (`verify_mask`), or
    allocates exactly bs * n * n cells when the batch does not fit it; any other mask is
    FULL_MASK (when every prefix is empty the two layouts coincide)."""
    if qlen_buffer is not None and mask.untyped_storage().data_ptr() == qlen_buffer.untyped_storage().data_ptr():
        return True
    return mask.numel() == bs * n * n
