"""Allreduce + residual add + RMSNorm: fused vs unfused, and each allreduce algorithm vs NCCL.

    pytest benchmarks/test_allreduce_rmsnorm.py --benchmark-only                # preset by device
    SPEC_KERNELS_BENCH_PRESET=gpu pytest benchmarks/test_allreduce_rmsnorm.py --benchmark-only

GOAL (docs/design.md): on 8x RTX PRO 6000 Blackwell joined only by PCIe Gen5, tensor parallel 8,
one decode token of hidden 7168 bf16 (14 KB per rank) through allreduce + residual add + RMSNorm
in <= 8 us per layer, where NCCL alone takes 36-60 us. The physical floor is about 4-6 us
(~1 us launch inside a CUDA graph, 0.5-3 us P2P latency, 100 KB of ingress at 25-50 GB/s).

What is timed:

* ``test_add_rmsnorm`` (one process): ``fused`` = spec_kernels.fused_add_rmsnorm (each
  implementation that runs here) vs ``unfused`` = ``residual = x + residual`` then
  ``torch.nn.functional.rms_norm``, for [tokens, 7168].
* ``test_allreduce`` (this process is rank 0, the other ranks are spawned): for every usable
  algorithm of FusedAllReduce (``torch`` is NCCL when every rank has its own GPU, gloo
  otherwise), ``fused`` = ``all_reduce_add_rmsnorm`` vs ``unfused`` = ``all_reduce`` then the
  separate add + rms_norm above. Times are rank 0's, per call, eager (no CUDA graph: the other
  ranks would have to replay in lock step).

READ THIS BEFORE QUOTING A NUMBER: a measurement on ONE GPU (ranks sharing it through CUDA IPC,
control plane on gloo) says nothing about PCIe: no byte crosses a PCIe link, peers' "remote"
reads hit local HBM, and NCCL cannot run at all (one GPU per rank). It checks that the
algorithms run and what their synchronisation costs. CPU runs (gloo, the ``tiny`` preset) check
the harness only. PCIe numbers need several GPUs on PCIe (`extra_info["pcie"]` says which).

Sizes: preset ``tiny`` (CPU default): 1 and 16 tokens, world size 2. ``gpu-quick``: 1, 16, 256
tokens. ``gpu``: 1, 4, 16, 64, 256, 2048 tokens. World sizes: 2/4/8 where every rank gets its own
GPU, else 2 (sharing). Hidden 7168 always (DeepSeek-V3 / Kimi K2.5); dtype bf16 on GPU, the
preset's dtype on CPU.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import _timing
from spec_kernels.comm import FusedAllReduce, launch
from spec_kernels.norm import fused_add_rmsnorm
from spec_kernels.norm.api import FUSED_ADD_RMSNORM

HIDDEN = 7168
EPS = 1e-6
TOKENS = {"tiny": (1, 16), "gpu-quick": (1, 16, 256), "gpu": (1, 4, 16, 64, 256, 2048)}
CALLS_PER_ROUND = 8  # eager rounds of several calls, so the clock's sync is amortised
PRESET = _timing.active_preset()
DEVICE = _timing.bench_device()
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else getattr(torch, PRESET.dtype)
GPUS = torch.cuda.device_count() if DEVICE.type == "cuda" else 0
WORLD_SIZES = tuple(w for w in (2, 4, 8) if w <= GPUS) or (2,)


def unfused_add_rmsnorm(x, residual, weight):
    """What a server does without fusion: two separate passes over the rows."""
    residual = x + residual
    return F.rms_norm(residual, (x.shape[1],), weight, EPS), residual


def _inputs(tokens, device=DEVICE, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x, r = (torch.randn(tokens, HIDDEN, generator=g).to(device, DTYPE) for _ in range(2))
    w = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(device, DTYPE)
    return x, r, w


# --------------------------------------------------------------------------- one process
def _norm_impls():
    # On CPU only the reference: the Triton interpreter's times say nothing.
    usable = [i for i, why in FUSED_ADD_RMSNORM.explain(DEVICE).items() if why is None]
    return [i for i in usable if DEVICE.type == "cuda" or i == "reference"]


@pytest.mark.parametrize("tokens", TOKENS[PRESET.name])
@pytest.mark.parametrize("variant", ["fused:" + i for i in _norm_impls()] + ["unfused"])
def test_add_rmsnorm(benchmark, bench_results, variant, tokens):
    x, r, w = _inputs(tokens)
    out, res = torch.empty_like(x), torch.empty_like(x)
    if variant == "unfused":
        call = lambda: unfused_add_rmsnorm(x, r, w)  # noqa: E731
    else:
        impl = variant.split(":")[1]
        call = lambda: fused_add_rmsnorm(x, r, w, EPS, impl, out=out, residual_out=res)  # noqa: E731
    info = _timing.measure(benchmark, [call], DEVICE, PRESET.rounds)
    elt = x.element_size()
    _timing.record(benchmark, bench_results, nbytes=4 * tokens * HIDDEN * elt + HIDDEN * elt,
                   kind="add_rmsnorm", variant=variant, tokens=tokens, hidden=HIDDEN,
                   dtype=str(DTYPE).replace("torch.", ""), **info)


# --------------------------------------------------------------------------- several ranks
def _run_calls(comm, cmd, x, residual, weight):
    for _ in range(cmd["calls"]):
        if cmd["fused"]:
            comm.all_reduce_add_rmsnorm(x, residual, weight, EPS)
        else:
            unfused_add_rmsnorm(comm.all_reduce(x), residual, weight)
    comm.synchronize()


def _make_comm(cmd, device):
    return FusedAllReduce(max_tokens=max(cmd["tokens"], 1), hidden_size=HIDDEN, dtype=DTYPE, device=device,
                          timeout_s=120, algorithm=cmd["algorithm"])


def _probe(device):
    """What the group can run (construction is collective: every rank makes this one)."""
    comm = FusedAllReduce(max_tokens=1, hidden_size=HIDDEN, dtype=DTYPE, device=device)
    available = dict(comm.available)
    comm.close()
    return available


def _serve(rank, world):
    """The other ranks: mirror rank 0's calls, one command at a time, until told to stop."""
    device = DEVICE if DEVICE.type == "cpu" else torch.device("cuda", torch.cuda.current_device())
    _probe(device)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        cmd = box[0]
        if cmd is None:
            return None
        comm = _make_comm(cmd, device)
        x, r, w = _inputs(cmd["tokens"], device, seed=rank)
        _run_calls(comm, cmd, x, r, w)
        dist.barrier()
        comm.close()


class Group:
    """This process as rank 0 of `world` local ranks; the others run _serve."""

    def __init__(self, world):
        self.world = world
        self.own_gpus = GPUS >= world
        self.backend = "nccl" if self.own_gpus else "gloo"
        port = launch.free_port()
        # Ranks use the reference norm on CPU, not the interpreter benchmarks/conftest.py enables.
        self.helpers = launch.spawn_ranks(world, _serve, ranks=range(1, world), port=port, backend=self.backend,
                                          env={"TRITON_INTERPRET": None}, threads=1 if DEVICE.type == "cpu" else 0)
        launch.init_local_group(0, world, port, self.backend)
        self.device = DEVICE if DEVICE.type == "cpu" else torch.device("cuda", torch.cuda.current_device())
        self.available = _probe(self.device)

    def start(self, cmd) -> FusedAllReduce:
        """Tell the other ranks what to run; return this rank's communicator for it."""
        dist.broadcast_object_list([cmd], src=0)
        return _make_comm(cmd, self.device)

    def close(self):
        dist.broadcast_object_list([None], src=0)
        self.helpers.join(timeout=120)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def group_for():
    """group_for(world): the process group of that size (one at a time: torch.distributed has a
    single default group per process, so a new size closes the previous group)."""
    current: list[Group] = []
    saved = os.environ.pop("TRITON_INTERPRET", None)  # rank 0 too runs the norm's reference on CPU

    def get(world: int) -> Group:
        if current and current[0].world != world:
            current.pop().close()
        if not current:
            current.append(Group(world))
        return current[0]

    try:
        yield get
    finally:
        for g in current:
            g.close()
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


# The bottom parametrize varies slowest: one process group per world size, in turn.
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("tokens", TOKENS[PRESET.name])
@pytest.mark.parametrize("algorithm", ["oneshot_push_1block", "oneshot_push", "oneshot_pull", "twoshot", "torch"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_allreduce(benchmark, bench_results, group_for, world, tokens, algorithm, fused):
    group = group_for(world)
    if group.available[algorithm] is not None:
        pytest.skip(f"{algorithm}: {group.available[algorithm]}")
    disabled = getattr(benchmark, "disabled", False)
    calls = CALLS_PER_ROUND * (1 if disabled else PRESET.rounds + 1)  # pedantic: 1 warm-up round
    cmd = {"algorithm": algorithm, "tokens": tokens, "fused": fused, "calls": CALLS_PER_ROUND}
    comm = group.start({**cmd, "calls": calls})
    x, r, w = _inputs(tokens, group.device, seed=0)
    benchmark._timer = _timing._per_call_clock(CALLS_PER_ROUND, synchronize=group.device.type == "cuda")
    if disabled:
        _run_calls(comm, cmd, x, r, w)
    else:
        benchmark.pedantic(_run_calls, args=(comm, cmd, x, r, w), rounds=PRESET.rounds, warmup_rounds=1)
    dist.barrier()
    comm.close()
    backend = "nccl" if algorithm == "torch" and group.backend == "nccl" else group.backend
    pcie = (f"{world} GPUs" if group.own_gpus else
            f"NO: {world} ranks share {'one GPU' if DEVICE.type == 'cuda' else 'the CPU'}; says nothing about PCIe")
    _timing.record(benchmark, bench_results, nbytes=tokens * HIDDEN * x.element_size(), kind="allreduce",
                   algorithm=algorithm, fused=fused, world=world, tokens=tokens, hidden=HIDDEN,
                   dtype=str(DTYPE).replace("torch.", ""), backend=backend if algorithm == "torch" else "ipc",
                   pcie=pcie, timing="eager", calls_per_round=CALLS_PER_ROUND,
                   goal="<= 8 us for 1 token at TP8 on 8x RTX PRO 6000 (PCIe Gen5)")
