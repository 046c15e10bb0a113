"""Where the timings of a pytest-benchmark JSON came from, as far as the file records it.

benchmarks/conftest.py writes ``machine_info["spec_kernels"]``: the benchmark preset and the
device (``{"type": "cpu" | "cuda", "name": ...}``); rows may carry ``extra_info["preset"]`` (the
benchmark preset, or a model preset such as ``tiny-gqa``) and ``extra_info["bench_preset"]``.
A CPU run or the ``tiny`` preset only checks that the benchmarks run: its times say nothing about
GPU kernels. Hand-written cost files have no such record and get no caveat.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

PRESET_KEYS = ("preset", "bench_preset")


def _is_tiny(preset) -> bool:
    return isinstance(preset, str) and (preset == "tiny" or preset.startswith("tiny-"))


def timing_caveats(data: Mapping, infos: Optional[Iterable[Mapping]] = None) -> list[str]:
    """Why the file's times do not measure GPU performance ([] when nothing says so).
    `infos`: the rows' extra_info dicts to look at (default: every row's)."""
    ours = (data.get("machine_info") or {}).get("spec_kernels") or {}
    device = ours.get("device")
    reasons = []
    if isinstance(device, Mapping) and device.get("type") == "cpu":
        reasons.append(f"a CPU run ({device.get('name') or 'cpu'})")
    if infos is None:
        infos = [b.get("extra_info") or {} for b in data.get("benchmarks") or [] if isinstance(b, Mapping)]
    presets = {ours.get("preset")} | {info.get(k) for info in infos for k in PRESET_KEYS}
    tiny = sorted(p for p in presets if _is_tiny(p))
    if tiny:
        models = [p for p in tiny if p != "tiny"]
        reasons.append("the tiny preset" + (f" ({', '.join(models)})" if models else ""))
    return reasons


def caveat_warning(path: str, reasons: list[str]) -> str:
    """The one WARNING line for a file with caveats."""
    return (f"WARNING: {path}: timings from {' and '.join(reasons)}: they only show that the benchmarks "
            "run and say nothing about GPU kernel performance; use a GPU run (preset gpu-quick or gpu)")
