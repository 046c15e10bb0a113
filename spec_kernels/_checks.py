"""Argument checks shared by all ops.

Two kinds, with different costs and guarantees:

* metadata checks (type, rank, shape, dtype, device, contiguity) are free and always run, also
  under FakeTensorMode and torch.compile;
* value checks (index ranges, indptr consistency) must read tensor contents. They always run on
  CPU tensors. On CUDA tensors they would cost a host sync per call, so they run only in debug
  mode (``SPEC_KERNELS_DEBUG=1`` or ``spec_kernels.set_debug_checks(True)``) and never during
  CUDA graph capture or compilation. The kernels never read or write out of bounds on invalid
  values, but results for such inputs are unspecified.
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


def check_tensor(
    t,
    name: str,
    *,
    dim: Optional[int] = None,
    dtypes: Optional[Iterable[torch.dtype]] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = True,
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
        raise ValueError(f"{name} must be on {device} like the other inputs, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {tuple(t.stride())}); call .contiguous()")


def check_shape(t: torch.Tensor, name: str, expected: tuple, meaning: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        extra = f" ({meaning})" if meaning else ""
        raise ValueError(f"{name} must have shape {tuple(expected)}{extra}, got {tuple(t.shape)}")


def check_indptr_values(indptr: torch.Tensor, name: str, total: int, total_name: str) -> list[int]:
    """indptr must start at 0, never decrease, and end at `total`. Returns it as a list."""
    vals = indptr.tolist()
    if vals[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {vals[0]}")
    for b in range(len(vals) - 1):
        if vals[b + 1] < vals[b]:
            raise ValueError(f"{name} must be non-decreasing, but {name}[{b + 1}]={vals[b + 1]} < {name}[{b}]={vals[b]}")
    if vals[-1] != total:
        raise ValueError(f"{name}[-1] must equal {total_name} = {total}, got {vals[-1]}")
    return vals


def check_index_range(idx: torch.Tensor, name: str, upper: int, upper_name: str) -> None:
    """All values of idx in [0, upper)."""
    if idx.numel() == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= upper:
        raise ValueError(f"{name} values must be in [0, {upper_name}={upper}), got range [{lo}, {hi}]")
