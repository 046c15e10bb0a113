"""`python -m spec_kernels.comm.tune`: measure every usable allreduce algorithm on this machine
and write the per-(world size, message bytes) thresholds to the tuning JSON.

For each world size it spawns that many local ranks (GPU r % device_count each; NCCL when every
rank has its own GPU, else gloo), times ``all_reduce_add_rmsnorm`` for each algorithm and token
count (the slowest rank's mean counts), and keeps the fastest algorithm per size. Ranks that
share a GPU, or CPU ranks, measure nothing about PCIe: such tables are still written (keyed by
this machine's fingerprint) so the pipeline can be exercised, and the output says so. It prints a
rough expected duration first, then a progress bar per world size (stderr).

Examples:
    python -m spec_kernels.comm.tune                                   # GPUs: world sizes 2/4/8 that fit
    python -m spec_kernels.comm.tune --world-sizes 8 --hidden 7168 --out /etc/spec_kernels/ar.json
    python -m spec_kernels.comm.tune --device cpu --world-sizes 2 --tokens 1,64 --iters 3
"""
from __future__ import annotations

import argparse
import datetime
import sys
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._extras import MissingExtraError, import_extra
from . import launch, selection

PROGRESS_BAR = "python -m spec_kernels.comm.tune's progress bar"

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# Measurements must not depend on an existing table: point the communicators at no file.
_NO_TABLE = "/nonexistent/spec_kernels_untuned.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Rough costs behind the up-front duration estimate (the progress bar then shows the real pace):
# seconds to start the ranks of one world size, seconds of set-up per (algorithm, token count),
# per-call latency and bandwidth, and how many algorithms are usually measured.
ESTIMATE = {"cuda": dict(start_s=30.0, setup_s=0.5, latency_s=30e-6, bytes_per_s=10e9, algorithms=4),
            "cpu": dict(start_s=20.0, setup_s=0.1, latency_s=20e-3, bytes_per_s=15e6, algorithms=1)}


def estimate_seconds(device_type: str, world_sizes: list[int], hidden: int, dtype_name: str, tokens: list[int],
                     iters: int, warmup: int) -> float:
    """A rough duration of the whole run (see ESTIMATE); CPU ranks share the cores, so CPU
    time grows with the world size."""
    e = ESTIMATE[device_type]
    itemsize = DTYPES[dtype_name].itemsize
    calls = sum((iters + warmup) * (e["latency_s"] + n * hidden * itemsize / e["bytes_per_s"]) for n in tokens)
    per_world = e["start_s"] + e["algorithms"] * (len(tokens) * e["setup_s"] + calls)
    return sum(per_world * (max(1.0, w / 2) if device_type == "cpu" else 1.0) for w in world_sizes)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _time_calls(comm, x, residual, weight, iters: int, warmup: int) -> float:
    """Mean microseconds per call on this rank, ranks started together by a barrier."""
    for _ in range(warmup):
        comm.all_reduce_add_rmsnorm(x, residual, weight)
    comm.synchronize()
    dist.barrier(group=comm.group)
    start = time.perf_counter()
    for _ in range(iters):
        comm.all_reduce_add_rmsnorm(x, residual, weight)
    comm.synchronize()
    return (time.perf_counter() - start) * 1e6 / iters


def _rank_worker(rank, world, device_type, hidden, dtype_name, tokens, iters, warmup, timeout_s, progress=None):
    """Times every usable algorithm at every token count; rank 0 reports progress to the parent
    on `progress` (("total", count), then ("done", algorithm, tokens) per measurement)."""
    from .fused_allreduce import FusedAllReduce

    dtype = DTYPES[dtype_name]
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    max_tokens = max(tokens)
    probe = FusedAllReduce(max_tokens=max_tokens, hidden_size=hidden, dtype=dtype, device=device,
                           timeout_s=timeout_s, tuning_path=_NO_TABLE)
    usable = [a for a, why in probe.available.items() if why is None]
    unavailable = {a: why for a, why in probe.available.items() if why is not None}
    probe.close()
    report = progress.put if progress is not None and rank == 0 else (lambda _msg: None)
    report(("total", len(usable) * len(tokens)))
    times: dict[str, list[float]] = {}
    for algo in usable:
        comm = FusedAllReduce(max_tokens=max_tokens, hidden_size=hidden, dtype=dtype, device=device,
                              timeout_s=timeout_s, algorithm=algo, tuning_path=_NO_TABLE)
        times[algo] = []
        for n in tokens:
            x = torch.randn(n, hidden, device=device).to(dtype)
            residual = torch.randn(n, hidden, device=device).to(dtype)
            weight = torch.ones(hidden, device=device, dtype=dtype)
            us = torch.tensor([_time_calls(comm, x, residual, weight, iters, warmup)], dtype=torch.float64,
                              device=device if "nccl" in str(dist.get_backend()) else "cpu")
            dist.all_reduce(us, op=dist.ReduceOp.MAX)  # the slowest rank decides
            times[algo].append(float(us))
            report(("done", algo, n))
        dist.barrier()
        comm.close()
    return {"usable": usable, "unavailable": unavailable, "times": times, "backend": str(dist.get_backend())}


def _run_with_progress(world: int, backend: str, timeout: float, args: tuple) -> dict:
    """_rank_worker in `world` ranks; a progress bar (stderr) follows rank 0's reports. Rank 0's result."""
    queue = mp.get_context("spawn").SimpleQueue()  # put() writes synchronously, as launch's results queue
    ranks = launch.spawn_ranks(world, _rank_worker, *args, queue, backend=backend)
    outcome: dict = {}

    def join():
        try:
            outcome["results"] = ranks.join(timeout)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            outcome["error"] = exc

    joiner = threading.Thread(target=join, daemon=True)
    joiner.start()
    tqdm = import_extra("tqdm", "bench", PROGRESS_BAR).tqdm
    with tqdm(desc=f"world size {world}", unit="size", file=sys.stderr, dynamic_ncols=True) as bar:
        bar.set_postfix_str("starting the ranks")
        while joiner.is_alive() or not queue.empty():
            if queue.empty():
                joiner.join(0.2)
                continue
            msg = queue.get()
            if msg[0] == "total":
                bar.total = msg[1]
                bar.set_postfix_str("measuring")
            else:
                bar.update(1)
                bar.set_postfix_str(f"last: {msg[1]}, {msg[2]} tokens")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["results"][0]


def tune_world_size(world: int, device_type: str, hidden: int, dtype_name: str, tokens: list[int],
                    iters: int, warmup: int, timeout_s: float) -> dict:
    """Measure one world size; returns the table entry (thresholds + measurements)."""
    own_gpus = device_type == "cuda" and torch.cuda.device_count() >= world
    backend = "nccl" if own_gpus else "gloo"
    res = _run_with_progress(world, backend, max(600.0, 20 * timeout_s),
                             (device_type, hidden, dtype_name, list(tokens), iters, warmup, timeout_s))
    itemsize = DTYPES[dtype_name].itemsize
    measurements, winners = [], []
    for i, n in enumerate(tokens):
        us = {a: round(res["times"][a][i], 2) for a in res["usable"]}
        nbytes = n * hidden * itemsize
        measurements.append({"tokens": n, "bytes": nbytes, "us": us})
        winners.append((nbytes, min(us, key=us.__getitem__)))
    note = None
    if device_type != "cuda":
        note = "CPU ranks on gloo: measures the fallback only, nothing about PCIe"
    elif not own_gpus:
        note = f"{world} ranks shared {torch.cuda.device_count()} GPU(s): nothing about PCIe was measured"
    return {
        "thresholds": selection.thresholds_from_winners(winners),
        "measurements": measurements,
        "dtype": dtype_name,
        "hidden_size": hidden,
        "iters": iters,
        "backend": res["backend"],
        "unavailable": res["unavailable"],
        "note": note,
        "tuned_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
    }


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m spec_kernels.comm.tune", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the ranks run (default: cuda when a GPU is visible, else cpu, which measures "
                         "only the torch.distributed fallback)")
    ap.add_argument("--world-sizes", type=_int_list, default=None,
                    help="comma-separated; default the sizes of 2/4/8 that have a GPU per rank, else 2")
    ap.add_argument("--hidden", type=int, default=7168, help="hidden size of the messages (default 7168)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="element type (default bfloat16)")
    ap.add_argument("--tokens", type=_int_list, default=list(DEFAULT_TOKENS),
                    help="comma-separated token counts to time, i.e. message sizes of tokens x hidden "
                         f"(default {','.join(map(str, DEFAULT_TOKENS))})")
    ap.add_argument("--iters", type=int, default=50, help="timed calls per algorithm and size (default 50)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls before them (default 5)")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds a rank waits for the others before it raises (the communicators' timeout_s; "
                         "default 60)")
    ap.add_argument("--out", default=None, help=f"tuning file (default ${selection.TUNING_ENV} or "
                                                f"{selection.DEFAULT_TUNING_PATH})")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:  # before any rank starts
        import_extra("tqdm", "bench", PROGRESS_BAR)
    except MissingExtraError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.world_sizes is None:
        n = torch.cuda.device_count() if args.device == "cuda" else 0
        args.world_sizes = [w for w in (2, 4, 8) if w <= n] or [2]
    tokens = sorted(set(args.tokens))
    path = selection.tuning_path(args.out)
    fingerprint = selection.machine_fingerprint(torch.device(args.device))
    print(f"tuning {fingerprint!r}: hidden {args.hidden} {args.dtype}, tokens {tokens}, -> {path}")
    expected = estimate_seconds(args.device, args.world_sizes, args.hidden, args.dtype, tokens, args.iters,
                                args.warmup)
    print(f"expected duration: about {_duration(expected)} for world sizes {args.world_sizes} (a rough estimate; "
          "the progress bar shows the real pace)", flush=True)
    started = time.monotonic()
    for world in args.world_sizes:
        entry = tune_world_size(world, args.device, args.hidden, args.dtype, tokens, args.iters, args.warmup,
                                args.timeout)
        selection.save_table(path, fingerprint, world, entry.pop("thresholds"), **entry)
        table = selection.load_table(path, fingerprint, world)
        print(f"\nworld size {world} ({entry['backend']}, {_duration(time.monotonic() - started)} so far)"
              f"{': ' + entry['note'] if entry['note'] else ''}")
        algos = sorted({a for m in entry["measurements"] for a in m["us"]})
        print(f"{'tokens':>7} {'bytes':>10} " + " ".join(f"{a:>13}" for a in algos) + "   fastest")
        for m in entry["measurements"]:
            fastest = min(m["us"], key=m["us"].__getitem__)
            cells = " ".join(f"{m['us'][a]:>10.1f} us" for a in algos)
            print(f"{m['tokens']:>7} {m['bytes']:>10} {cells}   {fastest}")
        for why_algo, why in entry["unavailable"].items():
            print(f"  not measured: {why_algo}: {why}")
        print("thresholds: " + ", ".join(f"<= {b} B: {a}" if b is not None else f"above: {a}"
                                         for b, a in table.thresholds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
