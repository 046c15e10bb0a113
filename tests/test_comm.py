"""FusedAllReduce on CPU: 2 and 4 spawned processes on gloo (127.0.0.1), checked against a plain
reference (sum over ranks, then the reference add + RMSNorm); the size-mismatch, timeout and
configuration checks; the selection rule and the tuning file; `python -m spec_kernels.comm.tune`
and `.topo` on this machine. GPU tests (marked) spawn ranks on one GPU and check every CUDA
algorithm.

Worker functions run in the spawned ranks (spec_kernels.comm.launch); each returns something
picklable or raises, and run_ranks fails the test with the ranks' tracebacks.
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from spec_kernels.comm import launch, selection
from spec_kernels.comm.selection import ALGORITHMS, choose, thresholds_from_winners

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_GPU = torch.cuda.is_available()


# Ranks use the reference norm on CPU like a real CPU deployment, not the Triton interpreter
# that tests/conftest.py enables for this process; up to 4 ranks share 2 cores.
RANK_ENV = {"TRITON_INTERPRET": None}


def run_ranks(world, fn, *args, backend="gloo", timeout=120.0):
    return launch.run_ranks(world, fn, *args, backend=backend, timeout=timeout, env=RANK_ENV, threads=1)


# --------------------------------------------------------------------------- data + reference
def pattern(tokens, hidden, seed, dtype, device="cpu"):
    """Cheap deterministic pseudo-random values in [-3, 3): a permutation of 2039 levels, tiled
    (randn of 2048 x 7168 per rank is too slow with 4 ranks on 2 cores)."""
    period = ((torch.arange(2039) * 1021 + seed * 977 + 123) % 2039).float() * (6.0 / 2039) - 3.0
    n = tokens * hidden
    return period.repeat(n // 2039 + 1)[:n].view(tokens, hidden).to(device, dtype)


def reference(world, tokens, hidden, dtype, eps=1e-6, out_scale=None):
    """What every rank must get: sum over ranks (fp32, rounded once), then add + RMSNorm."""
    from spec_kernels.norm.reference import fused_add_rmsnorm

    summed = sum(pattern(tokens, hidden, r, dtype).float() for r in range(world)).to(dtype)
    residual, weight = pattern(tokens, hidden, 1000, dtype), 1 + 0.1 * pattern(1, hidden, 1001, dtype)[0]
    out = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn if out_scale else dtype)
    res = torch.empty(tokens, hidden, dtype=dtype)
    fused_add_rmsnorm(summed, residual, weight, eps, out, res, out_scale)
    return summed, out, res, residual, weight


# gloo/NCCL may round partial sums in bf16: allow a few ulps of the summands' scale.
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=0.1, rtol=0.03)}
FP8_TOL = dict(atol=0.05, rtol=0.13)  # dequantised: the bf16 tolerance plus one e4m3 step


def _checksum(*tensors):
    return [float(t.double().sum()) for t in tensors]


# --------------------------------------------------------------------------- rank workers
def _correctness_worker(rank, world, cases, device, algorithm):
    from spec_kernels.comm import FusedAllReduce

    sums = []
    for dtype, hidden, token_counts in cases:
        comm = FusedAllReduce(max_tokens=max(token_counts), hidden_size=hidden, dtype=dtype, device=device,
                              timeout_s=60, algorithm=algorithm)
        limit = comm._limits.get(algorithm, float("inf"))  # the push path takes small messages only
        for tokens in [t for t in token_counts if t * hidden * dtype.itemsize <= limit]:
            summed, want_out, want_res, residual, weight = reference(world, tokens, hidden, dtype)
            x = pattern(tokens, hidden, rank, dtype, device)
            y = comm.all_reduce(x)
            case = f"{tokens}x{hidden} {dtype}"
            torch.testing.assert_close(y.cpu(), summed, **TOL[dtype], msg=lambda m: f"all_reduce {case}: {m}")
            out, res = comm.all_reduce_add_rmsnorm(x, residual.to(device), weight.to(device), 1e-6)
            torch.testing.assert_close(res.cpu(), want_res, **TOL[dtype], msg=lambda m: f"residual_out {case}: {m}")
            torch.testing.assert_close(out.cpu(), want_out, **TOL[dtype], msg=lambda m: f"out {case}: {m}")
            sums.append(_checksum(y, out, res))
        if dtype == torch.bfloat16:  # fp8 output, and in-place outputs
            tokens = token_counts[0]
            _, want8, want_res, residual, weight = reference(world, tokens, hidden, dtype, out_scale=0.01)
            x = pattern(tokens, hidden, rank, dtype, device)
            res = residual.to(device)
            out8, res2 = comm.all_reduce_add_rmsnorm(x, res, weight.to(device), out_scale=0.01, residual_out=res)
            assert out8.dtype == torch.float8_e4m3fn and res2 is res
            torch.testing.assert_close(out8.cpu().float() * 0.01, want8.float() * 0.01, **FP8_TOL)
            torch.testing.assert_close(res.cpu(), want_res, **TOL[dtype])
        torch.distributed.barrier()  # peers may still read this rank's buffers (close() is not collective)
        comm.close()
    return sums


# (dtype, hidden, token counts): one 2048-token message per world size keeps the file < 2 min.
CPU_CASES = {
    2: [(torch.float32, 4096, [1, 7, 64]), (torch.bfloat16, 7168, [1, 16, 2048]),
        (torch.bfloat16, 4096, [3]), (torch.float32, 7168, [5])],
    4: [(torch.bfloat16, 4096, [1, 16]), (torch.float32, 7168, [1, 64]),
        (torch.float32, 4096, [2, 2048]), (torch.bfloat16, 7168, [9])],
}


@pytest.mark.parametrize("world", [2, 4])
def test_cpu_matches_reference(world):
    sums = run_ranks(world, _correctness_worker, CPU_CASES[world], "cpu", None)
    assert all(s == sums[0] for s in sums), "ranks got different results"


def _mismatch_worker(rank, world, tuning_file):
    from spec_kernels.comm import FusedAllReduce

    def make(hidden=64, tuning_path=None):
        return FusedAllReduce(max_tokens=8, hidden_size=hidden, dtype=torch.float32, device="cpu", timeout_s=30,
                              tuning_path=tuning_path)

    def attempt(fn):
        try:
            fn()
            return "no error"
        except (RuntimeError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"

    ones, w = torch.ones(4, 64), torch.ones(64)
    errors = [attempt(lambda: make(hidden=64 + 64 * (rank == 1)))]  # construction disagrees
    comm = make()
    comm.all_reduce(ones)  # call #1 agrees
    errors.append(attempt(lambda: comm.all_reduce(torch.ones(4 + (rank == 1), 64))))  # rows differ
    errors.append(attempt(lambda: comm.all_reduce(ones)))  # refused from now on
    comm = make()
    op = (lambda: comm.all_reduce(ones)) if rank == 0 else (lambda: comm.all_reduce_add_rmsnorm(ones, ones, w))
    errors.append(attempt(op))  # operations differ
    comm = make()
    comm._seq += rank  # as if rank 1 had made one call more
    errors.append(attempt(lambda: comm.all_reduce(ones)))
    errors.append(attempt(lambda: make(tuning_path=tuning_file if rank == 0 else None)))  # table on rank 0 only
    comm = make(tuning_path=tuning_file)
    errors.append(attempt(lambda: comm.all_reduce(ones)))  # agrees again
    errors.append(comm.algorithm_for(4).reason)
    # Argument errors are raised locally, before the group is involved.
    for bad in (torch.ones(9, 64), torch.ones(4, 65), torch.ones(4, 64, dtype=torch.bfloat16)):
        errors.append(attempt(lambda: comm.all_reduce(bad)))
    return errors


def test_cpu_size_mismatch_fails_loudly_on_every_rank(tmp_path):
    tuning = tmp_path / "tuning.json"
    selection.save_table(tuning, selection.machine_fingerprint(torch.device("cpu")), 2, [(100, "oneshot_push"),
                                                                                         (None, "torch")])
    results = run_ranks(2, _mismatch_worker, str(tuning))
    for rank, errors in enumerate(results):
        construct, rows, refused, op, seq, table, fine, reason, too_many, hidden, dtype = errors
        head = f"RuntimeError: FusedAllReduce rank {rank} of 2 "
        assert construct.startswith(head + "(algorithm 'construction', call #0): ranks were constructed differently")
        assert "rank 1: [1397769547, 128," in construct
        assert rows.startswith(head + "(algorithm 'torch', call #2): ranks disagree on the message")
        assert "rank 0: call #2 all_reduce of 4 x 64 float32" in rows
        assert "rank 1: call #2 all_reduce of 5 x 64 float32" in rows
        assert "unusable after an earlier failure" in refused
        assert "rank 1: call #1 all_reduce_add_rmsnorm of 4 x 64 float32" in op
        assert "rank 0: call #1 all_reduce of" in seq and "rank 1: call #2 all_reduce of" in seq
        assert "ranks were constructed differently" in table and "tuning table crc" in table
        assert fine == "no error"
        assert "1024 B: tuned threshold no upper bound -> torch" in reason
        assert too_many == "ValueError: x has 9 rows, more than max_tokens=8"
        assert "hidden_size=64 columns" in hidden and "x must have dtype float32" in dtype


def _timeout_worker(rank, world, timeout_s):
    from spec_kernels.comm import FusedAllReduce

    comm = FusedAllReduce(max_tokens=4, hidden_size=32, dtype=torch.bfloat16, device="cpu", timeout_s=timeout_s)
    x = torch.ones(2, 32, dtype=torch.bfloat16)
    comm.all_reduce(x)
    if rank != 0:
        time.sleep(timeout_s + 2)  # alive, but never makes call #2
        return None
    start = time.monotonic()
    try:
        comm.all_reduce(x)
        return "no error"
    except RuntimeError as exc:
        first, elapsed = str(exc), time.monotonic() - start
    try:
        comm.all_reduce(x)
        return "no error on the broken communicator"
    except RuntimeError as exc:
        second = str(exc)
    return first, elapsed, second


def test_cpu_timeout_raises_instead_of_hanging():
    results = run_ranks(2, _timeout_worker, 2.0)
    first, elapsed, second = results[0]
    assert "FusedAllReduce rank 0 of 2 (algorithm 'torch', call #2)" in first
    assert "did not complete within timeout_s=2 s" in first
    assert 1.5 < elapsed < 10, elapsed
    assert "unusable after an earlier failure" in second and "call #2" in second


def _reset_worker(rank, world):
    from spec_kernels.comm import FusedAllReduce

    comm = FusedAllReduce(max_tokens=4, hidden_size=32, dtype=torch.float32, device="cpu", timeout_s=20)
    try:
        comm.all_reduce(torch.ones(3 + rank, 32))  # rows differ: refused on every rank
        return "no error"
    except RuntimeError as exc:
        first = str(exc)
    try:
        comm.all_reduce(torch.ones(2, 32))
        refused = "no error on the broken communicator"
    except RuntimeError as exc:
        refused = str(exc)
    comm.reset()
    y = comm.all_reduce(pattern(2, 32, rank, torch.float32))
    want = sum(pattern(2, 32, r, torch.float32) for r in range(world))
    return first, refused, comm.seq, bool(torch.allclose(y, want, **TOL[torch.float32]))


def test_cpu_reset_recovers_after_a_refused_call():
    for rank, (first, refused, seq, ok) in enumerate(run_ranks(2, _reset_worker)):
        assert "ranks disagree on the message" in first and "unusable after an earlier failure" in refused
        assert seq == 1 and ok, f"rank {rank}: after reset(), call #{seq} gave a wrong sum"


# --------------------------------------------------------------------------- selection, tuning
def test_cost_model_defaults():
    cuda_ok = {a: None for a in ALGORITHMS}
    one_token_tp8 = 7168 * 2
    # one decode token: the one-block push (no per-block handshakes); a few tokens: the full grid
    assert choose(one_token_tp8, 8, cuda_ok, None) == "oneshot_push_1block"
    assert choose(4 * one_token_tp8, 2, cuda_ok, None) == "oneshot_push_1block"
    assert choose(4 * one_token_tp8, 8, cuda_ok, None) != "oneshot_push_1block"
    assert choose(64 * one_token_tp8, 8, cuda_ok, None) == "twoshot"
    assert choose(2048 * one_token_tp8, 2, cuda_ok, None) == "oneshot_push"  # equal bytes at TP2
    small_push = {"oneshot_push": 1 << 20, "oneshot_push_1block": 1 << 20}
    c = choose(2048 * one_token_tp8, 2, cuda_ok, None, max_bytes=small_push)
    assert c == "oneshot_pull" and "oneshot_push_1block, oneshot_push: takes messages up to 1048576 B" in c.reason
    c = choose(one_token_tp8, 8, cuda_ok, None)
    assert "untuned" in c.reason and "cost model" in c.reason and "oneshot_push_1block 8.0 us" in c.reason
    only_torch = {a: ("needs CUDA tensors" if a != "torch" else None) for a in ALGORITHMS}
    c = choose(100, 2, only_torch, None)
    assert c == "torch" and "the only usable algorithm" in c.reason and "needs CUDA tensors" in c.reason
    assert isinstance(c, str) and c.upper() == "TORCH"


def test_tuned_table_and_file(tmp_path):
    path = tmp_path / "tuning.json"
    fp = selection.machine_fingerprint(torch.device("cpu"))
    thresholds = thresholds_from_winners([(1000, "oneshot_push"), (4000, "oneshot_push"), (16000, "twoshot"),
                                          (64000, "torch")])
    assert thresholds == ((8000, "oneshot_push"), (32000, "twoshot"), (None, "torch"))
    selection.save_table(path, fp, 8, thresholds, dtype="bfloat16")
    selection.save_table(path, fp, 2, [(None, "torch")])
    assert set(json.loads(path.read_text())["machines"][fp]) == {"2", "8"}
    table = selection.load_table(path, fp, 8)
    assert selection.load_table(path, "other-host|cpu", 8) is None
    cuda_ok = {a: None for a in ALGORITHMS}
    c = choose(8000, 8, cuda_ok, table)
    assert c == "oneshot_push" and "tuned threshold <= 8000 B" in c.reason
    assert choose(8001, 8, cuda_ok, table) == "twoshot"
    assert choose(10 ** 9, 8, cuda_ok, table) == "torch"
    no_push = {**cuda_ok, "oneshot_push": "P2P writes unavailable"}
    c = choose(100, 8, no_push, table)
    assert c != "oneshot_push"
    assert "tuned choice 'oneshot_push' is unavailable here (P2P writes unavailable)" in c.reason
    path.write_text(json.dumps({"format": selection.FORMAT, "machines": {fp: {"8": {"thresholds": [
        {"max_bytes": 10, "algorithm": "magic"}]}}}}))
    with pytest.raises(ValueError, match="algorithm='magic' is not one of"):
        selection.load_table(path, fp, 8)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        selection.load_table(path, fp, 8)
    assert selection.tuning_path(None) == selection.tuning_path(os.environ.get(selection.TUNING_ENV))


def _run_module(*args, env=None, timeout=120):
    env = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)


def test_tune_cli_writes_a_table_the_communicator_uses(tmp_path):
    path = tmp_path / "tuning.json"
    proc = _run_module("spec_kernels.comm.tune", "--world-sizes", "2", "--hidden", "512", "--tokens", "1,64",
                       "--iters", "3", "--out", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(path.read_text())
    entry = data["machines"][selection.machine_fingerprint(torch.device("cpu"))]["2"]
    assert entry["thresholds"] == [{"max_bytes": None, "algorithm": "torch"}]
    assert [m["tokens"] for m in entry["measurements"]] == [1, 64]
    assert "torch" in entry["measurements"][0]["us"]
    assert "world size 2" in proc.stdout
    assert proc.stdout.splitlines()[1].startswith("expected duration: about ")  # up front, before any rank runs
    assert "world size 2: 100%" in proc.stderr and "2/2" in proc.stderr  # the progress bar: 1 algorithm x 2 sizes
    table = selection.load_table(path, selection.machine_fingerprint(torch.device("cpu")), 2)
    assert "tuned threshold no upper bound -> torch" in choose(4096, 2, {"torch": None}, table).reason


def test_tune_and_topo_options_all_have_help_and_tune_estimates_its_duration():
    from spec_kernels.comm import topo, tune

    for module in (tune, topo):
        options = [a for a in module.parser()._actions if a.option_strings]
        assert options and all(a.help for a in options), [a.dest for a in options if not a.help]
    est = lambda device, worlds, iters: tune.estimate_seconds(device, worlds, 7168, "bfloat16",  # noqa: E731
                                                              list(tune.DEFAULT_TOKENS), iters, 5)
    assert 0 < est("cuda", [2], 10) < est("cuda", [2], 50) < est("cuda", [2, 4, 8], 50)
    assert est("cpu", [2], 50) < est("cpu", [4], 50)  # CPU ranks share the cores


def test_topo_cli_without_gpus():
    if HAS_GPU:
        pytest.skip("this machine has GPUs; test_gpu_topo_cli covers it")
    proc = _run_module("spec_kernels.comm.topo", env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("no CUDA GPU visible (CUDA_VISIBLE_DEVICES is empty)")
    proc = _run_module("spec_kernels.comm.topo", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["gpus"] == [] and report["reason"].startswith("no CUDA GPU visible (")


def test_topo_reason_for_an_empty_report():
    from spec_kernels.comm import topo

    assert "one CUDA GPU visible: no GPU pairs" in topo.empty_reason(1)
    assert topo.empty_reason(2) is None and topo.empty_reason(8) is None
    assert topo.empty_reason(0).startswith("no CUDA GPU visible (")
    one = {"gpus": [{"index": 0, "name": "G", "sm": "90", "memory_GiB": 141, "pci": None, "numa_node": None}],
           "pairs": [], "notes": [], "reason": topo.empty_reason(1)}
    assert topo.format_report(one).splitlines()[-1] == topo.empty_reason(1)


# --------------------------------------------------------------------------- GPU
GPU_CASES = [(torch.bfloat16, 7168, [1, 4, 16, 64, 256]), (torch.float16, 2048, [5, 2048])]


def _cuda_algorithm_or_skip(algorithm, world):
    if algorithm != "torch":
        from spec_kernels.comm import ipc

        why = ipc.unavailable_reason(torch.device("cuda", 0), world, 7168, torch.bfloat16)
        if why is not None:
            pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("algorithm", ["oneshot_push_1block", "oneshot_push", "oneshot_pull", "twoshot", "torch"])
def test_gpu_ranks_on_one_gpu(world, algorithm):
    """Ranks share GPU 0 through CUDA IPC (a gloo group carries the control plane)."""
    _cuda_algorithm_or_skip(algorithm, world)
    cases = GPU_CASES + ([(torch.float32, 4096, [1, 3])] if algorithm == "torch" else [])
    sums = run_ranks(world, _correctness_worker, cases, "cuda", algorithm)
    assert all(s == sums[0] for s in sums), "ranks got different results"


def _gpu_safety_worker(rank, world, algorithm):
    from spec_kernels.comm import FusedAllReduce

    def attempt(fn):
        try:
            fn()
            return "no error"
        except RuntimeError as exc:
            return str(exc)

    dev = torch.device("cuda", torch.cuda.current_device())
    make = lambda: FusedAllReduce(max_tokens=8, hidden_size=1024, dtype=torch.bfloat16, device=dev,  # noqa: E731
                                  timeout_s=3, algorithm=algorithm)
    comm = make()
    x = torch.ones(4, 1024, dtype=torch.bfloat16, device=dev)
    comm.all_reduce(x)
    comm.synchronize()
    mismatch = attempt(lambda: (comm.all_reduce(x[: 3 + rank]), comm.synchronize()))
    comm = make()
    if rank == 1:
        time.sleep(6)  # never makes the call: rank 0's kernel must give up after 3 s
        return mismatch, None
    start = time.monotonic()
    timeout = attempt(lambda: (comm.all_reduce(x), comm.synchronize()))
    return mismatch, (timeout, time.monotonic() - start)


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["oneshot_push_1block", "oneshot_push", "oneshot_pull", "twoshot"])
def test_gpu_kernels_report_mismatch_and_timeout(algorithm):
    _cuda_algorithm_or_skip(algorithm, 2)
    results = run_ranks(2, _gpu_safety_worker, algorithm)
    for rank, (mismatch, _) in enumerate(results):
        assert f"FusedAllReduce rank {rank} of 2" in mismatch and "ranks disagree on the message" in mismatch
    timeout, elapsed = results[0][1]
    assert "waited more than timeout_s=3 s for rank 1" in timeout and elapsed < 30


def _gpu_graph_replay_worker(rank, world, algorithm):
    """Both ranks capture one fused call in a CUDA graph and replay it twice; then rank 1 stops.
    Rank 0's next replay times out: its outputs must be NaN and check_device_errors() (host
    memory, no sync) must raise, without any eager call in between. Then both ranks reset() and
    the same graph replays correctly (the buffers were re-armed in place)."""
    import torch.distributed as dist

    from spec_kernels.comm import FusedAllReduce

    dev = torch.device("cuda", torch.cuda.current_device())
    comm = FusedAllReduce(max_tokens=4, hidden_size=1024, dtype=torch.bfloat16, device=dev, timeout_s=3,
                          algorithm=algorithm)
    x = torch.full((1, 1024), 0.5, dtype=torch.bfloat16, device=dev)
    residual = torch.ones_like(x)
    weight = torch.ones(1024, dtype=torch.bfloat16, device=dev)
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    comm.all_reduce_add_rmsnorm(x, residual, weight, 1e-6, out=out, residual_out=res_out)  # warm-up
    comm.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        comm.all_reduce_add_rmsnorm(x, residual, weight, 1e-6, out=out, residual_out=res_out)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    good = bool(torch.isfinite(out).all()) and float(res_out[0, 0]) == 1.0 + 0.5 * world
    dist.barrier()
    poisoned = raised = None
    if rank == 1:
        time.sleep(6)
    else:
        graph.replay()  # rank 1 never comes
        torch.cuda.synchronize()
        poisoned = bool(torch.isnan(out).all()) and bool(torch.isnan(res_out).all())
        try:
            comm.check_device_errors()
            raised = "no error"
        except RuntimeError as exc:
            raised = str(exc)
    comm.reset(timeout_s=60)  # both ranks: the same graph replays correctly afterwards
    graph.replay()
    torch.cuda.synchronize()
    recovered = bool(torch.isfinite(out).all()) and float(res_out[0, 0]) == 1.0 + 0.5 * world
    return good and recovered, poisoned, raised


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["oneshot_push_1block", "oneshot_push", "twoshot"])
def test_gpu_graph_replay_after_a_timeout_is_poisoned_and_raised(algorithm):
    _cuda_algorithm_or_skip(algorithm, 2)
    results = run_ranks(2, _gpu_graph_replay_worker, algorithm)
    assert all(good for good, _, _ in results), "replays before the failure or after reset() gave wrong results"
    _, poisoned, raised = results[0]
    assert poisoned, "the timed-out replay left its outputs unpoisoned"
    assert "FusedAllReduce rank 0 of 2" in raised and "waited more than timeout_s=3 s for rank 1" in raised, raised


@pytest.mark.gpu
def test_gpu_topo_cli():
    from spec_kernels.comm import topo

    proc = _run_module("spec_kernels.comm.topo", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["gpus"] and all("numa_node" in g for g in report["gpus"])
    assert report["reason"] == topo.empty_reason(len(report["gpus"]))  # one GPU: says so; more: null
    world = max(len(report["gpus"]), 2)  # one GPU: two ranks share it
    assert len(report["probe"]) == world * (world - 1)
    assert all(e["self_test"] == "pass" and e["proved"] for e in report["probe"]), report["probe"]
    proc = _run_module("spec_kernels.comm.topo")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("P2P self-test: pass") == world * (world - 1), proc.stdout


def test_topo_shows_the_self_test_verdict_per_pair():
    from spec_kernels.comm import topo

    gpu = {"index": 0, "name": "G", "sm": "90", "memory_GiB": 141, "pci": None, "numa_node": None}
    passed = {"from_rank": 0, "to_rank": 1, "gpus": [0, 1], "self_test": "pass", "proved": True,
              "write_GBps": 20.0, "read_GBps": 50.0, "read_latency_us": 1.5, "slow_writes": True}
    failed = {"from_rank": 1, "to_rank": 0, "gpus": [1, 0], "proved": False, "slow_writes": False,
              "self_test": "FAIL (rank 1 reading rank 0's own data: nothing arrived (all words still zero))"}
    report = {"gpus": [gpu, {**gpu, "index": 1}], "pairs": [], "notes": [], "reason": None,
              "self_test_via": "the CUDA extension's IPC buffers", "probe": [passed, failed]}
    lines = topo.format_report(report).splitlines()
    assert "P2P self-test per ordered rank pair" in lines[3] and "the CUDA extension's IPC buffers" in lines[3]
    assert lines[4] == ("  rank 0 (GPU 0) -> rank 1 (GPU 1): P2P self-test: pass; write 20.0 GB/s, read 50.0 GB/s, "
                        "read latency 1.50 us  SLOW P2P WRITES")
    assert lines[5] == ("  rank 1 (GPU 1) -> rank 0 (GPU 0): P2P self-test: FAIL (rank 1 reading rank 0's own data: "
                        "nothing arrived (all words still zero))")
    assert topo.format_probe_entry({"from_rank": 0, "to_rank": 1, "gpus": [0, 0]}).endswith(
        "P2P self-test: FAIL (no result from the rank)")


NVIDIA_SMI_TOPO = """\
\x1b[4m\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tPIX\tNODE\tSYS\t0-31\t0\t\tN/A
GPU1\tPIX\t X \tNODE\tSYS\t0-31\t0\t\tN/A
GPU2\tNODE\tNODE\t X \tNV4\t0-31\t0\t\tN/A
GPU3\tSYS\tSYS\tNV4\t X \t32-63\t1\t\tN/A

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def test_topo_parsers(tmp_path):
    from spec_kernels.comm import topo

    links = topo.parse_nvidia_smi_topo(NVIDIA_SMI_TOPO)
    assert links[("GPU0", "GPU1")] == "PIX" and links[("GPU3", "GPU0")] == "SYS"
    assert links[("GPU2", "GPU3")] == "NV4" and ("GPU0", "GPU0") not in links and len(links) == 12
    # A fake sysfs: GPUs a, b below one switch; c on another root port; d on another root complex.
    devices = {
        "0000:3b:00.0": "pci0000:3a/0000:3a:00.0/0000:3b:00.0",  # switch upstream port (placeholder)
        "0000:3d:00.0": "pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:08.0/0000:3d:00.0",
        "0000:3e:00.0": "pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:10.0/0000:3e:00.0",
        "0000:5e:00.0": "pci0000:3a/0000:3a:02.0/0000:5e:00.0",
        "0000:af:00.0": "pci0000:ae/0000:ae:00.0/0000:af:00.0",
    }
    (tmp_path / "bus/pci/devices").mkdir(parents=True)
    for addr, rel in devices.items():
        (tmp_path / "devices" / rel).mkdir(parents=True, exist_ok=True)
        (tmp_path / "bus/pci/devices" / addr).symlink_to(tmp_path / "devices" / rel)
        (tmp_path / "devices" / rel / "numa_node").write_text("1\n" if addr.startswith("0000:af") else "0\n")
    path = {a: topo.pci_path(a, str(tmp_path)) for a in devices}
    assert path["0000:3d:00.0"][0] == "pci0000:3a" and path["0000:3d:00.0"][-1] == "0000:3d:00.0"
    assert topo.pcie_relation(path["0000:3d:00.0"], path["0000:3e:00.0"]) == "same PCIe switch"
    assert topo.pcie_relation(path["0000:3d:00.0"], path["0000:5e:00.0"]) == "same root complex, different root ports"
    assert topo.pcie_relation(path["0000:3d:00.0"], path["0000:af:00.0"]) == "different root complexes"
    assert topo.pcie_relation([], path["0000:af:00.0"]).startswith("unknown")
    assert topo.numa_node("0000:af:00.0", str(tmp_path)) == 1 and topo.numa_node("0000:00:00.0", str(tmp_path)) is None
    assert topo.pci_path("0000:00:00.0", str(tmp_path)) == []
