"""The benchmark harness shared by benchmarks/test_*.py: presets, GPU-correct timing, the summary.

Presets (environment variable SPEC_KERNELS_BENCH_PRESET):

* ``tiny``      - the default without a GPU: fp32, a handful of small shapes, so that the whole
  suite runs on a 2-core CPU through the Triton interpreter in well under a minute. It checks
  the harness, not performance.
* ``gpu-quick`` - the subset scripts/gpu_check.sh runs, sized for a few minutes on an H200
  (an estimate: not measured yet).
* ``gpu``       - the default with a GPU: the full grid.

Timing (:func:`measure`): pytest-benchmark times one *round* as ``timer()`` after minus
``timer()`` before. On a GPU that clock synchronizes the device, so a round covers the device
work, not just the launches. A round runs ``calls_per_round`` calls back to back, rotating
over input sets that together stream several times the GPU's L2 (so repeats do not measure the
cache), captured in one CUDA graph where possible (so launch overhead, not present in a server's
graph-captured decode step, is not measured either; an eager round is the fallback). The clock
counts in units of 1/calls_per_round seconds, so every statistic pytest-benchmark reports (and
saves) is the time of ONE call. Everything is warmed up first: Triton compiles and autotunes on
the first call of a shape.

Run as a script to print the summary table of saved results (e.g. gpu_check.sh's JSON), and with
--plots DIR to (re)draw the decode-step plots (:func:`write_decode_step_plots`) from them:

    python benchmarks/_timing.py [--plots DIR] OUTDIR/tree_verify.json [more.json ...]
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from spec_kernels._extras import import_extra

PRESET_ENV = "SPEC_KERNELS_BENCH_PRESET"
MIN_GPU_CALLS_PER_ROUND = 4  # so a round of one large call is not dominated by the sync
ROTATE_L2_MULTIPLE = 4  # a round streams at least this many times the L2 cache...
MAX_INPUT_SETS = 128  # ...with at most this many distinct input sets


# --------------------------------------------------------------------------- presets
@dataclass(frozen=True)
class Preset:
    name: str
    dtype: str  # torch dtype name
    batch_sizes: tuple[int, ...]
    prefix_lens: tuple[int, ...]  # L: KV slots of each request before its drafts
    draft_counts: tuple[int, ...]  # n: draft tokens per request; 1 = plain decode
    heads: tuple[tuple[int, int], ...]  # (Hq, Hkv) per tensor-parallel rank
    head_dim: int
    rounds: int  # timed rounds per benchmark (after one warm-up round)
    stream_bytes: int  # buffer size of the streaming-bandwidth ceiling benchmark
    needs_gpu: bool
    # The forced-split sweep (benchmarks/test_tree_verify.py::test_forced_splits): (B, L, n) shapes
    # at the first heads pair, timed at the planned split count and at each of split_counts.
    split_shapes: tuple[tuple[int, int, int], ...] = ()
    split_counts: tuple[int, ...] = ()


# The batches where the split planner's choice rests on the model's DRAM-latency assumption
# (docs/speed_of_light.md): verify n = 16 at L = 4096, B = 1 / 8 / 32, against forced counts.
SPLIT_SHAPES = ((1, 4096, 16), (8, 4096, 16), (32, 4096, 16))
SPLIT_COUNTS = (1, 2, 4, 8, 16, 32)

PRESETS = {
    p.name: p
    for p in (
        Preset("tiny", "float32", batch_sizes=(1, 3), prefix_lens=(64, 200), draft_counts=(1, 4, 16),
               heads=((8, 2),), head_dim=64, rounds=3, stream_bytes=64 << 20, needs_gpu=False,
               split_shapes=((3, 200, 4),), split_counts=(1, 4)),
        # Both ends of the targets' "GQA 4-8": Llama-3.3-70B at TP2 (32 q heads, 4 KV heads: GQA 8)
        # and Llama-3.1-8B unsharded (32 / 8: GQA 4). On an H200 mma.sync attention is expected to
        # be memory-bound at GQA 4 and compute-bound at GQA 8 (README, "Predicted").
        Preset("gpu-quick", "bfloat16", batch_sizes=(1, 32), prefix_lens=(4096, 32768), draft_counts=(1, 16, 64),
               heads=((32, 4), (32, 8)), head_dim=128, rounds=5, stream_bytes=2 << 30, needs_gpu=True,
               split_shapes=SPLIT_SHAPES, split_counts=SPLIT_COUNTS),
        Preset("gpu", "bfloat16", batch_sizes=(1, 8, 32, 64), prefix_lens=(1024, 4096, 16384, 32768),
               draft_counts=(1, 16, 32, 64), heads=((32, 4), (32, 8)), head_dim=128, rounds=10,
               stream_bytes=2 << 30, needs_gpu=True, split_shapes=SPLIT_SHAPES, split_counts=SPLIT_COUNTS),
    )
}


def bench_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def active_preset() -> Preset:
    """The preset named by SPEC_KERNELS_BENCH_PRESET; default `gpu` with a GPU, else `tiny`."""
    has_gpu = torch.cuda.is_available()
    name = os.environ.get(PRESET_ENV) or ("gpu" if has_gpu else "tiny")
    if name not in PRESETS:
        raise ValueError(f"{PRESET_ENV}={name!r}: must be one of {', '.join(PRESETS)}")
    if PRESETS[name].needs_gpu and not has_gpu:
        raise ValueError(f"{PRESET_ENV}={name!r} needs a CUDA GPU and none is visible to torch; use 'tiny'")
    return PRESETS[name]


# --------------------------------------------------------------------------- timing
def input_sets_for(set_bytes: int, device: torch.device) -> int:
    """How many input sets (each reading `set_bytes` from distinct memory) a round rotates over
    so that it streams ROTATE_L2_MULTIPLE x the L2 cache; 1 on CPU."""
    if device.type != "cuda":
        return 1
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 0) or 50 << 20
    return max(1, min(MAX_INPUT_SETS, math.ceil(ROTATE_L2_MULTIPLE * l2 / max(set_bytes, 1))))


def _per_call_clock(calls_per_round: int, synchronize: bool) -> Callable[[], float]:
    def per_call_clock() -> float:  # its name is what pytest-benchmark saves as the timer
        if synchronize:
            torch.cuda.synchronize()
        return time.perf_counter() / calls_per_round

    return per_call_clock


def _capture(run_round: Callable[[], None]):
    """(graph, None), or (None, why) when the calls cannot be captured (e.g. one syncs the host)."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_round()
        return graph, None
    except Exception as exc:  # noqa: BLE001  any failure only means: time it eagerly
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {exc}"[:300]


def measure(benchmark, calls: Sequence[Callable[[], object]], device: torch.device, rounds: int) -> dict:
    """Time `calls` (zero-argument callables, one per input set) with pytest-benchmark so that
    every reported statistic is the time of one call (see the module docstring). Returns how it
    was timed, for benchmark.extra_info."""
    per_round = max(len(calls), MIN_GPU_CALLS_PER_ROUND if device.type == "cuda" else 1)
    sequence = [calls[i % len(calls)] for i in range(per_round)]

    def run_round() -> None:
        for call in sequence:
            call()

    info = {"timing": "cpu", "calls_per_round": per_round, "input_sets": len(calls)}
    target = run_round
    if device.type == "cuda":
        # Warm up (compile, autotune, touch every input set) on a side stream, as CUDA graph
        # capture wants; then capture the whole round.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run_round()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph, why = _capture(run_round)
        if graph is not None:
            target, info["timing"] = graph.replay, "cuda-graph"
        else:
            info.update(timing="eager", graph_capture_error=why)
    # pytest-benchmark takes its clock from the fixture's _timer (there is no public per-test
    # option) and times a round as clock() after minus clock() before.
    benchmark._timer = _per_call_clock(per_round, synchronize=device.type == "cuda")
    try:
        benchmark.pedantic(target, rounds=rounds, warmup_rounds=1)
    except BaseException:
        # pytest-benchmark's fixture flags only Exceptions; a KeyboardInterrupt (how
        # gpu_check.sh's timeouts stop pytest) would leave a half-timed entry that makes
        # --benchmark-json fail for the whole session. Flag it so it is left out instead.
        benchmark.has_error = True
        raise
    return info


def record(benchmark, results: list, nbytes: int, **extra) -> None:
    """Add `extra`, the bytes moved per call and the achieved GB/s (from the median) to
    benchmark.extra_info, and the row to `results` for the end-of-session summary."""
    benchmark.extra_info.update(extra, bytes=nbytes)
    if benchmark.stats is None:  # --benchmark-disable: nothing was timed
        return
    median = benchmark.stats.stats.median
    benchmark.extra_info["gbps"] = nbytes / median / 1e9 if median > 0 else None
    results.append(dict(benchmark.extra_info, median_s=median))


# --------------------------------------------------------------------------- summary
def rows_from_json(path: str) -> list[dict]:
    """Summary rows of a pytest-benchmark JSON file (benchmarks that called :func:`record`)."""
    with open(path) as fh:
        data = json.load(fh)
    return [dict(b["extra_info"], median_s=b["stats"]["median"])
            for b in data.get("benchmarks", []) if "kind" in b.get("extra_info", {})]


def _num(x: Optional[float], fmt: Optional[str] = None) -> str:
    """`fmt`, or 3 significant digits without an exponent (1234, 12.3, 0.123)."""
    if x is None or not math.isfinite(x):
        return "-"
    if fmt is None:
        fmt = ".0f" if abs(x) >= 100 else ".1f" if abs(x) >= 10 else ".2f" if abs(x) >= 1 else ".3f"
    return format(x, fmt)


def format_summary(rows: list[dict]) -> list[str]:
    """The side-by-side table: one line per attention case, one column group per impl."""
    lines = []
    stream = {r["op"]: r for r in rows if r["kind"] == "stream"}
    read_gbps = stream["read"]["gbps"] if "read" in stream else None
    if stream:
        lines.append("streaming ceiling: " + ", ".join(
            f"{op} {_num(r['gbps'])} GB/s ({r['bytes'] / 2**30:.2f} GiB moved per call)" for op, r in stream.items()))

    lines += format_decode_steps(rows)
    lines += format_split_sweep(rows, read_gbps)
    lines += format_merge_launch(rows)
    attn = [r for r in rows if r["kind"] == "attention"]
    if not attn:
        return lines
    impls = list(dict.fromkeys(r["impl"] for r in attn))
    group_key = ("B", "L", "Hq", "Hkv", "D", "Dv", "dtype")
    by_case: dict[tuple, dict] = {}  # (group values..., n) -> impl -> row
    group_rank: dict[tuple, int] = {}  # cases keep the order they ran in, then n ascending
    for r in attn:
        group = tuple(r[k] for k in group_key)
        group_rank.setdefault(group, len(group_rank))
        by_case.setdefault(group + (r["n"],), {})[r["impl"]] = r
    ordered = sorted(by_case, key=lambda k: (group_rank[k[:-1]], k[-1]))

    header = _case_cols("B", "L", "n", "Hq/Hkv", "D", "dtype")
    impl_width = len(_cells("", "", "", "")) - 3
    lines += [
        "tree-verify attention (median time per call; GB/s = bytes the op must move (K/V rows + q + out) / time;",
        "  %rd = share of the streaming-read ceiling; /dec = time / the same impl's n=1 decode at the same B, L)",
        (" " * len(header) + "".join(f" | {impl:<{impl_width}}" for impl in impls)).rstrip(),
        header + _cells("us", "GB/s", "%rd", "/dec") * len(impls),
    ]
    for key in ordered:
        B, L, Hq, Hkv, D, _, dtype, n = key
        line = _case_cols(B, L, n, f"{Hq}/{Hkv}", D, dtype)
        for impl in impls:
            r = by_case[key].get(impl)
            if r is None:
                line += _cells("-", "-", "-", "-")
                continue
            decode = by_case.get(key[:-1] + (1,), {}).get(impl)
            ratio = r["median_s"] / decode["median_s"] if decode and n != 1 else None
            pct = 100 * r["gbps"] / read_gbps if read_gbps and r.get("gbps") else None
            line += _cells(_num(r["median_s"] * 1e6), _num(r.get("gbps")), _num(pct, ".1f"), _num(ratio, ".2f"))
        lines.append(line)
    return lines


def format_split_sweep(rows: list[dict], read_gbps: Optional[float] = None) -> list[str]:
    """Per shape of the forced-split sweep: the time at the planner's count and at each forced
    count, the model's time for each count where it was computed (GPU), and planned / fastest."""
    shapes: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        if r["kind"] == "split_sweep":
            shapes.setdefault((r["impl"], r["B"], r["L"], r["n"], r["Hq"], r["Hkv"], r["D"], r["dtype"]), {})[r["forced"]] = r
    if not shapes:
        return []
    lines = ["", "forced KV splits (tree verify through TreeVerifyPlan; us = measured median per call, model = the",
             "  speed-of-light model's time at that count on this GPU, '-' without one; %rd = share of the",
             "  streaming-read ceiling; * = the planner's count; planned / fastest = its time / the best measured)"]
    for (impl, B, L, n, Hq, Hkv, D, dtype), by_forced in shapes.items():
        planned = by_forced.get(0)
        forced = sorted(k for k in by_forced if k)
        lines.append(f"  {impl} B={B} L={L} n={n} Hq/Hkv={Hq}/{Hkv} D={D} {dtype}:")
        for k in ([0] if planned else []) + forced:
            r = by_forced[k]
            pct = 100 * r["gbps"] / read_gbps if read_gbps and r.get("gbps") else None
            model = r.get("modelled_s")
            mark = "*" if planned and r["splits"] == planned["splits"] else " "
            label = f"planned ({r['splits']})" if k == 0 else f"{k} splits"
            lines.append(f"    {label:>13}{mark} {_num(r['median_s'] * 1e6):>9} us  {_num(r.get('gbps')):>7} GB/s "
                         f"{_num(pct, '.1f'):>5} %rd  model {_num(model * 1e6 if model else None):>8} us")
        if planned and forced:
            best = min(by_forced.values(), key=lambda r: r["median_s"])
            lines.append(f"    planned / fastest = {planned['median_s'] / best['median_s']:.3f} "
                         f"(fastest: {best['splits']} splits)")
    return lines


def format_merge_launch(rows: list[dict]) -> list[str]:
    """Per shape: the CUDA path with its split merge launched as a programmatic dependent and as a
    plain launch (measured medians, the same run), their difference, and the model's time."""
    shapes: dict[tuple, dict[bool, dict]] = {}
    for r in rows:
        if r["kind"] == "merge_launch":
            shapes.setdefault((r["B"], r["L"], r["n"], r["Hq"], r["Hkv"], r["D"], r["dtype"]), {})[r["dependent"]] = r
    if not shapes:
        return []
    lines = ["", "split merge launch (CUDA tree verify at the planned split count; us = measured median per call;",
             "  dependent = the merge launched as a programmatic dependent, plain = an ordinary launch; model = the",
             "  speed-of-light model's time of the dependent launch)"]
    for (B, L, n, Hq, Hkv, D, dtype), by in shapes.items():
        dep, plain = by.get(True), by.get(False)
        splits = (dep or plain)["splits"]
        line = f"  B={B} L={L} n={n} Hq/Hkv={Hq}/{Hkv} D={D} {dtype} ({splits} splits):"
        if dep:
            model = dep.get("modelled_s")
            line += f" dependent {_num(dep['median_s'] * 1e6)} us {_num(dep.get('gbps'))} GB/s" \
                    f" (model {_num(model * 1e6 if model else None)} us)"
        if plain:
            line += f", plain {_num(plain['median_s'] * 1e6)} us {_num(plain.get('gbps'))} GB/s"
        if dep and plain:
            line += f", saved {_num((plain['median_s'] - dep['median_s']) * 1e6)} us"
        lines.append(line)
    return lines


# --------------------------------------------------------------------------- decode-step summary
def _decode_groups(rows: list[dict]) -> dict[tuple, dict]:
    """(preset, L) -> {"steps": {(B, n): row}, "parts": {(B, n, component, impl): row}} in run order."""
    groups: dict[tuple, dict] = {}
    for r in rows:
        if r["kind"] not in ("decode_step", "decode_component"):
            continue
        g = groups.setdefault((r["preset"], r["L"]), {"steps": {}, "parts": {}})
        if r["kind"] == "decode_step":
            g["steps"][(r["B"], r["n"])] = r
        else:
            g["parts"][(r["B"], r["n"], r["component"], r["impl"])] = r
    return groups


def format_decode_steps(rows: list[dict]) -> list[str]:
    """Per (model preset, L): baseline vs EAGLE step time per B and n, the ratio, plain decoding's
    tok/s; where a layer's time goes; EAGLE attention beside the anchors (benchmarks/test_decode_step.py)."""
    lines: list[str] = []
    for (preset, L), g in _decode_groups(rows).items():
        steps, parts = g["steps"], g["parts"]
        any_row = next(iter(steps.values()), None) or next(iter(parts.values()))
        layers = any_row["layers"]
        head = (f"decode step: {any_row['model']} ({preset}), TP{any_row['tp']}, {layers} layers, L={L}, "
                f"{any_row['dtype']}, attention {any_row['attention']}")
        if steps:
            head += f" ({next(iter(steps.values()))['impl']})"
        lines += ["", head + "; allreduce NOT timed (one process)"]
        Bs = sorted({B for B, _ in list(steps) + [k[:2] for k in parts]})
        ns = sorted({n for _, n in steps if n > 1} | {k[1] for k in parts if k[1] > 1})
        if steps:
            lines += [f"  step = one layer x {layers} + the step's KV alloc/commit; plain decoding's tok/s = B / step;",
                      "  tokens = through the target per step; x base = EAGLE step / baseline step = the tokens",
                      "  per request (tau, bonus included) an EAGLE step must emit to tie plain decoding",
                      "  (EAGLE tok/s = B x tau / step)",
                      f"{'B':>6} | {'baseline':>9} {'tok/s':>8}"
                      + "".join(f" | {f'n={n}':>9} {'tokens':>6} {'x base':>6}" for n in ns)]
            for B in Bs:
                base = steps.get((B, 1))
                t_base = base["median_s"] * layers if base else None
                line = f"{B:>6} | {_ms(t_base):>9} {_num(B / t_base if t_base else None):>8}"
                for n in ns:
                    r = steps.get((B, n))
                    t = r["median_s"] * layers if r else None
                    line += f" | {_ms(t):>9} {B * n:>6} {_num(t / t_base if t and t_base else None, '.2f'):>6}"
                lines.append(line)
        lines += _decode_parts(steps, parts, Bs, ns, layers)
        lines += _decode_anchors(steps, parts, Bs, ns)
    return lines


def _ms(t: Optional[float]) -> str:
    return "-" if t is None else f"{_num(t * 1e3)} ms"


def _decode_parts(steps: dict, parts: dict, Bs: list, ns: list, layers: int) -> list[str]:
    comps = ("attention", "gemm", "norm", "kv")
    if not any(k[2] in comps for k in parts):
        return []
    lines = ["  where a layer's time goes (us; kv = the step's alloc/commit / layers; parts = their sum;",
             "  layer = the measured step / layers; attention: the impl the step ran)",
             f"{'B':>6} {'n':>3} {'tokens':>6} | " + " ".join(f"{c:>9}" for c in comps)
             + f" | {'parts':>9} {'layer':>9}"]
    step_impl = {"attention": "impl", "norm": "norm_impl", "kv": "kv_impl"}
    for B in Bs:
        for n in [1] + ns:
            step = steps.get((B, n))
            cells, total = [], 0.0
            for comp in comps:
                # the implementation the step ran, else ours (never an anchor)
                want = step.get(step_impl.get(comp, ""), None) if step else None
                found = [r for (b, m, c, impl), r in parts.items() if (b, m, c) == (B, n, comp)
                         and (impl == want or want is None and not r.get("anchor"))]
                t = found[0]["median_s"] / (layers if comp == "kv" else 1) if found else None
                total += t or 0.0
                cells.append(_num(t * 1e6 if t is not None else None))
            if all(c == "-" for c in cells) and step is None:
                continue
            layer = step["median_s"] * 1e6 if step else None
            lines.append(f"{B:>6} {n:>3} {B * n:>6} | " + " ".join(f"{c:>9}" for c in cells)
                         + f" | {_num(total * 1e6 if total else None):>9} {_num(layer):>9}")
    return lines


def _decode_anchors(steps: dict, parts: dict, Bs: list, ns: list) -> list[str]:
    attn = {k: r for k, r in parts.items() if k[2] == "attention" and k[1] > 1}
    impls = list(dict.fromkeys(k[3] for k in attn))
    if len(impls) < 2:
        return []
    ref_impl = next((s["impl"] for s in steps.values()), impls[0])
    ref_impl = ref_impl if ref_impl in impls else impls[0]
    lines = [f"  EAGLE attention, ours beside the anchors (us per layer; x = time / {ref_impl}'s; anchors on the real",
             "  MLA where ours is the proxy: compare those rows with care)",
             f"{'B':>6} {'n':>3} | " + " | ".join(f"{i:>13} {'x':>5}" for i in impls)]
    for B in Bs:
        for n in ns:
            row = {i: attn.get((B, n, "attention", i)) for i in impls}
            if not any(row.values()):
                continue
            ref = row.get(ref_impl)
            cells = []
            for i in impls:
                r = row[i]
                t = r["median_s"] if r else None
                ratio = t / ref["median_s"] if t and ref else None
                cells.append(f"{_num(t * 1e6 if t else None):>13} {_num(ratio, '.2f'):>5}")
            lines.append(f"{B:>6} {n:>3} | " + " | ".join(cells))
    return lines


def write_decode_step_plots(rows: list[dict], out_dir: str) -> list[str]:
    """One PNG per (model preset, L) in out_dir: decode_step-<preset>-L<L>.png with step time vs
    B (baseline and each n) and the EAGLE / baseline ratio vs B. Returns the paths written."""
    matplotlib = import_extra("matplotlib", "bench", "the decode-step plots")
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker below)

    paths = []
    for (preset, L), g in _decode_groups(rows).items():
        steps = g["steps"]
        if not steps:
            continue
        layers = next(iter(steps.values()))["layers"]
        ns = sorted({n for _, n in steps})
        fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4.5))
        base = {B: r["median_s"] * layers for (B, n), r in steps.items() if n == 1}
        for n in ns:
            pts = sorted((B, r["median_s"] * layers) for (B, m), r in steps.items() if m == n)
            label = "baseline (n=1)" if n == 1 else f"EAGLE n={n}"
            style = dict(color="black", lw=2) if n == 1 else dict(lw=1.5)
            ax_t.plot([b for b, _ in pts], [t * 1e3 for _, t in pts], "o-", ms=3, label=label, **style)
            if n > 1:
                ratio = [(b, t / base[b]) for b, t in pts if b in base]
                ax_r.plot([b for b, _ in ratio], [x for _, x in ratio], "o-", ms=3, lw=1.5, label=label)
        ax_t.set(xscale="log", yscale="log", xlabel="batch size B (requests per step)",
                 ylabel=f"step time, ms (one layer x {layers})")
        ax_r.set(xscale="log", xlabel="batch size B (requests per step)",
                 ylabel="EAGLE step / baseline step (tau needed to tie)")
        ax_r.axhline(1.0, color="black", lw=0.8)
        Bs = sorted({B for B, _ in steps})
        for ax in (ax_t, ax_r):
            ax.set_xticks(Bs, [str(b) for b in Bs])  # the measured B, not powers of ten
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        ax_t.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))  # 1-2-5 ms ticks
        ax_t.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax_t.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        any_row = next(iter(steps.values()))
        fig.suptitle(f"decode step, {any_row['model']} ({preset}), L={L}, {any_row['dtype']}, attention "
                     f"{any_row['attention']} ({any_row['impl']}); allreduce not timed", fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, f"decode_step-{preset}-L{L}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _case_cols(B, L, n, heads, D, dtype) -> str:
    return f"{B:>4} {L:>6} {n:>3} {heads:>7} {D:>4} {dtype:<10}"


def _cells(us: str, gbps: str, pct: str, ratio: str) -> str:
    return f" | {us:>8} {gbps:>7} {pct:>5} {ratio:>5}"


def main(argv: list[str]) -> int:
    plots = None
    if argv[:1] == ["--plots"] and len(argv) > 1:
        plots, argv = argv[1], argv[2:]
    if not argv:
        print("usage: python benchmarks/_timing.py [--plots DIR] RESULTS.json [MORE.json ...]", file=sys.stderr)
        return 2
    for path in argv:
        print(f"== {path}")
        rows = rows_from_json(path)
        print("\n".join(format_summary(rows)) if rows else "(no spec-kernels benchmark rows)")
        if plots:
            os.makedirs(plots, exist_ok=True)
            for written in write_decode_step_plots(rows, plots):
                print(f"plot -> {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
