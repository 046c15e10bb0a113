"""Cost curves, acceptance statistics, predictions, crossovers and SGLang's adaptive config.

The model and its assumptions are described in the package docstring (spec_kernels/policy).

Cost input, either of two JSON files (both become rows {mode, B, n, step_s, ...}):

* pytest-benchmark JSON of the decode-step benchmark. A result is used when its ``extra_info``
  has ``kind: "decode_step"`` and:
    - ``mode``: ``"baseline"`` (B requests x 1 token), ``"eagle"`` (the verify step: B x n tokens,
      plus KV slot alloc + commit) or ``"draft"`` (the draft model's work for one EAGLE step at
      that B and n; added to ``eagle``'s step when present);
    - ``B`` (requests per step) and ``n`` (tokens per request through the target: 1 for baseline,
      the tree size for eagle and draft);
    - ``layers`` (optional, default 1): how many times the timed unit runs per model step, e.g. the
      preset's layer count when one layer is timed. step_s = ``stats.median`` x ``layers``;
    - anything else (``preset``, ``impl``, ``L``, ``dtype``, device...) only selects results:
      ``--select preset=kimi-k2.5-tp8 --select L=4096``. Two results left for the same
      (mode, B, n) are an error that names the keys they differ in.
  Times from a CPU run or the ``tiny`` preset (``machine_info["spec_kernels"]``, the rows'
  presets) still load, with ``CostModel.caveats`` saying so (the CLI prints a WARNING).
* a hand-written cost file: ``{"description": "...", "steps": [{"mode": "baseline", "B": 1,
  "n": 1, "step_s": 0.0108}, ...]}``, step_s = seconds per whole decode step; other keys in a
  row are kept for provenance (and ``--select``). Such a file (``python -m spec_kernels.serve_check``
  writes one) may also carry ``mode: "eagle_off"`` rows (n = 1): the step of SGLang's EAGLE worker
  with drafting turned off by its adaptive mode (steps 0: a 1-token verify, and the draft's extend
  unless skipped), which is what an adaptive server runs where the policy says "no speculation",
  and is not the plain server's step.

The tensor-parallel allreduce is not in a one-process decode-step measurement. With an
`AllReduceCost` (latency + bytes / bandwidth per call, e.g. from benchmarks/test_allreduce_rmsnorm.py
or the DESIGN card's NCCL figures), every row that carries ``allreduce_bytes`` (the message of one
allreduce: rows x hidden x element size) gets ``layers x per_layer x (latency + bytes / bandwidth)``
added to its step; the verify step's messages are n times larger than decode's.

Acceptance input: ``{"description": "...", "configs": [{"n": 4, "tau": 2.18, "topk": 1,
"label": "chain-4"}, ...]}``: n = draft tokens verified per request per step (SGLang's
``speculative_num_draft_tokens``), tau = mean tokens emitted per request per step including the
bonus token (SGLang's "accept length"; 1 <= tau <= n), topk = 1 for a chain (the only shape
SGLang's adaptive mode runs), > 1 or null for a tree. Other keys are ignored.
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from ..bench.provenance import timing_caveats

MODES = ("baseline", "eagle", "draft", "eagle_off")
ONE_TOKEN_MODES = ("baseline", "eagle_off")  # n = 1: one token per request per step


class Curve:
    """Step time in seconds vs batch size B, from measurements at a few B: linear between them,
    made non-decreasing, held below the first and continued along the last segment above the
    last (a single point is constant)."""

    def __init__(self, points: Mapping[int, float]):
        if not points:
            raise ValueError("a cost curve needs at least one measured batch size")
        self.bs = sorted(points)
        self.ts: list[float] = []
        for b in self.bs:
            t = float(points[b])
            if not (t > 0 and math.isfinite(t)):
                raise ValueError(f"step time at B={b} must be a positive number of seconds, got {points[b]!r}")
            self.ts.append(max(t, self.ts[-1]) if self.ts else t)  # a larger batch is never faster

    def __call__(self, B: float) -> float:
        bs, ts = self.bs, self.ts
        if B <= bs[0] or len(bs) == 1:
            return ts[0]
        i = min(bisect.bisect_right(bs, B), len(bs) - 1)  # segment [i-1, i]; the last one above
        return ts[i - 1] + (ts[i] - ts[i - 1]) * (B - bs[i - 1]) / (bs[i] - bs[i - 1])


@dataclass
class CostModel:
    """t_base(B) and t_eagle(B, n), in seconds per decode step of the whole model."""

    baseline: Curve
    eagle: dict[int, list[Curve]]  # n -> curves summed per step (verify, and draft when measured)
    overhead_s: float = 0.0  # added to every step of both modes: what the costs did not time
    interpolate_n: bool = False
    description: str = ""
    draft_fixed_s: float = 0.0  # with interpolate_n: an EAGLE step's cost at n -> 1 is baseline + this
    caveats: list[str] = field(default_factory=list)  # why the measured times say nothing about a GPU
    # SGLang's EAGLE worker with drafting off (adaptive steps 0); None: not measured, taken as baseline
    eagle_off: Optional[Curve] = None

    def off_step_time(self, B: float) -> float:
        """The step of an adaptive server at steps 0: measured, or the plain server's when not."""
        return (self.eagle_off(B) if self.eagle_off is not None else self.baseline(B)) + self.overhead_s

    @property
    def measured_max_B(self) -> int:
        return self.baseline.bs[-1]

    def step_time(self, B: float, n: int = 1) -> float:
        return self._raw(B, n) + self.overhead_s

    def _raw(self, B: float, n: int) -> float:
        if n == 1:
            return self.baseline(B)
        if n in self.eagle:
            return sum(curve(B) for curve in self.eagle[n])
        sizes = sorted(self.eagle)
        if not self.interpolate_n:
            raise ValueError(f"no EAGLE costs for n={n} (measured: {sizes or 'none'}); "
                             "measure it, or pass --interpolate-n to interpolate in n")
        if not sizes or n > sizes[-1]:
            raise ValueError(f"n={n} is above the largest measured tree size ({sizes}): no extrapolation in n")
        lo = max(k for k in [1] + sizes if k < n)
        hi = min(k for k in sizes if k > n)
        # the part of an EAGLE step that does not grow with n (drafting, draft extend) is in the
        # measured sizes but not in plain decode: start the line from decode + that part
        t_lo = self._raw(B, lo) + (self.draft_fixed_s if lo == 1 else 0.0)
        t_hi = self._raw(B, hi)
        return t_lo + (t_hi - t_lo) * (n - lo) / (hi - lo)


@dataclass(frozen=True)
class AllReduceCost:
    """Time of one tensor-parallel allreduce of `nbytes`: latency_s + nbytes / bytes_per_s."""

    latency_s: float
    bytes_per_s: float
    per_layer: int = 2  # after attention's o_proj and after the MLP / MoE

    def step_seconds(self, row: Mapping) -> float:
        nbytes = float(row.get("allreduce_bytes") or 0)
        if nbytes <= 0:
            return 0.0
        return int(row.get("layers", 1)) * self.per_layer * (self.latency_s + nbytes / self.bytes_per_s)


def _bench_rows(data: dict) -> list[dict]:
    """Rows of the decode-step results of a pytest-benchmark JSON (see the module docstring)."""
    rows = []
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info") or {}
        median = (bench.get("stats") or {}).get("median")
        if info.get("kind") != "decode_step" or median is None:
            continue
        rows.append(dict(info, step_s=median * info.get("layers", 1)))
    return rows


def _describe_bench(data: dict, rows: list[dict]) -> str:
    device = ((data.get("machine_info") or {}).get("spec_kernels") or {}).get("device") or {}
    presets = sorted({str(r["preset"]) for r in rows if "preset" in r})
    return f"decode-step benchmark on {device.get('name', 'unknown device')}" + (
        f", preset {', '.join(presets)}" if presets else "")


def load_costs(path: str, select: Optional[Mapping[str, str]] = None, overhead_s: float = 0.0,
               interpolate_n: bool = False, draft_fixed_s: float = 0.0,
               allreduce: Optional[AllReduceCost] = None) -> CostModel:
    """A CostModel from a pytest-benchmark JSON or a cost file (formats: module docstring).
    `select`: keep only rows whose key has this value (compared as strings); `allreduce`: add
    the allreduce time of rows that carry allreduce_bytes."""
    with open(path) as fh:
        data = json.load(fh)
    if "benchmarks" in data:
        rows = _bench_rows(data)
        description = _describe_bench(data, rows)
    elif "steps" in data:
        rows, description = list(data["steps"]), data.get("description", "")
    else:
        raise ValueError(f"{path}: neither pytest-benchmark JSON (no 'benchmarks') nor a cost file (no 'steps')")
    select = dict(select or {})
    rows = [r for r in rows if all(str(r.get(k)) == v for k, v in select.items())]
    caveats = timing_caveats(data, rows) if "benchmarks" in data else []  # cost files: no record

    points: dict[tuple[str, int], dict[int, float]] = {}
    seen: dict[tuple[str, int, int], dict] = {}
    for r in rows:
        mode, B, n = r.get("mode"), int(r["B"]), int(r.get("n", 1))
        if mode not in MODES:
            raise ValueError(f"{path}: mode {mode!r} is not one of {MODES}")
        if (mode in ONE_TOKEN_MODES) != (n == 1):
            raise ValueError(f"{path}: {mode} row with n={n} (baseline and eagle_off are n = 1, eagle/draft n >= 2)")
        key = (mode, B, n)
        if key in seen:
            other = seen[key]
            differ = sorted(k for k in set(r) | set(other) if k != "step_s" and r.get(k) != other.get(k))
            raise ValueError(f"{path}: two results for mode={mode} B={B} n={n} (they differ in "
                             f"{', '.join(differ) or 'nothing but their time'}); keep one with --select KEY=VALUE")
        seen[key] = r
        step_s = float(r["step_s"]) + (allreduce.step_seconds(r) if allreduce else 0.0)
        points.setdefault((mode, n), {})[B] = step_s
    if ("baseline", 1) not in points:
        raise ValueError(f"{path}: no baseline costs" + (f" with {select}" if select else ""))
    eagle: dict[int, list[Curve]] = {}
    for (mode, n), pts in sorted(points.items()):
        if mode == "eagle":
            eagle[n] = [Curve(pts)]
    for (mode, n), pts in points.items():
        if mode == "draft":
            if n not in eagle:
                raise ValueError(f"{path}: draft costs for n={n} without eagle (verify) costs for it")
            eagle[n].append(Curve(pts))
    off = Curve(points[("eagle_off", 1)]) if ("eagle_off", 1) in points else None
    return CostModel(Curve(points[("baseline", 1)]), eagle, overhead_s, interpolate_n, description, draft_fixed_s,
                     caveats, off)


@dataclass(frozen=True)
class SpecConfig:
    """One speculation configuration: n draft tokens per request per step, tau tokens out."""

    n: int
    tau: float
    topk: Optional[int] = 1  # 1: a chain; > 1 or None: a tree
    label: str = ""

    def __post_init__(self):
        if self.n < 2:
            raise ValueError(f"n={self.n}: a speculation config verifies at least 2 tokens (n = 1 is baseline)")
        if not 1.0 <= self.tau <= self.n:
            raise ValueError(f"n={self.n}: tau={self.tau} must lie in [1, n] (it counts the bonus token)")

    @property
    def name(self) -> str:
        return self.label or f"n={self.n}"

    @property
    def sglang_steps(self) -> Optional[int]:
        """speculative_num_steps in SGLang's adaptive mode, which runs chains only (topk = 1,
        num_draft_tokens = steps + 1); None for a tree."""
        return self.n - 1 if self.topk == 1 else None


def load_acceptance(path: str) -> tuple[list[SpecConfig], str]:
    with open(path) as fh:
        data = json.load(fh)
    configs = [SpecConfig(int(c["n"]), float(c["tau"]), c.get("topk", 1), c.get("label", ""))
               for c in data.get("configs", [])]
    if not configs:
        raise ValueError(f"{path}: no 'configs'")
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: config names must be unique (give each a 'label'): {names}")
    return configs, data.get("description", "")


@dataclass(frozen=True)
class Prediction:
    B: int
    baseline: float  # tok/s
    eagle: dict[str, float]  # config name -> tok/s
    best: str  # "baseline" or a config name

    @property
    def best_tok_s(self) -> float:
        return self.baseline if self.best == "baseline" else self.eagle[self.best]


def predict(costs: CostModel, configs: Sequence[SpecConfig], B: int) -> Prediction:
    """Throughput of baseline and of each config at batch size B, and the fastest (ties go to
    baseline, the simpler server)."""
    base = B / costs.step_time(B)
    eagle, best = _fastest(costs, configs, B, "baseline", base)
    return Prediction(B, base, eagle, best)


def _fastest(costs: CostModel, configs: Sequence[SpecConfig], B: int, plain: str, plain_tok_s: float
             ) -> tuple[dict[str, float], str]:
    """Each config's tok/s at B and the fastest of them and the tier without drafting (`plain`,
    at `plain_tok_s`), which wins ties."""
    eagle = {c.name: B * c.tau / costs.step_time(B, c.n) for c in configs}
    best = max(eagle, key=eagle.get, default=None)
    return eagle, best if best is not None and eagle[best] > plain_tok_s else plain


def break_even_tau(costs: CostModel, config: SpecConfig, B: int) -> float:
    """The tau at which `config` ties baseline at B: how many decode steps one EAGLE step costs."""
    return costs.step_time(B, config.n) / costs.step_time(B)


def crossovers(costs: CostModel, configs: Sequence[SpecConfig], max_B: int) -> dict[str, list[tuple[int, int, bool]]]:
    """Per config, the runs of B in 1..max_B where it is ahead of baseline (True) or not:
    [(first B, last B, ahead), ...]. A run's first B after the first one is a crossover."""
    result = {}
    for c in configs:
        runs: list[tuple[int, int, bool]] = []
        for B in range(1, max_B + 1):
            p = predict(costs, [c], B)
            ahead = p.best != "baseline"
            if runs and runs[-1][2] == ahead:
                runs[-1] = (runs[-1][0], B, ahead)
            else:
                runs.append((B, B, ahead))
        result[c.name] = runs
    return result


@dataclass(frozen=True)
class AdaptivePrediction:
    """An adaptive server (SGLang ``--speculative-adaptive``, chains only) at batch size B: each
    chain's tok/s, the tok/s of its steps-0 tier (drafting off), the tier it should run, and how it
    compares with a plain server."""

    B: int
    off: float  # tok/s with drafting off (the measured eagle_off step, else the plain server's)
    eagle: dict[str, float]  # chain name -> tok/s
    best: str  # "off" or a chain name
    plain: float  # tok/s of a plain server (no EAGLE worker)
    off_measured: bool

    @property
    def best_tok_s(self) -> float:
        return self.off if self.best == "off" else self.eagle[self.best]


def predict_adaptive(costs: CostModel, configs: Sequence[SpecConfig], B: int) -> AdaptivePrediction:
    """The adaptive server's tiers at B (trees are left out: adaptive runs chains only); ties go
    to drafting off."""
    chains = [c for c in configs if c.sglang_steps is not None]
    off = B / costs.off_step_time(B)
    eagle, best = _fastest(costs, chains, B, "off", off)
    return AdaptivePrediction(B, off, eagle, best, B / costs.step_time(B), costs.eagle_off is not None)


def sglang_adaptive_config(costs: CostModel, configs: Sequence[SpecConfig], max_B: int) -> dict:
    """SGLang 0.5.23's --speculative-adaptive-config JSON for the policy over B = 1..max_B.

    Format (sglang/srt/speculative/adaptive_spec_params.py): each integer-string key is a batch-size
    slot; a batch of b requests (after SGLang pads b to a captured CUDA-graph batch size) uses the
    slot with the largest key <= b. A slot's ``candidate_steps`` are the speculative_num_steps the
    runtime may move between as it tracks acceptance; 0 turns drafting off. Adaptive mode needs
    topk = 1, so only chains (and drafting off) are candidates here, steps = n - 1. Drafting off is
    judged by its measured cost (``eagle_off`` rows) where the cost file has them, else by the plain
    server's. One candidate per slot pins the model's choice; other knobs (ema_alpha, hysteresis,
    ...) keep SGLang's defaults.
    """
    steps_of = {c.name: c.sglang_steps for c in configs if c.sglang_steps is not None}
    config: dict[str, dict] = {}
    last = None
    for B in range(1, max_B + 1):
        best = predict_adaptive(costs, configs, B).best
        steps = 0 if best == "off" else steps_of[best]
        if steps != last:
            config[str(B)] = {"candidate_steps": [steps]}
            last = steps
    return config
