"""Compare two pytest-benchmark JSON files case by case, for kernel regression tracking.

    python -m spec_kernels.bench compare OLD.json NEW.json [--threshold 5%]

Cases are matched by ``fullname`` (e.g. ``benchmarks/test_tree_verify.py::test_attention[B1-...]``).
For each matched case: the median time per call of both runs, the change, the noise (the larger
of the two runs' own spread: interquartile range / median, else stddev / median) and the
achieved GB/s (``extra_info.bytes`` / median, else ``extra_info.gbps``, else "-"). Cases found in
one file only are listed.

A case is SLOWER only when its median grew by more than the threshold AND more than its noise;
a change beyond the threshold but within the noise is marked "noise". Exit status: 1 when any
case is SLOWER, 2 on bad input, else 0.

Warnings (stderr): timings from a CPU run or the tiny preset (they say nothing about GPU
kernels); different devices (times not comparable); two runs of the same build (same commit,
clean tree, same spec_kernels version, extension, torch and triton) whose cases differ beyond
their noise: the machine's run-to-run variation, with a threshold that would cover it.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from typing import Optional

from .provenance import caveat_warning, timing_caveats


@dataclass(frozen=True)
class Case:
    name: str
    median_s: float
    gbps: Optional[float]
    spread: Optional[float] = None  # the run's own spread relative to the median; None: not measured


@dataclass(frozen=True)
class Run:
    path: str
    device: str
    preset: Optional[str]
    when: Optional[str]
    cases: dict[str, Case]
    caveats: list[str] = field(default_factory=list)  # why the times say nothing about a GPU
    build: Optional[str] = None  # what identifies the build, when the file pins it down


def _spread(stats: dict, median: float) -> Optional[float]:
    """IQR / median (stddev / median without an IQR); None for fewer than 2 rounds."""
    if median <= 0 or (stats.get("rounds") or 0) < 2:
        return None
    width = stats.get("iqr")
    if width is None:
        width = stats.get("stddev")
    return None if width is None else float(width) / median


def build_identity(data: dict) -> Optional[str]:
    """The build a pytest-benchmark JSON was measured with, when it says: a clean git commit
    (pytest-benchmark's commit_info) plus machine_info's spec_kernels version, extension, torch
    and triton. None when any of it is unknown or the tree had uncommitted changes."""
    commit = data.get("commit_info") or {}
    ours = (data.get("machine_info") or {}).get("spec_kernels") or {}
    cid = commit.get("id")
    if not cid or cid in ("unversioned", "unknown") or commit.get("dirty") is not False or not ours.get("spec_kernels"):
        return None
    if ours.get("extension_error"):
        ext = "no CUDA extension"
    else:
        ext = f"extension {'/'.join(str(a) for a in ours.get('extension_archs') or []) or '?'} " \
              f"CUDA {ours.get('extension_cuda')}"
    return (f"spec_kernels {ours['spec_kernels']}, commit {str(cid)[:12]}, {ext}, "
            f"torch {ours.get('torch')}, triton {ours.get('triton')}")


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
        cases[name] = Case(name, float(median), gbps, _spread(bench["stats"], float(median)))
    machine = data.get("machine_info") or {}
    ours = machine.get("spec_kernels") or {}
    device = (ours.get("device") or {}).get("name") or (machine.get("cpu") or {}).get("brand_raw") \
        or machine.get("processor") or "unknown device"
    return Run(path, device, ours.get("preset"), data.get("datetime"), cases, timing_caveats(data),
               build_identity(data))


@dataclass(frozen=True)
class Row:
    old: Case
    new: Case
    threshold: float

    @property
    def change(self) -> float:  # relative change of the median time: +0.2 = 20% slower
        if self.old.median_s > 0:
            return self.new.median_s / self.old.median_s - 1
        return 0.0 if self.new.median_s == self.old.median_s else math.inf  # counters can be 0

    @property
    def noise(self) -> Optional[float]:
        """The larger of the two runs' relative spreads (None when neither measured one)."""
        spreads = [c.spread for c in (self.old, self.new) if c.spread is not None]
        return max(spreads) if spreads else None

    @property
    def beyond_noise(self) -> bool:
        return self.noise is not None and abs(self.change) > self.noise

    @property
    def status(self) -> str:
        if abs(self.change) <= self.threshold:
            return "ok"
        if self.noise is not None and not self.beyond_noise:
            return "noise"  # beyond the threshold, but within what the runs themselves scatter
        return "SLOWER" if self.change > 0 else "faster"


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


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1%}"


def _short(name: str) -> str:
    return name.rsplit("/", 1)[-1]  # drop the directory; keep file::test[params]


def format_report(old: Run, new: Run, threshold: float) -> tuple[list[str], int, list[str]]:
    """The report's lines, how many cases are SLOWER, and the warnings (for stderr)."""
    rows, only_old, only_new = compare(old, new, threshold)
    lines = [f"old: {old.path} ({old.device}, preset {old.preset or '-'}, {old.when or 'no date'})",
             f"new: {new.path} ({new.device}, preset {new.preset or '-'}, {new.when or 'no date'})"]
    warnings = [caveat_warning(run.path, run.caveats) for run in (old, new) if run.caveats]
    if old.device != new.device:
        warnings.append(f"WARNING: different devices ({old.device} vs {new.device}): times are not comparable")
    same_build = old.build is not None and old.build == new.build and old.device == new.device
    if rows:
        width = max(len(_short(r.old.name)) for r in rows)
        lines += ["", f"{'case':<{width}} | {'old median':>10} {'new median':>10} {'change':>8} {'noise':>7} | "
                      f"{'old GB/s':>8} {'new GB/s':>8} | status"]
        for r in rows:
            lines.append(f"{_short(r.old.name):<{width}} | {_time(r.old.median_s):>10} {_time(r.new.median_s):>10} "
                         f"{r.change:>+8.1%} {_pct(r.noise):>7} | {_gbps(r.old.gbps):>8} {_gbps(r.new.gbps):>8} | "
                         f"{r.status}")
    for label, names in (("only in old", only_old), ("only in new", only_new)):
        if names:
            lines += ["", f"{label} ({len(names)}):"] + [f"  {_short(n)}" for n in names]
    slower = sum(r.status == "SLOWER" for r in rows)
    noisy = sum(r.status == "noise" for r in rows)
    lines += ["", f"{len(rows)} matched, {slower} slower than +{threshold:.1%} (and their noise), "
                  f"{sum(r.status == 'faster' for r in rows)} faster than -{threshold:.1%}, "
                  f"{noisy} beyond the threshold but within noise, "
                  f"{len(only_old)} only in old, {len(only_new)} only in new"]
    beyond = [r for r in rows if r.beyond_noise]
    if same_build and beyond:
        worst = max(beyond, key=lambda r: abs(r.change))
        variation = (f"median {statistics.median(abs(r.change) for r in rows):.1%}, up to {abs(worst.change):.1%} "
                     f"({_short(worst.old.name)}: {worst.change:+.1%}, its noise {_pct(worst.noise)})")
        if any(r.status in ("SLOWER", "faster") for r in rows):
            warnings.append(
                f"WARNING: old and new come from the same build ({new.build}), yet {len(beyond)} of {len(rows)} "
                f"cases differ by more than their own noise: the measurements are noisy. Run-to-run variation: "
                f"{variation}. Differences of this size are not from the code: on this machine use --threshold "
                f"{math.ceil(abs(worst.change) * 100)}% or more, or more rounds.")
        else:
            lines.append(f"same build ({new.build}): {len(beyond)} cases differ beyond their own noise but within "
                         f"the threshold; run-to-run variation {variation}")
    elif same_build and rows:
        lines.append(f"same build ({new.build}): every difference is within the runs' own noise")
    return lines, slower, warnings


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
    lines, slower, warnings = format_report(old, new, args.threshold)
    print("\n".join(lines), flush=True)
    for line in warnings:  # last, so that they are what a reader sees
        print(line, file=sys.stderr)
    return 1 if slower else 0


def add_parser(commands) -> None:
    p = commands.add_parser("compare", help="compare two pytest-benchmark JSON files",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", help="the baseline JSON (e.g. benchmarks/results/<gpu>/<date>-<module>.json)")
    p.add_argument("new", help="the JSON of the run to check")
    p.add_argument("--threshold", type=parse_threshold, default=0.05,
                   help="fail when a median time grew by more than this and by more than its noise (default 5%%)")
    p.set_defaults(run=run)
