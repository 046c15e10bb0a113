"""FusedAllReduce: the tensor-parallel allreduce that ends every layer, fused with the residual
add and RMSNorm that follow it.

Algorithms (chosen per message size, see spec_kernels.comm.selection):

* ``oneshot_push``, ``oneshot_push_1block`` (small messages: one thread block, one handshake per
  peer), ``oneshot_pull``, ``twoshot``: CUDA kernels over IPC buffers registered once
  (spec_kernels.comm.ipc), the residual+RMSNorm epilogue fused; CUDA tensors, the extension,
  world size 2/4/8 and P2P (or one shared GPU) needed, proved at construction by a P2P self-test
  over the IPC mappings (spec_kernels.comm.p2p_check); any failing pair sends every rank to
  ``torch``.
* ``torch``: torch.distributed all_reduce on the group (NCCL on GPUs, gloo on CPUs; CUDA tensors
  on a gloo group are staged through host memory), then spec_kernels.fused_add_rmsnorm.

Semantics are the same on every path: ``all_reduce_add_rmsnorm(x, residual, weight, eps)`` is
``fused_add_rmsnorm(all_reduce(x), residual, weight, eps)``, where the sum is rounded to x's
dtype before the add. Our kernels sum in fp32 in rank order and round once, so every rank gets the
same bits; NCCL/gloo may round partial sums (bf16: within a few ulps of the fp32 sum).

Safety:

* every call carries a header; ranks that disagree raise a RuntimeError on every rank, naming
  the ranks, the algorithm and the call number, before any data moves. On the torch path the
  header (sequence number, tokens, hidden, dtype, operation) is an all_gather, checked on the
  host (one sync on CUDA tensors; skipped during CUDA graph capture, where shapes are fixed);
  the CUDA kernels compare a header word on the device (call number, operation, algorithm, rows,
  grid size: the grid is fixed when the buffers are registered, another grid is refused; hidden
  size and dtype are the same on every rank since construction), so ranks that picked different
  algorithms are refused on their first call, on every rank.
* waits time out: gloo collectives are waited for with ``timeout_s``; NCCL ones use the process
  group's own timeout (its watchdog aborts the communicator); the CUDA kernels' spin-waits
  give up after ``timeout_s`` and report to a host-mapped error word, checked at the next call,
  by ``synchronize()`` and by ``check_device_errors()`` (host memory only: safe between CUDA
  graph replays, where no per-call host code runs). A failed call and every call after it write
  NaN into their outputs, so a replayed graph never computes on stale buffers silently. A
  communicator that failed once refuses further calls until ``reset()`` (collective) re-arms it.
* construction is collective and checks that all ranks agree on hidden size, dtype, max_tokens,
  device kind and tuning table, so every rank selects the same algorithm for every call.
"""
from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist

from .._checks import check_shape, check_tensor
from ..norm.api import MAX_HIDDEN, _check_no_partial_overlap, check_norm_args, fused_add_rmsnorm
from . import selection
from .selection import ALGORITHMS, CUDA_ALGORITHMS, AlgorithmChoice

_MAGIC = 0x5350454B  # "SPEK": a header that is not ours means the ranks' call streams diverged
_RESET = 0x52535400  # what every rank sends in reset()'s barriers
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_OPS = ("all_reduce", "all_reduce_add_rmsnorm")


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]).replace("torch.", "") if 0 <= code < len(_DTYPES) else f"dtype#{code}"


class FusedAllReduce:
    """Allreduce over a process group, optionally fused with residual add + RMSNorm.

    Args:
        group: the torch.distributed process group (None: the default group). NCCL for CUDA
            tensors on one GPU per rank; gloo for CPU tensors, or for ranks sharing one GPU.
        max_tokens: the largest number of rows a call may have (sizes the registered buffers).
        hidden_size: columns of every message (1..16384).
        dtype: float16, bfloat16 or float32.
        device: where the tensors live; default the current CUDA device if there is one, else CPU.
        timeout_s: how long any wait may take before it raises.
        tuning_path: the tuning JSON (default $SPEC_KERNELS_AR_TUNING or the per-user cache).
        algorithm: force one algorithm for every call (tests, benchmarks); it must be usable.
        check_sizes: exchange and compare a header on the torch path (an extra tiny collective).

    Construction and every call are collective: all ranks of the group must make the same calls
    in the same order with the same shapes.

    Example:
        >>> comm = FusedAllReduce(hidden_size=7168, dtype=torch.bfloat16)
        >>> out, residual = comm.all_reduce_add_rmsnorm(partial, residual, norm_weight, 1e-6)
        >>> comm.algorithm_for(1), comm.algorithm_for(1).reason
        >>> comm.close()
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        max_tokens: int = 2048,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        device: Optional[torch.device] = None,
        timeout_s: float = 30.0,
        tuning_path: Optional[str] = None,
        algorithm: Optional[str] = None,
        check_sizes: bool = True,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("FusedAllReduce needs torch.distributed initialised (init_process_group)")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of float16, bfloat16, float32, got {dtype}")
        if not 1 <= int(hidden_size) <= MAX_HIDDEN:
            raise ValueError(f"hidden_size must be in [1, {MAX_HIDDEN}], got {hidden_size}")
        if int(max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if algorithm is not None and algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS} or None, got {algorithm!r}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.group = group
        self.device = torch.device(device)
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self.max_tokens = int(max_tokens)
        self.timeout_s = float(timeout_s)
        self.check_sizes = bool(check_sizes)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group)).lower()
        if self.device.type == "cpu" and "gloo" not in self.backend:
            raise ValueError(f"CPU tensors need a gloo process group, this group's backend is {self.backend}")
        self._stage_via_cpu = self.device.type == "cuda" and "nccl" not in self.backend
        self._seq = 0
        self._algo = "construction"
        self._broken: Optional[str] = None
        self._closed = False
        self._scratch: Optional[torch.Tensor] = None
        self._ipc = None
        self._limits: dict[str, int] = {}

        self._fingerprint = selection.machine_fingerprint(self.device)
        self._tuning_path = selection.tuning_path(tuning_path)
        self._table = selection.load_table(self._tuning_path, self._fingerprint, self.world_size)
        self._check_config_agrees(algorithm)
        self.available = self._setup_cuda_algorithms()
        if algorithm is not None and self.available[algorithm] is not None:
            raise RuntimeError(f"algorithm={algorithm!r} is not usable here: {self.available[algorithm]}")
        self._forced = algorithm

    # ------------------------------------------------------------------ public API
    def algorithm_for(self, num_tokens: int) -> AlgorithmChoice:
        """The algorithm a call with num_tokens rows uses; ``.reason`` explains the choice."""
        if not 0 <= int(num_tokens) <= self.max_tokens:
            raise ValueError(f"num_tokens must be in [0, max_tokens={self.max_tokens}], got {num_tokens}")
        nbytes = int(num_tokens) * self.hidden_size * self.dtype.itemsize
        if self._forced is not None:
            limit = self._limits.get(self._forced)
            if limit is not None and nbytes > limit:
                raise ValueError(f"algorithm={self._forced!r} takes messages up to {limit} B; "
                                 f"{num_tokens} tokens are {nbytes} B")
            return AlgorithmChoice(self._forced, f"{nbytes} B: forced with algorithm={self._forced!r}")
        return selection.choose(nbytes, self.world_size, self.available, self._table, self._limits)

    def all_reduce(self, x: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The sum of x over the group's ranks, in x's dtype ([tokens, hidden], contiguous)."""
        self._check_x(x)
        given = out is not None
        out = self._out(out, "out", x, x.dtype)
        if given:  # out may be x (in place), not partly overlap it
            _check_no_partial_overlap(out, "out", {"x": x}, may_equal=True)
        algo = self._begin(x, "all_reduce")
        if algo == "torch":
            out.copy_(x)
            self._torch_all_reduce(out)
        else:
            self._run_ipc(algo, x, out=out)
        return out

    def all_reduce_add_rmsnorm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float = 1e-6,
        *,
        out_scale: Optional[float] = None,
        out: Optional[torch.Tensor] = None,
        residual_out: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, residual_out) = fused_add_rmsnorm(all_reduce(x), residual, weight, eps).

        residual and weight must be the same on every rank (as in tensor parallelism); then every
        rank gets the same residual_out. out_scale: fp8 e4m3 ``out`` holding normed / out_scale
        (see spec_kernels.fused_add_rmsnorm). out / residual_out: optional preallocated outputs;
        residual_out may be residual and out may be x (in place).
        """
        self._check_x(x)
        check_norm_args(x, residual, weight, eps, out_scale)
        given = out is not None or residual_out is not None
        out = self._out(out, "out", x, torch.float8_e4m3fn if out_scale is not None else x.dtype)
        residual_out = self._out(residual_out, "residual_out", x, x.dtype)
        if given:  # the aliasing fused_add_rmsnorm allows (checked here for the CUDA paths too)
            inputs = {"x": x, "residual": residual}
            _check_no_partial_overlap(out, "out", inputs, may_equal=True)
            _check_no_partial_overlap(residual_out, "residual_out", inputs, may_equal=True)
            _check_no_partial_overlap(residual_out, "residual_out", {"out": out, "weight": weight}, may_equal=False)
            _check_no_partial_overlap(out, "out", {"weight": weight}, may_equal=False)
        algo = self._begin(x, "all_reduce_add_rmsnorm")
        if algo == "torch":
            summed = self._scratch_rows(x.shape[0])
            summed.copy_(x)
            self._torch_all_reduce(summed)
            fused_add_rmsnorm(summed, residual, weight, eps, out=out, residual_out=residual_out,
                              out_scale=out_scale)
        else:
            self._run_ipc(algo, x, out=out, residual=residual, weight=weight, eps=float(eps),
                         residual_out=residual_out, out_scale=out_scale)
        return out, residual_out

    def synchronize(self) -> None:
        """Wait for this rank's queued calls and raise if any of them failed (CUDA paths)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._raise_device_errors()

    def check_device_errors(self) -> None:
        """Raise the RuntimeError (rank, algorithm, device call number) of a failure that a CUDA
        kernel of this communicator has reported, or of an earlier failure; else return.

        Reads host memory only: no device sync, no CUDA call, so it may run while a CUDA graph is
        captured or between replays. Calls captured in a graph never run the per-call checks on
        the host; call this once per step (the SGLang integration does, before every forward and
        graph replay). A failure shows here once the kernel that failed has run; until then, and
        for every call after it, the kernels write NaN into their outputs."""
        if self._broken is not None:
            raise RuntimeError(f"FusedAllReduce is unusable after an earlier failure: {self._broken}")
        self._raise_device_errors()

    def reset(self, timeout_s: Optional[float] = None) -> None:
        """Recover after a failure (a kernel's timeout or mismatch report, a failed launch, a
        header mismatch on the torch path) without re-creating the IPC mappings. Collective:
        every rank of the group calls it, also the ranks that saw no error.

        1. wait for this rank's queued kernels: they all end, since every wait gives up after
           timeout_s and calls after a failure return at once;
        2. a barrier (an all_gather that also checks that every rank is resetting): past it no
           kernel of any rank touches any buffer;
        3. re-initialise this rank's IPC buffer in place (ipc.IpcBuffers.reset) and clear its
           error word;
        4. a second barrier: no rank calls again before every buffer is re-armed;
        5. clear the failure; call numbering (``seq``, the kernels' call counters) restarts at 0.

        Buffers, mappings and the error word keep their addresses, so CUDA graphs that captured
        calls of this communicator replay correctly afterwards. timeout_s bounds each barrier
        (default twice the communicator's: a rank whose own kernels are still timing out arrives
        late). If a barrier fails the communicator stays unusable and reset may be called again.
        On the torch path the process group itself must still work: after a gloo collective
        timed out, the ranks' collectives may be out of step (the barrier then raises); an NCCL
        communicator aborted by its watchdog cannot be recovered here.

        Raises:
            RuntimeError if the communicator is closed, or a barrier failed or found a rank that
            is not resetting.
        """
        if self._closed:
            raise RuntimeError("FusedAllReduce is closed")
        wait = 2 * self.timeout_s if timeout_s is None else float(timeout_s)
        if not wait > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._algo, self._broken = "reset", None
        for step in ("before", "after"):
            if step == "after" and self._ipc is not None:
                self._ipc.reset()
            rows = self._all_gather_ints([_MAGIC, _RESET], f"the reset barrier ({step} the buffers)", wait)
            if any(r != [_MAGIC, _RESET] for r in rows):
                self._fail("reset: the ranks are out of step (a rank is not resetting, or the process group's "
                           "collectives no longer pair up); recreate the group and the communicator:\n" +
                           "\n".join(f"  rank {i}: {r}" for i, r in enumerate(rows)))
        self._seq = 0

    def close(self) -> None:
        """Release the registered buffers. Idempotent; later calls raise. Not collective, but on
        the CUDA paths peers may still read this rank's buffers until they are done: close after
        the last call has completed everywhere (e.g. after a barrier)."""
        if self._closed:
            return
        self._closed = True
        self._scratch = None
        if self._ipc is not None:
            self._ipc.close()
            self._ipc = None

    def __enter__(self) -> "FusedAllReduce":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def seq(self) -> int:
        """Number of calls made so far (the sequence number of the last call)."""
        return self._seq

    def __repr__(self) -> str:
        usable = [a for a, why in self.available.items() if why is None]
        return (f"FusedAllReduce(rank={self.rank}/{self.world_size}, backend={self.backend}, device={self.device}, "
                f"hidden={self.hidden_size}, dtype={self.dtype}, max_tokens={self.max_tokens}, usable={usable})")

    # ------------------------------------------------------------------ errors
    def _error(self, msg: str, algorithm: Optional[str] = None) -> RuntimeError:
        return RuntimeError(f"FusedAllReduce rank {self.rank} of {self.world_size} "
                            f"(algorithm {(algorithm or self._algo)!r}, call #{self._seq}): {msg}")

    def _fail(self, msg: str, cause: Optional[BaseException] = None, algorithm: Optional[str] = None):
        err = self._error(msg, algorithm)
        self._broken = str(err)
        raise err from cause

    def _raise_device_errors(self) -> None:
        """A kernel's report names the algorithm of the call that failed and its device call
        number (graph replays advance only that one)."""
        if self._ipc is not None:
            found = self._ipc.pending_error()
            if found is not None:
                algorithm, msg = found
                self._fail(msg, algorithm=algorithm)

    # ------------------------------------------------------------------ per call
    def _check_x(self, x: torch.Tensor) -> None:
        check_tensor(x, "x", dim=2, dtypes=(self.dtype,), device=self.device)
        if x.shape[1] != self.hidden_size:
            raise ValueError(f"x must have hidden_size={self.hidden_size} columns, got shape {tuple(x.shape)}")
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"x has {x.shape[0]} rows, more than max_tokens={self.max_tokens}")

    def _out(self, t: Optional[torch.Tensor], name: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if t is None:
            return torch.empty(x.shape, dtype=dtype, device=x.device)
        check_tensor(t, name, dim=2, dtypes=(dtype,), device=x.device)
        check_shape(t, name, tuple(x.shape), "like x")
        return t

    def _begin(self, x: torch.Tensor, op: str) -> str:
        """Start call #seq: refuse after a failure, pick the algorithm, compare headers."""
        if self._closed:
            raise RuntimeError("FusedAllReduce is closed")
        if self._broken is not None:
            raise RuntimeError(f"FusedAllReduce is unusable after an earlier failure: {self._broken}")
        self._raise_device_errors()
        self._seq += 1
        self._algo = str(self.algorithm_for(x.shape[0]))
        if self._algo == "torch" and self.check_sizes and not _capturing(self.device):
            header = [_MAGIC, self._seq, x.shape[0], x.shape[1], _DTYPES.index(x.dtype), _OPS.index(op)]
            rows = self._all_gather_ints(header, "the size check (header all_gather)")
            if any(r != rows[self.rank] for r in rows):
                self._fail("ranks disagree on the message; no data was exchanged:\n" +
                           "\n".join(f"  rank {i}: {_describe(r)}" for i, r in enumerate(rows)))
        return self._algo

    def _run_ipc(self, algo: str, x: torch.Tensor, **kwargs) -> None:
        """Launch the CUDA kernel. A launch that fails leaves this rank's device call counter one
        behind its peers', so later calls would pair with the peers' stale flags and data: the
        communicator must refuse further calls (the peers' kernels time out and report)."""
        try:
            self._ipc.run(algo, x, self._seq, **kwargs)
        except RuntimeError as exc:
            self._fail(f"launching the kernel failed: {exc}", exc)

    def _scratch_rows(self, rows: int) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty(self.max_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        return self._scratch[:rows]

    # ------------------------------------------------------------------ torch.distributed
    def _wait(self, work, what: str, timeout_s: Optional[float] = None) -> None:
        """Wait for a collective with the timeout (gloo); NCCL stays stream-ordered and relies on
        the process group's timeout, since a blocking wait would sync the host every call."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            if "nccl" in self.backend:
                work.wait()
            else:
                work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            self._fail(f"{what} did not complete within timeout_s={timeout_s:g} s; a peer rank is "
                       f"dead, stuck, or not making the same calls ({exc})", exc)

    def _torch_all_reduce(self, t: torch.Tensor) -> None:
        if t.numel() == 0:
            return
        host = t.cpu() if self._stage_via_cpu else t
        self._wait(dist.all_reduce(host, group=self.group, async_op=True), "all_reduce")
        if host is not t:
            t.copy_(host)

    def _all_gather_ints(self, values: list[int], what: str, timeout_s: Optional[float] = None) -> list[list[int]]:
        dev = torch.device("cuda", torch.cuda.current_device()) if "nccl" in self.backend else torch.device("cpu")
        mine = torch.tensor(values, dtype=torch.int64, device=dev)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._wait(dist.all_gather(everyone, mine, group=self.group, async_op=True), what, timeout_s)
        return torch.stack(everyone).tolist()

    # ------------------------------------------------------------------ construction
    def _check_config_agrees(self, algorithm: Optional[str]) -> None:
        digest = self._table.digest() if self._table is not None else 0
        forced = ALGORITHMS.index(algorithm) if algorithm is not None else -1
        mine = [_MAGIC, self.hidden_size, _DTYPES.index(self.dtype), self.max_tokens,
                int(self.device.type == "cuda"), digest, forced]
        rows = self._all_gather_ints(mine, "the configuration exchange")
        if any(r != rows[self.rank] for r in rows):
            fields = "magic, hidden_size, dtype, max_tokens, cuda, tuning table crc, forced algorithm"
            self._fail(f"ranks were constructed differently ({fields}):\n" +
                       "\n".join(f"  rank {i}: {r}" for i, r in enumerate(rows)))

    def _setup_cuda_algorithms(self) -> dict[str, Optional[str]]:
        """algorithm -> None if usable, else why not. The ranks agree at every step (each step
        ends in a collective every rank reaches), so all of them use the CUDA algorithms or none."""
        if self.device.type != "cuda":
            reason = f"needs CUDA tensors (device is {self.device})"
        else:
            from . import ipc, p2p_check

            reason = self._agree(ipc.unavailable_reason(self.device, self.world_size, self.hidden_size, self.dtype,
                                                         self.max_tokens),
                                 "unavailable")
            if reason is None:  # a driver's P2P claim is no proof: test the IPC path (same verdict on all ranks)
                reason = p2p_check.communicator_reason(self)
            if reason is None:
                try:
                    self._ipc = ipc.IpcBuffers(self)
                except Exception as exc:  # noqa: BLE001 - any failure means: use the fallback
                    reason = f"registering IPC buffers failed: {exc}"
                reason = self._agree(reason, "mapping the peers' IPC buffers failed")
            if reason is not None and self._ipc is not None:
                self._ipc.close()
                self._ipc = None
        if self._ipc is not None:
            self._limits = self._ipc.limits()
        return {**{a: reason for a in CUDA_ALGORITHMS}, "torch": None}

    def _agree(self, reason: Optional[str], what: str) -> Optional[str]:
        """This rank's reason, or a reason naming the other ranks for which it is not None."""
        ok = self._all_gather_ints([int(reason is None)], f"the agreement on the CUDA algorithms ({what})")
        bad = [r for r, (flag,) in enumerate(ok) if not flag]
        if reason is None and bad:
            return f"{what} on rank(s) {bad}"
        return reason


def _describe(h: list[int]) -> str:
    if h[0] != _MAGIC:
        return f"an unknown header {h} (not a FusedAllReduce call)"
    op = _OPS[h[5]] if 0 <= h[5] < len(_OPS) else f"op#{h[5]}"
    return f"call #{h[1]} {op} of {h[2]} x {h[3]} {_dtype_name(h[4])}"


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
