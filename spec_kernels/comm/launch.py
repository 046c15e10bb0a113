"""Run a function in N local processes joined by a torch.distributed group (127.0.0.1 only).

Used by `python -m spec_kernels.comm.tune`, the tests and the benchmarks. Each rank runs
``fn(rank, world, *args)``; the results come back by rank, or a RuntimeError carries every failed
rank's traceback. Ranks that outlive ``timeout`` are killed, so a deadlock fails instead of hanging.
"""
from __future__ import annotations

import os
import socket
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_local_group(rank: int, world: int, port: int, backend: str) -> None:
    """Join a group of `world` local processes. With CUDA, rank r uses GPU r % device_count
    (ranks share GPUs when there are fewer GPUs than ranks)."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _rank_main(rank, world, port, backend, fn, args, env, threads, results):
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if threads:
        torch.set_num_threads(threads)
    try:
        init_local_group(rank, world, port, backend)
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    # No process-group teardown: after a deliberate timeout a pending collective can block it.
    os._exit(0)


class Ranks:
    """Spawned ranks (see :func:`spawn_ranks`); :meth:`join` collects their results."""

    def __init__(self, world, fn, args, ranks, port, backend, env, threads):
        ctx = mp.get_context("spawn")
        self._results = ctx.SimpleQueue()  # put() writes synchronously: nothing is lost at os._exit
        self._procs = {r: ctx.Process(target=_rank_main, args=(r, world, port, backend, fn, args, env or {},
                                                                threads, self._results))
                       for r in ranks}
        for p in self._procs.values():
            p.start()

    def join(self, timeout: float) -> dict[int, Any]:
        """Wait up to `timeout` s; kill ranks still running; results by rank, or a RuntimeError
        carrying every problem (hung ranks, tracebacks, ranks that died without a result)."""
        deadline = time.monotonic() + timeout
        for p in self._procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in self._procs.items() if p.is_alive()]
        for r in hung:
            self._procs[r].kill()
            self._procs[r].join()
        out: dict[int, tuple[bool, Any]] = {}
        while not self._results.empty():
            rank, ok, value = self._results.get()
            out[rank] = (ok, value)
        problems = []
        if hung:
            problems.append(f"ranks {hung} did not finish within {timeout:g} s and were killed")
        problems += [f"--- rank {r} failed:\n{v}" for r, (ok, v) in sorted(out.items()) if not ok]
        missing = {r: p.exitcode for r, p in self._procs.items() if r not in out and r not in hung}
        if missing:
            problems.append(f"ranks {sorted(missing)} exited without a result (exit codes {missing})")
        if problems:
            raise RuntimeError("\n".join(problems))
        return {r: v for r, (ok, v) in out.items()}


def spawn_ranks(world: int, fn: Callable[..., Any], *args, ranks: Optional[range] = None,
                port: Optional[int] = None, backend: str = "gloo",
                env: Optional[dict[str, Optional[str]]] = None, threads: int = 0) -> Ranks:
    """Start fn(rank, world, *args) in one spawned process per rank of `ranks` (default all).
    The caller may be one of the other ranks: then it joins with init_local_group(rank, world,
    port, backend) itself. env: variables to set (None: unset) in the ranks before fn runs;
    threads: torch intra-op threads per rank (0: torch's default). fn must be importable."""
    return Ranks(world, fn, args, ranks if ranks is not None else range(world), port or free_port(), backend,
                 env, threads)


def run_ranks(world: int, fn: Callable[..., Any], *args, backend: str = "gloo", timeout: float = 300.0,
              env: Optional[dict[str, Optional[str]]] = None, threads: int = 0) -> list[Any]:
    """fn(rank, world, *args) in `world` spawned processes; returns the results by rank."""
    results = spawn_ranks(world, fn, *args, backend=backend, env=env, threads=threads).join(timeout)
    return [results[r] for r in range(world)]
