"""Compare two pytest-benchmark JSON files case by case, for kernel regression tracking.

    python -m spec_kernels.bench compare OLD.json NEW.json [--threshold 5%]

Cases are matched by ``fullname`` (e.g. ``benchmarks/test_tree_verify.py::test_attention[B1-...]``).
For each matched case: the median time per call of both runs, the change, and the achieved GB/s
(``extra_info.bytes`` / median, else ``extra_info.gbps``, else "-"). Cases found in one file only
are listed. Exit status: 1 when any matched case's median grew by more than the threshold, 2 on
bad input, else 0. Times from different devices are not comparable: a warning says so.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Case:
    name: str
    median_s: float
    gbps: Optional[float]


@dataclass(frozen=True)
class Run:
    path: str
    device: str
    preset: Optional[str]
    when: Optional[str]
    cases: dict[str, Case]


def load(path: str) -> Run:
    with open(path) as fh:
        data = json.load(fh)
    if not isinstance(data, dict) or "benchmarks" not in data:
        raise ValueError(f"{path}: not a pytest-benchmark JSON file (no 'benchmarks')")
    cases = {}
    for bench in data["benchmarks"]:
        name = bench.get("fullname") or bench.get("name")
        median = (bench.get("stats") or {}).get("median")
        if name is None or median is None:
            continue
        info = bench.get("extra_info") or {}
        gbps = info.get("gbps")
        if info.get("bytes") and median > 0:  # recomputed, so that it always matches the median shown
            gbps = info["bytes"] / median / 1e9
        cases[name] = Case(name, float(median), gbps)
    machine = data.get("machine_info") or {}
    ours = machine.get("spec_kernels") or {}
    device = (ours.get("device") or {}).get("name") or (machine.get("cpu") or {}).get("brand_raw") \
        or machine.get("processor") or "unknown device"
    return Run(path, device, ours.get("preset"), data.get("datetime"), cases)


@dataclass(frozen=True)
class Row:
    old: Case
    new: Case
    threshold: float

    @property
    def change(self) -> float:  # relative change of the median time: +0.2 = 20% slower
        return self.new.median_s / self.old.median_s - 1 if self.old.median_s > 0 else math.inf

    @property
    def status(self) -> str:
        if self.change > self.threshold:
            return "SLOWER"
        return "faster" if self.change < -self.threshold else "ok"


def compare(old: Run, new: Run, threshold: float) -> tuple[list[Row], list[str], list[str]]:
    """(matched rows, worst change first; names only in old; names only in new)."""
    rows = [Row(old.cases[name], new.cases[name], threshold) for name in old.cases if name in new.cases]
    rows.sort(key=lambda r: -r.change)
    only_old = [name for name in old.cases if name not in new.cases]
    only_new = [name for name in new.cases if name not in old.cases]
    return rows, only_old, only_new


def _time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds / 1e-9:.4g} ns"


def _gbps(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4g}"


def _short(name: str) -> str:
    return name.rsplit("/", 1)[-1]  # drop the directory; keep file::test[params]


def format_report(old: Run, new: Run, threshold: float) -> tuple[list[str], int]:
    """The report's lines and how many cases slowed beyond the threshold."""
    rows, only_old, only_new = compare(old, new, threshold)
    lines = [f"old: {old.path} ({old.device}, preset {old.preset or '-'}, {old.when or 'no date'})",
             f"new: {new.path} ({new.device}, preset {new.preset or '-'}, {new.when or 'no date'})"]
    if old.device != new.device:
        lines.append(f"warning: different devices ({old.device} vs {new.device}): times are not comparable")
    if rows:
        width = max(len(_short(r.old.name)) for r in rows)
        lines += ["", f"{'case':<{width}} | {'old median':>10} {'new median':>10} {'change':>8} | "
                      f"{'old GB/s':>8} {'new GB/s':>8} | status"]
        for r in rows:
            lines.append(f"{_short(r.old.name):<{width}} | {_time(r.old.median_s):>10} {_time(r.new.median_s):>10} "
                         f"{r.change:>+8.1%} | {_gbps(r.old.gbps):>8} {_gbps(r.new.gbps):>8} | {r.status}")
    for label, names in (("only in old", only_old), ("only in new", only_new)):
        if names:
            lines += ["", f"{label} ({len(names)}):"] + [f"  {_short(n)}" for n in names]
    slower = sum(r.status == "SLOWER" for r in rows)
    lines += ["", f"{len(rows)} matched, {slower} slower than +{threshold:.1%}, "
                  f"{sum(r.status == 'faster' for r in rows)} faster than -{threshold:.1%}, "
                  f"{len(only_old)} only in old, {len(only_new)} only in new"]
    return lines, slower


def parse_threshold(text: str) -> float:
    """'5%' or '5' -> 0.05 (a percentage either way)."""
    try:
        value = float(text.strip().rstrip("%")) / 100
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want a percentage such as 5%") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 0")
    return value


def run(args) -> int:
    try:
        old, new = load(args.old), load(args.new)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    lines, slower = format_report(old, new, args.threshold)
    print("\n".join(lines))
    return 1 if slower else 0


def add_parser(commands) -> None:
    p = commands.add_parser("compare", help="compare two pytest-benchmark JSON files",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", help="the baseline JSON (e.g. benchmarks/results/<gpu>/<date>-<module>.json)")
    p.add_argument("new", help="the JSON of the run to check")
    p.add_argument("--threshold", type=parse_threshold, default=0.05,
                   help="fail when a median time grew by more than this (default 5%%)")
    p.set_defaults(run=run)
