"""Which PTX instruction forms the interpreter implements (the census test's oracle).

`unsupported(forms)` returns {form: reason} for every form the handlers in ops.py do not
implement; it mirrors the decoder's own refusals (ops.py raises SimError on the same forms), and
the semantics tests (tests/test_semantics.py) exercise what it accepts."""
from __future__ import annotations

from typing import Iterable

from .memory import SimError

# forms the decoder accepts syntactically but whose semantics are only partly modelled
_NOT_MODELLED_PREFIXES = ("wgmma", "tcgen05", "mbarrier", "cp.async.bulk", "cp.reduce", "tensormap",
                          "fence.proxy", "setmaxnreg", "elect", "bar.arrive", "brx")

_BASE_OK = {"mov", "add", "sub", "mul", "mad", "fma", "div", "rem", "and", "or", "xor", "not", "shl", "shr",
            "shf", "bfe", "bfi", "prmt", "popc", "clz", "brev", "neg", "abs", "min", "max", "setp", "selp", "cvt", "cvta", "ex2",
            "rsqrt", "rcp", "sqrt", "lg2", "ld", "st", "atom", "red", "membar", "fence", "shfl", "redux", "vote",
            "ldmatrix", "stmatrix", "mma", "cp", "bra", "ret", "exit", "trap", "bar", "barrier", "nanosleep",
            "griddepcontrol"}


def _check(form: str):
    from . import ops
    parts = form.split(".")
    base = parts[0]
    if form.startswith(_NOT_MODELLED_PREFIXES) or base not in _BASE_OK:
        return f"no handler for {base!r}" if base not in _BASE_OK else "not modelled"
    if base == "mma":
        if "m16n8k16" not in parts or parts[4:6] != ["row", "col"] or parts[6] != "f32" or parts[9] != "f32" \
                or parts[7] not in ("bf16", "f16") or parts[7] != parts[8]:
            return "only mma.sync m16n8k16 row.col f32 += {bf16,f16} is modelled"
        return None
    if base == "griddepcontrol":
        return None if form in ("griddepcontrol.wait", "griddepcontrol.launch_dependents") else "not a griddepcontrol form"
    if base == "cp":
        if parts[1] != "async":
            return "not modelled"
        if parts[2] in ("commit_group", "wait_group", "wait_all"):
            return None
        if parts[2] in ("ca", "cg") and parts[3].startswith("shared") and parts[4] == "global":
            return None
        return "only cp.async.{ca,cg}.shared.global is modelled"
    if base in ("bar", "barrier"):
        if parts[1:] in (["sync"], ["warp", "sync"], ["red", "and", "pred"], ["red", "or", "pred"],
                         ["sync", "aligned"]):
            return None
        return "only bar.sync / bar.red.{and,or}.pred on barrier 0 and bar.warp.sync are modelled"
    if base == "cvt":
        types = [p for p in parts[1:] if p not in ("rn", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi", "ftz",
                                                      "sat", "satfinite", "relu")]
        if len(types) != 2:
            return "unrecognised cvt form"
        dt, at = types
        if dt in ("e4m3x2",) and "satfinite" not in parts:
            return "e4m3x2 without .satfinite"
        if at in ("e4m3x2", "e5m2x2"):
            return None if dt == "f16x2" and "rn" in parts and "relu" not in parts else \
                "fp8 sources are modelled as cvt.rn.f16x2.{e4m3x2,e5m2x2} only"
        if dt in ("e5m2x2", "e2m1x2", "e3m2x2", "e2m3x2", "ue8m0x2", "tf32") or at.startswith(("e2", "e3", "ue8")):
            return "fp6/fp4 and conversions to e5m2/tf32 are not modelled"
        if dt in ("bf16", "f16", "bf16x2", "f16x2") and "rn" not in parts:
            return "conversions to half types are modelled with .rn only"
        if "relu" in parts:
            return ".relu is not modelled"
        return None
    if base in ("ex2", "rsqrt", "rcp", "sqrt", "lg2"):
        if "approx" not in parts and "rn" not in parts:
            return "only .approx and .rn forms are modelled"
        if parts[-1] not in ("f32", "f64"):
            return "only f32/f64"
        return None
    if base == "prmt" and len(parts) > 2:
        return "only the default prmt mode is modelled"
    if base in ("add", "sub", "mul", "fma", "mad", "min", "max", "neg", "abs", "setp", "selp", "div") and \
            parts[-1] in ("f16", "bf16", "f16x2", "bf16x2"):
        return "half-precision arithmetic is not modelled"
    if base == "mad" and "hi" in parts:
        return "mad.hi is not modelled"
    if base in ("ld", "st"):
        if any(p in ("local",) for p in parts):
            return "local memory is not modelled"
    return None


def unsupported(forms: Iterable[str]) -> dict:
    out = {}
    for f in forms:
        reason = _check(f)
        if reason:
            out[f] = reason
    return out
