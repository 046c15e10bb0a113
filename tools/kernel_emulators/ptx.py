"""The PTX instructions the two attention emulators need, modelled from the PTX ISA text (NOT from
csrc/include/spec_kernels/mma.cuh, whose comments they thereby check independently):

* mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: which lane holds which A / B / C element;
* ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: which lane gives which row address and
  which lane receives which element;
* cp.async.cg.shared.global 16 bytes with src-size 0 (zero fill), cp.async.commit_group and
  cp.async.wait_group N;
* __shfl_xor_sync within a warp; __syncthreads as a barrier epoch.

SharedMemory also checks that every shared-memory access is ordered by the kernel's barriers and
cp.async waits (see its docstring). Values are fp16 / bf16 numbers held as float32 (exactly);
products are summed in float64 and added to the fp32 accumulator (the hardware's internal order
and rounding are not modelled, hence the tolerances in the checks).
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

LANE = np.arange(32)
# Fragment coordinates of a lane: "groupID" g = lane / 4 and "threadID_in_group" t = lane % 4.
G, T4 = LANE // 4, LANE % 4


class HazardError(AssertionError):
    """An access the kernel does not order (race), or out of bounds, or of never-written memory."""


def fail(msg):
    raise HazardError(msg)


def to_dtype(x, dtype):
    """Round float32 values to fp16 / bf16 (round to nearest even, as __floats2half2_rn /
    __floats2bfloat162_rn / __float2*_rn) and return them as float32."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(dtype).float().numpy()


def ceil_div(a, b):
    """The kernels' int ceil_div, (a + b - 1) / b, with C's truncating division."""
    x = a + b - 1
    return -((-x) // b) if x < 0 else x // b


def c_int(x, what="int expression"):
    """A value the kernel computes in 32-bit int: signed overflow is UB, so flag it."""
    if not -(2**31) <= x < 2**31:
        fail(f"{what} = {x} overflows int32 (undefined behaviour in C++)")
    return x


def shfl_xor(v, mask):
    """__shfl_xor_sync(0xffffffff, v, mask) for per-lane values on the last axis."""
    return v[..., LANE ^ mask]


def swizzled(k_chunks, row, chunk):
    """spec_kernels::swizzled<kChunks>(row, chunk): element offset of 16-byte chunk `chunk` of
    `row`, chunks XOR-swizzled by row & 7 (same expression as mma.cuh; works on arrays)."""
    assert k_chunks >= 8 and k_chunks % 8 == 0
    return row * k_chunks * 8 + ((chunk ^ (row & 7)) << 3)


# Inputs may hold NaN / inf on purpose (the attention kernels' non-finite cases): then a NaN in an
# mma operand is data, not a sign of unwritten memory (ldmatrix still flags never-written shared
# memory by its own bookkeeping). Set with `with nan_data():`.
NAN_DATA = False


@contextlib.contextmanager
def nan_data():
    global NAN_DATA
    old, NAN_DATA = NAN_DATA, True
    try:
        yield
    finally:
        NAN_DATA = old


def mma_m16n8k16(d, a, b0, b1):
    """d += A @ B for one warp. d: [32 lanes, 4] fp32 (c0..c3); a: [4 regs, 32, 2 halves];
    b0, b1: [32, 2]. Element placement per the PTX ISA, lane = 4 * g + t:
      A (16x16, row): reg0 = A[g][2t..2t+1], reg1 = A[g+8][2t..2t+1], reg2 = A[g][8+2t..], reg3 = A[g+8][8+2t..]
      B (16x8, col):  b0 = B[2t..2t+1][g], b1 = B[8+2t..8+2t+1][g]
      C (16x8):       c0, c1 = C[g][2t], C[g][2t+1]; c2, c3 = C[g+8][2t], C[g+8][2t+1]"""
    A = np.full((16, 16), np.nan)
    B = np.full((16, 8), np.nan)
    for e in range(2):
        A[G, 2 * T4 + e] = a[0][:, e]
        A[G + 8, 2 * T4 + e] = a[1][:, e]
        A[G, 8 + 2 * T4 + e] = a[2][:, e]
        A[G + 8, 8 + 2 * T4 + e] = a[3][:, e]
        B[2 * T4 + e, G] = b0[:, e]
        B[8 + 2 * T4 + e, G] = b1[:, e]
    # every element is set exactly once by the 32 lanes; NaN here = an input read unwritten memory
    if not NAN_DATA and (np.isnan(A).any() or np.isnan(B).any()):
        fail("mma operand holds a NaN (unwritten shared memory?)")
    with np.errstate(invalid="ignore", over="ignore"):
        C = (A @ B).astype(np.float32)
    d[:, 0] += C[G, 2 * T4]
    d[:, 1] += C[G, 2 * T4 + 1]
    d[:, 2] += C[G + 8, 2 * T4]
    d[:, 3] += C[G + 8, 2 * T4 + 1]


class SharedMemory:
    """One CTA's shared memory in 2-byte elements (fp16 / bf16 values as float32), plus a float32
    view (st_f32 / ld_f32, float index f = elements 2f, 2f+1) for data the kernel reuses it for.

    Hazard model, per element and at warp granularity. epoch = number of __syncthreads passed.
    * A cp.async is "pending" from its issue until the wait_group that retires its group; it may
      land at any moment in between, so ANY read of a pending element is an error (this covers
      both "landed too early: overwrote data still being read" and "read before it landed").
    * A retired cp.async or a plain store is visible to other warps only after the next barrier:
      reading it in the same epoch is an error (conservatively also for the writing warp).
    * Writing (store or cp.async issue) an element another warp read in this epoch: WAR race.
    * Writing an element another warp wrote (or whose cp.async retired) in this epoch, or one
      with a cp.async in flight: WAW race.
    * Reads of never-written memory, out-of-bounds or misaligned accesses are errors.
    cp.async groups are tracked for the CTA as a whole: every thread of these kernels commits and
    waits at the same points, so per-thread groups retire together.
    """

    def __init__(self, n_elems, name="smem"):
        self.name = name
        self.val = np.full(n_elems, np.nan, np.float32)  # NaN = never written (as 2-byte data)
        self.valid16 = np.zeros(n_elems, bool)  # holds 2-byte data (a landed cp.async); NaN data may be real
        self.f32 = np.zeros(n_elems // 2, np.float32)
        self.f32_written = np.zeros(n_elems // 2, bool)
        self.pending = np.zeros(n_elems, bool)
        self.vis_epoch = np.full(n_elems, -1)  # first epoch in which other warps may read it
        self.write_warp = np.full(n_elems, -1)
        self.read_epoch = np.full(n_elems, -1)
        self.read_mask = np.zeros(n_elems, np.int64)  # warps that read it in read_epoch (bit mask)
        self.epoch = 0
        self.groups = []  # committed, not yet retired: [[(elements, values, warp), ...], ...]
        self.open_group = []

    # --------------------------------------------------------------------- bookkeeping
    def _bounds(self, idx, what):
        if not (idx.size == 0 or (idx.min() >= 0 and idx.max() < self.val.size)):
            fail(f"{what}: {self.name} access out of bounds ({idx.min()}..{idx.max()}, size {self.val.size})")

    def _before_write(self, idx, warp, what):
        self._bounds(idx, what)
        others = self.read_mask[idx] & ~np.int64(1 << warp)
        if ((self.read_epoch[idx] == self.epoch) & (others != 0)).any():
            fail(f"{what}: WAR race, {self.name} element read by another warp since the last __syncthreads")
        if self.pending[idx].any():
            fail(f"{what}: WAW race, {self.name} element has a cp.async in flight")
        if ((self.vis_epoch[idx] > self.epoch) & (self.write_warp[idx] != warp)).any():
            fail(f"{what}: WAW race, {self.name} element written by another warp since the last __syncthreads")

    def _read(self, idx, warp, what):
        self._bounds(idx, what)
        if self.pending[idx].any():
            fail(f"{what}: {self.name} element read while its cp.async is in flight")
        if (self.vis_epoch[idx] > self.epoch).any():
            fail(f"{what}: {self.name} element read before a __syncthreads published its write")
        fresh = self.read_epoch[idx] != self.epoch
        self.read_mask[idx] = np.where(fresh, 0, self.read_mask[idx]) | np.int64(1 << warp)
        self.read_epoch[idx] = self.epoch

    # --------------------------------------------------------------------- cp.async
    def cp_async_16(self, dst, src_values, warp):
        """cp.async.cg.shared.global [dst], [src], 16, src_size: src_values = the 8 elements read
        from global memory, or None for src_size 0 (nothing read, 16 zero bytes written)."""
        if dst % 8:
            fail(f"cp.async destination {dst} not 16-byte aligned")
        idx = np.arange(dst, dst + 8)
        self._before_write(idx, warp, "cp.async")
        self.pending[idx] = True
        vals = np.zeros(8, np.float32) if src_values is None else np.asarray(src_values, np.float32)
        self.open_group.append((idx, vals, warp))

    def commit_group(self):
        self.groups.append(self.open_group)
        self.open_group = []

    def wait_group(self, n):
        """cp.async.wait_group n: all but the n most recent committed groups have landed."""
        while len(self.groups) > n:
            for idx, vals, warp in self.groups.pop(0):
                self.val[idx] = vals
                self.valid16[idx] = True
                self.f32_written[idx[::2] // 2] = False
                self.pending[idx] = False
                self.vis_epoch[idx] = self.epoch + 1
                self.write_warp[idx] = warp

    def syncthreads(self):
        self.epoch += 1

    # --------------------------------------------------------------------- ldmatrix
    def ldmatrix_x4(self, addr, warp, trans=False):
        """ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 for one warp. addr: [32] element
        offsets; lanes 8i..8i+7 give the addresses of rows 0..7 of matrix i. Returns [4, 32, 2]:
        register i of each lane. Without .trans lane L receives row L/4, columns 2(L%4), 2(L%4)+1
        of matrix i; with .trans the matrix is transposed: rows 2(L%4), 2(L%4)+1 of column L/4."""
        addr = np.asarray(addr).reshape(32)
        if (addr % 8).any():
            fail("ldmatrix row address not 16-byte aligned")
        out = np.empty((4, 32, 2), np.float32)
        for i in range(4):
            rows = addr[8 * i:8 * i + 8]
            idx = rows[:, None] + np.arange(8)[None, :]  # [8 rows][8 columns]
            self._read(idx.reshape(-1), warp, "ldmatrix")
            M = self.val[idx]
            if not self.valid16[idx].all():
                fail(f"ldmatrix reads never-written {self.name}")
            if trans:
                M = M.T
            out[i, :, 0] = M[G, 2 * T4]
            out[i, :, 1] = M[G, 2 * T4 + 1]
        return out

    # --------------------------------------------------------------------- float32 view
    def st_f32(self, fidx, values, warp):
        fidx = np.asarray(fidx)
        idx = np.concatenate([2 * fidx, 2 * fidx + 1])
        self._before_write(idx, warp, "float store")
        self.f32[fidx] = values
        self.f32_written[fidx] = True
        self.val[idx] = np.nan  # no longer valid as 2-byte data
        self.valid16[idx] = False
        self.vis_epoch[idx] = self.epoch + 1
        self.write_warp[idx] = warp

    def ld_f32(self, fidx, warp):
        fidx = np.asarray(fidx)
        self._read(np.concatenate([2 * fidx, 2 * fidx + 1]), warp, "float load")
        if not self.f32_written[fidx].all():
            fail(f"float load of never-written {self.name}")
        return self.f32[fidx].copy()


class GlobalOut:
    """An output tensor in global memory: NaN = not written, bounds checked on every store (no
    negative-index wrap), and a second store to one element in a launch (two threads or CTAs
    owning the same output) is an error."""

    def __init__(self, shape, name):
        self.name = name
        self.a = np.full(shape, np.nan, np.float32)
        self.written = np.zeros(shape, bool)

    def store(self, index, values):
        for axis, ix in enumerate(index):
            ix = np.asarray(ix)
            if not (ix.size == 0 or (ix.min() >= 0 and ix.max() < self.a.shape[axis])):
                fail(f"store out of bounds of {self.name} (axis {axis}: {ix.min()}..{ix.max()}, size {self.a.shape[axis]})")
        if self.written[index].any():
            fail(f"{self.name}{tuple(np.asarray(i).tolist() for i in index)} written twice")
        self.a[index] = values
        self.written[index] = True


def in_bounds(i, n, what):
    """A global read the kernel guards: must hold, or the kernel would read out of bounds."""
    if not 0 <= i < n:
        fail(f"global read out of bounds: {what} index {i}, size {n}")
    return i
