"""Numerics of the PTX interpreter's m16n8k16 mma.sync model (ptxsim/mma.py).

The "exact" mode must be bit-identical to MMA-Sim (PyPI `mmasim`, Microsoft's bit-accurate model
of the tensor cores). Three independent checks:

* golden files (tests/data/mma_golden_{bf16,f16}.npz): inputs and MMA-Sim 2.1.1's outputs for
  random and edge cases on sm_120, sm_90 and sm_80, written by this module's `--write-golden`
  entry point; they make the check run where mmasim is not installed;
* live comparison against mmasim on freshly drawn cases (skipped, with the reason, when mmasim
  is not importable);
* a plain scalar implementation of the same algorithm in exact rational arithmetic (below),
  compared on fresh cases, so a change to the vectorised code is caught even without mmasim.

The "fast" mode is checked against "exact" for the accuracy its docstring promises.

Regenerate the golden files (needs mmasim and torch): python tests/test_mma_numerics.py --write-golden
"""
from __future__ import annotations

import math
import sys
import zlib
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from ptxsim.mma import ArchParams, arch_params, mma_m16n8k16

DATA = Path(__file__).resolve().parent / "data"
DTYPES = ("bf16", "f16")
# arch string -> the architecture name MMA-Sim uses
MMASIM_ARCH = {"sm_120": "RTX Blackwell", "sm_90": "Hopper", "sm_89": "Ada Lovelace", "sm_80": "Ampere"}
GOLDEN_ARCHS = ("sm_120", "sm_90", "sm_80")
# instances (one 16x16x8 mma each) per case kind in the golden files
GOLDEN_KINDS = {
    "normal": 4, "wide": 5, "cancel": 5, "tiny": 3, "special": 6, "overflow": 4, "bits": 5,
    "zeros": 3, "spread": 4, "ezero": 5, "subnormal": 5,
}


# --------------------------------------------------------------------------------------------
# Case generation: bit patterns (uint16 for A and B, uint32 for C) so that NaN payloads, signed
# zeros and subnormals are stored exactly.
# --------------------------------------------------------------------------------------------

def _to_bits16(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values -> bf16/f16 bit patterns (round to nearest even)."""
    if dtype == "f16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).view(np.uint16)
    with np.errstate(over="ignore"):
        f = x.astype(np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(f)
    rounded[nan] = (u[nan] >> 16) | 0x40  # keep NaN a NaN
    return rounded.astype(np.uint16)


def bits16_to_f32(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "f16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _exp_scaled(rng, shape, lo, hi):
    """Standard-normal significands times 2**e with e uniform in [lo, hi)."""
    return rng.standard_normal(shape) * np.exp2(rng.integers(lo, hi, shape).astype(np.float64))


def _sprinkle(rng, x, values, p):
    """Replace a fraction p of x's elements by values drawn from `values`."""
    x = x.copy()
    mask = rng.random(x.shape) < p
    x[mask] = rng.choice(np.asarray(values, dtype=np.float64), size=int(mask.sum()))
    return x


def make_cases(rng: np.random.Generator, dtype: str, kind: str, n: int):
    """n mma instances of one kind: (a_bits (n,16,16) u16, b_bits (n,16,8) u16, c_bits (n,16,8) u32)."""
    bf16 = dtype == "bf16"
    # exponent ranges of the input type, subnormals included
    e_lo, e_hi = (-134, 128) if bf16 else (-25, 16)
    sa, sb, sc = (n, 16, 16), (n, 16, 8), (n, 16, 8)
    inf, nan = np.inf, np.nan
    if kind == "normal":
        a, b, c = rng.standard_normal(sa), rng.standard_normal(sb), rng.standard_normal(sc)
    elif kind == "wide":
        a, b = _exp_scaled(rng, sa, e_lo, e_hi), _exp_scaled(rng, sb, e_lo, e_hi)
        c = _exp_scaled(rng, sc, -152, 128)
    elif kind == "cancel":
        # products cancel in pairs (k and k + 8) up to small perturbations, C is small or cancels
        a = rng.standard_normal(sa)
        b = rng.standard_normal(sb)
        a[:, :, 8:] = -a[:, :, :8]
        b[:, 8:, :] = b[:, :8, :]
        a = _sprinkle(rng, a, [1e-3, -1e-3, 2.0**-10, 3.0], 0.1)
        b = b * np.exp2(rng.integers(-4, 4, sb))
        c = np.where(rng.random(sc) < 0.5, 0.0, rng.standard_normal(sc) * 2.0**-20)
    elif kind == "tiny":
        # subnormal and near-subnormal factors, C zero, subnormal or tiny: exercises e_zero
        a = _exp_scaled(rng, sa, e_lo, e_lo + 12)
        b = _exp_scaled(rng, sb, e_lo, e_lo + 12)
        a = _sprinkle(rng, a, [0.0, -0.0], 0.1)
        b = _sprinkle(rng, b, [0.0], 0.05)
        c = rng.choice([0.0, -0.0, 1.0], size=sc) * _exp_scaled(rng, sc, -152, -120)
    elif kind == "ezero":
        # sums near the float32 subnormal range (bf16: products of about 2**-160 .. 2**-110), with
        # zero terms present or not: whether e_zero sets the alignment grid shows in the result;
        # negative sums that truncate to zero must give +0.0
        # each instance draws its own exponent base, so some have every product below 2**-149
        base = rng.integers(-86, -62, (n, 1, 1)) if bf16 else rng.integers(-25, -16, (n, 1, 1))
        a = _sprinkle(rng, rng.standard_normal(sa) * np.exp2(base + rng.integers(0, 6, sa)), [0.0, -0.0], 0.1)
        b = rng.standard_normal(sb) * np.exp2(base + rng.integers(0, 6, sb))
        b[:, :, ::2] = np.abs(b[:, :, ::2])
        a[::2] = -np.abs(a[::2])  # negative products in even columns of every other instance
        c = rng.choice([0.0, -0.0, 0.0, 1.0, -1.0], size=sc) * _exp_scaled(rng, sc, -152, -126)
    elif kind == "subnormal":
        # subnormal A values times ordinary B, C just below the largest product with all 24 bits:
        # the aligned grid depends on subnormals taking the smallest normal exponent
        a = _exp_scaled(rng, sa, e_lo, e_lo + 9)  # bf16: [-134, -125), f16: [-25, -16)
        b = _exp_scaled(rng, sb, -3, 3)
        top = np.abs(a).max(-1)[:, :, None] * 4.0  # about the largest product
        c = rng.uniform(-1, 1, sc) * top * np.exp2(-rng.integers(0, 10, sc).astype(np.float64))
    elif kind == "special":
        a, b, c = rng.standard_normal(sa), rng.standard_normal(sb), rng.standard_normal(sc)
        a = _sprinkle(rng, a, [inf, -inf, nan, 0.0, -0.0], 0.03)
        b = _sprinkle(rng, b, [inf, -inf, nan, 0.0, -0.0], 0.03)
        c = _sprinkle(rng, c, [inf, -inf, nan, 0.0, -0.0], 0.1)
    elif kind == "overflow":
        if bf16:  # products up to 2**256: sums beyond the float32 range
            a, b = _exp_scaled(rng, sa, 100, 128), _exp_scaled(rng, sb, 20, 28)
        else:  # f16 products stay below 2**32; C near the float32 maximum decides
            a, b = _exp_scaled(rng, sa, 10, 16), _exp_scaled(rng, sb, 10, 16)
        a = np.abs(a) * np.where(rng.random(sa) < 0.8, 1.0, -1.0)
        big = np.float64(np.finfo(np.float32).max)
        c = rng.choice([big, -big, big * 0.999, 0.0, 1.0], size=sc)
    elif kind == "bits":
        a_bits = rng.integers(0, 1 << 16, sa, dtype=np.uint64).astype(np.uint16)
        b_bits = rng.integers(0, 1 << 16, sb, dtype=np.uint64).astype(np.uint16)
        c_bits = rng.integers(0, 1 << 32, sc, dtype=np.uint64).astype(np.uint32)
        return a_bits, b_bits, c_bits
    elif kind == "zeros":
        a = _sprinkle(rng, rng.standard_normal(sa), [0.0, -0.0], 0.7)
        b = _sprinkle(rng, rng.standard_normal(sb), [0.0, -0.0], 0.7)
        a[:, ::3, :] = -0.0  # whole rows of zeros
        c = rng.choice([0.0, -0.0, 1.0, -1.0], size=sc)
    elif kind == "spread":
        # one large term per dot product next to many small ones: truncation of the small ones
        a = _exp_scaled(rng, sa, -30, 0) if bf16 else _exp_scaled(rng, sa, -12, 0)
        b = rng.standard_normal(sb)
        k = rng.integers(0, 16, (n, 16))
        a[np.arange(n)[:, None], np.arange(16)[None, :], k] = 2.0 ** (10 if bf16 else 8)
        c = _exp_scaled(rng, sc, -40, 12)
    else:
        raise ValueError(kind)
    with np.errstate(over="ignore"):
        c_bits = c.astype(np.float32).view(np.uint32)
    return _to_bits16(a, dtype), _to_bits16(b, dtype), c_bits


def to_operands(a_bits, b_bits, c_bits, dtype):
    return bits16_to_f32(a_bits, dtype), bits16_to_f32(b_bits, dtype), c_bits.view(np.float32)


def mmasim_reference(a, b, c, dtype, arch):
    """MMA-Sim's D for a batch (float32 arrays in and out)."""
    import torch
    from mmasim.nv_ptx import MMA

    tdt = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    op = MMA(MMASIM_ARCH[arch], f"m16n8k16.f32.{dtype}.{dtype}.f32")
    at = torch.from_numpy(np.ascontiguousarray(a)).to(tdt)
    bt = torch.from_numpy(np.ascontiguousarray(b)).to(tdt)
    a_vec = at[:, :, None, :].expand(-1, -1, 8, -1)  # (N, 16, 8, K): row i of A
    b_vec = bt.transpose(1, 2)[:, None, :, :].expand(-1, 16, -1, -1)  # column j of B
    return op.dpa(a_vec, b_vec, torch.from_numpy(np.ascontiguousarray(c))).numpy()


def _mismatches(got: np.ndarray, want: np.ndarray) -> int:
    return int((got.view(np.uint32) != want.view(np.uint32)).sum())


def _describe_mismatch(got, want, a, b, c):
    idx = tuple(int(i) for i in np.argwhere(got.view(np.uint32) != want.view(np.uint32))[0])
    n, i, j = idx
    return (
        f"first mismatch at {idx}: got {got[idx]!r} ({got.view(np.uint32)[idx]:#010x}), want "
        f"{want[idx]!r} ({want.view(np.uint32)[idx]:#010x}); a row {a[n, i].tolist()}, "
        f"b column {b[n, :, j].tolist()}, c {c[idx]!r}"
    )


# --------------------------------------------------------------------------------------------
# An independent scalar model of the documented algorithm, in exact rational arithmetic.
# --------------------------------------------------------------------------------------------

_E_MIN = {"bf16": -126, "f16": -14}


def _exp_of(x: float, e_min: int) -> int:
    m, e = math.frexp(x)  # x = m * 2**e, 0.5 <= |m| < 1
    return max(e - 1, e_min)


def _rz_f32(v: Fraction) -> float:
    if v == 0:
        return 0.0
    sign = -1.0 if v < 0 else 1.0
    mag = abs(v)
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    if Fraction(2) ** e > mag:
        e -= 1
    if e > 127:
        return sign * math.inf
    quantum = Fraction(2) ** (max(e, -126) - 23)
    units = math.floor(mag / quantum)
    return sign * float(units * quantum)


def _scalar_block(avals, bvals, c: float, dtype: str, p: ArchParams) -> float:
    prods = [x * y for x, y in zip(avals, bvals)]  # Python floats: exact here (<= 22 bits)
    terms = prods + [c]
    if any(math.isnan(t) for t in terms):
        return math.nan
    infs = {math.copysign(1.0, t) for t in terms if math.isinf(t)}
    if infs:
        return math.nan if len(infs) == 2 else infs.pop() * math.inf
    exps = [
        p.e_zero if t == 0 else _exp_of(x, _E_MIN[dtype]) + _exp_of(y, _E_MIN[dtype])
        for t, x, y in zip(prods, avals, bvals)
    ]
    exps.append(p.e_zero if c == 0 else _exp_of(c, -126))
    e_max = max(exps)
    unit = Fraction(2) ** (e_max - p.F)
    total = sum(int(Fraction(t) / unit) for t in terms)  # int() truncates toward zero
    return _rz_f32(total * unit)


def scalar_mma(a, b, c, dtype, arch):
    p = arch_params(arch)
    out = np.empty(c.shape, np.float32)
    for n in range(c.shape[0]):
        for i in range(16):
            for j in range(8):
                acc = float(c[n, i, j])
                for k0 in range(0, 16, p.block):
                    acc = _scalar_block(
                        [float(v) for v in a[n, i, k0 : k0 + p.block]],
                        [float(v) for v in b[n, k0 : k0 + p.block, j]],
                        acc, dtype, p,
                    )
                out[n, i, j] = acc
    out = out + np.float32(0.0)
    out.view(np.uint32)[np.isnan(out)] = 0x7FFFFFFF
    return out


# --------------------------------------------------------------------------------------------
# Golden files
# --------------------------------------------------------------------------------------------

def _golden_path(dtype):
    return DATA / f"mma_golden_{dtype}.npz"


def write_golden():
    import mmasim  # noqa: F401  (fail early and clearly)
    from importlib.metadata import version

    DATA.mkdir(parents=True, exist_ok=True)
    for dtype in DTYPES:
        rng = np.random.default_rng(20261201 + (dtype == "f16"))
        parts, kinds = [], []
        for kind, count in GOLDEN_KINDS.items():
            parts.append(make_cases(rng, dtype, kind, count))
            kinds += [kind] * count
        a_bits, b_bits, c_bits = (np.concatenate(x) for x in zip(*parts))
        a, b, c = to_operands(a_bits, b_bits, c_bits, dtype)
        d = np.stack([mmasim_reference(a, b, c, dtype, arch) for arch in GOLDEN_ARCHS])
        np.savez_compressed(
            _golden_path(dtype), a_bits=a_bits, b_bits=b_bits, c_bits=c_bits,
            d_bits=d.view(np.uint32), archs=np.array(GOLDEN_ARCHS), kinds=np.array(kinds),
            mmasim_version=np.array(version("mmasim")),
        )
        print(f"{_golden_path(dtype)}: {len(kinds)} mma instances, {d[0].size} outputs per arch, "
              f"{_golden_path(dtype).stat().st_size} bytes")


def _load_golden(dtype):
    path = _golden_path(dtype)
    if not path.exists():
        pytest.fail(f"{path} is missing; regenerate it with `python {Path(__file__).name} --write-golden`")
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", GOLDEN_ARCHS)
def test_exact_matches_golden(dtype, arch):
    g = _load_golden(dtype)
    a, b, c = to_operands(g["a_bits"], g["b_bits"], g["c_bits"], dtype)
    want = g["d_bits"][list(g["archs"]).index(arch)].view(np.float32)
    assert set(g["kinds"]) == set(GOLDEN_KINDS)
    # the stored cases reach every kind of result (so a trivial golden file cannot pass)
    assert np.isnan(want).any() and np.isinf(want).any() and (want == 0).any()
    tiny = np.abs(want) < np.finfo(np.float32).tiny
    assert (tiny & (want != 0)).any() or dtype == "f16"  # f16 cannot reach float32 subnormals
    got = mma_m16n8k16(a, b, c, dtype, mode="exact", arch=arch)
    assert _mismatches(got, want) == 0, _describe_mismatch(got, want, a, b, c)
    # the same inputs with the architecture suffix PTX uses
    assert _mismatches(mma_m16n8k16(a, b, c, dtype, mode="exact", arch=arch + "a"), want) == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_golden_sm90_equals_sm120(dtype):
    """MMA-Sim uses the same parameters for Hopper and RTX Blackwell for these instructions."""
    g = _load_golden(dtype)
    archs = list(g["archs"])
    assert np.array_equal(g["d_bits"][archs.index("sm_90")], g["d_bits"][archs.index("sm_120")])
    assert arch_params("sm_90") == arch_params("sm_120")
    # sm_80 differs (F = 24, blocks of 8): the file shows it
    assert not np.array_equal(g["d_bits"][archs.index("sm_80")], g["d_bits"][archs.index("sm_120")])


# --------------------------------------------------------------------------------------------
# Live comparison with mmasim
# --------------------------------------------------------------------------------------------

def _mmasim_or_skip():
    try:
        import mmasim  # noqa: F401
        import torch  # noqa: F401
    except Exception as exc:  # ImportError, or its C++ extension failing to build
        pytest.skip(f"mmasim is not importable ({type(exc).__name__}: {exc}); the golden-file "
                    "tests still check bit-exactness")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["sm_120", "sm_90", "sm_89", "sm_80"])
def test_exact_matches_mmasim_live(dtype, arch):
    _mmasim_or_skip()
    rng = np.random.default_rng(zlib.crc32(f"{dtype}/{arch}".encode()))
    parts = [make_cases(rng, dtype, kind, 3) for kind in GOLDEN_KINDS]
    a_bits, b_bits, c_bits = (np.concatenate(x) for x in zip(*parts))
    a, b, c = to_operands(a_bits, b_bits, c_bits, dtype)
    want = mmasim_reference(a, b, c, dtype, arch)
    got = mma_m16n8k16(a, b, c, dtype, mode="exact", arch=arch)
    assert _mismatches(got, want) == 0, _describe_mismatch(got, want, a, b, c)


# --------------------------------------------------------------------------------------------
# Independent scalar model
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["sm_120", "sm_80"])
def test_exact_matches_scalar_model(dtype, arch):
    rng = np.random.default_rng(7 + (dtype == "f16") + 2 * (arch == "sm_80"))
    parts = [make_cases(rng, dtype, kind, 1) for kind in GOLDEN_KINDS]
    a_bits, b_bits, c_bits = (np.concatenate(x) for x in zip(*parts))
    a, b, c = to_operands(a_bits, b_bits, c_bits, dtype)
    want = scalar_mma(a, b, c, dtype, arch)
    got = mma_m16n8k16(a, b, c, dtype, mode="exact", arch=arch)
    assert _mismatches(got, want) == 0, _describe_mismatch(got, want, a, b, c)


# --------------------------------------------------------------------------------------------
# Properties that follow from the model's definition
# --------------------------------------------------------------------------------------------

def _single(a_row, b_col, c, dtype="bf16", arch="sm_120", mode="exact"):
    a = np.zeros((1, 16, 16), np.float32)
    b = np.zeros((1, 16, 8), np.float32)
    a[0, 0, : len(a_row)] = a_row
    b[0, : len(b_col), 0] = b_col
    cc = np.zeros((1, 16, 8), np.float32)
    cc[0, 0, 0] = c
    return mma_m16n8k16(a, b, cc, dtype, mode=mode, arch=arch)[0, 0, 0]


def test_exact_truncates_terms_below_window_and_rounds_toward_zero():
    # 1 + 2**-30: the small product lies below the 2**-25 grid of the large one (F = 25) and is
    # dropped. 1 + 3 * 2**-25: the small products sit on the grid and are kept, then the sum is
    # rounded toward zero to float32 (1.0), where round-to-nearest gives 1 + 2**-23.
    assert _single([1.0, 2.0**-15], [1.0, 2.0**-15], 0.0) == 1.0
    v = _single([1.0, 2.0**-24, 2.0**-24, 2.0**-24], [1.0, 0.5, 0.5, 0.5], 0.0)
    assert v == 1.0  # 1 + 3 * 2**-25 truncated toward zero in float32
    fast = _single([1.0, 2.0**-24, 2.0**-24, 2.0**-24], [1.0, 0.5, 0.5, 0.5], 0.0, mode="fast")
    assert fast == np.float32(1.0 + 2.0**-23)
    neg = _single([-1.0, 2.0**-24, 2.0**-24, 2.0**-24], [1.0, -0.5, -0.5, -0.5], 0.0)
    assert neg == -1.0  # toward zero for negative sums too


def test_exact_special_values():
    assert np.isnan(_single([np.inf], [0.0], 1.0))  # inf * 0
    assert np.isnan(_single([np.inf, np.inf], [1.0, -1.0], 0.0))  # inf - inf
    assert np.isnan(_single([np.inf], [1.0], -np.inf))
    assert _single([np.inf], [-2.0], 5.0) == -np.inf
    assert _single([1.0], [1.0], np.inf) == np.inf
    assert _single([np.nan], [1.0], 0.0).view(np.uint32) == 0x7FFFFFFF  # canonical NaN
    assert _single([1.0], [1.0], -np.float32(np.nan)).view(np.uint32) == 0x7FFFFFFF
    # signed zeros: every zero result is +0.0
    z = _single([-0.0], [1.0], -0.0)
    assert z == 0 and not np.signbit(z)
    z = _single([1.0, -1.0], [1.0, 1.0], -0.0)
    assert z == 0 and not np.signbit(z)
    z = _single([-(2.0**-75)], [2.0**-75], -0.0)  # -2**-150 rounds toward zero to zero: +0.0
    assert z == 0 and not np.signbit(z)
    # ... and -2**-149 is kept (a float32 subnormal)
    assert _single([-(2.0**-75)], [2.0**-74], 0.0) == -(2.0**-149)
    # overflow of a finite sum: +-inf (bf16 products reach 2**254)
    assert _single([2.0**127, 2.0**127], [2.0, 2.0], 0.0) == np.inf
    assert _single([-(2.0**127)], [2.0], 0.0) == -np.inf


def test_exact_single_product_is_exact():
    """With one nonzero product and c == 0 the result is that product (exact in float32)."""
    rng = np.random.default_rng(3)
    a = bits16_to_f32(_to_bits16(rng.standard_normal((64, 16, 16)), "bf16"), "bf16")
    b = bits16_to_f32(_to_bits16(rng.standard_normal((64, 16, 8)), "bf16"), "bf16")
    a[:, :, 1:] = 0.0
    c = np.zeros((64, 16, 8), np.float32)
    got = mma_m16n8k16(a, b, c, "bf16", mode="exact")
    want = (a[:, :, :1].astype(np.float64) * b[:, :1, :].astype(np.float64)).astype(np.float32)
    assert np.array_equal(got, want + np.float32(0.0))


# --------------------------------------------------------------------------------------------
# fast versus exact
# --------------------------------------------------------------------------------------------

def _ulp_distance(x, y):
    def ordered(v):
        i = v.view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    return np.abs(ordered(x) - ordered(y))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["sm_120", "sm_90"])
def test_fast_within_2ulp_of_exact_on_same_sign_inputs(dtype, arch):
    rng = np.random.default_rng(11 + (dtype == "f16"))
    n = 256
    sign = np.where(rng.random((n, 1, 1)) < 0.5, -1.0, 1.0)  # one sign per mma: no cancellation
    a = bits16_to_f32(_to_bits16(sign * rng.uniform(0.05, 4.0, (n, 16, 16)), dtype), dtype)
    b = bits16_to_f32(_to_bits16(rng.uniform(0.05, 4.0, (n, 16, 8)), dtype), dtype)
    c = (sign * rng.uniform(0.0, 8.0, (n, 16, 8))).astype(np.float32)
    fast = mma_m16n8k16(a, b, c, dtype, mode="fast", arch=arch)
    exact = mma_m16n8k16(a, b, c, dtype, mode="exact", arch=arch)
    dist = _ulp_distance(fast, exact)
    assert dist.max() <= 2, f"max {dist.max()} ulp"
    assert (dist > 0).any()  # the two models do differ (truncation + RZ versus nearest)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_within_error_bound_of_exact_on_mixed_signs(dtype):
    """With cancellation the ulp distance can be large; the absolute difference stays below the
    hardware's truncation error (17 terms, each < 2**(e_max - F)) plus the two final roundings."""
    rng = np.random.default_rng(5 + (dtype == "f16"))
    n = 256
    a = bits16_to_f32(_to_bits16(rng.standard_normal((n, 16, 16)), dtype), dtype)
    b = bits16_to_f32(_to_bits16(rng.standard_normal((n, 16, 8)), dtype), dtype)
    c = rng.standard_normal((n, 16, 8)).astype(np.float32)
    fast = mma_m16n8k16(a, b, c, dtype, mode="fast").astype(np.float64)
    exact = mma_m16n8k16(a, b, c, dtype, mode="exact").astype(np.float64)
    prods = np.abs(a.astype(np.float64)[:, :, None, :] * np.swapaxes(b, 1, 2)[:, None, :, :])
    max_term = np.maximum(prods.max(-1), np.abs(c))  # >= 2**e_max for normal inputs
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    bound = 17 * 2.0**-25 * max_term + 1.5 * ulp
    assert (np.abs(fast - exact) <= bound).all()


# --------------------------------------------------------------------------------------------
# Argument checking
# --------------------------------------------------------------------------------------------

def _ones(n=2):
    return (np.ones((n, 16, 16), np.float32), np.ones((n, 16, 8), np.float32),
            np.zeros((n, 16, 8), np.float32))


def test_bad_arguments():
    a, b, c = _ones()
    with pytest.raises(ValueError, match="in_dtype"):
        mma_m16n8k16(a, b, c, "f32")
    with pytest.raises(ValueError, match="mode"):
        mma_m16n8k16(a, b, c, "bf16", mode="approx")
    with pytest.raises(ValueError, match="arch"):
        mma_m16n8k16(a, b, c, "bf16", arch="sm_70")
    with pytest.raises(TypeError, match="arch"):
        mma_m16n8k16(a, b, c, "bf16", arch=120)
    with pytest.raises(TypeError, match="^a "):
        mma_m16n8k16(a.astype(np.float64), b, c, "bf16")
    with pytest.raises(TypeError, match="^b "):
        mma_m16n8k16(a, b.tolist(), c, "bf16")
    with pytest.raises(ValueError, match="^c "):
        mma_m16n8k16(a, b, c[:, :, :4], "bf16")
    with pytest.raises(ValueError, match="batch"):
        mma_m16n8k16(a, b[:1], c, "bf16")
    bad = a.copy()
    bad[1, 2, 3] = 1.0 + 2.0**-10  # an f16 value, not a bf16 one
    with pytest.raises(ValueError, match=r"a\[\(1, 2, 3\)\]"):
        mma_m16n8k16(bad, b, c, "bf16")
    mma_m16n8k16(bad, b, c, "f16")  # fine as f16
    bad_b = b.copy()
    bad_b[0, 0, 0] = 1e-30  # a bf16-range value that f16 cannot hold
    with pytest.raises(ValueError, match="b holds"):
        mma_m16n8k16(a, bad_b, c, "f16")


def test_empty_batch():
    a, b, c = _ones(0)
    for mode in ("fast", "exact"):
        d = mma_m16n8k16(a, b, c, "bf16", mode=mode)
        assert d.shape == (0, 16, 8) and d.dtype == np.float32


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-golden"]:
        write_golden()
    else:
        print(__doc__)
        sys.exit(2)
