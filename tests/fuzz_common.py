"""Shared pieces of the bad-input fuzzer (tests/test_bad_input_fuzz.py): the hypothesis
settings, the generic tensor corruptions and the outcome property.

A fuzz example is a valid call (small random shapes) with exactly one argument corrupted. The
corruption says what outcome the contract demands:

* ``raise``: a ValueError / TypeError / RuntimeError whose message names the argument;
* ``legal``: no error, and the result equals the reference implementation on the same input
  (NaN and inf positions included);
* ``either``: whichever of the two the op picks (input whose validity depends on the other
  arguments, e.g. a longer kv_indices), but never another exception, an error naming some
  other argument, or a result that differs from the reference.
"""
from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

# SPEC_KERNELS_FUZZ_EXAMPLES=<n>: n examples per test instead of the CI default (a longer profile).
FUZZ_EXAMPLES = int(os.environ.get("SPEC_KERNELS_FUZZ_EXAMPLES", "0") or 0)


def fuzz_settings(default_examples: int):
    """Deterministic (derandomize), no example database, no deadline; failures print the
    example's draws and the notes describing the corruption."""
    return settings(max_examples=FUZZ_EXAMPLES or default_examples, deadline=None, derandomize=True,
                    database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def fuzz_by_kind(examples: dict):
    """Decorator: test(..., kind, data) becomes a pytest test(..., kind) that runs hypothesis
    with examples[kind] examples (cheap metadata corruptions get more than the ones that run a
    kernel), or SPEC_KERNELS_FUZZ_EXAMPLES of them when that is set."""
    def deco(fn):
        def test(**kwargs):
            @fuzz_settings(examples[kwargs["kind"]])
            @given(data=st.data())
            def example(data):
                fn(**kwargs, data=data)

            example()

        sig = inspect.signature(fn)
        test.__signature__ = sig.replace(parameters=[p for n, p in sig.parameters.items() if n != "data"])
        test.__name__, test.__qualname__, test.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
        test.__module__ = fn.__module__
        return test
    return deco


ACCEPTED_ERRORS = (ValueError, TypeError, RuntimeError)


@dataclass
class Bad:
    """One corruption: `arg` is the corrupted argument; `names` the words an error message may
    use for it (default: arg itself); `expect` one of raise / legal / either."""

    arg: str
    kind: str
    detail: str
    expect: str
    names: tuple = ()

    def __post_init__(self):
        assert self.expect in ("raise", "legal", "either"), self.expect
        if not self.names:
            self.names = (self.arg,)

    def __str__(self):
        return f"{self.kind} of {self.arg}: {self.detail} (expect {self.expect})"


def names_argument(message: str, names: Sequence[str]) -> bool:
    """Whether message names one of `names` as a word (kv_indices[3] counts, qo_indptr does not count as q)."""
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message) for n in names)


def describe(kw: dict) -> str:
    parts = []
    for k, v in kw.items():
        if isinstance(v, torch.Tensor):
            extra = "" if v.is_contiguous() else f" strides {tuple(v.stride())}"
            small = v.device.type != "meta" and v.numel() <= 12 and not v.is_floating_point()
            vals = f" = {v.tolist()}" if small else ""
            parts.append(f"  {k}: {str(v.dtype).replace('torch.', '')}{list(v.shape)} on {v.device}{extra}{vals}")
        elif isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            items = ", ".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" for t in v)
            parts.append(f"  {k}: [{items}]")
        else:
            parts.append(f"  {k}: {v!r}")
    return "\n".join(parts)


def clone_value(v):
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, list):
        return [clone_value(x) for x in v]
    return v


def assert_same_results(got, want, what: str, atol=2e-5, rtol=2e-5) -> None:
    """got/want: tensors or tuples of them; equal values, NaN and inf in the same places."""
    if isinstance(want, torch.Tensor):
        got, want = (got,), (want,)
    assert len(got) == len(want), f"{what}: {len(got)} results, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert tuple(g.shape) == tuple(w.shape), \
            f"{what}: result {i} has shape {tuple(g.shape)}, expected {tuple(w.shape)}"
        assert g.dtype == w.dtype, f"{what}: result {i} has dtype {g.dtype}, expected {w.dtype}"
        if g.dtype.is_floating_point:
            g32, w32 = g.float(), w.float()
            assert torch.equal(torch.isnan(g32), torch.isnan(w32)), \
                f"{what}: result {i} has NaN at other places than the reference:\n{g}\n{w}"
            torch.testing.assert_close(g32, w32, atol=atol, rtol=rtol, equal_nan=True,
                                       msg=lambda m: f"{what}: result {i}: {m}")
        else:
            assert torch.equal(g, w), f"{what}: result {i} differs from the reference:\n{g}\n{w}"


def _event(text: str) -> None:
    """A hypothesis event; also appended to the file $SPEC_KERNELS_FUZZ_LOG if set (coverage counts)."""
    event(text)
    log = os.environ.get("SPEC_KERNELS_FUZZ_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]}\t{text}\n")


def check_outcome(bad: Bad, kw: dict, call: Callable[[], object], reference: Callable[[], object],
                  compare=assert_same_results, after_refusal: Optional[Callable[[], None]] = None) -> str:
    """The fuzz property. Returns "raised" or "ran". `reference` is evaluated before `call`, on
    the same (already corrupted) arguments; it must not mutate kw (clone first)."""
    note(f"corruption: {bad}\narguments:\n{describe(kw)}")
    want, ref_error = None, None
    if bad.expect != "raise":
        try:
            want = reference()
        except Exception as exc:  # noqa: BLE001 - only matters if the op accepts the input
            ref_error = exc
    try:
        got = call()
    except ACCEPTED_ERRORS as exc:
        msg = str(exc)
        note(f"raised {type(exc).__name__}: {msg}")
        assert bad.expect != "legal", f"legal input refused ({bad}): {type(exc).__name__}: {msg}"
        assert names_argument(msg, bad.names), \
            f"the error does not name the corrupted argument {bad.names} ({bad}): {type(exc).__name__}: {msg}"
        if after_refusal is not None:
            after_refusal()
        _event(f"{bad.kind} of {bad.arg}, expect {bad.expect}: raised")
        return "raised"
    assert bad.expect != "raise", f"bad input accepted without an error ({bad})"
    assert ref_error is None, f"the op accepted input its reference cannot process ({bad}): {ref_error!r}"
    compare(got, want, f"{bad}")
    _event(f"{bad.kind} of {bad.arg}, expect {bad.expect}: ran, equal to the reference")
    return "ran"


# --------------------------------------------------------------------------- tensor corruptions
DTYPE_POOL = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.uint8, torch.bool)


def wrong_dtype(data, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> torch.Tensor:
    choices = [d for d in DTYPE_POOL if d not in tuple(allowed)]
    return t.to(data.draw(st.sampled_from(choices), label="wrong dtype"))


def other_rank(data, t: torch.Tensor) -> torch.Tensor:
    """A view with one dimension more or one less (same values)."""
    if t.dim() >= 2 and data.draw(st.booleans(), label="merge two dims"):
        d = data.draw(st.integers(0, t.dim() - 2), label="merged dim")
        return t.flatten(d, d + 1)
    if t.dim() == 1 and data.draw(st.booleans(), label="0-d"):
        return t[0] if t.numel() else t.sum()
    return t.unsqueeze(data.draw(st.integers(0, t.dim()), label="new dim"))


def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view whose last dimension has stride 2: not contiguous unless it has
    at most one element (then torch calls it contiguous, and it is legal input)."""
    buf = torch.zeros(tuple(t.shape) + (2,), dtype=t.dtype, device=t.device)
    view = buf[..., 0]
    view.copy_(t)
    return view


def resized(data, t: torch.Tensor, dim: int, size: int, fill: Optional[Callable] = None) -> torch.Tensor:
    """t with dimension `dim` cut or grown to `size` (new entries: fill(shape) or random/zeros)."""
    cur = t.shape[dim]
    if size <= cur:
        return t.narrow(dim, 0, size).contiguous()
    shape = list(t.shape)
    shape[dim] = size - cur
    if fill is not None:
        extra = fill(tuple(shape)).to(t.dtype)
    elif t.dtype.is_floating_point:
        extra = torch.randn(shape).to(t.dtype)
    else:
        extra = torch.zeros(shape, dtype=t.dtype)
    return torch.cat([t, extra], dim).contiguous()


def new_size(data, cur: int) -> int:
    """A different size near the current one, 0 and 1 included."""
    choices = sorted({0, 1, max(cur - 1, 0), cur + 1} - {cur})
    return data.draw(st.sampled_from(choices), label="new size")


def poison(data, t: torch.Tensor) -> tuple[torch.Tensor, str]:
    """A copy of float tensor t with NaN / +inf / -inf at one element or along one row."""
    t = t.clone()
    if t.numel() == 0:
        return t, "empty: nothing to poison"
    value = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]), label="non-finite value")
    flat = t.view(-1)
    if data.draw(st.booleans(), label="whole row"):
        row = data.draw(st.integers(0, t.shape[0] - 1), label="row")
        t[row] = value
        return t, f"row {row} = {value}"
    i = data.draw(st.integers(0, t.numel() - 1), label="element")
    flat[i] = value
    return t, f"element {tuple(int(x) for x in torch.unravel_index(torch.tensor(i), t.shape))} = {value}"
