"""Semantics of each PTX instruction form (PTX ISA 9.x), decoded once per launch into closures.

A plain op is `fn(sel, tids)`: `sel` indexes the register arrays (a slice when the threads are
contiguous), `tids` are the executing threads (after the guard). Control ops (branches, exit,
barriers, nanosleep, trap) are `fn(group, frame, sel, tids, guard_values, pc)` and steer the
SIMT stack. `supported(form)` says whether a form decodes; isa.py builds the census check on it.
"""
from __future__ import annotations

import numpy as np

from . import numerics as ex
from .memory import GENERIC_SHARED_BASE, PARAM_BASE, SHARED_BASE, Hazard, SimError
from .state import Frame, Group

_NP, _UNS, _SIGNED = ex._NP, ex._UNS, ex._SIGNED
FLOATS = {"f32", "f64", "f16", "bf16"}
SPACES = {"global", "shared", "shared::cta", "param", "const", "local", "generic"}
LANES = np.arange(32)


def _tsize(t):
    return np.dtype(_NP[t]).itemsize


def _signed(t):
    return t.startswith("s")


class _UncheckedParts:
    @staticmethod
    def _check_def(r, name, sel, ins):
        return None


class Ctx:
    """Operand access for one launch."""

    def __init__(self, m, r, ins):
        self.m, self.r, self.ins = m, r, ins

    # readers ----------------------------------------------------------------------------------
    def rd(self, op, typ):
        r = self.r
        npt = _NP[typ]
        size = np.dtype(npt).itemsize if typ != "pred" else 0
        if op.kind == "reg":
            name = op.name
            rtyp = r.entry.regs[name]
            if typ == "pred" or rtyp == "pred":
                if rtyp != "pred" or typ != "pred":
                    raise SimError(f"{op.name} used as .{typ}")

                def f(sel, tids):
                    self.m._check_def(r, name, sel, self.ins)
                    return r.reg(name)[sel]
                return f
            rsize = _tsize(rtyp)

            if rsize == size:
                def f(sel, tids):
                    self.m._check_def(r, name, sel, self.ins)
                    return r.reg(name)[sel].view(npt)
            elif rsize > size:
                un = _UNS[size]

                def f(sel, tids):
                    self.m._check_def(r, name, sel, self.ins)
                    return r.reg(name)[sel].astype(un).view(npt)
            else:
                ext = _SIGNED[rsize] if _signed(typ) else _UNS[rsize]

                def f(sel, tids):
                    self.m._check_def(r, name, sel, self.ins)
                    return r.reg(name)[sel].view(ext).astype(_SIGNED[size] if _signed(typ) else _UNS[size]).view(npt)
            return f
        if op.kind == "negpred":
            name = op.name

            def f(sel, tids):
                self.m._check_def(r, name, sel, self.ins)
                return ~r.reg(name)[sel]
            return f
        if op.kind == "imm":
            if typ in FLOATS:
                val = np.array(op.value, np.float64).astype(npt) if typ not in ("bf16",) else np.uint16(op.value)
            elif typ == "pred":
                val = np.bool_(op.value)
            else:
                val = np.array(op.value & ((1 << (8 * size)) - 1), _UNS[size]).view(npt)[()]
            return lambda sel, tids: val
        if op.kind == "fimm":
            if op.width == 32:
                v = np.array(op.value, np.uint32).view(np.float32)
            else:
                v = np.array(op.value, np.uint64).view(np.float64)
            if typ in ("f32", "f64"):
                val = v.astype(npt)[()]
            else:
                val = np.array(op.value & ((1 << (8 * size)) - 1), _UNS[size]).view(npt)[()]
            return lambda sel, tids: val
        if op.kind == "special":
            return self._special(op.name, npt)
        if op.kind == "sym":
            space, addr = r.sym_addr[op.name]
            val = np.array(addr & ((1 << (8 * size)) - 1), _UNS[size]).view(npt)[()]
            return lambda sel, tids: val
        if op.kind == "vec":    # packing {a, b} into one wider value (mov.b32 %r, {%rs1, %rs2})
            # Parts are not checked for definedness: LLVM packs an undef half (Triton's f32x2 code:
            # mov.b64 %rd, {%r_lo, %r_never_written}; only the low half is unpacked again).
            raw = Ctx(_UncheckedParts, self.r, self.ins)
            parts = [raw.rd(o, f"b{8 * size // len(op.items)}") for o in op.items]
            w = 8 * size // len(op.items)

            def f(sel, tids):
                acc = np.zeros(tids.size, _UNS[size])
                for i, p in enumerate(parts):
                    acc |= p(sel, tids).astype(_UNS[size]) << _UNS[size](w * i)
                return acc.view(npt)
            return f
        raise SimError(f"operand {op} cannot be read as .{typ}")

    def _special(self, name, npt):
        r = self.r
        bx, by, bz = r.block
        gx, gy, gz = r.grid
        base = name.split(".")[0]
        axis = name.split(".")[1] if "." in name else ""

        def mk(fn):
            return lambda sel, tids: fn(tids).astype(npt)
        if base == "%tid":
            return mk({"x": lambda t: r.tid_lin[t] % bx, "y": lambda t: r.tid_lin[t] // bx % by,
                       "z": lambda t: r.tid_lin[t] // (bx * by)}[axis])
        if base == "%ntid":
            v = {"x": bx, "y": by, "z": bz}[axis]
            return mk(lambda t: np.full(t.size, v))
        if base == "%ctaid":
            return mk({"x": lambda t: r.cta_of[t] % gx, "y": lambda t: r.cta_of[t] // gx % gy,
                       "z": lambda t: r.cta_of[t] // (gx * gy)}[axis])
        if base == "%nctaid":
            v = {"x": gx, "y": gy, "z": gz}[axis]
            return mk(lambda t: np.full(t.size, v))
        if base == "%laneid":
            return mk(lambda t: r.lane[t])
        if base == "%warpid":
            return mk(lambda t: r.tid_lin[t] // 32)
        if base in ("%globaltimer", "%clock64", "%clock"):
            return mk(lambda t: np.full(t.size, self.m.clock_ns, np.uint64))
        if base == "%smid":
            return mk(lambda t: r.cta_of[t] % 188)
        if base == "%dynamic_smem_size":
            return mk(lambda t: np.full(t.size, r.spec.dynamic_smem))
        raise SimError(f"special register {name} is not modelled")

    # writers ----------------------------------------------------------------------------------
    def wr(self, op, typ):
        r = self.r
        if op.kind == "sink":
            return lambda sel, tids, v: None
        if op.kind != "reg":
            raise SimError(f"cannot write to operand {op}")
        name = op.name
        rtyp = r.entry.regs[name]
        if rtyp == "pred" or typ == "pred":
            if rtyp != typ:
                raise SimError(f"{name} (.{rtyp}) written as .{typ}")

            def f(sel, tids, v):
                r.reg(name)[sel] = v
                r.defined[name][sel] = True
            return f
        rsize, size = _tsize(rtyp), _tsize(typ)
        rt = _UNS[rsize]
        if rsize == size:
            def f(sel, tids, v):
                r.reg(name)[sel] = np.asarray(v, _NP[typ]).view(rt) if np.ndim(v) else \
                    np.array(v, _NP[typ]).view(rt)
                r.defined[name][sel] = True
        elif rsize > size:
            ext = (_SIGNED[size], _SIGNED[rsize]) if _signed(typ) else (_UNS[size], _UNS[rsize])

            def f(sel, tids, v):
                r.reg(name)[sel] = np.asarray(v, _NP[typ]).view(ext[0]).astype(ext[1]).view(rt)
                r.defined[name][sel] = True
        else:
            def f(sel, tids, v):
                r.reg(name)[sel] = np.asarray(v, _NP[typ]).view(_UNS[size]).astype(rt)
                r.defined[name][sel] = True
        return f

    def where(self):
        return self.r.where(self.ins)


# ============================================================================ helpers for decoding
def _type_of(parts):
    for p in reversed(parts):
        if p in ex._TYPES:
            return p
    raise SimError(f"no type in {'.'.join(parts)}")


def _shift_clamp(amount, width):
    return np.minimum(amount.astype(np.uint64), np.uint64(width))


def _setp_cmp(cmp, a, b, typ):
    isf = typ in FLOATS
    if isf:
        nan = np.isnan(a) | np.isnan(b)
        base = cmp.rstrip("u") if cmp not in ("num", "nan") else cmp
        unordered = cmp.endswith("u") and cmp not in ("num",)
    else:
        base, unordered = cmp, False
        nan = None
    res = {"eq": lambda: a == b, "ne": lambda: a != b, "lt": lambda: a < b, "le": lambda: a <= b,
           "gt": lambda: a > b, "ge": lambda: a >= b, "lo": lambda: a < b, "ls": lambda: a <= b,
           "hi": lambda: a > b, "hs": lambda: a >= b,
           "num": lambda: ~(np.isnan(a) | np.isnan(b)), "nan": lambda: np.isnan(a) | np.isnan(b)}[base]()
    if isf and cmp not in ("num", "nan"):
        res = (res | nan) if unordered else (res & ~nan)
    return res


def _to_f32(bits, typ):
    if typ == "bf16":
        return ex.bf16_to_f32(bits)
    if typ == "f16":
        return ex.f16_to_f32(bits.view(np.uint16))
    return bits


def _cvt(parts, a, dt, at):
    """cvt value `a` (typed as `at`) to type `dt`."""
    mods = set(parts)
    if at in ("f16", "bf16"):
        a = _to_f32(a.view(np.uint16), at)
        at = "f32"
    if "ftz" in mods and at == "f32":
        a = ex.ftz(a)
    if dt in ("bf16", "f16"):
        x = a.astype(np.float32) if at in FLOATS else a.astype(np.float64).astype(np.float32)
        if at not in FLOATS:   # int -> half: round the exact value once
            x = a.astype(np.float64)
        if dt == "bf16":
            if at == "f64" or at not in FLOATS:
                raise SimError("cvt to bf16 from a non-f32 source is not modelled")
            return ex.f32_to_bf16(x)
        with np.errstate(over="ignore"):
            return np.asarray(x).astype(np.float16).view(np.uint16)
    if dt in ("f32", "f64"):
        if at in FLOATS:
            v = a.astype(np.float64)
            if dt == "f32" and at == "f64":
                return v.astype(np.float32)
            if any(m in mods for m in ("rni", "rzi", "rmi", "rpi")):
                v = {"rni": np.rint, "rzi": np.trunc, "rmi": np.floor, "rpi": np.ceil}[
                    [m for m in mods if m in ("rni", "rzi", "rmi", "rpi")][0]](v)
            out = v.astype(_NP[dt])
            return ex.ftz(out) if "ftz" in mods and dt == "f32" else out
        # int -> float, round to nearest even (numpy rounds int64 -> float32 correctly via f64 for |x| < 2**53)
        if "rn" not in mods and not any(m in mods for m in ("rz", "rm", "rp")):
            raise SimError("int -> float cvt without a rounding mode")
        if not ("rn" in mods):
            raise SimError("int -> float cvt rounding other than .rn is not modelled")
        if np.dtype(a.dtype).itemsize == 8:
            return np.array([float(int(x)) for x in a.astype(object)], np.float64).astype(_NP[dt]) \
                if dt == "f32" else a.astype(np.float64)
        return a.astype(np.float64).astype(_NP[dt])
    # -> integer
    dsize = _tsize(dt)
    if at in FLOATS:
        v = a.astype(np.float64)
        rm = [m for m in mods if m in ("rni", "rzi", "rmi", "rpi")]
        if not rm:
            raise SimError("float -> int cvt without .rni/.rzi/.rmi/.rpi")
        v = {"rni": np.rint, "rzi": np.trunc, "rmi": np.floor, "rpi": np.ceil}[rm[0]](v)
        lo, hi = (-(2 ** (8 * dsize - 1)), 2 ** (8 * dsize - 1) - 1) if _signed(dt) else (0, 2 ** (8 * dsize) - 1)
        v = np.where(np.isnan(v), 0, np.clip(v, lo, hi))
        return np.array([int(x) for x in v], dtype=object).astype(_NP[dt]) if dsize == 8 else v.astype(_NP[dt])
    # int -> int: wrap (or saturate with .sat)
    if "sat" in mods:
        lo, hi = (-(2 ** (8 * dsize - 1)), 2 ** (8 * dsize - 1) - 1) if _signed(dt) else (0, 2 ** (8 * dsize) - 1)
        return np.clip(a.astype(object), lo, hi).astype(_NP[dt])
    return a.astype(_NP[dt])


def _mulhi(a, b, typ):
    size = _tsize(typ)
    if size <= 4:
        wide = np.int64 if _signed(typ) else np.uint64
        return ((a.astype(wide) * b.astype(wide)) >> wide(8 * size)).astype(_NP[typ])
    out = [(int(x) * int(y)) >> 64 for x, y in zip(a.astype(object), b.astype(object))]
    return np.array([v & (2 ** 64 - 1) for v in out], np.uint64).view(_NP[typ])


def _wide(t):
    return {"u16": "u32", "s16": "s32", "u32": "u64", "s32": "s64"}[t]


def _idiv(a, b, typ, rem):
    if np.any(b == 0):
        raise SimError("integer division by zero")
    if _signed(typ):
        a64, b64 = a.astype(object), b.astype(object)
        q = np.array([int(x / y) if abs(x) < 2 ** 52 and abs(y) < 2 ** 52 else _tdiv(x, y) for x, y in zip(a64, b64)],
                     dtype=object)
        if rem:
            return (a64 - q * b64).astype(_NP[typ])
        return q.astype(_NP[typ]) if typ != "s64" else np.array([int(v) for v in q], np.int64)
    return (a % b) if rem else (a // b)


def _tdiv(x, y):
    q = abs(x) // abs(y)
    return q if (x >= 0) == (y >= 0) else -q


def _bfe(a, pos, ln, typ):
    """bfe: bits pos .. pos + len - 1 of a (pos, len taken mod 256), sign-extended from bit
    min(pos + len - 1, size - 1) for .s types; 0 when len is 0."""
    size = 8 * _tsize(typ)
    ux = np.atleast_1d(a).view(_UNS[size // 8]).astype(np.uint64) if np.ndim(a) else \
        np.atleast_1d(np.asarray(a, _NP[typ]).view(_UNS[size // 8])).astype(np.uint64)
    p = np.broadcast_to(np.asarray(pos).astype(np.int64) & 0xFF, ux.shape)
    l = np.broadcast_to(np.asarray(ln).astype(np.int64) & 0xFF, ux.shape)
    nbits = np.clip(np.minimum(l, size - p), 0, 64)          # bits taken from a
    shifted = np.where(p < size, ux >> np.minimum(p, 63).astype(np.uint64), np.uint64(0))
    full = np.uint64((1 << size) - 1)
    mask = np.where(nbits >= 64, np.uint64(0xFFFFFFFFFFFFFFFF),
                    (np.uint64(1) << np.minimum(nbits, 63).astype(np.uint64)) - np.uint64(1))
    v = shifted & mask
    if _signed(typ):
        msb = np.minimum(p + l - 1, size - 1).clip(0).astype(np.uint64)
        sbit = (ux >> msb) & np.uint64(1)
        v = v | (np.where(sbit == 1, ~mask & full, np.uint64(0)))
    v = np.where(l == 0, np.uint64(0), v & full)
    out = v.astype(_UNS[size // 8]).view(_NP[typ])
    return out.reshape(np.shape(a)) if np.ndim(a) else out


def _prmt(a, b, c):
    a64 = a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32))
    c = np.broadcast_to(c.astype(np.uint32), a.shape)
    out = np.zeros(a.shape, np.uint32)
    for i in range(4):
        sel = (c >> np.uint32(4 * i)) & np.uint32(0xF)
        byte = ((a64 >> ((sel & np.uint32(7)).astype(np.uint64) * np.uint64(8))) & np.uint64(0xFF)).astype(np.uint32)
        sign = (byte >> np.uint32(7)) & np.uint32(1)
        byte = np.where(sel & np.uint32(8), sign * np.uint32(0xFF), byte)
        out |= byte << np.uint32(8 * i)
    return out


# ==================================================================================== decoding
def decode(m, r, ins, pc):
    parts = ins.opcode.split(".")
    base = parts[0]
    c = Ctx(m, r, ins)
    h = _HANDLERS.get(base)
    if h is None:
        raise SimError(f"PTX instruction {ins.opcode!r} is not implemented (at {r.where(ins)})")
    return h(c, parts, ins.operands, pc)


def _op(fn):
    return ("op", fn)


def h_mov(c, parts, ops, pc):
    typ = _type_of(parts)
    d, a = ops
    if d.kind == "vec":   # unpack: mov.b32 {%rs1, %rs2}, %r1
        w = 8 * _tsize(typ) // len(d.items)
        src = c.rd(a, typ)
        outs = [c.wr(o, f"b{w}") for o in d.items]
        un = _UNS[_tsize(typ)]

        def f(sel, tids):
            v = src(sel, tids).view(un) if np.ndim(src(sel, tids)) else np.full(tids.size, src(sel, tids)).view(un)
            for i, o in enumerate(outs):
                o(sel, tids, ((v >> un(w * i)) & un((1 << w) - 1)).astype(_UNS[w // 8]))
        return _op(f)
    src, dst = c.rd(a, typ), c.wr(d, typ)
    return _op(lambda sel, tids: dst(sel, tids, _bcast(src(sel, tids), tids)))


def _bcast(v, tids):
    return v if np.ndim(v) else np.full(tids.size, v)


def _arith(fn_int, fn_float=None, fn_float_ftz_ok=True):
    def h(c, parts, ops, pc):
        typ = _type_of(parts)
        mods = set(parts[1:])
        if typ == "f32x2":
            fa = [c.rd(o, "b64") for o in ops[1:]]
            dst = c.wr(ops[0], "b64")

            def f(sel, tids):
                vals = [_bcast(x(sel, tids), tids).view(np.float32).reshape(-1, 2) for x in fa]
                with np.errstate(invalid="ignore", over="ignore"):  # IEEE results (NaN, inf), as on the GPU
                    res = _f32(fn_float(*[v.astype(np.float64) for v in vals], mods, "f32")).reshape(-1)
                dst(sel, tids, res.view(np.uint64))
            return _op(f)
        fa = [c.rd(o, typ) for o in ops[1:]]
        dst = c.wr(ops[0], typ)
        if typ in FLOATS:
            if typ in ("f16", "bf16"):
                raise SimError(f"{'.'.join(parts)}: half arithmetic is not modelled")

            def f(sel, tids):
                vals = [x(sel, tids) for x in fa]
                if "ftz" in mods:
                    vals = [ex.ftz(v) for v in vals]
                with np.errstate(invalid="ignore", over="ignore"):  # IEEE results (NaN, inf), as on the GPU
                    res = fn_float(*[np.asarray(v, np.float64) for v in vals], mods, typ)
                    res = np.asarray(res).astype(_NP[typ])
                if "ftz" in mods:
                    res = ex.ftz(res)
                dst(sel, tids, _bcast(res, tids))
            return _op(f)

        def f(sel, tids):
            vals = [x(sel, tids) for x in fa]
            with np.errstate(over="ignore"):
                res = fn_int(*vals, mods, typ)
            dst(sel, tids, _bcast(np.asarray(res).astype(_NP[typ]), tids))
        return _op(f)
    return h


def _f32(x):
    return np.asarray(x, np.float64).astype(np.float32)


def _fma(a, b, c_, mods, typ):
    if typ == "f32":
        # a*b is exact in float64; one rounding of the sum in float64 then to float32 can differ
        # from a single rounding in rare ties (documented).
        return a * b + c_
    return np.array([float(np.longdouble(x) * np.longdouble(y) + np.longdouble(z)) for x, y, z in
                     zip(np.broadcast_to(a, np.broadcast(a, b, c_).shape).ravel(),
                         np.broadcast_to(b, np.broadcast(a, b, c_).shape).ravel(),
                         np.broadcast_to(c_, np.broadcast(a, b, c_).shape).ravel())])


def _fminmax(op):
    def f(a, b, *rest):
        # min/max.f32 d, a, b[, c] (PTX ISA 8.8: three inputs on sm_100+): NaN inputs are ignored
        # unless .NaN; the result is NaN only if all are.
        *more, mods, typ = rest
        r = np.fmin(a, b) if op == "min" else np.fmax(a, b)
        for c_ in more:
            r = np.fmin(r, c_) if op == "min" else np.fmax(r, c_)
        if "NaN" in mods:
            r = np.where(np.isnan(a) | np.isnan(b) | np.any([np.isnan(c_) for c_ in more] or [False], axis=0),
                         np.nan, r)
        return r
    return f


def _ex2(a, mods, typ):
    with np.errstate(over="ignore"):
        return np.exp2(a)


def _rsqrt(a, mods, typ):
    with np.errstate(divide="ignore", invalid="ignore"):
        return 1.0 / np.sqrt(a)


def _div_f(a, b, mods, typ):
    with np.errstate(divide="ignore", invalid="ignore"):
        return a / b


def _rcp(a, mods, typ):
    with np.errstate(divide="ignore"):
        return 1.0 / a


def _sqrt(a, mods, typ):
    with np.errstate(invalid="ignore"):
        return np.sqrt(a)


def _lg2(a, mods, typ):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log2(a)


def _shl(a, b, mods, typ):
    w = 8 * _tsize(typ)
    amt = np.asarray(b).astype(np.uint64)
    un = _UNS[w // 8]
    res = (a.view(un) if np.ndim(a) else np.array(a).view(un)).astype(np.uint64) << np.minimum(amt, np.uint64(63))
    res = np.where(amt >= w, 0, res & np.uint64((1 << w) - 1) if w < 64 else res)
    return res.astype(un).view(_NP[typ])


def _shr(a, b, mods, typ):
    w = 8 * _tsize(typ)
    amt = np.minimum(np.asarray(b).astype(np.uint64), np.uint64(w - 1 if _signed(typ) else w))
    if _signed(typ):
        return (np.asarray(a).astype(np.int64) >> amt.astype(np.int64)).astype(_NP[typ])
    un = _UNS[w // 8]
    a = np.asarray(a).view(un) if np.ndim(a) else np.array(a).view(un)
    res = np.where(amt >= w, 0, a.astype(np.uint64) >> np.minimum(amt, np.uint64(63)))
    return res.astype(un).view(_NP[typ])


def h_mul(c, parts, ops, pc):
    typ = _type_of(parts)
    mods = set(parts)
    if typ in FLOATS or typ == "f32x2":
        return _arith(None, lambda a, b, m, t: a * b)(c, parts, ops, pc)
    if "wide" in mods:
        wt = _wide(typ)
        fa, fb, dst = c.rd(ops[1], typ), c.rd(ops[2], typ), c.wr(ops[0], wt)
        return _op(lambda sel, tids: dst(sel, tids, _bcast(
            np.asarray(fa(sel, tids)).astype(_NP[wt]) * np.asarray(fb(sel, tids)).astype(_NP[wt]), tids)))
    if "hi" in mods:
        fa, fb, dst = c.rd(ops[1], typ), c.rd(ops[2], typ), c.wr(ops[0], typ)
        return _op(lambda sel, tids: dst(sel, tids, _bcast(_mulhi(_bcast(fa(sel, tids), tids),
                                                                 _bcast(fb(sel, tids), tids), typ), tids)))
    return _arith(lambda a, b, m, t: a * b)(c, parts, ops, pc)


def h_mad(c, parts, ops, pc):
    typ = _type_of(parts)
    mods = set(parts)
    if typ in FLOATS:
        return _arith(None, _fma)(c, parts, ops, pc)
    if "wide" in mods:
        wt = _wide(typ)
        fa, fb, fc, dst = c.rd(ops[1], typ), c.rd(ops[2], typ), c.rd(ops[3], wt), c.wr(ops[0], wt)

        def f(sel, tids):
            with np.errstate(over="ignore"):
                v = np.asarray(fa(sel, tids)).astype(_NP[wt]) * np.asarray(fb(sel, tids)).astype(_NP[wt]) + fc(sel, tids)
            dst(sel, tids, _bcast(v, tids))
        return _op(f)
    if "hi" in mods:
        raise SimError("mad.hi is not modelled")
    return _arith(lambda a, b, c_, m, t: a * b + c_)(c, parts, ops, pc)


def h_div(c, parts, ops, pc):
    typ = _type_of(parts)
    if typ in FLOATS:
        return _arith(None, _div_f)(c, parts, ops, pc)
    return _arith(lambda a, b, m, t: _idiv(_b(a, b), _b(b, a), t, False))(c, parts, ops, pc)


def _b(a, other):
    return np.broadcast_to(np.asarray(a), np.broadcast(np.asarray(a), np.asarray(other)).shape)


def h_rem(c, parts, ops, pc):
    return _arith(lambda a, b, m, t: _idiv(_b(a, b), _b(b, a), t, True))(c, parts, ops, pc)


def h_logic(name):
    def h(c, parts, ops, pc):
        typ = _type_of(parts)
        fa = [c.rd(o, typ) for o in ops[1:]]
        dst = c.wr(ops[0], typ)
        fn = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}.get(name)

        def f(sel, tids):
            vals = [x(sel, tids) for x in fa]
            if name == "not":
                res = ~vals[0] if typ == "pred" else np.invert(vals[0])
            else:
                res = fn(vals[0], vals[1])
            dst(sel, tids, _bcast(res, tids))
        return _op(f)
    return h


def h_setp(c, parts, ops, pc):
    typ = _type_of(parts)
    cmp = parts[1]
    boolop = parts[2] if parts[2] in ("and", "or", "xor") else None
    fa, fb = c.rd(ops[1], typ), c.rd(ops[2], typ)
    fcp = c.rd(ops[3], "pred") if boolop else None
    dsts = ops[0].items if ops[0].kind == "vec" else (ops[0],)
    wp = c.wr(dsts[0], "pred")
    wq = c.wr(dsts[1], "pred") if len(dsts) > 1 else None

    def f(sel, tids):
        a, b = fa(sel, tids), fb(sel, tids)
        if typ in ("bf16", "f16"):
            a, b = _to_f32(np.asarray(a), typ), _to_f32(np.asarray(b), typ)
        res = _bcast(_setp_cmp(cmp, a, b, typ if typ not in ("bf16", "f16") else "f32"), tids)
        nres = ~res
        if boolop:
            q = fcp(sel, tids)
            op = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}[boolop]
            res, nres = op(res, q), op(nres, q)
        wp(sel, tids, res)
        if wq:
            wq(sel, tids, nres)
    return _op(f)


class _NoDefCheck:
    """Stands in for the Machine in a Ctx whose register reads skip the never-written check."""

    @staticmethod
    def _check_def(r, name, sel, ins):
        return None


def h_selp(c, parts, ops, pc):
    # Definedness flows through selp: the result is defined where the SELECTED operand is. Compiled
    # code selects an uninitialised variable on paths that never use it (CUB's block scan keeps
    # warp 0's unused warp_prefix in a loop-carried register), so reading it is not yet an error.
    typ = _type_of(parts)
    fp, dst = c.rd(ops[3], "pred"), c.wr(ops[0], typ)
    raw = Ctx(_NoDefCheck(), c.r, c.ins)
    fa, fb = raw.rd(ops[1], typ), raw.rd(ops[2], typ)
    r = c.r
    name = ops[0].name if ops[0].kind == "reg" else None

    def defined(op, sel):
        return r.defined[op.name][sel] if op.kind == "reg" and op.name in r.defined else op.kind != "reg"

    def f(sel, tids):
        p = _bcast(fp(sel, tids), tids)
        v = _bcast(np.where(p, fa(sel, tids), fb(sel, tids)), tids)
        ok = np.where(p, defined(ops[1], sel), defined(ops[2], sel))  # before dst may overwrite a source
        dst(sel, tids, v)
        if name is not None:
            r.defined[name][sel] = ok
    return _op(f)


def h_cvt(c, parts, ops, pc):
    types = [p for p in parts[1:] if p in ex._TYPES or p in ("e4m3x2", "e5m2x2", "bf16x2", "f16x2")]
    dt, at = types[0], types[-1]
    if at in ("e4m3x2", "e5m2x2"):  # two fp8 values in a b16 -> two halves, each exact
        fa, dst = c.rd(ops[1], "b16"), c.wr(ops[0], "b32")
        e5m2 = at == "e5m2x2"

        def f(sel, tids):
            bits = _bcast(fa(sel, tids), tids).astype(np.uint16)
            lo = ex.fp8_to_f16_bits((bits & np.uint16(0xFF)).astype(np.uint8), e5m2).astype(np.uint32)
            hi = ex.fp8_to_f16_bits((bits >> np.uint16(8)).astype(np.uint8), e5m2).astype(np.uint32)
            dst(sel, tids, (hi << np.uint32(16)) | lo)
        return _op(f)
    if dt in ("bf16x2", "f16x2", "e4m3x2"):
        fa, fb = c.rd(ops[1], at), c.rd(ops[2], at)
        if dt == "e4m3x2":
            if "satfinite" not in parts:
                raise SimError("cvt to e4m3x2 without .satfinite is not modelled")
            dst = c.wr(ops[0], "b16")

            def f(sel, tids):
                hi = ex.f32_to_e4m3_satfinite(_bcast(fa(sel, tids), tids)).astype(np.uint16)
                lo = ex.f32_to_e4m3_satfinite(_bcast(fb(sel, tids), tids)).astype(np.uint16)
                dst(sel, tids, (hi << np.uint16(8)) | lo)
            return _op(f)
        dst = c.wr(ops[0], "b32")
        conv = ex.f32_to_bf16 if dt == "bf16x2" else ex.f32_to_f16
        if "rn" not in parts:
            raise SimError(f"{'.'.join(parts)}: only .rn is modelled")

        def f(sel, tids):
            hi = conv(_bcast(fa(sel, tids), tids)).astype(np.uint32)
            lo = conv(_bcast(fb(sel, tids), tids)).astype(np.uint32)
            dst(sel, tids, (hi << np.uint32(16)) | lo)
        return _op(f)
    rt_a = "b16" if at in ("bf16", "f16") else at
    rt_d = "b16" if dt in ("bf16", "f16") else dt
    fa, dst = c.rd(ops[1], rt_a), c.wr(ops[0], rt_d)
    if dt in ("bf16", "f16") and at == "f32" and "rn" not in parts:
        raise SimError(f"{'.'.join(parts)}: only .rn is modelled")

    def f(sel, tids):
        a = _bcast(fa(sel, tids), tids)
        dst(sel, tids, _cvt(parts, a, dt, at))
    return _op(f)


def h_cvta(c, parts, ops, pc):
    typ = _type_of(parts)
    to = "to" in parts
    space = [p for p in parts if p in ("global", "shared", "param", "const", "local")][0]
    fa, dst = c.rd(ops[1], typ), c.wr(ops[0], typ)
    if space == "global":
        return _op(lambda sel, tids: dst(sel, tids, _bcast(fa(sel, tids), tids)))
    if space == "shared":
        off = np.uint64(GENERIC_SHARED_BASE)
        if to:
            return _op(lambda sel, tids: dst(sel, tids, _bcast(fa(sel, tids), tids).astype(np.uint64) - off))
        return _op(lambda sel, tids: dst(sel, tids, _bcast(fa(sel, tids), tids).astype(np.uint64) + off))
    raise SimError(f"{'.'.join(parts)} is not modelled")


def h_bfe(c, parts, ops, pc):
    typ = _type_of(parts)
    fa, fb, fc, dst = c.rd(ops[1], typ), c.rd(ops[2], "u32"), c.rd(ops[3], "u32"), c.wr(ops[0], typ)
    return _op(lambda sel, tids: dst(sel, tids, _bfe(_bcast(fa(sel, tids), tids), fb(sel, tids), fc(sel, tids), typ)))


def h_bfi(c, parts, ops, pc):
    """bfi.b32/b64 f, a, b, c, d: b with bits [c, c + d) replaced by the low d bits of a
    (c and d use their low 8 bits; bits past the width are dropped)."""
    typ = _type_of(parts)
    w = 8 * _tsize(typ)
    fa, fb, fc, fd, dst = (c.rd(ops[1], typ), c.rd(ops[2], typ), c.rd(ops[3], "u32"), c.rd(ops[4], "u32"),
                           c.wr(ops[0], typ))
    un = _UNS[w // 8]

    def f(sel, tids):
        a = _bcast(fa(sel, tids), tids).view(un).astype(object)
        b = _bcast(fb(sel, tids), tids).view(un).astype(object)
        pos = _bcast(fc(sel, tids), tids).astype(np.int64) & 0xFF
        ln = _bcast(fd(sel, tids), tids).astype(np.int64) & 0xFF
        out = []
        for x, y, p_, l_ in zip(a, b, pos, ln):
            p_, l_ = int(p_), int(l_)
            if l_ == 0 or p_ >= w:
                out.append(int(y))
                continue
            mask = (((1 << l_) - 1) << p_) & ((1 << w) - 1)
            out.append((int(y) & ~mask & ((1 << w) - 1)) | ((int(x) << p_) & mask))
        dst(sel, tids, np.array(out, dtype=np.uint64).astype(un).view(_NP[typ]))
    return _op(f)


def h_prmt(c, parts, ops, pc):
    if len(parts) > 2 and parts[1] != "b32":
        raise SimError(f"{'.'.join(parts)}: only the default prmt mode is modelled")
    fa, fb, fc, dst = (c.rd(ops[1], "b32"), c.rd(ops[2], "b32"), c.rd(ops[3], "b32"), c.wr(ops[0], "b32"))
    return _op(lambda sel, tids: dst(sel, tids, _prmt(_bcast(fa(sel, tids), tids), _bcast(fb(sel, tids), tids),
                                                       _bcast(fc(sel, tids), tids))))


def h_popc(c, parts, ops, pc):
    typ = _type_of(parts)
    fa, dst = c.rd(ops[1], typ), c.wr(ops[0], "u32")

    def f(sel, tids):
        a = _bcast(fa(sel, tids), tids).view(_UNS[_tsize(typ)])
        bits = np.unpackbits(a.astype(np.dtype(a.dtype).newbyteorder("<")).view(np.uint8).reshape(a.size, -1), axis=1)
        dst(sel, tids, bits.sum(axis=1).astype(np.uint32))
    return _op(f)


def h_clz(c, parts, ops, pc):
    typ = _type_of(parts)
    w = 8 * _tsize(typ)
    fa, dst = c.rd(ops[1], typ), c.wr(ops[0], "u32")

    def f(sel, tids):
        a = _bcast(fa(sel, tids), tids).astype(np.uint64)
        dst(sel, tids, np.array([w - int(x).bit_length() for x in a], np.uint32))
    return _op(f)


def h_brev(c, parts, ops, pc):
    typ = _type_of(parts)
    w = 8 * _tsize(typ)
    fa, dst = c.rd(ops[1], typ), c.wr(ops[0], typ)

    def f(sel, tids):
        a = _bcast(fa(sel, tids), tids)
        dst(sel, tids, np.array([int(f"{int(x):0{w}b}"[::-1], 2) for x in a.astype(np.uint64)],
                                np.uint64).astype(_NP[typ]))
    return _op(f)


def h_shf(c, parts, ops, pc):
    left, wrap = "l" in parts, "wrap" in parts
    fa, fb, fn, dst = c.rd(ops[1], "b32"), c.rd(ops[2], "b32"), c.rd(ops[3], "u32"), c.wr(ops[0], "b32")

    def f(sel, tids):
        a = _bcast(fa(sel, tids), tids).astype(np.uint64)
        b = _bcast(fb(sel, tids), tids).astype(np.uint64)
        n = _bcast(fn(sel, tids), tids).astype(np.uint64)
        n = n & np.uint64(31) if wrap else np.minimum(n, np.uint64(32))
        both = (b << np.uint64(32)) | a
        if left:
            res = (both << n) >> np.uint64(32)
        else:
            res = both >> n
        dst(sel, tids, (res & np.uint64(0xFFFFFFFF)).astype(np.uint32))
    return _op(f)


def h_neg(c, parts, ops, pc):
    typ = _type_of(parts)
    if typ in FLOATS:
        return _arith(None, lambda a, m, t: -a)(c, parts, ops, pc)
    return _arith(lambda a, m, t: (np.zeros_like(a) - a))(c, parts, ops, pc)


def h_abs(c, parts, ops, pc):
    typ = _type_of(parts)
    if typ in FLOATS:
        return _arith(None, lambda a, m, t: np.abs(a))(c, parts, ops, pc)
    return _arith(lambda a, m, t: np.where(a < 0, np.zeros_like(a) - a, a))(c, parts, ops, pc)


def h_minmax(name):
    def h(c, parts, ops, pc):
        typ = _type_of(parts)
        if typ in FLOATS:
            return _arith(None, _fminmax(name))(c, parts, ops, pc)
        fn = np.minimum if name == "min" else np.maximum
        return _arith(lambda a, b, m, t: fn(a, b))(c, parts, ops, pc)
    return h


def h_float1(fn, need_approx=False):
    def h(c, parts, ops, pc):
        typ = _type_of(parts)
        if need_approx and "approx" not in parts and "rn" not in parts:
            raise SimError(f"{'.'.join(parts)} is not modelled")
        return _arith(None, fn)(c, parts, ops, pc)
    return h


# ----------------------------------------------------------------------------------- memory ops
def _mem_parts(parts):
    space = "generic"
    for p in parts[1:]:
        if p in SPACES:
            space = p
    if space == "shared::cta":
        space = "shared"
    vec = 1
    for p in parts:
        if p in ("v2", "v4", "v8"):
            vec = int(p[1])
    return space, vec, _type_of(parts)


def _addr_fn(c, op):
    r = c.r
    if op.kind != "mem":
        raise SimError(f"expected an address, got {op}")
    off = op.value
    if op.base_kind == "reg":
        rtyp = r.entry.regs[op.name]
        rd = c.rd(Operand_reg(op.name), "u64" if _tsize(rtyp) == 8 else "u32")
        return lambda sel, tids: _bcast(rd(sel, tids), tids).astype(np.int64) + off
    if op.base_kind == "sym":
        space, addr = r.sym_addr[op.name]
        return lambda sel, tids: np.full(tids.size, addr + off, np.int64)
    return lambda sel, tids: np.full(tids.size, off, np.int64)


def Operand_reg(name):
    from .parser import Operand
    return Operand("reg", name=name)


def _shared_counters(r, opcode, klass, tids, idx, width):
    """Bank conflicts (per form), bytes and wavefronts (per class) of one shared access."""
    r.stats.bank_conflicts[opcode] += r.smem.count_banks(tids, idx, width)
    r.stats.note_shared(klass, tids.size, width, r.smem.last_wavefronts)


def _region_name(m):
    return lambda rid: m.mem.regions[rid][1]


class _Access:
    """Route a vectorised access to global, shared or param memory."""

    def __init__(self, c, space, what):
        self.c, self.space, self.what = c, space, what
        self.r = c.r

    def load(self, tids, addrs, width):
        r, m = self.r, self.c.m
        space = self.space
        if space == "generic":
            return self._generic(tids, addrs, width, None)
        if space == "shared":
            idx = r.smem.index(tids, addrs, width, "load")
            _shared_counters(r, self.c.ins.opcode, "ld.shared", tids, idx, width)
            return r.smem.access(tids, idx, width, False, f"{self.what}")
        if space in ("param",):
            off = addrs - PARAM_BASE
            bad = (off < 0) | (off + width > r.params.size)
            if np.any(bad):
                raise SimError(f"param load of {width} bytes at {int(addrs[np.nonzero(bad)[0][0]]):#x} is outside "
                               f"the {r.params.size} parameter bytes")
            return r.params[off[:, None] + np.arange(width)]
        if space in ("global", "const"):
            before = m.mem.bytes_read
            if m.check_races and self.what != "atomic":
                m.mem.race_check(r, tids, addrs.astype(np.uint64), width, False, "load")
            out = m.mem.load(addrs.astype(np.uint64), width)
            r.stats.global_read += m.mem.bytes_read - before
            r.stats.note_global(r.warp_of[tids], addrs, width, False, _region_name(m))
            return out
        raise SimError(f"{space} memory is not modelled")

    def store(self, tids, addrs, data):
        r, m = self.r, self.c.m
        width = data.shape[1]
        if self.space == "generic":
            return self._generic(tids, addrs, width, data)
        if self.space == "shared":
            idx = r.smem.index(tids, addrs, width, "store")
            _shared_counters(r, self.c.ins.opcode, "st.shared", tids, idx, width)
            r.smem.access(tids, idx, width, True, self.what, data)
            return None
        if self.space == "global":
            before = m.mem.bytes_written
            if m.check_races and self.what != "atomic":
                m.mem.race_check(r, tids, addrs.astype(np.uint64), width, True, "store")
            m.mem.store(addrs.astype(np.uint64), data)
            r.stats.global_written += m.mem.bytes_written - before
            r.stats.note_global(r.warp_of[tids], addrs, width, True, _region_name(m))
            return None
        raise SimError(f"store to {self.space} memory is not modelled")

    def _generic(self, tids, addrs, width, data):
        r, m = self.r, self.c.m
        a = addrs.astype(np.int64)
        is_sh = (a >= GENERIC_SHARED_BASE) & (a < GENERIC_SHARED_BASE + (1 << 32))
        is_par = (a >= PARAM_BASE) & (a < PARAM_BASE + (1 << 32))
        out = np.zeros((tids.size, width), np.uint8) if data is None else None
        for mask, space, shift in ((is_sh, "shared", GENERIC_SHARED_BASE), (is_par, "param", 0),
                                   (~(is_sh | is_par), "global", 0)):
            if not mask.any():
                continue
            acc = _Access(self.c, space, self.what)
            if data is None:
                out[mask] = acc.load(tids[mask], a[mask] - shift, width)
            else:
                if space == "param":
                    raise SimError("store to the parameter space")
                acc.store(tids[mask], a[mask] - shift, data[mask])
        return out


def _val_bytes(v, typ):
    v = np.asarray(v, _NP[typ]) if typ != "pred" else v
    return v.view(np.uint8).reshape(v.size, -1) if typ not in ("bf16",) else v.view(np.uint8).reshape(v.size, -1)


def h_ld(c, parts, ops, pc):
    space, vec, typ = _mem_parts(parts)
    size = _tsize(typ)
    dsts = ops[0].items if ops[0].kind == "vec" else (ops[0],)
    if len(dsts) != vec:
        raise SimError(f"{'.'.join(parts)} with {len(dsts)} destinations")
    writers = [c.wr(d, typ) for d in dsts]
    addr = _addr_fn(c, ops[1])
    # volatile / acquire / relaxed accesses are the kernels' flag protocols (ordered by the memory
    # model, not by barriers): no race check, like atomics
    acc = _Access(c, space, "atomic" if {"volatile", "acquire", "relaxed"} & set(parts) else "load")
    src_regs = [ops[1].name] if ops[1].base_kind == "reg" else []
    dst_regs = [d.name for d in dsts if d.kind == "reg"]
    r = c.r
    is_global = space in ("global", "generic", "const")

    def f(sel, tids):
        a = addr(sel, tids)
        raw = acc.load(tids, a, size * vec).reshape(tids.size, vec, size)
        for i, w in enumerate(writers):
            w(sel, tids, raw[:, i, :].copy().view(_NP[typ]).reshape(tids.size))
        if is_global:
            depth = max((r.load_depth.get(s, 0) for s in src_regs), default=0) + 1
            for d in dst_regs:
                r.load_depth[d] = depth
            if depth > r.stats.load_chain:
                r.stats.load_chain = depth
        else:   # shared / param data: no global round trip on this path
            for d in dst_regs:
                r.load_depth.pop(d, None)
    return _op(f)


def h_st(c, parts, ops, pc):
    space, vec, typ = _mem_parts(parts)
    size = _tsize(typ)
    srcs = ops[1].items if ops[1].kind == "vec" else (ops[1],)
    readers = [c.rd(s, typ) for s in srcs]
    addr = _addr_fn(c, ops[0])
    acc = _Access(c, space, "atomic" if {"volatile", "release", "relaxed"} & set(parts) else "store")

    def f(sel, tids):
        a = addr(sel, tids)
        data = np.concatenate([_bcast(np.asarray(rd(sel, tids), _NP[typ]), tids).view(np.uint8).reshape(tids.size, size)
                               for rd in readers], axis=1)
        acc.store(tids, a, data)
    return _op(f)


def h_atom(c, parts, ops, pc):
    space, vec, typ = _mem_parts(parts)
    opn = [p for p in parts if p in ("cas", "add", "exch", "min", "max", "and", "or", "xor", "inc", "dec")][0]
    size = _tsize(typ)
    dst = c.wr(ops[0], typ)
    addr = _addr_fn(c, ops[1])
    fb = c.rd(ops[2], typ)
    fc = c.rd(ops[3], typ) if len(ops) > 3 else None
    acc = _Access(c, space, "atomic")
    m = c.m

    def f(sel, tids):
        a = addr(sel, tids)
        b = _bcast(fb(sel, tids), tids).astype(_NP[typ])
        cc = _bcast(fc(sel, tids), tids).astype(_NP[typ]) if fc else None
        old_all = np.zeros(tids.size, _NP[typ])
        for i in range(tids.size):       # atomics of one instruction serialise in lane order
            old = acc.load(tids[i:i + 1], a[i:i + 1], size).copy().view(_NP[typ]).reshape(-1)[0]
            if opn == "cas":
                new = cc[i] if old == b[i] else old
            elif opn == "add":
                with np.errstate(over="ignore"):
                    new = (old + b[i]) if typ not in FLOATS else np.array(np.float64(old) + np.float64(b[i]), _NP[typ])
            elif opn == "exch":
                new = b[i]
            elif opn == "min":
                new = min(old, b[i])
            elif opn == "max":
                new = max(old, b[i])
            elif opn == "and":
                new = old & b[i]
            elif opn == "or":
                new = old | b[i]
            elif opn == "xor":
                new = old ^ b[i]
            elif opn == "inc":
                new = 0 if old >= b[i] else old + 1
            else:
                new = b[i] if (old == 0 or old > b[i]) else old - 1
            acc.store(tids[i:i + 1], a[i:i + 1], np.array([new], _NP[typ]).view(np.uint8).reshape(1, size))
            old_all[i] = old
        m.mem.stores += 1
        dst(sel, tids, old_all)
    return _op(f)


def h_red(c, parts, ops, pc):
    from .parser import Operand
    return h_atom(c, parts, [Operand("sink")] + list(ops), pc)


def h_fence(c, parts, ops, pc):
    def f(sel, tids):  # one sequentially consistent memory: nothing to order (the executor counts it)
        pass
    return _op(f)


# ----------------------------------------------------------------------------------- warp ops
def _require_warps(c, tids, what, lanes_mask=0xFFFFFFFF):
    r = c.r
    w = r.warp_of[tids]
    live = r.alive
    uw = np.unique(w)
    for wi in uw:
        members = np.nonzero((r.warp_of == wi) & live)[0]
        lanes = r.lane[members]
        need = members[(lanes_mask >> lanes) & 1 == 1]
        have = tids[w == wi]
        if need.size != np.intersect1d(need, have).size:
            raise SimError(f"{what} executed by a diverged warp (warp {int(wi % r.wpc)} of CTA "
                           f"{int(wi // r.wpc)}: {have.size} of {need.size} lanes present)")
    return uw


def _full_warps(c, tids, what):
    """tids as (warps, 32) in lane order; every warp must be complete and converged."""
    if tids.size % 32 or np.any(c.r.lane[tids].reshape(-1, 32) != LANES):
        _require_warps(c, tids, what)
        raise SimError(f"{what} needs whole warps of 32 lanes")
    _require_warps(c, tids, what)
    return tids.reshape(-1, 32)


def h_shfl(c, parts, ops, pc):
    mode = parts[2]
    dsts = ops[0].items if ops[0].kind == "vec" else (ops[0],)
    wd = c.wr(dsts[0], "b32")
    wp = c.wr(dsts[1], "pred") if len(dsts) > 1 else None
    fa, fb, fcc, fm = c.rd(ops[1], "b32"), c.rd(ops[2], "u32"), c.rd(ops[3], "u32"), c.rd(ops[4], "u32")
    r = c.r

    def f(sel, tids):
        mask = _bcast(fm(sel, tids), tids)
        mvals = np.unique(mask)
        if mvals.size != 1:
            raise SimError("shfl.sync with different member masks in one warp")
        _require_warps(c, tids, "shfl.sync", int(mvals[0]))
        lane = r.lane[tids].astype(np.int64)
        b = _bcast(fb(sel, tids), tids).astype(np.int64) & 31
        cc = _bcast(fcc(sel, tids), tids).astype(np.int64)
        cval, seg = cc & 31, (cc >> 8) & 31
        max_lane = (lane & seg) | (cval & ~seg)
        min_lane = lane & seg
        if mode == "up":
            j = lane - b
            ok = j >= max_lane
        elif mode == "down":
            j = lane + b
            ok = j <= max_lane
        elif mode == "bfly":
            j = lane ^ b
            ok = j <= max_lane
        else:
            j = min_lane | (b & ~seg)
            ok = j <= max_lane
        j = np.where(ok, j, lane)
        src_t = tids - lane + j
        a_all = r.reg(ops[1].name) if ops[1].kind == "reg" else None
        if a_all is not None:
            c.m._check_def(r, ops[1].name, src_t, c.ins)
            # the source lane must take part too
            if not np.all(np.isin(src_t, tids)):
                raise SimError("shfl.sync reads a lane that is not executing the instruction")
            val = a_all[src_t].view(np.uint32) if a_all.dtype.itemsize == 4 else a_all[src_t].astype(np.uint32)
        else:
            val = _bcast(fa(sel, tids), tids)
        wd(sel, tids, val)
        if wp:
            wp(sel, tids, ok)
    return _op(f)


def h_redux(c, parts, ops, pc):
    opn = parts[2]
    typ = _type_of(parts)
    fa, fm, dst = c.rd(ops[1], typ), c.rd(ops[2], "u32"), c.wr(ops[0], typ)
    r = c.r

    def f(sel, tids):
        mask = int(np.unique(_bcast(fm(sel, tids), tids))[0])
        _require_warps(c, tids, "redux.sync", mask)
        a = _bcast(fa(sel, tids), tids)
        w = r.warp_of[tids]
        out = np.empty_like(a)
        fn = {"min": np.min, "max": np.max, "add": np.sum, "and": np.bitwise_and.reduce,
              "or": np.bitwise_or.reduce, "xor": np.bitwise_xor.reduce}[opn]
        for wi in np.unique(w):
            sel_w = w == wi
            inmask = ((mask >> r.lane[tids[sel_w]]) & 1) == 1
            out[sel_w] = fn(a[sel_w][inmask]).astype(a.dtype)
        dst(sel, tids, out)
    return _op(f)


def h_vote(c, parts, ops, pc):
    mode = parts[1] if parts[1] != "sync" else parts[2]
    r = c.r
    typ = "b32" if mode == "ballot" else "pred"
    dst = c.wr(ops[0], typ)
    fp = c.rd(ops[1], "pred")

    def f(sel, tids):
        _require_warps(c, tids, "vote.sync")
        p = _bcast(fp(sel, tids), tids)
        w = r.warp_of[tids]
        out = np.zeros(tids.size, np.uint32 if mode == "ballot" else bool)
        for wi in np.unique(w):
            s = w == wi
            if mode == "ballot":
                out[s] = np.uint32(np.sum((p[s].astype(np.uint64) << r.lane[tids[s]].astype(np.uint64))))
            elif mode == "all":
                out[s] = p[s].all()
            elif mode == "any":
                out[s] = p[s].any()
            else:
                out[s] = p[s].all() | ~p[s].any()
        dst(sel, tids, out)
    return _op(f)


def h_ldmatrix(c, parts, ops, pc):
    num = int([p for p in parts if p.startswith("x")][0][1:])
    trans = "trans" in parts
    dsts = ops[0].items
    writers = [c.wr(d, "b32") for d in dsts]
    addr = _addr_fn(c, ops[1])
    r = c.r

    def f(sel, tids):
        W = _full_warps(c, tids, "ldmatrix")
        a = addr(sel, tids).reshape(W.shape)
        rows_t = W[:, :8 * num]
        rows_a = a[:, :8 * num]
        idx = r.smem.index(rows_t.ravel(), rows_a.ravel(), 16, "ldmatrix")
        _shared_counters(r, c.ins.opcode, "ldmatrix", rows_t.ravel(), idx, 16)
        data = r.smem.access(rows_t.ravel(), idx, 16, False, "ldmatrix")
        mats = data.view(np.uint16).reshape(W.shape[0], num, 8, 8)   # warp, matrix, row, col
        g, t = LANES // 4, LANES % 4
        for mi, w in enumerate(writers):
            M = mats[:, mi]
            if trans:
                lo, hi = M[:, 2 * t, g], M[:, 2 * t + 1, g]
            else:
                lo, hi = M[:, g, 2 * t], M[:, g, 2 * t + 1]
            w(sel, tids, (lo.astype(np.uint32) | (hi.astype(np.uint32) << np.uint32(16))).reshape(-1))
    return _op(f)


def h_stmatrix(c, parts, ops, pc):
    num = int([p for p in parts if p.startswith("x")][0][1:])
    trans = "trans" in parts
    addr = _addr_fn(c, ops[0])
    readers = [c.rd(s, "b32") for s in ops[1].items]
    r = c.r

    def f(sel, tids):
        W = _full_warps(c, tids, "stmatrix")
        a = addr(sel, tids).reshape(W.shape)
        g, t = LANES // 4, LANES % 4
        mats = np.zeros((W.shape[0], num, 8, 8), np.uint16)
        for mi, rd in enumerate(readers):
            v = _bcast(rd(sel, tids), tids).reshape(W.shape).astype(np.uint32)
            lo, hi = (v & 0xFFFF).astype(np.uint16), (v >> 16).astype(np.uint16)
            if trans:
                mats[:, mi, 2 * t, g], mats[:, mi, 2 * t + 1, g] = lo, hi
            else:
                mats[:, mi, g, 2 * t], mats[:, mi, g, 2 * t + 1] = lo, hi
        rows_t = W[:, :8 * num].ravel()
        idx = r.smem.index(rows_t, a[:, :8 * num].ravel(), 16, "stmatrix")
        _shared_counters(r, c.ins.opcode, "stmatrix", rows_t, idx, 16)
        r.smem.access(rows_t, idx, 16, True, "stmatrix", mats.reshape(-1, 16 * 1).view(np.uint8).reshape(-1, 16)
                      if False else mats.reshape(W.shape[0] * num * 8, 8).view(np.uint8).reshape(-1, 16))
    return _op(f)


def h_mma(c, parts, ops, pc):
    shape = parts[3]
    if shape != "m16n8k16" or parts[4:6] != ["row", "col"]:
        raise SimError(f"{'.'.join(parts)} is not modelled")
    dt, at, bt, ct = parts[6:10]
    if dt != "f32" or ct != "f32" or at != bt or at not in ("bf16", "f16"):
        raise SimError(f"{'.'.join(parts)} is not modelled")
    D, A, B, C = ops
    wd = [c.wr(o, "f32") for o in D.items]
    ra = [c.rd(o, "b32") for o in A.items]
    rb = [c.rd(o, "b32") for o in B.items]
    rc = [c.rd(o, "f32") for o in C.items]
    r, m = c.r, c.m
    g, t = LANES // 4, LANES % 4
    conv = ex.bf16_to_f32 if at == "bf16" else (lambda b: ex.f16_to_f32(b))

    def unpack(v):
        v = v.astype(np.uint32)
        return conv((v & 0xFFFF).astype(np.uint16)), conv((v >> 16).astype(np.uint16))

    def f(sel, tids):
        Wt = _full_warps(c, tids, "mma.sync")
        nw = Wt.shape[0]
        Am = np.zeros((nw, 16, 16), np.float32)
        Bm = np.zeros((nw, 16, 8), np.float32)
        Cm = np.zeros((nw, 16, 8), np.float32)
        av = [_bcast(x(sel, tids), tids).reshape(nw, 32) for x in ra]
        for i, (ro, co) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
            lo, hi = unpack(av[i])
            Am[:, g + ro, 2 * t + co], Am[:, g + ro, 2 * t + co + 1] = lo, hi
        bv = [_bcast(x(sel, tids), tids).reshape(nw, 32) for x in rb]
        for i, ko in enumerate((0, 8)):
            lo, hi = unpack(bv[i])
            Bm[:, 2 * t + ko, g], Bm[:, 2 * t + ko + 1, g] = lo, hi
        cv = [np.asarray(_bcast(x(sel, tids), tids), np.float32).reshape(nw, 32) for x in rc]
        Cm[:, g, 2 * t], Cm[:, g, 2 * t + 1], Cm[:, g + 8, 2 * t], Cm[:, g + 8, 2 * t + 1] = cv
        Dm = mma_numerics(Am, Bm, Cm, at, m.mma_mode, m.arch)
        outs = (Dm[:, g, 2 * t], Dm[:, g, 2 * t + 1], Dm[:, g + 8, 2 * t], Dm[:, g + 8, 2 * t + 1])
        for w, o in zip(wd, outs):
            w(sel, tids, np.ascontiguousarray(o, np.float32).reshape(-1))
    return _op(f)


def mma_numerics(A, B, C, in_dtype, mode, arch):
    try:
        from .mma import mma_m16n8k16
    except ImportError:
        mma_m16n8k16 = None
    if mma_m16n8k16 is not None:
        return mma_m16n8k16(A, B, C, in_dtype, mode=mode, arch=arch)
    if mode != "fast":
        raise SimError("the exact mma model (ptxsim/mma.py) is not available")
    with np.errstate(over="ignore", invalid="ignore"):
        return (np.einsum("wik,wkj->wij", A.astype(np.float64), B.astype(np.float64)) + C).astype(np.float32)


# ----------------------------------------------------------------------------------- cp.async
def h_cp(c, parts, ops, pc):
    r = c.r
    if parts[1] != "async":
        raise SimError(f"{'.'.join(parts)} is not modelled")
    if parts[2] == "commit_group":
        def f(sel, tids):
            r.cp_group[tids] += 1
        return _op(f)
    if parts[2] in ("wait_group", "wait_all"):
        n = ops[0].value if ops else 0
        if parts[2] == "wait_all":
            def commit(sel, tids):
                r.cp_group[tids] += 1
        else:
            commit = None

        def f(sel, tids):
            if commit:
                commit(sel, tids)
            _cp_complete(r, tids, n)
        return _op(f)
    if parts[2] not in ("ca", "cg") or "shared" not in parts[3] or parts[4] != "global":
        raise SimError(f"{'.'.join(parts)} is not modelled")
    dst_a = _addr_fn(c, ops[0])
    src_a = _addr_fn(c, ops[1])
    if ops[2].kind != "imm":
        raise SimError("cp.async with a non-constant copy size")
    size = ops[2].value
    src_regs = [ops[1].name] if ops[1].base_kind == "reg" else []
    fsrc = c.rd(ops[3], "u32") if len(ops) > 3 and ops[3].kind in ("reg", "imm") else None
    m = c.m

    def f(sel, tids):
        d = dst_a(sel, tids)
        s = src_a(sel, tids)
        ss = _bcast(fsrc(sel, tids), tids).astype(np.int64) if fsrc else np.full(tids.size, size)
        if np.any(ss > size) or np.any(ss < 0):
            raise SimError(f"cp.async src-size {int(ss.max())} above the copy size {size}")
        idx = r.smem.index(tids, d, size, "cp.async")
        _shared_counters(r, c.ins.opcode, "cp.async", tids, idx, size)
        if np.any(r.smem.pending[idx[:, None] + np.arange(size)]):
            raise Hazard("cp.async into shared bytes that an earlier cp.async still has pending")
        # the copy may land any time from now on: it races with unordered reads/writes of others now
        r.smem.access(tids, idx, size, True, "cp.async", perform=False)
        data = np.zeros((tids.size, size), np.uint8)
        for k in np.unique(ss):
            if k == 0:
                continue
            mk = ss == k
            before = m.mem.bytes_read
            # read the source bytes now (the copy may read them any time before completion)
            part = m.mem.load(s[mk].astype(np.uint64), int(k)) if int(k) in (1, 2, 4, 8, 16) and np.all(s[mk] % k == 0) \
                else np.stack([m.mem.load(s[mk].astype(np.uint64) + j, 1)[:, 0] for j in range(int(k))], axis=1)
            r.stats.global_read += m.mem.bytes_read - before
            r.stats.note_global(r.warp_of[tids[mk]], s[mk], int(k), False, _region_name(m))
            data[mk, :int(k)] = part
        r.smem.pending[idx[:, None] + np.arange(size)] = True
        depth = max((r.load_depth.get(x, 0) for x in src_regs), default=0) + 1
        if depth > r.stats.load_chain:
            r.stats.load_chain = depth
        r.cp_pending.append((tids.copy(), r.cp_group[tids].copy(), idx, data))
        r.cp_inflight += np.bincount(r.cta_of[tids], minlength=r.n_cta) * size
        r.stats.cp_inflight_max = max(r.stats.cp_inflight_max, int(r.cp_inflight.max()))
    return _op(f)


def _cp_complete(r, tids, n):
    keep = []
    sm = r.smem
    for (ts, grp, idx, data) in r.cp_pending:
        mine = np.isin(ts, tids)
        done = mine & (grp < r.cp_group[ts] - n)
        if done.any():
            w = np.arange(data.shape[1])
            sm.pending[idx[done][:, None] + w] = False
            sm.access(ts[done], idx[done], data.shape[1], True, "cp.async completion", data[done], check=False)
            r.cp_inflight -= np.bincount(r.cta_of[ts[done]], minlength=r.n_cta) * data.shape[1]
        if (~done).any():
            keep.append((ts[~done], grp[~done], idx[~done], data[~done]))
    r.cp_pending = keep


# ----------------------------------------------------------------------------------- control
def h_bra(c, parts, ops, pc):
    r = c.r
    target = r.entry.labels[ops[0].name]
    m = c.m
    split_ok = True

    def f(g, fr, sel, tids, gv, pc_):
        if gv is None or gv.all():
            fr.pc = target
        elif not gv.any():
            fr.pc = pc + 1
        else:
            pos = np.nonzero(fr.mask)[0]
            tmask = np.zeros_like(fr.mask)
            tmask[pos[gv]] = True
            nmask = fr.mask & ~tmask
            w = r.warp_of[g.threads]
            tw = np.unique(w[tmask])
            nwp = np.unique(w[nmask])
            mixed = np.intersect1d(tw, nwp)  # warps that diverge inside themselves
            if split_ok and (mixed.size < tw.size or mixed.size < nwp.size):
                # Warps whose lanes all go one way leave the group, so that no warp waits at a
                # reconvergence point for another warp (a CTA spinning on a flag that a CTA of
                # the same group has already seen would then hang).
                def carve(warps, new_pc):
                    inside = np.isin(r.warp_of[g.threads], warps)
                    if not inside.any():
                        return inside | True
                    ng = Group(r, g.threads[inside], [Frame(x.pc, x.rpc, x.mask[inside]) for x in g.stack])
                    ng.stack[-1].pc = new_pc
                    ng.penalty = g.penalty
                    ng.stack = [x for x in ng.stack if x.mask.any()]
                    r.groups.append(ng)
                    keep = ~inside
                    g.threads = g.threads[keep]
                    for x in g.stack:
                        x.mask = x.mask[keep]
                    return keep

                keep = carve(np.setdiff1d(tw, mixed), target)
                tmask, nmask = tmask[keep], nmask[keep]
                if mixed.size:
                    keep = carve(np.setdiff1d(nwp, mixed), pc + 1)
                    tmask, nmask = tmask[keep], nmask[keep]
                    rpc = r.ipdom[pc]
                    fr.pc = rpc
                    g.stack.append(Frame(pc + 1, rpc, nmask))
                    g.stack.append(Frame(target, rpc, tmask))
                else:
                    g.stack[-1].pc = pc + 1
                g.stack = [x for x in g.stack if x.mask.any()]
            else:
                rpc = r.ipdom[pc]
                fr.pc = rpc
                g.stack.append(Frame(pc + 1, rpc, nmask))
                g.stack.append(Frame(target, rpc, tmask))
        if target <= pc and (gv is None or gv.any()):
            g.backedges += 1
            if g.backedges % 64 == 0:
                g.penalty += 1
        return "yield"
    return ("ctl", f)


def h_ret(c, parts, ops, pc):
    m, r = c.m, c.r

    def f(g, fr, sel, tids, gv, pc_):
        t = tids if gv is None else tids[gv]
        if gv is not None and not gv.all():
            fr.pc = pc + 1
        m._exit(r, g, t)
        return "yield"
    return ("ctl", f)


def h_trap(c, parts, ops, pc):
    def f(g, fr, sel, tids, gv, pc_):
        if gv is None or gv.any():
            raise SimError("trap (the kernel aborted)")
        fr.pc = pc + 1
    return ("ctl", f)


def h_bar(c, parts, ops, pc):
    r = c.r
    sub = parts[1] if len(parts) > 1 else "sync"
    if sub == "warp":
        fm = c.rd(ops[0], "u32")

        def f(sel, tids):
            mask = int(np.unique(_bcast(fm(sel, tids), tids))[0])
            ws = _require_warps(c, tids, "bar.warp.sync", mask)
            r.smem.warp_epoch[ws] += 1
        return _op(f)
    if sub in ("sync", "red", "arrive") or parts[0] == "barrier":
        if sub == "arrive":
            raise SimError("bar.arrive is not modelled")
        is_red = sub == "red"
        bar_id_op = ops[1] if is_red else ops[0]
        if bar_id_op.kind != "imm" or bar_id_op.value != 0 or (not is_red and len(ops) > 1) or (is_red and len(ops) > 3):
            raise SimError("only barrier 0 over the whole CTA is modelled")
        fp = c.rd(ops[2], "pred") if is_red else None

        def f(g, fr, sel, tids, gv, pc_):
            if gv is not None and not gv.all():
                raise SimError("bar.sync under a guard that is false for some threads")
            _require_warps(c, tids, "bar.sync")
            if fp is not None:
                r.bar_vals[tids] = _bcast(fp(sel, tids), tids)
            if len(g.stack) > 1:
                # threads of the group wait in lower frames: they are elsewhere in the code
                others = g.threads[~fr.mask]
                if np.isin(r.cta_of[others], r.cta_of[tids]).any():
                    raise SimError("bar.sync reached while other threads of the same CTA are on a diverged "
                                   "path of the same warp group")
            g.state = "bar"
            g.bar_pc = pc
            return "yield"
        return ("ctl", f)
    raise SimError(f"{'.'.join(parts)} is not modelled")


def h_nanosleep(c, parts, ops, pc):
    m = c.m
    fa = c.rd(ops[0], "u32")

    def f(g, fr, sel, tids, gv, pc_):
        t = int(np.max(_bcast(fa(sel, tids), tids))) if tids.size else 0
        m.clock_ns += t
        g.penalty += 1
        fr.pc = pc + 1
        return "yield"
    return ("ctl", f)


def h_griddepcontrol(c, parts, ops, pc):
    """griddepcontrol.wait: the group waits (state "gdwait") until the launch's prerequisite grids
    have exited (Launch.after); launch_dependents: nothing to do, the dependents start with it."""
    sub = parts[1] if len(parts) > 1 else ""
    if sub not in ("wait", "launch_dependents") or ops:
        raise SimError(f"{'.'.join(parts)} is not a griddepcontrol form")

    def f(g, fr, sel, tids, gv, pc_):
        if gv is not None and not gv.all():
            raise SimError(f"griddepcontrol.{sub} under a guard that is false for some threads")
        fr.pc = pc + 1
        if sub == "wait" and g.launch.prerequisites:
            g.state = "gdwait"
            return "yield"
        return None
    return ("ctl", f)


def h_exit(c, parts, ops, pc):
    return h_ret(c, parts, ops, pc)


_HANDLERS = {
    "mov": h_mov,
    "add": _arith(lambda a, b, m, t: a + b, lambda a, b, m, t: a + b),
    "sub": _arith(lambda a, b, m, t: a - b, lambda a, b, m, t: a - b),
    "mul": h_mul, "mad": h_mad, "fma": _arith(None, _fma), "div": h_div, "rem": h_rem,
    "and": h_logic("and"), "or": h_logic("or"), "xor": h_logic("xor"), "not": h_logic("not"),
    "shl": _arith(_shl), "shr": _arith(_shr), "shf": h_shf, "bfe": h_bfe, "bfi": h_bfi, "prmt": h_prmt, "popc": h_popc, "clz": h_clz, "brev": h_brev,
    "neg": h_neg, "abs": h_abs, "min": h_minmax("min"), "max": h_minmax("max"),
    "setp": h_setp, "selp": h_selp, "cvt": h_cvt, "cvta": h_cvta,
    "ex2": h_float1(_ex2, True), "rsqrt": h_float1(_rsqrt, True), "rcp": h_float1(_rcp, True),
    "sqrt": h_float1(_sqrt, True), "lg2": h_float1(_lg2, True),
    "ld": h_ld, "st": h_st, "atom": h_atom, "red": h_red, "membar": h_fence, "fence": h_fence,
    "shfl": h_shfl, "redux": h_redux, "vote": h_vote, "ldmatrix": h_ldmatrix, "stmatrix": h_stmatrix,
    "mma": h_mma, "cp": h_cp, "bra": h_bra, "ret": h_ret, "exit": h_exit, "trap": h_trap,
    "bar": h_bar, "barrier": h_bar, "nanosleep": h_nanosleep, "griddepcontrol": h_griddepcontrol,
}
