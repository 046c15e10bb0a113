"""Which allreduce algorithm runs for a message: a per-machine tuning table, else a cost model.

Tuning file (JSON, written by ``python -m spec_kernels.comm.tune``; path from the
communicator's ``tuning_path``, else ``$SPEC_KERNELS_AR_TUNING``, else
``~/.cache/spec_kernels/allreduce_tuning.json``)::

    {"format": "spec_kernels.allreduce_tuning/1",
     "machines": {"<fingerprint>": {"<world size>": {
         "thresholds": [{"max_bytes": 28672, "algorithm": "oneshot_push"},
                        {"max_bytes": null, "algorithm": "twoshot"}],   # null: no upper bound
         "measurements": [...], "dtype": "bfloat16", "hidden_size": 7168, ...}}}}

One file can hold several machines (fingerprint = host name, device kind and names) and world
sizes; a table from another machine is never used. A message of B bytes takes the first
threshold with B <= max_bytes. Untuned, the cost model below picks the algorithm with the
smallest estimate; ``algorithm_for`` says which source decided and why.
"""
from __future__ import annotations

import json
import os
import socket
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch

FORMAT = "spec_kernels.allreduce_tuning/1"
TUNING_ENV = "SPEC_KERNELS_AR_TUNING"
DEFAULT_TUNING_PATH = Path("~/.cache/spec_kernels/allreduce_tuning.json")

# Fastest first for tiny messages; "torch" (torch.distributed: NCCL on GPUs, gloo on CPUs, then
# our fused_add_rmsnorm) runs everywhere.
CUDA_ALGORITHMS = ("oneshot_push_1block", "oneshot_push", "oneshot_pull", "twoshot")
ALGORITHMS = CUDA_ALGORITHMS + ("torch",)

# First-principles model of one call (PCIe Gen5 x16, no NVLink; docs/design.md, "What the alternatives do").
P2P_HOP_US = 3.0  # one cross-GPU signal: write + remote poll sees it (0.5-3 us measured on PCIe)
P2P_GBPS = 25.0  # P2P ingress per GPU (Gen5 x16 P2P through switches / root complex: 25-50)
TORCH_BASE_US = 30.0  # NCCL over PCIe for a tiny message at TP 4-8 (measured 13-60 us)
# Assumed, not measured (a tuning table replaces them): the full grid's blocks each handshake
# with every peer and the call waits for the slowest; one block sends at a fraction of P2P_GBPS.
GRID_SYNC_US = 2.0
ONE_BLOCK_GBPS = 20.0


class AlgorithmChoice(str):
    """An algorithm name (compares equal to the plain string) with ``reason``: why it was chosen."""

    reason: str

    def __new__(cls, name: str, reason: str) -> "AlgorithmChoice":
        obj = super().__new__(cls, name)
        obj.reason = reason
        return obj


def estimate_us(algorithm: str, world_size: int, nbytes: int) -> float:
    """Modelled time of one call. One-shot moves (W-1) x B into every GPU; two-shot moves
    2 (W-1)/W x B but needs more synchronisation steps; push needs one signal (the data is its own
    flag), pull two (ready, then read), two-shot three (scatter, reduce, gather). The full-grid
    kernels pay GRID_SYNC_US for their many per-block handshakes; the one-block push does not, but
    moves its bytes at ONE_BLOCK_GBPS."""
    w = world_size
    per_byte_us = 1e-3 / P2P_GBPS  # us per byte at P2P_GBPS GB/s
    if algorithm == "oneshot_push_1block":
        return P2P_HOP_US + (w - 1) * nbytes * 1e-3 / ONE_BLOCK_GBPS
    if algorithm == "oneshot_push":
        return P2P_HOP_US + GRID_SYNC_US + (w - 1) * nbytes * per_byte_us
    if algorithm == "oneshot_pull":
        return 2 * P2P_HOP_US + GRID_SYNC_US + (w - 1) * nbytes * per_byte_us
    if algorithm == "twoshot":
        return 3 * P2P_HOP_US + GRID_SYNC_US + 2 * (w - 1) / w * nbytes * per_byte_us
    if algorithm == "torch":
        return TORCH_BASE_US + 2 * (w - 1) / w * nbytes * per_byte_us
    raise ValueError(f"unknown algorithm {algorithm!r}; one of {ALGORITHMS}")


# --------------------------------------------------------------------------- machine / file
def machine_fingerprint(device: torch.device) -> str:
    """What a tuning table is valid for: this host and the kind and names of its devices."""
    host = socket.gethostname()
    if device.type == "cuda":
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        return f"{host}|cuda|{torch.cuda.device_count()}x{'+'.join(names)}"
    return f"{host}|{device.type}"


def tuning_path(path: Optional[os.PathLike] = None) -> Path:
    """The tuning file to use: the argument, else $SPEC_KERNELS_AR_TUNING, else the default."""
    chosen = path or os.environ.get(TUNING_ENV) or DEFAULT_TUNING_PATH
    return Path(chosen).expanduser()


@dataclass(frozen=True)
class Table:
    """Thresholds for one (machine, world size): ((max_bytes or None, algorithm), ...)."""

    thresholds: tuple[tuple[Optional[int], str], ...]
    source: str  # where it came from, for explanations

    def digest(self) -> int:
        """A checksum ranks compare to make sure they all select alike."""
        return zlib.crc32(json.dumps(self.thresholds).encode())


def _read(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {"format": FORMAT, "machines": {}}
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"tuning file {path} is unreadable ({exc}); fix or delete it") from exc
    if data.get("format") != FORMAT:
        raise ValueError(f"tuning file {path} has format {data.get('format')!r}, expected {FORMAT!r}")
    return data


def _validate(thresholds, where: str) -> tuple[tuple[Optional[int], str], ...]:
    out = []
    last = -1
    for i, entry in enumerate(thresholds):
        algo, max_bytes = entry.get("algorithm"), entry.get("max_bytes")
        if algo not in ALGORITHMS:
            raise ValueError(f"{where}: thresholds[{i}].algorithm={algo!r} is not one of {ALGORITHMS}")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= last):
            raise ValueError(f"{where}: thresholds[{i}].max_bytes must be an int above the previous "
                             f"one ({last}) or null, got {max_bytes!r}")
        if max_bytes is None and i != len(thresholds) - 1:
            raise ValueError(f"{where}: only the last threshold may have max_bytes=null")
        last = max_bytes if max_bytes is not None else last
        out.append((max_bytes, algo))
    return tuple(out)


def load_table(path: Path, fingerprint: str, world_size: int) -> Optional[Table]:
    """This machine's table for world_size from the file, or None if it has none."""
    entry = _read(path).get("machines", {}).get(fingerprint, {}).get(str(world_size))
    if entry is None:
        return None
    where = f"tuning file {path}, machine {fingerprint!r}, world size {world_size}"
    return Table(_validate(entry.get("thresholds", []), where), where)


def save_table(path: Path, fingerprint: str, world_size: int, thresholds: Iterable[tuple[Optional[int], str]],
               **details) -> None:
    """Write (or replace) one (machine, world size) entry, keeping the rest of the file."""
    data = _read(path)
    entry = {"thresholds": [{"max_bytes": b, "algorithm": a} for b, a in thresholds], **details}
    _validate(entry["thresholds"], str(path))
    data.setdefault("machines", {}).setdefault(fingerprint, {})[str(world_size)] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new file


def thresholds_from_winners(winners: list[tuple[int, str]]) -> tuple[tuple[Optional[int], str], ...]:
    """Measured (bytes, fastest algorithm) pairs, ascending -> thresholds. A switch happens
    halfway (geometrically) between two measured sizes; the last algorithm has no bound."""
    out: list[tuple[Optional[int], str]] = []
    for i, (nbytes, algo) in enumerate(winners):
        nxt = winners[i + 1] if i + 1 < len(winners) else None
        if nxt is None:
            out.append((None, algo))
        elif nxt[1] != algo:
            out.append((int((nbytes * nxt[0]) ** 0.5), algo))
    return tuple(out)


# --------------------------------------------------------------------------- choice
def choose(nbytes: int, world_size: int, available: dict[str, Optional[str]],
           table: Optional[Table], max_bytes: Optional[dict[str, int]] = None) -> AlgorithmChoice:
    """The algorithm for a message of nbytes. available: algorithm -> None if usable here, else
    why not; max_bytes: the largest message an algorithm takes (its buffers' size). The table
    decides when it names a usable algorithm; otherwise the cost model."""
    available = dict(available)
    for algo, limit in (max_bytes or {}).items():
        if available.get(algo) is None and nbytes > limit:
            available[algo] = f"takes messages up to {limit} B"
    usable = [a for a in ALGORITHMS if available.get(a) is None]
    notes = []
    if table is not None:
        for max_bytes, algo in table.thresholds:
            if max_bytes is None or nbytes <= max_bytes:
                if algo in usable:
                    bound = "no upper bound" if max_bytes is None else f"<= {max_bytes} B"
                    return AlgorithmChoice(algo, f"{nbytes} B: tuned threshold {bound} -> {algo} ({table.source})")
                notes.append(f"tuned choice {algo!r} is unavailable here ({available.get(algo)})")
                break
        else:
            notes.append(f"no tuned threshold covers {nbytes} B ({table.source})")
    else:
        notes.append("untuned (run `python -m spec_kernels.comm.tune` to measure this machine)")
    by_reason: dict[str, list[str]] = {}
    for a, why in available.items():
        if why is not None:
            by_reason.setdefault(why, []).append(a)
    unavailable = [f"{', '.join(algos)}: {why}" for why, algos in by_reason.items()]
    if len(usable) == 1:
        why = "; ".join(notes + [f"the only usable algorithm ({'; '.join(unavailable)})"])
        return AlgorithmChoice(usable[0], f"{nbytes} B: {why}")
    est = {a: estimate_us(a, world_size, nbytes) for a in usable}
    best = min(usable, key=est.__getitem__)
    model = ", ".join(f"{a} {t:.1f} us" for a, t in est.items())
    notes.append(f"cost model ({P2P_HOP_US:g} us per P2P signal, {P2P_GBPS:g} GB/s P2P, "
                 f"{TORCH_BASE_US:g} us NCCL base): {model}")
    if unavailable:
        notes.append("unavailable: " + "; ".join(unavailable))
    return AlgorithmChoice(best, f"{nbytes} B at world size {world_size}: " + "; ".join(notes))
