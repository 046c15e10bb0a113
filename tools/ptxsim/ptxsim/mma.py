"""Numerics of `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32` on the CPU.

One call computes D = A @ B + C for a batch of independent warp-level operations, each on whole
matrices: A is 16x16 (M x K), B is 16x8 (K x N), C and D are 16x8, all float32 NumPy arrays. A and
B must hold values that are exactly representable in the input type (bf16 or f16).

Two models are offered:

``mode="fast"``
    The 16 products of each dot product are summed in float64 (BLAS order), C is added in float64
    and the result is rounded once to float32 (round to nearest even). Each product of two bf16 or
    f16 values is exact in float64, so this is (nearly always) the correctly rounded result. It is
    NOT what the tensor cores compute, which truncate every term below 2**(e_max - F) and round
    toward zero (see "exact"). On same-sign inputs the two modes differ by at most 1 ulp on
    sm_90/sm_100/sm_120 (in about half of the outputs; up to 3 ulp on sm_8x). With mixed signs,
    cancellation turns the hardware's truncation error (below 18 * 2**(e_max - F) in absolute terms,
    e_max being the largest term's exponent) into many ulps of a small result: on standard-normal
    inputs about 31% (bf16) / 42% (f16) of the outputs differ, and 0.4% / 1.6% by more than 2 ulp.
    Use "fast" where a test tolerates a few ulp; use "exact" to reproduce the hardware's bits.

``mode="exact"``
    A model of the tensor core's fused dot-product-add as MMA-Sim (Microsoft's bit-accurate model of
    tensor cores, PyPI package ``mmasim``) describes it for these instructions. For every output
    element, the 16 products a_k * b_k and the addend c form 17 terms, each written as a significand
    s (1 <= |s| < 4 for a product of two normal inputs) times 2**e, where a product's exponent is
    the SUM of its factors' exponents (so 1.5 * 1.5 has s = 2.25, e = 0). Then:

    1. exponents: a subnormal factor uses the smallest normal exponent of its type (bf16: -126,
       f16: -14; the addend, an fp32 value: -126); a term that is zero (a zero product, or c ==
       +-0) takes the exponent ``e_zero`` (-133 on sm_90/sm_100/sm_120, -132 on sm_8x), which
       takes part in the maximum below;
    2. alignment: with e_max the largest of the 17 exponents, every term is scaled to a fixed-point
       number with F fractional bits below 2**e_max (F = 25 on sm_90/sm_100/sm_120, 24 on sm_8x)
       and TRUNCATED toward zero there (bits below 2**(e_max - F) are dropped, per term);
    3. the truncated terms are added exactly;
    4. the sum is rounded once to float32 toward zero (RZ), subnormal results included; a
       magnitude of 2**128 or more becomes +-inf; a zero result is +0.0;
    5. special values: a NaN input, inf * 0, or +inf and -inf among the terms give NaN, returned as
       the canonical 0x7FFFFFFF; otherwise an infinite input gives an infinity of its sign.

    On sm_90, sm_100 and sm_120 the whole K = 16 is one such fused block. On sm_8x the model
    fuses 8 products at a time: the first 8 products and C give an intermediate float32 value (as
    above), which is the addend of the second block of 8.

    This model is bit-identical to MMA-Sim 2.1.1 (``mmasim.nv_ptx.MMA``) for these instructions on
    all inputs the project's tests generate (random, wide exponent ranges, cancellation,
    subnormals, signed zeros, inf, NaN, overflow); it was written from the algorithm, with NumPy,
    vectorised over the batch and needs neither torch nor mmasim. MMA-Sim in turn states that its
    model matches the hardware bit for bit; that claim is MMA-Sim's.

Speed (NumPy, one core): N = 512 operations take about 0.5-2.5 ms in "fast" mode and 25 ms in
"exact" mode; a single operation about 0.1-0.2 ms and 0.5 ms.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ArchParams", "arch_params", "mma_m16n8k16", "IN_DTYPES", "MODES"]

IN_DTYPES = ("bf16", "f16")
MODES = ("fast", "exact")

M, N, K = 16, 8, 16

_CANONICAL_NAN = np.int32(0x7FFFFFFF)
_TWO_128 = 2.0**128


@dataclass(frozen=True)
class ArchParams:
    """Parameters of the fused dot-product-add for one architecture family."""

    F: int  # fraction bits kept below the largest term's exponent (truncation width)
    block: int  # products fused per step (K = 16 is split into blocks of this size)
    e_zero: int  # exponent given to a zero term (below -126)


# Values as MMA-Sim 2.1.1 sets them for fp32-accumulating bf16/f16 mma.sync (16-bit inputs).
_PARAMS_SM8X = ArchParams(F=24, block=8, e_zero=-132)  # Ampere (sm_80/86/87), Ada (sm_89)
_PARAMS_SM9X_PLUS = ArchParams(F=25, block=16, e_zero=-133)  # Hopper, Blackwell, RTX Blackwell

_ARCH_TABLE = {
    "sm_80": _PARAMS_SM8X,
    "sm_86": _PARAMS_SM8X,
    "sm_87": _PARAMS_SM8X,
    "sm_89": _PARAMS_SM8X,
    "sm_90": _PARAMS_SM9X_PLUS,
    "sm_100": _PARAMS_SM9X_PLUS,
    "sm_120": _PARAMS_SM9X_PLUS,
}

# Smallest normal exponent of each input type (a subnormal is aligned as if it had this exponent).
_E_MIN_NORMAL = {"bf16": -126, "f16": -14}
_E_MIN_NORMAL_F32 = -126


def arch_params(arch: str) -> ArchParams:
    """Parameters for `arch` ("sm_120", "sm_120a", "sm_90a", "sm_80", ...)."""
    if not isinstance(arch, str):
        raise TypeError(f"arch must be a str such as 'sm_120', got {type(arch).__name__}")
    base = arch[:-1] if arch.endswith(("a", "f")) else arch
    try:
        return _ARCH_TABLE[base]
    except KeyError:
        raise ValueError(
            f"arch {arch!r} is not modelled; known: {sorted(_ARCH_TABLE)} (optionally with an "
            "'a' or 'f' suffix)"
        ) from None


def _check_operand(name: str, x, shape_tail: tuple[int, int]) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise TypeError(f"{name} must have dtype float32, got {x.dtype}")
    if x.ndim != 3 or x.shape[1:] != shape_tail:
        raise ValueError(f"{name} must have shape (N, {shape_tail[0]}, {shape_tail[1]}), got {x.shape}")
    return x


def _check_representable(name: str, x: np.ndarray, in_dtype: str) -> None:
    """Raise ValueError unless every element of x is a value of `in_dtype`."""
    if in_dtype == "bf16":
        bad = (x.view(np.uint32) & np.uint32(0xFFFF)) != 0
        bad &= ~np.isnan(x)  # any NaN stands for a bf16 NaN
    else:
        with np.errstate(over="ignore"):
            bad = x.astype(np.float16).astype(np.float32) != x
        bad &= ~np.isnan(x)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name} holds a value that is not exactly representable in {in_dtype}: "
            f"{name}[{idx}] = {x[idx]!r}"
        )


def _exponents(x: np.ndarray, e_min: int) -> np.ndarray:
    """Exponent e of x = s * 2**e with 1 <= |s| < 2, raised to e_min for subnormals (int32).

    Zeros get e_min too (callers treat zero terms separately). For inf/NaN the value does not
    matter: the result is non-finite whatever the alignment.
    """
    with np.errstate(invalid="ignore"):
        _, e = np.frexp(x)
    e = e.astype(np.int32)
    e -= 1
    np.maximum(e, e_min, out=e)
    return e


# Exponent given to zero factors so that a zero product never wins the maximum (the e_zero rule
# is applied separately, see _fused_block). Far below any real product exponent (>= -266), and
# two of them still fit in int32.
_E_SENTINEL = -(1 << 20)


def _round_rz_f32(x: np.ndarray) -> np.ndarray:
    """Round float64 values to float32 toward zero; |x| >= 2**128 gives +-inf; -0.0 gives +0.0;
    NaN gives the canonical NaN 0x7FFFFFFF."""
    with np.errstate(over="ignore", invalid="ignore"):
        f = x.astype(np.float32)  # round to nearest even (subnormals included)
        too_far = np.abs(f.astype(np.float64)) > np.abs(x)  # rounded away from zero
        f = np.where(too_far, np.nextafter(f, np.float32(0)), f)
        f = np.where(np.abs(x) >= _TWO_128, np.copysign(np.float32(np.inf), x).astype(np.float32), f)
    f = f + np.float32(0.0)  # -0.0 -> +0.0
    nan = np.isnan(f)
    if nan.any():
        f.view(np.int32)[nan] = _CANONICAL_NAN
    return f


def _fused_block(
    a: np.ndarray, b: np.ndarray, c: np.ndarray, in_dtype: str, p: ArchParams
) -> np.ndarray:
    """One fused dot-product-add step.

    a: (N, 16, L) and b: (N, L, 8) float32 holding in_dtype values, c: (N, 16, 8) float32.
    Returns the (N, 16, 8) float32 result.

    Work arrays are laid out (L, N, 16, 8) so that the maximum and the sum over the L products
    are element-wise operations on contiguous blocks.
    """
    e_min = _E_MIN_NORMAL[in_dtype]
    a_k = np.ascontiguousarray(a.transpose(2, 0, 1))  # (L, N, 16)
    b_k = np.ascontiguousarray(b.transpose(1, 0, 2))  # (L, N, 8)

    # Exponents of the products: ea + eb; a zero factor gets a sentinel so that zero products
    # never set the maximum.
    ea = _exponents(a_k, e_min)
    eb = _exponents(b_k, e_min)
    ea[a_k == 0] = _E_SENTINEL
    eb[b_k == 0] = _E_SENTINEL
    e_max = (ea[:, :, :, None] + eb[:, :, None, :]).max(axis=0)  # (N, 16, 8)

    # A zero term takes part in the maximum with the exponent e_zero. For the addend that matters
    # (c == +-0). For a zero product it never does: e_zero lies below -126, and a nonzero addend
    # has an exponent of at least -126 (subnormals are aligned as -126), while a zero addend
    # already brings e_zero into the maximum. So only the addend's zero rule is applied.
    ec = _exponents(c, _E_MIN_NORMAL_F32)
    ec[c == 0] = p.e_zero
    np.maximum(e_max, ec, out=e_max)

    # Products, each exact in float64 (at most 22 significant bits, exponents within
    # [-266, 256]); inf * 0 gives NaN as it should.
    with np.errstate(invalid="ignore"):
        prod = a_k.astype(np.float64)[:, :, :, None] * b_k.astype(np.float64)[:, :, None, :]

    # Align to the fixed-point grid 2**(e_max - F) and truncate toward zero. The scale is a power
    # of two within float64's normal range, so scaling is exact; each truncated term is an integer
    # below 2**(F + 2) in magnitude and the sum of the 17 terms is below 2**53: it is exact in
    # any order.
    scale = np.ldexp(1.0, p.F - e_max)  # (N, 16, 8) float64
    with np.errstate(invalid="ignore"):
        np.multiply(prod, scale, out=prod)
        np.trunc(prod, out=prod)
        total = prod.sum(axis=0)
        total += np.trunc(c.astype(np.float64) * scale)
        value = total * np.ldexp(1.0, e_max - p.F)  # exact: |total| < 2**53, no underflow
    return _round_rz_f32(value)


def _fast(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.matmul(a.astype(np.float64), b.astype(np.float64)) + c.astype(np.float64)
        f = d.astype(np.float32)
    f = f + np.float32(0.0)
    nan = np.isnan(f)
    if nan.any():
        f.view(np.int32)[nan] = _CANONICAL_NAN
    return f


def mma_m16n8k16(
    a: np.ndarray,
    b: np.ndarray,
    c: np.ndarray,
    in_dtype: str,
    mode: str = "fast",
    arch: str = "sm_120",
    check_inputs: bool = True,
) -> np.ndarray:
    """D = A @ B + C for a batch of m16n8k16 mma.sync operations with float32 accumulation.

    a: (N, 16, 16) float32 holding `in_dtype` values (row-major A, M x K).
    b: (N, 16, 8) float32 holding `in_dtype` values (B as K x N).
    c: (N, 16, 8) float32.
    in_dtype: "bf16" or "f16" (both A and B; mixed input types do not exist for this shape).
    mode: "fast" (float64 sum, one rounding to nearest; about 1 ulp from the hardware) or "exact"
        (the hardware's truncated fused sum; see the module docstring).
    arch: "sm_120" (default), "sm_100", "sm_90", or "sm_80"/"sm_86"/"sm_87"/"sm_89", optionally
        with an "a"/"f" suffix. Only mode="exact" depends on it.
    check_inputs: verify that a and b hold only `in_dtype` values (ValueError otherwise).

    Returns a new (N, 16, 8) float32 array. NaN results are the canonical NaN 0x7FFFFFFF and zero
    results are +0.0 in both modes.
    """
    if in_dtype not in IN_DTYPES:
        raise ValueError(f"in_dtype must be one of {IN_DTYPES}, got {in_dtype!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    params = arch_params(arch)
    a = _check_operand("a", a, (M, K))
    b = _check_operand("b", b, (K, N))
    c = _check_operand("c", c, (M, N))
    if not (a.shape[0] == b.shape[0] == c.shape[0]):
        raise ValueError(
            f"a, b and c must have the same batch size, got {a.shape[0]}, {b.shape[0]}, {c.shape[0]}"
        )
    if check_inputs:
        _check_representable("a", a, in_dtype)
        _check_representable("b", b, in_dtype)
    if mode == "fast":
        return _fast(a, b, c)
    d = c
    for k0 in range(0, K, params.block):
        k1 = k0 + params.block
        d = _fused_block(a[:, :, k0:k1], b[:, k0:k1, :], d, in_dtype, params)
    return d
