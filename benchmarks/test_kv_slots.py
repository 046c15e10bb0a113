"""Benchmarks of draft-token KV slot allocation and commit, and the slots they hold vs SGLang.

* test_alloc_time / test_commit_time: one call for B requests x n drafts each. pytest-benchmark
  times the call end to end (Python, launch, kernel, sync); on a GPU extra_info["device_us"] is
  the kernel time alone (CUDA events around a launch queued behind a GPU sleep, state restored
  between calls). Commit runs random tree paths, so with page_size > 1 it moves KV rows of
  2 x kv_layers buffers [slots, 8, 128] bf16.
* test_slots_held_vs_sglang (any machine, no GPU needed): the KV slots held at the peak of each
  speculative step by this allocator (measured on the reference implementation) vs SGLang
  0.5.23's reservation `committed + 2 x max(steps x topk, n)` page-aligned per request
  (computed from that rule), on the same workload.

Both tables are printed at the end of the run and saved in extra_info. Preset:
SPEC_KERNELS_BENCH_PRESET = tiny (default without a GPU: a few small shapes, < 1 min on a CPU
through the Triton interpreter) | gpu-quick (scripts/gpu_check.sh) | gpu (default with a GPU).
Works with or without benchmarks/conftest.py.
"""
from __future__ import annotations

import os
import random
import statistics
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before spec_kernels defines its Triton kernels

import spec_kernels  # noqa: E402
from spec_kernels import _ops  # noqa: E402
from spec_kernels.kv_slots import reference  # noqa: E402


@dataclass(frozen=True)
class Preset:
    batch_sizes: tuple[int, ...]
    draft_counts: tuple[int, ...]
    page_sizes: tuple[int, ...]
    kv_layers: int
    rounds: int
    table_batch: int  # requests in the slots-held simulation
    table_steps: int


PRESETS = {
    "tiny": Preset((1, 4), (4, 16), (1, 16), kv_layers=1, rounds=3, table_batch=16, table_steps=12),
    "gpu-quick": Preset((1, 32, 256), (4, 16, 64), (1, 16), kv_layers=16, rounds=20, table_batch=32, table_steps=24),
    "gpu": Preset((1, 32, 256), (4, 16, 64), (1, 16, 64), kv_layers=40, rounds=50, table_batch=64, table_steps=48),
}
HAS_GPU = torch.cuda.is_available()
PRESET_NAME = os.environ.get("SPEC_KERNELS_BENCH_PRESET") or ("gpu" if HAS_GPU else "tiny")
PRESET = PRESETS.get(PRESET_NAME, PRESETS["gpu" if HAS_GPU else "tiny"])
DEVICE = torch.device("cuda") if HAS_GPU else torch.device("cpu")
IMPLS = ("cuda", "triton") if HAS_GPU else ("triton",)
KV_ROW = (4, 128)  # KV heads x head dim of one buffer row (bf16: 1 KiB)
PROMPT_LENS = (64, 512)
GPU_SLEEP_CYCLES = 2_000_000  # ~1 ms: our launch is queued before the GPU reaches the start event

# (speculative steps, topk, draft tokens n): a chain, a small tree, a large tree
SGLANG_CONFIGS = ((3, 1, 4), (5, 4, 16), (6, 8, 64))


# --------------------------------------------------------------------------- summary tables
class _Tables:
    """Registered once as a pytest plugin: prints the collected tables at the end of the run."""

    name = "spec_kernels_kv_slots_tables"

    def __init__(self):
        self.sections: dict[str, list[str]] = {}

    def pytest_terminal_summary(self, terminalreporter):
        for title, lines in self.sections.items():
            terminalreporter.write_sep("-", title)
            for line in lines:
                terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tables(pytestconfig) -> _Tables:
    found = pytestconfig.pluginmanager.get_plugin(_Tables.name)
    if found is None:
        found = _Tables()
        pytestconfig.pluginmanager.register(found, _Tables.name)
    return found


# --------------------------------------------------------------------------- workload
def random_path(rng: random.Random, n: int) -> list[int]:
    """Root-to-node path of a random node in a random tree of n drafts (parents precede children)."""
    if n == 0:
        return []
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    node, path = rng.randrange(n), []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def accept_tensors(paths: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    acc = torch.tensor([p + [-1] * (width - len(p)) for p in paths], dtype=torch.int64).reshape(len(paths), width)
    return acc, torch.tensor([len(p) for p in paths], dtype=torch.int64)


def admit(req_to_token, rows: list[int], lengths: list[int], free_pages, num_free, page_state,
          page_size: int) -> None:
    """New requests' prompts get slots (the reference allocator takes any count)."""
    out = torch.empty(sum(lengths), dtype=torch.int64)
    status = torch.empty(reference.STATUS_LEN, dtype=torch.int64)
    reference.alloc_draft_slots(req_to_token, torch.tensor(rows), torch.zeros(len(rows), dtype=torch.int64),
                                torch.tensor(lengths), free_pages, num_free, page_state, page_size,
                                req_to_token.shape[1], out, status)
    assert status[0].item() == reference.STATUS_OK, status


@dataclass
class Batch:
    """One step's inputs on DEVICE, and the allocator state before its alloc."""

    args: dict
    accept_index: torch.Tensor
    accept_len: torch.Tensor
    kv: list[torch.Tensor]
    pre_alloc: list[torch.Tensor]  # req_to_token, free_pages, num_free, page_state


_BATCHES: dict[tuple, Batch] = {}
_KV_POOLS: dict[int, list[torch.Tensor]] = {}


def kv_pool(page_size: int, slots: int) -> list[torch.Tensor]:
    """2 x kv_layers KV buffers with at least `slots` rows, shared by every batch of a page size
    (page size 1 never moves KV: one small buffer)."""
    pool = _KV_POOLS.get(page_size)
    if pool is None or pool[0].shape[0] < slots:
        layers = PRESET.kv_layers if page_size > 1 else 1
        rows = max(PRESET.batch_sizes) * (PROMPT_LENS[1] + max(PRESET.draft_counts) + page_size) + 8 * page_size
        _KV_POOLS[page_size] = pool = [torch.zeros(max(rows, slots), *KV_ROW, dtype=torch.bfloat16, device=DEVICE)
                                       for _ in range(2 * layers)]
    return pool



def batch_for(B: int, n: int, page_size: int) -> Batch:
    key = (B, n, page_size)
    if key not in _BATCHES:
        rng = random.Random(hash(key))
        lens = [rng.randint(*PROMPT_LENS) for _ in range(B)]
        pages = sum(-(-(L + n) // page_size) for L in lens) + 8
        rtt = torch.full((B, PROMPT_LENS[1] + 64), -1, dtype=torch.int32)
        free = torch.tensor(rng.sample(range(pages), pages), dtype=torch.int64)
        num_free = torch.tensor([pages], dtype=torch.int64)
        page_state = spec_kernels.kv_slots.page_state_from_free_stack(free, num_free)
        admit(rtt, list(range(B)), lens, free, num_free, page_state, page_size)
        acc, acc_len = accept_tensors([random_path(rng, n) for _ in range(B)], n)
        kv = kv_pool(page_size, pages * page_size)
        state = [t.to(DEVICE) for t in (rtt, free, num_free, page_state)]
        args = dict(req_to_token=state[0], req_pool_indices=torch.arange(B, device=DEVICE),
                    seq_lens=torch.tensor(lens, device=DEVICE), num_draft=torch.full((B,), n, device=DEVICE),
                    free_pages=state[1], num_free=state[2], page_state=state[3], page_size=page_size)
        _BATCHES[key] = Batch(args, acc.to(DEVICE), acc_len.to(DEVICE), kv, [t.clone() for t in state])
    return _BATCHES[key]


STATE_KEYS = ("req_to_token", "free_pages", "num_free", "page_state")


def _restore(batch: Batch, saved: list[torch.Tensor]) -> None:
    for key, src in zip(STATE_KEYS, saved):
        batch.args[key].copy_(src)


def _alloc(batch: Batch, impl: str) -> torch.Tensor:
    return spec_kernels.alloc_draft_slots(**batch.args, impl=impl, check_free=False,
                                          total_draft=batch.args["num_draft"].numel() * batch.accept_index.shape[1])


def _commit(batch: Batch, impl: str) -> torch.Tensor:
    return spec_kernels.commit_draft_slots(**batch.args, accept_index=batch.accept_index,
                                           accept_len=batch.accept_len, kv_buffers=batch.kv, impl=impl)


def device_time_us(run, restore, reps: int) -> float:
    """Median kernel time of run() (restore() untimed before each call). The GPU sleeps while
    the host enqueues the start event and the launch, so host overhead is not measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        restore()
        torch.cuda._sleep(GPU_SLEEP_CYCLES)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times[1:])


def _skip_unavailable(impl: str) -> None:
    why = _ops.op_impls("alloc_draft_slots").unavailable_reason(impl, DEVICE)
    if why is not None:
        pytest.skip(f"{impl}: {why}")


def _time(benchmark, tables, op: str, impl: str, B: int, n: int, page_size: int) -> None:
    _skip_unavailable(impl)
    batch = batch_for(B, n, page_size)
    if op == "alloc":
        saved = batch.pre_alloc
        run = lambda: _alloc(batch, impl)  # noqa: E731
    else:
        _restore(batch, batch.pre_alloc)
        _alloc(batch, impl)
        saved = [batch.args[key].clone() for key in STATE_KEYS]
        run = lambda: _commit(batch, impl)  # noqa: E731

    def target():
        run()
        if HAS_GPU:
            torch.cuda.synchronize()

    benchmark.extra_info.update(op=op, impl=impl, B=B, n=n, page_size=page_size, preset=PRESET_NAME,
                                kv_buffers=len(batch.kv) if op == "commit" and page_size > 1 else 0)
    benchmark.pedantic(target, setup=lambda: _restore(batch, saved), rounds=PRESET.rounds, warmup_rounds=1)
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)  # None with --benchmark-disable
    wall = f"{stats.median * 1e6:9.1f} us" if stats else "      n/a"
    line = f"{op:<7} {impl:<7} page {page_size:>3}  B {B:>4}  n {n:>3}  end-to-end {wall}"
    if HAS_GPU:
        us = device_time_us(run, lambda: _restore(batch, saved), PRESET.rounds)
        benchmark.extra_info["device_us"] = us
        line += f"  device {us:7.2f} us"
    tables.sections.setdefault(f"kv_slots: time of one call (preset {PRESET_NAME})", []).append(line)


GRID = [(impl, P, B, n) for impl in IMPLS for P in PRESET.page_sizes for B in PRESET.batch_sizes
        for n in PRESET.draft_counts]
GRID_IDS = [f"{impl}-page{P}-B{B}-n{n}" for impl, P, B, n in GRID]


@pytest.mark.parametrize("impl,page_size,B,n", GRID, ids=GRID_IDS)
def test_alloc_time(benchmark, tables, impl, page_size, B, n):
    _time(benchmark, tables, "alloc", impl, B, n, page_size)


@pytest.mark.parametrize("impl,page_size,B,n", GRID, ids=GRID_IDS)
def test_commit_time(benchmark, tables, impl, page_size, B, n):
    _time(benchmark, tables, "commit", impl, B, n, page_size)


# --------------------------------------------------------------------------- slots held vs SGLang
def sglang_reserved(committed: int, steps: int, topk: int, n: int, page_size: int) -> int:
    """SGLang 0.5.23's per-request reservation for a step: committed + 2 x max(steps x topk, n),
    page-aligned."""
    need = committed + 2 * max(steps * topk, n)
    return -(-need // page_size) * page_size


def simulate_slots_held(B: int, steps: int, topk: int, n: int, page_size: int, num_steps: int, seed: int = 0):
    """Run the reference allocator on a stream of requests (B at a time; a finished request's
    pages go back, a new one arrives) and return per-step (committed, ours held, SGLang held)."""
    rng = random.Random(seed)
    max_context = 4096
    pages = B * -(-max_context // page_size) + 8
    rtt = torch.full((B, max_context), -1, dtype=torch.int32)
    free = torch.tensor(rng.sample(range(pages), pages), dtype=torch.int64)
    num_free = torch.tensor([pages], dtype=torch.int64)
    state = spec_kernels.kv_slots.page_state_from_free_stack(free, num_free)
    lens = [rng.randint(100, 2000) for _ in range(B)]
    budget = [rng.randint(64, 1024) for _ in range(B)]  # output tokens before each request finishes
    admit(rtt, list(range(B)), lens, free, num_free, state, page_size)
    rows = []
    for _ in range(num_steps):
        seq, counts = torch.tensor(lens), torch.full((B,), n)
        spec_kernels.alloc_draft_slots(rtt, torch.arange(B), seq, counts, free, num_free, state, page_size,
                                       impl="reference")
        ours = (pages - int(num_free.item())) * page_size  # the peak: drafts allocated, before commit
        theirs = sum(sglang_reserved(L, steps, topk, n, page_size) for L in lens)
        rows.append((sum(lens), ours, theirs))
        # accepted paths of an EAGLE tree: root plus at most `steps` more drafts
        paths = [random_path(rng, n)[:steps + 1] for _ in range(B)]
        acc, acc_len = accept_tensors(paths, n)
        lens = spec_kernels.commit_draft_slots(rtt, torch.arange(B), seq, counts, acc, acc_len, free, num_free,
                                               state, page_size, impl="reference", kv_buffers=None if page_size == 1 else
                                               [torch.zeros(pages * page_size, 1)]).tolist()
        for b in range(B):
            budget[b] -= len(paths[b])
            if budget[b] <= 0 or lens[b] + n > max_context:  # finish: pages back; a new request arrives
                held = rtt[b, :lens[b]:page_size].long() // page_size
                top = int(num_free.item())
                free[top:top + held.numel()] = held
                num_free += held.numel()
                state[held] = spec_kernels.kv_slots.PAGE_FREE  # pages pushed by the caller: free
                lens[b], budget[b] = rng.randint(100, 2000), rng.randint(64, 1024)
                admit(rtt, [b], [lens[b]], free, num_free, state, page_size)
    return rows


def test_slots_held_vs_sglang(benchmark, tables):
    B, num_steps = PRESET.table_batch, PRESET.table_steps
    header = (f"{'steps':>5} {'topk':>4} {'n':>3} {'page':>4} | {'committed':>9} | {'ours held':>9} "
              f"{'extra':>6} | {'SGLang held':>11} {'extra':>6} | {'extra x':>7}")
    lines = [f"B = {B} requests, mean over {num_steps} steps; extra = held - committed; "
             "SGLang = committed + 2 x max(steps x topk, n), page-aligned per request", header,
             "-" * len(header)]
    table = []

    def run():
        table.clear()
        for steps, topk, n in SGLANG_CONFIGS:
            for page_size in (1, 16, 64):
                rows = simulate_slots_held(B, steps, topk, n, page_size, num_steps)
                committed, ours, theirs = (statistics.mean(col) for col in zip(*rows))
                table.append(dict(steps=steps, topk=topk, n=n, page_size=page_size, committed=committed,
                                  ours_held=ours, sglang_held=theirs))

    benchmark.pedantic(run, rounds=1, iterations=1)
    for r in table:
        ours_extra, theirs_extra = r["ours_held"] - r["committed"], r["sglang_held"] - r["committed"]
        assert ours_extra <= theirs_extra  # exact sizes never hold more than the reservation rule
        lines.append(f"{r['steps']:>5} {r['topk']:>4} {r['n']:>3} {r['page_size']:>4} | {r['committed']:>9.0f} | "
                     f"{r['ours_held']:>9.0f} {ours_extra:>6.0f} | {r['sglang_held']:>11.0f} {theirs_extra:>6.0f} | "
                     f"{theirs_extra / max(ours_extra, 1e-9):>7.2f}")
    benchmark.extra_info.update(preset=PRESET_NAME, B=B, steps=num_steps, slots_held=table)
    tables.sections["kv_slots: KV slots held per step, ours vs SGLang 0.5.23's reservation"] = lines
