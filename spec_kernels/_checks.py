"""Argument checks shared by all ops.

Two kinds, with different costs and guarantees:

* metadata checks (type, rank, shape, dtype, device, contiguity) are free and always run, also
  under FakeTensorMode and torch.compile;
* value checks (index ranges, indptr consistency, tree-mask bits) must read tensor contents.
  They always run on CPU tensors. On CUDA tensors they would cost a host sync per call, so they
  run only in debug mode (``SPEC_KERNELS_DEBUG=1`` or ``spec_kernels.set_debug_checks(True)``)
  and never during CUDA graph capture or compilation.

The indptr rules (checked by the functions below, each ValueError naming the argument):

* a query indptr (``qo_indptr``) partitions the query rows: ``[0] == 0``, non-decreasing,
  ``[-1] == T``;
* a KV indptr (``kv_indptr``) points into ``kv_indices``, which may be a larger buffer, so it
  may start at an offset: ``[0] >= 0``, non-decreasing, ``[-1] <= len(kv_indices)``.

What the attention kernels do with unchecked invalid values (CUDA outside debug mode). Every
implementation (reference, Triton, CUDA) follows these rules, so they agree on such input too,
and none reads or writes out of bounds:

* request b's KV positions are ``[lo, hi)`` with ``lo = clamp(kv_indptr[b], 0, N)`` and
  ``hi = clamp(kv_indptr[b+1], lo, N)``, N = len(kv_indices): a range that decreases or lies
  outside kv_indices is cut to what lies inside (possibly nothing);
* its query rows are ``[lo, hi)`` with ``lo = clamp(qo_indptr[b], 0, T)`` and
  ``hi = clamp(qo_indptr[b+1], lo, T)``; only its first min(n_b, max_draft_tokens or 64) drafts
  are computed. Rows that no request claims get unspecified values (left unwritten without KV
  splits; the split merge writes every row); rows that two requests claim get either's result;
* a slot id outside [0, S) reads as a zero K and V row (a key with logit 0);
* draft i sees draft j only if j <= i: tree-mask bits of later drafts (and so of drafts at or
  past n_b) are ignored.
"""
from __future__ import annotations

import os
from typing import Iterable, Optional

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)

_debug_override: Optional[bool] = None


def set_debug_checks(enabled: Optional[bool]) -> None:
    """Turn value checks on CUDA tensors on or off (None: follow SPEC_KERNELS_DEBUG)."""
    global _debug_override
    _debug_override = enabled


def debug_checks_enabled() -> bool:
    if _debug_override is not None:
        return _debug_override
    return os.environ.get("SPEC_KERNELS_DEBUG", "0") == "1"


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


def values_checkable(*tensors: torch.Tensor) -> bool:
    """Whether value checks may read these tensors now (see the module docstring)."""
    if torch.compiler.is_compiling() or any(_is_fake(t) for t in tensors):
        return False
    device = tensors[0].device
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return debug_checks_enabled() and not torch.cuda.is_current_stream_capturing()
    return False


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def common_device(named: Iterable[tuple[str, object]]) -> tuple[torch.device, str]:
    """The device a call's tensors must share: the one most of them are on (the first tensor's on
    a tie), so that the device error names the tensor that is elsewhere, the first one included.
    Returns it and the words a device error uses for where it comes from (the tensors on it, or
    "the other inputs")."""
    named = [(n, t) for n, t in named if isinstance(t, torch.Tensor)]
    if not named:
        return torch.device("cpu"), "the other inputs"
    counts: dict[torch.device, list[str]] = {}
    for n, t in named:
        counts.setdefault(t.device, []).append(n)
    best = max(len(v) for v in counts.values())
    device = next(t.device for _, t in named if len(counts[t.device]) == best)
    on_it = counts[device]
    return device, " and ".join(on_it) if len(on_it) <= 2 else "the other inputs"


def check_tensor(
    t,
    name: str,
    *,
    dim: Optional[int] = None,
    dtypes: Optional[Iterable[torch.dtype]] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = True,
    like: str = "the other inputs",
) -> None:
    """Raise TypeError/ValueError naming `name` when `t` is not a tensor of the given kind."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise ValueError(f"{name} must have dtype {_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} like {like}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {tuple(t.stride())}); call .contiguous()")


def check_shape(t: torch.Tensor, name: str, expected: tuple, meaning: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        extra = f" ({meaning})" if meaning else ""
        raise ValueError(f"{name} must have shape {tuple(expected)}{extra}, got {tuple(t.shape)}")


def _check_non_decreasing(vals: list[int], name: str) -> None:
    for b in range(len(vals) - 1):
        if vals[b + 1] < vals[b]:
            raise ValueError(f"{name} must be non-decreasing, but {name}[{b + 1}]={vals[b + 1]} < {name}[{b}]={vals[b]}")


def check_indptr_values(indptr: torch.Tensor, name: str, total: int, total_name: str) -> list[int]:
    """A query indptr: must start at 0, never decrease, and end at `total`. Returns it as a list."""
    vals = indptr.tolist()
    if vals[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {vals[0]}")
    _check_non_decreasing(vals, name)
    if vals[-1] != total:
        raise ValueError(f"{name}[-1] must equal {total_name} = {total}, got {vals[-1]}")
    return vals


def check_offset_indptr_values(indptr: torch.Tensor, name: str, limit: int, limit_name: str) -> list[int]:
    """An indptr into a buffer of `limit` entries that may start at an offset: indptr[0] >= 0,
    never decreasing, indptr[-1] <= limit. Returns it as a list."""
    vals = indptr.tolist()
    if vals[0] < 0:
        raise ValueError(f"{name}[0] must be >= 0 (an offset into {limit_name}), got {vals[0]}")
    _check_non_decreasing(vals, name)
    if vals[-1] > limit:
        raise ValueError(f"{name}[-1]={vals[-1]} exceeds the length of {limit_name} ({limit})")
    return vals


def check_tree_mask_values(tree_mask: torch.Tensor, qo: list[int], name: str = "tree_mask") -> None:
    """Row qo[b] + i of `tree_mask` (draft i of request b, with n_b = qo[b+1] - qo[b] drafts)
    may only set bits 0..i: itself and earlier drafts (its ancestors). `qo` is a checked query
    indptr. Raises a ValueError naming the first bad row: a bit at or past n_b, or a later draft."""
    T = tree_mask.numel()
    if T == 0:
        return
    counts = torch.tensor([qo[b + 1] - qo[b] for b in range(len(qo) - 1)], dtype=torch.int64)
    starts = torch.tensor(qo[:-1], dtype=torch.int64)
    words = tree_mask.to("cpu", torch.int64)
    draft = torch.arange(T) - torch.repeat_interleave(starts, counts, output_size=T)
    # bits 0..i of row i: 2^(i+1) - 1, all 64 bits at i >= 63 (i >= 64 is rejected elsewhere)
    allowed = torch.where(draft >= 63, torch.full_like(draft, -1), (1 << (draft.clamp(max=62) + 1)) - 1)
    bad = (words & ~allowed) != 0
    if not bool(bad.any()):
        return
    t = int(bad.nonzero()[0])
    b = int(torch.searchsorted(torch.tensor(qo[1:]), t, right=True))
    i, n = int(draft[t]), qo[b + 1] - qo[b]
    extra = [j for j in range(64) if (int(words[t]) >> j) & 1 and j > i]
    j = extra[0]
    if j >= n:
        raise ValueError(f"{name}[{t}] (request {b}, draft {i}) has bit {j} set, but request {b} has only {n} "
                         f"draft tokens: bits at or past n_b must be 0 (requests and drafts as qo_indptr gives them)")
    raise ValueError(f"{name}[{t}] (request {b}, draft {i}) has bit {j} set: draft {j} comes later, so it cannot "
                     f"be an ancestor (a draft sees only itself and earlier drafts; drafts as qo_indptr gives them)")


def check_index_range(idx: torch.Tensor, name: str, upper: int, upper_name: str, where: str = "") -> None:
    """All values of idx in [0, upper); `where` says which part of the tensor idx is."""
    if idx.numel() == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= upper:
        raise ValueError(f"{name} values must be in [0, {upper_name}={upper}), got range [{lo}, {hi}]{where}")
