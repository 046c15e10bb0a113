"""Emulation of csrc/norm/fused_add_rmsnorm.cu (fused_add_rmsnorm_kernel as launched by
launch_fused_add_rmsnorm) and of the row epilogue in csrc/norm/rmsnorm_row.cuh (warp_sum,
block_sum, add_rmsnorm_row, row_launch), which allreduce.py uses for its fused epilogue too.
Checked against spec_kernels/norm/reference.py.

A hand transliteration, vectorised over the threads of a block: every thread's vectors are
`v = threadIdx.x + i * blockDim.x` (i < ITEMS, v < nvec), its fp32 arithmetic is done in the
kernel's order (ss accumulated over i, then k, as an fma; the butterfly warp sums; the two-level
block sum through `warp_sums` in shared memory, tracked by ptx.SharedMemory at warp granularity,
so a missing __syncthreads between two block sums is a race). Global memory is `Storage`: bounds
checked, vector accesses must be aligned to their size (a misaligned Vec<T, N> access faults on
the GPU), stores are rounded to the element type (RNE; fp8 e4m3 saturating), a second store to an
element in one launch is an error, and elements no store reached are reported.

Not modelled: rsqrtf's approximation (1 / sqrt correctly rounded here; the GPU's rsqrt.approx is
within 2 ulp) and whether nvcc contracts `ss += x * x` (an fma is assumed), hence tolerances on
`out`; residual_out (one fp32 add, one rounding) must be bit-exact.
Update this file together with the kernel (see README.md).
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (str(HERE), str(REPO)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from ptx import HazardError, SharedMemory, fail, to_dtype  # noqa: E402

KERNEL = "csrc/norm/fused_add_rmsnorm.cu + csrc/norm/rmsnorm_row.cuh"
K_MAX_NORM_HIDDEN = 16384  # kMaxNormHidden
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
F32 = np.float32
LANE = np.arange(32)
SIZEOF = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, FP8: 1}
NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", FP8: "fp8"}


# ------------------------------------------------------------------------------------ conversions
def round_to(x, dtype):
    """from_float<T> then to_float: float32 values rounded to T (RNE). fp8: __nv_fp8_e4m3(v),
    saturating to +-448 (SATFINITE; NaN stays NaN)."""
    x = np.asarray(x, F32)
    if dtype == torch.float32:
        return x.copy()
    if dtype == FP8:
        return torch.from_numpy(np.ascontiguousarray(np.clip(x, -FP8_MAX, FP8_MAX))).to(FP8).float().numpy()
    return to_dtype(x, dtype)


def fma(a, b, c):
    """fmaf(a, b, c) (what nvcc makes of `c += a * b`): a * b exact in float64, one rounding
    (through float64, which differs from a true fma only in rare double-rounding ties)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(F32)


def rsqrtf(x):
    return (1.0 / np.sqrt(x.astype(np.float64))).astype(F32)


# ------------------------------------------------------------------------------------ memory
class Storage:
    """One tensor in global memory: float32 values of `dtype`, at byte address `addr`."""

    def __init__(self, values, dtype, addr, name):
        self.v = np.array(values, F32).reshape(-1)
        self.dtype, self.size, self.addr, self.name = dtype, SIZEOF[dtype], addr, name
        self.written = np.zeros(self.v.size, bool)

    def _index(self, first, n, what):
        first = np.asarray(first, np.int64).reshape(-1)
        if first.size and (first.min() < 0 or first.max() + n > self.v.size):
            fail(f"{what} out of bounds of {self.name}: elements {first.min()}..{first.max() + n - 1}, "
                 f"size {self.v.size}")
        if n > 1 and ((self.addr + first * self.size) % (n * self.size)).any():
            fail(f"misaligned {n * self.size}-byte vector {what} of {self.name} (byte address "
                 f"{self.addr + int(first[((self.addr + first * self.size) % (n * self.size)) != 0][0]) * self.size})")
        return first[:, None] + np.arange(n)[None, :]

    def load(self, first, n):
        """Vec<T, n> loads at element offsets `first`: [len(first), n] float32."""
        return self.v[self._index(first, n, "load")]

    def store(self, first, vals, n):
        idx = self._index(first, n, "store")
        if self.written[idx].any():
            fail(f"{self.name}: element {int(idx[self.written[idx]][0])} stored twice in one launch")
        self.v[idx] = round_to(vals, self.dtype)
        self.written[idx] = True

    def begin_launch(self):
        self.written[:] = False


# ------------------------------------------------------------------------------------ rmsnorm_row.cuh
def row_launch(nvec, max_items):
    """norm::row_launch: (threads, items)."""
    items = 1
    while items < max_items and nvec > items * 1024:
        items *= 2
    threads = (nvec + items - 1) // items
    threads = ((threads + 31) // 32) * 32
    return (threads if threads < 1024 else 1024), items


def thread_vectors(threads, items, nvec):
    """V[i, t] = t + i * blockDim.x, the vector thread t handles as its item i; mask: v < nvec."""
    V = np.arange(threads)[None, :] + np.arange(items)[:, None] * threads
    return V, V < nvec


def warp_sum(v):
    """warp_sum over the last axis (32 lanes): the __shfl_xor_sync butterfly, fp32 adds."""
    for offset in (16, 8, 4, 2, 1):
        v = (v + v[..., LANE ^ offset]).astype(F32)
    return v


def block_sum(v, smem, threads):
    """block_sum(v) for every thread of the block: [threads] -> [threads]."""
    if threads % 32:
        fail(f"block_sum needs blockDim.x % 32 == 0, got {threads}")
    nw = threads // 32
    v = warp_sum(v.reshape(nw, 32).astype(F32))
    for w in range(nw):  # if (lane == 0) warp_sums[warp] = v;
        smem.st_f32([w], v[w, :1], w)
    smem.syncthreads()
    got = np.zeros((nw, 32), F32)
    lanes = LANE[LANE < (threads >> 5)]  # lane < blockDim.x >> 5 ? warp_sums[lane] : 0
    for w in range(nw):
        got[w, lanes] = smem.ld_f32(lanes, w)
    v = warp_sum(got)
    smem.syncthreads()  # warp_sums is reused by the next call
    return v.reshape(-1)


def add_rmsnorm_row(x, V, mask, residual, weight, out, res_out, start, nvec, hidden, eps, inv_scale, VEC,
                    threads, smem):
    """add_rmsnorm_row: x [ITEMS, threads, VEC] float32 holds each thread's first addend (valid
    where mask); residual / out / res_out rows begin at element `start`, weight at 0."""
    items = x.shape[0]
    ss = np.zeros(threads, F32)
    for i in range(items):
        m = mask[i]
        if m.any():
            r = residual.load(start + V[i, m] * VEC, VEC)
            for k in range(VEC):
                x[i, m, k] = (x[i, m, k] + r[:, k]).astype(F32)
                ss[m] = fma(x[i, m, k], x[i, m, k], ss[m])
    total = block_sum(ss, smem, threads)
    rstd = rsqrtf((total / F32(hidden)).astype(F32) + F32(eps))
    for i in range(items):
        m = mask[i]
        if m.any():
            w = weight.load(V[i, m] * VEC, VEC)
            y = ((x[i, m] * rstd[m, None]).astype(F32) * w).astype(F32) * F32(inv_scale)
            res_out.store(start + V[i, m] * VEC, x[i, m], VEC)
            out.store(start + V[i, m] * VEC, y.astype(F32), VEC)


# ------------------------------------------------------------------------------------ fused_add_rmsnorm.cu
def fused_add_rmsnorm_kernel(block, x, residual, weight, out, res_out, hidden, eps, inv_scale, VEC, ITEMS, threads):
    smem = SharedMemory(64, "warp_sums")  # __shared__ float warp_sums[32]
    row_start = block * hidden
    nvec = hidden // VEC
    V, mask = thread_vectors(threads, ITEMS, nvec)
    h = np.full((ITEMS, threads, VEC), np.nan, F32)
    h[mask] = x.load(row_start + V[mask] * VEC, VEC)
    add_rmsnorm_row(h, V, mask, residual, weight, out, res_out, row_start, nvec, hidden, eps, inv_scale, VEC,
                    threads, smem)


def launch_vec(VEC, x, residual, weight, out, res_out, rows, hidden, eps, inv_scale, info):
    kMaxItems = 16 if VEC == 1 else 4
    threads, items = row_launch(hidden // VEC, kMaxItems)
    info.update(vec=VEC, threads=threads, items=items)
    if items in (1, 2, 4) or (items in (8, 16) and kMaxItems >= items):
        for block in range(rows):
            fused_add_rmsnorm_kernel(block, x, residual, weight, out, res_out, hidden, eps, inv_scale, VEC, items,
                                     threads)
        return "cudaSuccess"
    if items in (8, 16):
        return "cudaSuccess"  # `if constexpr` false: the switch launches nothing
    return "cudaErrorInvalidConfiguration"


def aligned16(addr):
    return addr % 16 == 0


def launch_fused_add_rmsnorm(x, residual, weight, out, res_out, rows, hidden, dtype, fp8_out, eps, inv_scale,
                             info=None):
    info = {} if info is None else info
    if rows == 0:
        return "cudaSuccess"
    if rows < 0 or rows > 0x7FFFFFFF or hidden < 1 or hidden > K_MAX_NORM_HIDDEN:
        return "cudaErrorInvalidValue"
    out_t = FP8 if fp8_out else dtype
    if not fp8_out:
        inv_scale = 1.0
    kVec = 16 // SIZEOF[dtype]
    vec_ok = (hidden % kVec == 0 and aligned16(x.addr) and aligned16(residual.addr) and aligned16(weight.addr)
              and aligned16(res_out.addr) and out.addr % (kVec * SIZEOF[out_t]) == 0)
    return launch_vec(kVec if vec_ok else 1, x, residual, weight, out, res_out, rows, hidden, eps, inv_scale, info)


def emulate(x, residual, weight, eps, out_scale=None, addr=None, inplace=""):
    """spec_kernels.fused_add_rmsnorm(..., impl="cuda") on CPU tensors: (out, residual_out, info).
    addr: byte addresses of x / residual / weight / out / residual_out (default 0: aligned);
    inplace: "out=x", "res=residual" or both ("out=x,res=residual")."""
    rows, hidden = x.shape
    dtype = x.dtype
    addr = {**dict(x=0, residual=0, weight=0, out=0, residual_out=0), **(addr or {})}
    out_t = FP8 if out_scale is not None else dtype
    xs = Storage(x.float().numpy(), dtype, addr["x"], "x")
    rs = Storage(residual.float().numpy(), dtype, addr["residual"], "residual")
    ws = Storage(weight.float().numpy(), dtype, addr["weight"], "weight")
    os_ = xs if "out=x" in inplace else Storage(np.full(x.numel(), np.nan), out_t, addr["out"], "out")
    ros = rs if "res=residual" in inplace else Storage(np.full(x.numel(), np.nan), dtype, addr["residual_out"],
                                                       "residual_out")
    if os_ is xs:
        os_.dtype, os_.size = out_t, SIZEOF[out_t]  # out=x needs out's dtype == x's (no fp8 in place)
    for s in (os_, ros):
        s.begin_launch()
    inv_scale = float(np.float32(1.0 / out_scale)) if out_scale is not None else 1.0  # norm_checks.h inv_out_scale
    info = {}
    status = launch_fused_add_rmsnorm(xs, rs, ws, os_, ros, rows, hidden, dtype, out_scale is not None, eps,
                                      inv_scale, info)
    info["status"] = status
    for s in (os_, ros):
        if rows and not s.written.all():
            fail(f"{s.name}: {int((~s.written).sum())} of {s.v.size} elements never written "
                 f"(first {int(np.flatnonzero(~s.written)[0])}) [{status}]")
    out = torch.from_numpy(os_.v.reshape(rows, hidden).copy()).to(out_t)
    res = torch.from_numpy(ros.v.reshape(rows, hidden).copy()).to(dtype)
    return out, res, info


# ------------------------------------------------------------------------------------ checks
# As tests/test_fused_add_rmsnorm.py: out within one rounding step of the reference, residual_out exact.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1.6e-2, 8e-3)}
FP8_TOL = (2e-3, 0.0625)  # after dequantising (times out_scale)


def make(rows, hidden, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(rows, hidden, generator=g) * s for s in (1.0, 3.0))
    w = 1.0 + 0.1 * torch.randn(hidden, generator=g)
    return x.to(dtype), r.to(dtype), w.to(dtype)


def reference(x, residual, weight, eps, out_scale=None):
    from spec_kernels.norm.reference import fused_add_rmsnorm

    out = torch.empty(x.shape, dtype=FP8 if out_scale is not None else x.dtype)
    res = torch.empty_like(x)
    fused_add_rmsnorm(x, residual, weight, eps, out, res, out_scale)
    return out, res


def close(got, want, atol, rtol):
    """(ok, max abs error) as torch.testing.assert_close with equal_nan."""
    g, w = got.double(), want.double()
    both_nan = torch.isnan(g) & torch.isnan(w)
    err = torch.where(both_nan, torch.zeros_like(g), (g - w).abs())
    ok = bool(((err <= atol + rtol * w.abs()) | both_nan).all())
    return ok, float(err.max()) if err.numel() else 0.0


def compare(rows, hidden, dtype, seed, out_scale=None, eps=1e-6, addr=None, inplace=""):
    x, r, w = make(rows, hidden, dtype, seed)
    want_out, want_res = reference(x, r, w, eps, out_scale)
    got_out, got_res, info = emulate(x.clone(), r.clone(), w, eps, out_scale, addr, inplace)
    path = (f"{'vector' if info.get('vec', 1) > 1 else 'scalar'} path VEC={info.get('vec')} "
            f"threads={info.get('threads')} items={info.get('items')}") if rows else "no launch (0 rows)"
    res_exact = torch.equal(got_res.view(torch.int16 if dtype != torch.float32 else torch.int32),
                            want_res.view(torch.int16 if dtype != torch.float32 else torch.int32))
    if out_scale is None:
        ok, err = close(got_out, want_out, *TOL[dtype])
        key = NAMES[dtype]
    else:
        ok, err = close(got_out.float() * out_scale, want_out.float() * out_scale, *FP8_TOL)
        key = "fp8"
    note = f"{path}; out err {err:.1e}" + ("" if res_exact else "; residual_out NOT bit-exact")
    vec = info.get("vec", 0)
    return dict(ok=ok and res_exact, note=note, errs={key: err}, launches=1,
                tally=dict(rows=rows, vector=int(vec > 1), scalar=int(vec == 1), fp8=int(out_scale is not None),
                           max_items=info.get("items", 0)))


def summary_note(tally, errs):
    e = ", ".join(f"{k} {v:.1e}" for k, v in sorted(errs.items()) if k in ("fp32", "fp8"))
    return (f"{tally.get('vector', 0)} vector / {tally.get('scalar', 0)} scalar-path launches, "
            f"{tally.get('rows', 0)} rows, items <= {tally.get('max_items', 0)}; residual_out bit-exact; "
            f"out err {e or '-'}")


def cases(quick):
    """(name, thunk): vector paths of fp32 (VEC 4) / fp16 / bf16 (VEC 8) with 1, 2 and 4 items
    per thread, the scalar path (hidden not a multiple of the vector width, or a misaligned view)
    with up to 16 items, fp8 output with saturation, in-place use, 0 rows, and random shapes."""
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    fixed = [  # (rows, hidden, dtype, out_scale, addr, inplace, quick)
        (5, 123, bf16, None, None, "", True),  # scalar, 128 threads
        (3, 4096, bf16, None, None, "", True),  # vector 512 vectors
        (2, 16384, f16, None, None, "", True),  # vector, 2 items
        (2, 16384, f32, None, None, "", True),  # fp32 vector, 4 items
        (2, 16383, f32, None, None, "", True),  # scalar, 16 items
        (3, 8200, bf16, None, None, "", False),  # vector, 1025 vectors: 2 items, 544 threads
        (4, 1, f32, None, None, "", True),  # one element per row (a 32-thread block)
        (2, 8, f16, None, None, "", False),
        (0, 64, bf16, None, None, "", True),
        (5, 123, bf16, 0.005, None, "", True),  # fp8, some saturate
        (4, 7168, bf16, 0.05, None, "", True),  # fp8, vector path (8-byte fp8 vectors)
        (3, 7168, f32, 0.05, None, "", False),  # fp32 -> fp8 (4-byte fp8 vectors)
        (5, 4097, bf16, None, dict(x=2, residual=2, out=2, residual_out=2), "out=x,res=residual", True),
        (3, 4096, bf16, None, dict(x=2), "", True),  # misaligned x only: scalar path
        (3, 4096, f16, 0.01, dict(out=4), "", True),  # fp8 out at 4 bytes: not 8-aligned -> scalar
        (3, 2048, f16, None, None, "out=x", False),
        (6, 257, f32, None, None, "res=residual", False),
    ]
    out = []
    for rows, hidden, dt, sc, addr, inplace, q in fixed:
        if quick and not q:
            continue
        label = (f"{rows}x{hidden} {NAMES[dt]}" + (f" fp8 out (scale {sc})" if sc else "")
                 + (f" addr {addr}" if addr else "") + (f" in place {inplace}" if inplace else ""))
        out.append((label, lambda a=(rows, hidden, dt, 0), sc=sc, addr=addr, inplace=inplace: compare(
            *a, out_scale=sc, addr=addr, inplace=inplace)))
    rng = random.Random(1234)
    hiddens = [1, 3, 7, 8, 9, 31, 32, 33, 100, 511, 1000, 1024, 1032, 2049, 3000, 4104, 5000, 12345]
    for s in range(6 if quick else 40):
        rows, hidden = rng.randint(1, 4), rng.choice(hiddens)
        dt = rng.choice([f32, f16, bf16])
        sc = rng.choice([None, None, 0.02])
        addr = rng.choice([None, None, None, dict(x=SIZEOF[dt], residual_out=4)])  # one element off; 4 bytes off
        label = f"random {s}: {rows}x{hidden} {NAMES[dt]}" + (" fp8 out" if sc else "") + \
            (" misaligned" if addr else "")
        out.append((label, lambda a=(rows, hidden, dt, 100 + s), sc=sc, addr=addr:
                    compare(*a, out_scale=sc, addr=addr)))
    return out


if __name__ == "__main__":
    for name, fn in cases(quick="--quick" in sys.argv):
        try:
            r = fn()
        except HazardError as e:
            r = dict(ok=False, note=str(e))
        print(("ok  " if r["ok"] else "FAIL") + f" {name}: {r['note']}")
