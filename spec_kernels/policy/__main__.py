"""python -m spec_kernels.policy --costs COSTS.json --acceptance ACCEPTANCE.json [--out-dir DIR]

Prints predicted tok/s per concurrency (baseline, each EAGLE config, the best), the crossovers,
the break-even tau, and writes DIR/sglang_adaptive_config.json and DIR/throughput.png.
The model and the input formats: spec_kernels/policy/__init__.py and model.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .._extras import MissingExtraError
from ..bench.provenance import caveat_warning
from .model import (
    AllReduceCost,
    CostModel,
    SpecConfig,
    break_even_tau,
    crossovers,
    load_acceptance,
    load_costs,
    predict,
    predict_adaptive,
    sglang_adaptive_config,
)
from .plot import save_throughput_figure, throughput_figure

CONFIG_FILE = "sglang_adaptive_config.json"
PLOT_FILE = "throughput.png"


def _ints(text: str) -> list[int]:
    values = sorted({int(v) for v in text.split(",") if v.strip()})
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want positive integers, e.g. 1,2,5,10")
    return values


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: want KEY=VALUE")
    return key, value


def _allreduce(text: str) -> AllReduceCost:
    try:
        lat_us, gbps = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LATENCY_US,GBPS (e.g. 36,25), got {text!r}") from None
    if lat_us < 0 or gbps <= 0:
        raise argparse.ArgumentTypeError(f"latency must be >= 0 and bandwidth > 0, got {text!r}")
    return AllReduceCost(lat_us * 1e-6, gbps * 1e9)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m spec_kernels.policy", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--costs", required=True, help="decode-step pytest-benchmark JSON, or a cost file")
    p.add_argument("--acceptance", required=True, help="acceptance statistics (tau per config)")
    p.add_argument("--out-dir", default="policy-out", help="where the config JSON and the plot go")
    p.add_argument("--concurrency", type=_ints, help="table rows (default: the measured baseline B)")
    p.add_argument("--max-batch", type=int, help="crossovers/config/plot cover B = 1..this (default: max concurrency)")
    p.add_argument("--select", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="use only cost rows with this extra_info value (repeatable)")
    p.add_argument("--overhead-s", type=float, default=0.0, help="seconds added to every step of both modes")
    p.add_argument("--allreduce", type=_allreduce, metavar="LATENCY_US,GBPS",
                   help="add 2 tensor-parallel allreduces per layer to rows with allreduce_bytes: "
                        "latency (us) + bytes / bandwidth (GB/s) each, e.g. 36,25 for NCCL over PCIe at TP8")
    p.add_argument("--interpolate-n", action="store_true",
                   help="allow tree sizes without EAGLE costs: linear in n between measured sizes (n=1: baseline)")
    p.add_argument("--draft-fixed-s", type=float, default=0.0,
                   help="with --interpolate-n: seconds of each EAGLE step that do not grow with n (drafting); "
                        "the line in n starts at baseline + this at n = 1")
    return p.parse_args(argv)


def _fmt(x: float) -> str:
    return f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def format_table(costs: CostModel, configs: list[SpecConfig], concurrency: list[int]) -> list[str]:
    names = [c.name for c in configs]
    width = max([8, 9] + [len(n) for n in names])
    head = f"{'B':>5} | {'baseline':>{width}}" + "".join(f" | {n:>{width}}" for n in names)
    lines = [head + f" | {'best':<{width}} | best/base", "-" * (len(head) + width + 15)]
    for B in concurrency:
        p = predict(costs, configs, B)
        mark = "*" if B > costs.measured_max_B else " "
        row = f"{B:>4}{mark} | {_fmt(p.baseline):>{width}}" + "".join(f" | {_fmt(p.eagle[n]):>{width}}" for n in names)
        lines.append(row + f" | {p.best:<{width}} | {p.best_tok_s / p.baseline:.2f}")
    return lines


def format_adaptive(costs: CostModel, configs: list[SpecConfig], concurrency: list[int]) -> list[str]:
    """The adaptive server per B: its tier, its tok/s (drafting off at the measured eagle_off cost),
    a plain server's, and which of the two servers is faster."""
    lines = [f"{'B':>5} | {'tier':>16} | {'adaptive':>9} | {'drafting off':>12} | {'plain':>9} | faster server"]
    for B in concurrency:
        p = predict_adaptive(costs, configs, B)
        tier = "drafting off" if p.best == "off" else p.best
        faster = "adaptive" if p.best_tok_s > p.plain else "plain"
        lines.append(f"{B:>5} | {tier:>16} | {_fmt(p.best_tok_s):>9} | {_fmt(p.off):>12} | {_fmt(p.plain):>9} | "
                     f"{faster} ({max(p.best_tok_s, p.plain) / min(p.best_tok_s, p.plain):.2f}x)")
    return lines


def format_crossovers(costs: CostModel, configs: list[SpecConfig], max_B: int) -> list[str]:
    lines = []
    for name, runs in crossovers(costs, configs, max_B).items():
        if len(runs) == 1:
            lines.append(f"  {name}: {'ahead of' if runs[0][2] else 'behind'} baseline at every B in 1..{max_B}")
            continue
        parts = [f"{'ahead' if ahead else 'behind'} for B {lo}" + (f"..{hi}" if hi > lo else "") for lo, hi, ahead in runs]
        flips = ", ".join(str(lo) for lo, _, _ in runs[1:])
        lines.append(f"  {name}: {'; '.join(parts)} (crossover at B = {flips})")
    return lines


def format_break_even(costs: CostModel, configs: list[SpecConfig], concurrency: list[int]) -> list[str]:
    names = [f"{c.name} ({c.tau:g})" for c in configs]
    width = max([8] + [len(n) for n in names])
    lines = [f"{'B':>5}" + "".join(f" | {n:>{width}}" for n in names)]
    for B in concurrency:
        lines.append(f"{B:>5}" + "".join(f" | {break_even_tau(costs, c, B):>{width}.2f}" for c in configs))
    return lines


def write_plot(path: str, costs: CostModel, configs: list[SpecConfig], max_B: int, title: str) -> None:
    plt, fig, ax = throughput_figure("the policy's plot")
    bs = list(range(1, max_B + 1))
    preds = [predict(costs, configs, B) for B in bs]
    ax.plot(bs, [p.best_tok_s for p in preds], color="0.8", lw=7, zorder=0, label="policy (the best)")
    ax.plot(bs, [p.baseline for p in preds], color="black", lw=2, label="baseline")
    for c in configs:
        ax.plot(bs, [p.eagle[c.name] for p in preds], lw=1.5, label=f"EAGLE {c.name} (tau {c.tau:g})")
    measured = [b for b in costs.baseline.bs if b <= max_B]
    ax.plot(measured, [b / costs.step_time(b) for b in measured], "ko", ms=4, label="measured B")
    save_throughput_figure(plt, fig, ax, path, "concurrency = batch size B (closed loop)", title)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        costs = load_costs(args.costs, dict(args.select), args.overhead_s, args.interpolate_n, args.draft_fixed_s,
                           args.allreduce)
        configs, acc_description = load_acceptance(args.acceptance)
        concurrency = args.concurrency or costs.baseline.bs
        max_B = args.max_batch or max(concurrency)
        for c in configs:
            costs.step_time(1, c.n)  # raises if a tree size has no costs
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    if costs.caveats:  # first and on stderr: every number below inherits it
        print(caveat_warning(args.costs, costs.caveats) + "; so do the predictions below", file=sys.stderr)
    print(f"costs:      {args.costs}: {costs.description}")
    print(f"acceptance: {args.acceptance}: {acc_description}")
    if args.overhead_s:
        print(f"overhead:   {args.overhead_s * 1e3:g} ms added to every step")
    if args.allreduce:
        ar = args.allreduce
        print(f"allreduce:  {ar.per_layer} per layer, {ar.latency_s * 1e6:g} us + bytes / {ar.bytes_per_s / 1e9:g} GB/s "
              "each, added to rows with allreduce_bytes")
    if args.interpolate_n:
        print(f"n without costs: linear in n from baseline + {args.draft_fixed_s * 1e3:g} ms at n = 1 "
              "to the measured sizes (--interpolate-n, --draft-fixed-s)")
    print("\npredicted output tok/s (closed loop: concurrency = batch size B; * = beyond the measured B)")
    print("\n".join(format_table(costs, configs, concurrency)))
    print(f"\nEAGLE vs baseline over B = 1..{max_B}:")
    print("\n".join(format_crossovers(costs, configs, max_B)))
    print("\nbreak-even tau (tau a config needs to tie baseline = its step time / the baseline step time;"
          " its own tau in brackets)")
    print("\n".join(format_break_even(costs, configs, concurrency)))

    if costs.eagle_off is not None:
        print("\nadaptive server (SGLang --speculative-adaptive, chains only; drafting off at its measured cost, "
              "the eagle_off rows) vs a plain server")
        print("\n".join(format_adaptive(costs, configs, concurrency)))

    os.makedirs(args.out_dir, exist_ok=True)
    config = sglang_adaptive_config(costs, configs, max_B)
    config_path = os.path.join(args.out_dir, CONFIG_FILE)
    with open(config_path, "w") as fh:
        json.dump(config, fh, indent=2)
        fh.write("\n")
    trees = [c.name for c in configs if c.sglang_steps is None]
    print(f"\nSGLang --speculative-adaptive-config (topk=1 chains and baseline only"
          f"{'; trees left out: ' + ', '.join(trees) if trees else ''}) -> {config_path}")
    print(json.dumps(config))
    plot_path = os.path.join(args.out_dir, PLOT_FILE)
    try:
        write_plot(plot_path, costs, configs, max_B, f"{costs.description}\n{acc_description}")
        print(f"plot -> {plot_path}")
    except MissingExtraError as exc:
        print(f"plot skipped: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
