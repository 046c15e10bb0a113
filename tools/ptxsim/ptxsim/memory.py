"""Memory of a simulated launch: global regions with bounds checks, per-CTA shared memory with a
lane-granular race detector and cp.async pending bytes, and the address windows of generic
addressing.

Address map (64-bit, arbitrary but fixed):
  global regions  GLOBAL_BASE + k * 2**36 + offset     (one region per tensor / allocation)
  param window    PARAM_BASE + offset                  (the launch's packed parameters, read-only)
  shared window   SHARED_BASE + offset                 (32-bit shared addresses, per CTA)
  generic shared  GENERIC_SHARED_BASE + SHARED_BASE + offset   (what cvta.shared produces)
"""
from __future__ import annotations

import numpy as np

GLOBAL_BASE = 0x7000_0000_0000
REGION_SHIFT = 36
PARAM_BASE = 0x6000_0000_0000
SHARED_BASE = 0x400
GENERIC_SHARED_BASE = 0x5000_0000_0000


class SimError(AssertionError):
    """A kernel did something undefined or wrong (out of bounds, race, trap, diverged
    collective, deadlock ...). The message names the PTX instruction and its source line."""


class Hazard(SimError):
    """A shared-memory race or a touch of a cp.async destination before its wait."""


class GlobalMemory:
    """Byte arrays addressed as GLOBAL_BASE + region << 36 + offset. Shared by every launch (and
    every simulated GPU) run on the same Machine."""

    def __init__(self):
        self.regions = []          # list of [np.uint8 array, name]
        self.bytes_read = 0
        self.bytes_written = 0
        self.stores = 0            # stores + atomics: the scheduler's progress measure
        self.region_read = {}      # region name -> bytes loaded from it (all requests, cp.async incl.)

    def alloc(self, nbytes: int, name: str = "buffer", data=None) -> int:
        buf = np.zeros(max(int(nbytes), 0), np.uint8)
        if data is not None:
            raw = np.frombuffer(bytes(data), np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8).ravel()
            buf[:raw.size] = raw
        self.regions.append([buf, name])
        return GLOBAL_BASE + ((len(self.regions) - 1) << REGION_SHIFT)

    def view(self, addr: int) -> np.ndarray:
        rid, off = self._region_of(addr)
        return self.regions[rid][0][off:]

    def _region_of(self, addr):
        rid = (addr - GLOBAL_BASE) >> REGION_SHIFT
        if addr < GLOBAL_BASE or rid >= len(self.regions):
            raise SimError(f"address {addr:#x} is not in any global allocation")
        return rid, addr - GLOBAL_BASE - (rid << REGION_SHIFT)

    def is_global(self, addrs: np.ndarray) -> np.ndarray:
        rid = (addrs.astype(np.int64) - GLOBAL_BASE) >> REGION_SHIFT
        return (addrs >= GLOBAL_BASE) & (rid < len(self.regions))

    def _translate(self, addrs: np.ndarray, width: int, what: str, names: bool = False):
        a = addrs.astype(np.uint64)
        if a.size == 0:
            return []
        if np.any(a % np.uint64(width)):
            bad = int(a[np.nonzero(a % np.uint64(width))[0][0]])
            raise SimError(f"misaligned {width}-byte {what} at {bad:#x}")
        rel = a.astype(np.int64) - GLOBAL_BASE
        rid = rel >> REGION_SHIFT
        if np.any(rel < 0) or np.any(rid >= len(self.regions)):
            bad = int(a[np.nonzero((rel < 0) | (rid >= len(self.regions)))[0][0]])
            raise SimError(f"{what} of {width} bytes at {bad:#x}: not a global allocation "
                           f"(null or wild pointer)")
        off = rel - (rid << REGION_SHIFT)
        out = []
        for r in np.unique(rid):
            idx = np.nonzero(rid == r)[0]
            buf, name = self.regions[int(r)]
            o = off[idx]
            if np.any(o + width > buf.size):
                bad = int(o[np.nonzero(o + width > buf.size)[0][0]])
                raise SimError(f"{what} of {width} bytes at offset {bad} of {name!r} "
                               f"({buf.size} bytes): out of bounds")
            out.append((idx, buf, o, name) if names else (idx, buf, o))
        return out

    def load(self, addrs: np.ndarray, width: int) -> np.ndarray:
        """Bytes (n, width) at each address."""
        res = np.empty((addrs.size, width), np.uint8)
        for idx, buf, o, name in self._translate(addrs, width, "load", names=True):
            res[idx] = buf[o[:, None] + np.arange(width)]
            self.region_read[name] = self.region_read.get(name, 0) + idx.size * width
        self.bytes_read += addrs.size * width
        return res

    def store(self, addrs: np.ndarray, data: np.ndarray):
        width = data.shape[1]
        for idx, buf, o in self._translate(addrs, width, "store"):
            buf[o[:, None] + np.arange(width)] = data[idx]
        self.bytes_written += addrs.size * width
        self.stores += 1

    def check(self, addrs, width, what):
        return self._translate(addrs, width, what)

    # ------------------------------------------------------------------ intra-CTA races
    def race_check(self, run, tids, addrs, width, write, what):
        """Global-memory races between threads of one CTA: an access to a byte that another
        thread of the same CTA of the same launch wrote (or, for a write, read) with neither a
        bar.sync nor - same warp - a bar.warp.sync in between. Threads of different CTAs order
        through fences and atomics, which are not modelled: they are not checked."""
        shadows = getattr(self, "_shadows", None)
        if shadows is None:
            shadows = self._shadows = {}
        for idx, buf, o, name in self._translate(addrs, width, what, names=True):
            rid = (int(addrs[idx[0]]) - GLOBAL_BASE) >> REGION_SHIFT
            sh = shadows.get(rid)
            if sh is None or sh["w_tid"].size != buf.size:
                n = buf.size
                sh = shadows[rid] = {k: np.full(n, -1, np.int64) for k in ("w_tid", "w_run", "r_tid", "r_run")}
                sh.update({k: np.zeros(n, np.int64) for k in ("w_ep", "w_wep", "r_ep", "r_wep")})
            flat = (o[:, None] + np.arange(width)).ravel()
            t = np.repeat(tids[idx], width)
            cta = run.cta_of[t]
            gw = run.warp_of[t]
            ep, wep = run.smem.cta_epoch[cta], run.smem.warp_epoch[gw]

            def unordered(tid_a, run_a, ep_a, wep_a):
                same = (run_a == run.run_id) & (tid_a >= 0) & (tid_a != t)
                other = np.where(tid_a >= 0, tid_a, 0)
                same &= run.cta_of[np.minimum(other, run.N - 1)] == cta
                same &= ep_a == ep
                same &= ~((run.warp_of[np.minimum(other, run.N - 1)] == gw) & (wep_a < wep))
                return same

            bad = unordered(sh["w_tid"][flat], sh["w_run"][flat], sh["w_ep"][flat], sh["w_wep"][flat])
            kind = "written"
            if write and not bad.any():
                bad = unordered(sh["r_tid"][flat], sh["r_run"][flat], sh["r_ep"][flat], sh["r_wep"][flat])
                kind = "read"
            if bad.any():
                i = np.nonzero(bad)[0][0]
                other = int((sh["w_tid"] if kind == "written" else sh["r_tid"])[flat[i]])
                raise Hazard(f"global-memory race in {name!r}: {'write' if write else 'read'} by thread "
                             f"{int(t[i]) % run.tpc} of CTA {int(cta[i])} at byte {int(flat[i])}, {kind} by thread "
                             f"{other % run.tpc} of the same CTA with no barrier (or __syncwarp) in between")
            pre = "w_" if write else "r_"
            sh[pre + "tid"][flat] = t
            sh[pre + "run"][flat] = run.run_id
            sh[pre + "ep"][flat] = ep
            sh[pre + "wep"][flat] = wep
            if write:
                sh["r_tid"][flat] = -1


class SharedMemory:
    """Shared memory of every CTA of one launch, with a shadow that finds races at lane level.

    An access by thread t to a byte last written (or read, for a write) by another thread u in
    the same barrier epoch of the CTA is a race unless t and u are in the same warp and a
    bar.warp.sync of that warp lies between the two. Reading a byte never written in this
    launch, or touching a byte a cp.async has still pending, is reported too."""

    def __init__(self, n_cta: int, size: int, threads_per_cta: int, check: bool = True):
        self.size = size
        self.n_cta = n_cta
        self.tpc = threads_per_cta
        self.data = np.full(n_cta * size, 0xCD, np.uint8)
        self.check_races = check
        n = n_cta * size
        self.written = np.zeros(n, bool)
        self.w_tid = np.full(n, -1, np.int64)
        self.w_epoch = np.zeros(n, np.int64)
        self.w_wepoch = np.zeros(n, np.int64)
        self.r_tid = np.full(n, -1, np.int64)
        self.r_epoch = np.zeros(n, np.int64)
        self.r_wepoch = np.zeros(n, np.int64)
        self.pending = np.zeros(n, bool)
        self.cta_epoch = np.zeros(n_cta, np.int64)
        self.warp_epoch = None   # set by the launch: per global warp
        self.bank_conflicts = 0
        self.wavefronts = 0

    def index(self, threads: np.ndarray, addrs: np.ndarray, width: int, what: str) -> np.ndarray:
        a = addrs.astype(np.int64) - SHARED_BASE
        if np.any(a % width):
            bad = int(addrs[np.nonzero(a % width)[0][0]])
            raise SimError(f"misaligned {width}-byte shared {what} at {bad:#x}")
        if np.any(a < 0) or np.any(a + width > self.size):
            i = np.nonzero((a < 0) | (a + width > self.size))[0][0]
            raise SimError(f"shared {what} of {width} bytes at {int(addrs[i]):#x} (offset {int(a[i])}) by "
                           f"thread {int(threads[i]) % self.tpc} of CTA {int(threads[i]) // self.tpc}: outside "
                           f"the {self.size} bytes of shared memory")
        return (threads // self.tpc) * self.size + a

    def _ordered(self, tid, other, epoch_other, wepoch_other, threads):
        """Is the earlier access by `other` ordered before the access by `tid`?"""
        cta = tid // self.tpc
        same_thread = other == tid
        never = other < 0
        older_epoch = epoch_other < self.cta_epoch[cta]
        same_warp = (other // 32 == tid // 32) & ((other // self.tpc) == cta)
        warp = self._gwarp(tid)
        synced = same_warp & (wepoch_other < self.warp_epoch[warp])
        return same_thread | never | older_epoch | synced

    def _gwarp(self, t):
        return (t // self.tpc) * ((self.tpc + 31) // 32) + (t % self.tpc) // 32

    @staticmethod
    def _same_values(flat, data):
        if data is None:
            return False
        d = np.asarray(data).astype(np.uint8, copy=False).reshape(-1)
        if d.size != flat.size:
            return False
        order = np.argsort(flat, kind="stable")
        fs, ds = flat[order], d[order]
        dup = fs[1:] == fs[:-1]
        return bool(np.all(ds[1:][dup] == ds[:-1][dup]))

    def access(self, threads, base_idx, width, write, what, data=None, lanes_write_same_ok=False,
               check=True, perform=True):
        """Check and perform a shared access; returns bytes (n, width) for reads. check=False
        performs without the race checks (a cp.async landing, checked when it was issued);
        perform=False only checks (a cp.async issue: it may write any time until its wait)."""
        idx = base_idx[:, None] + np.arange(width)
        tid = np.broadcast_to(threads[:, None], idx.shape)
        flat, ft = idx.ravel(), tid.ravel()
        if np.any(self.pending[flat]):
            i = np.nonzero(self.pending[flat])[0][0]
            raise Hazard(f"shared {what} by thread {int(ft[i]) % self.tpc} touches byte {int(flat[i]) % self.size} "
                         f"that a cp.async has not completed (missing cp.async.wait_group / barrier)")
        if self.check_races and check:
            cta = ft // self.tpc
            if not write:
                if not np.all(self.written[flat]):
                    i = np.nonzero(~self.written[flat])[0][0]
                    raise SimError(f"shared {what} by thread {int(ft[i]) % self.tpc} of CTA {int(cta[i])} reads byte "
                                   f"{int(flat[i]) % self.size} that nothing wrote in this launch")
            ok = self._ordered(ft, self.w_tid[flat], self.w_epoch[flat], self.w_wepoch[flat], threads)
            if not np.all(ok):
                i = np.nonzero(~ok)[0][0]
                raise Hazard(f"shared-memory race: {what} by thread {int(ft[i]) % self.tpc} of CTA {int(cta[i])} "
                             f"at byte {int(flat[i]) % self.size}, written by thread {int(self.w_tid[flat[i]]) % self.tpc} "
                             f"with no barrier (or __syncwarp) in between")
            if write:
                ok = self._ordered(ft, self.r_tid[flat], self.r_epoch[flat], self.r_wepoch[flat], threads)
                if not np.all(ok):
                    i = np.nonzero(~ok)[0][0]
                    raise Hazard(f"shared-memory race: write by thread {int(ft[i]) % self.tpc} of CTA {int(cta[i])} "
                                 f"at byte {int(flat[i]) % self.size}, read by thread "
                                 f"{int(self.r_tid[flat[i]]) % self.tpc} with no barrier in between")
                if flat.size > 1 and not lanes_write_same_ok:
                    u, c = np.unique(flat, return_counts=True)
                    # Lanes of one store writing the same byte: one write lands (which is undefined),
                    # so it is only a race when their values differ (Triton stores replicated values).
                    if np.any(c > 1) and not self._same_values(flat, data):
                        b = int(u[np.nonzero(c > 1)[0][0]])
                        raise Hazard(f"shared-memory race: several threads write byte {b % self.size} "
                                     f"of CTA {b // self.size} in one {what}")
                if not perform:
                    return None
                self.w_tid[flat] = ft
                self.w_epoch[flat] = self.cta_epoch[cta]
                self.w_wepoch[flat] = self.warp_epoch[self._gwarp(ft)]
                self.r_tid[flat] = -1
            else:
                self.r_tid[flat] = ft
                self.r_epoch[flat] = self.cta_epoch[cta]
                self.r_wepoch[flat] = self.warp_epoch[self._gwarp(ft)]
        if write:
            if not perform:
                return None
            if self.check_races and not check:   # a landing cp.async: its thread wrote the bytes now
                self.w_tid[flat] = ft
                self.w_epoch[flat] = self.cta_epoch[ft // self.tpc]
                self.w_wepoch[flat] = self.warp_epoch[self._gwarp(ft)]
                self.r_tid[flat] = -1
            self.data[idx] = data
            self.written[flat] = True
            return None
        return self.data[idx]

    def count_banks(self, threads, base_idx, width):
        """Bank conflicts of one warp-instruction: extra wavefronts beyond the minimum, per warp,
        from the real addresses (32 banks of 4 bytes; a lane's access of > 4 bytes spans banks).
        The wavefronts themselves (the most distinct words any bank serves, per warp, summed) are
        left in `last_wavefronts`."""
        warps = self._gwarp(threads)
        words = (base_idx % self.size) // 4
        nwords = max(width // 4, 1)
        extra = 0
        self.last_wavefronts = 0
        for w in np.unique(warps):
            sel = warps == w
            ws = (words[sel][:, None] + np.arange(nwords)).ravel()
            uniq = np.unique(ws)
            per_bank = np.bincount(uniq % 32, minlength=32)
            ideal = max(1, -(-(sel.sum() * nwords) // 32))
            extra += max(int(per_bank.max()) - ideal, 0)
            self.wavefronts += int(per_bank.max())
            self.last_wavefronts += int(per_bank.max())
        self.bank_conflicts += extra
        return extra
