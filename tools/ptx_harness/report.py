"""Counters of simulated launches: the performance evidence available without a GPU.

    python -m tools.ptx_harness.report [--keys 1024] [--json out.json] [--arch sm_120a]

Runs the compiled tree-verify kernels (and the other kernels whose host glue exists in
tools/ptx_harness/cuda_glue.py) on fixed shapes through the interpreter, with bf16 caches and with
fp8 (e4m3) caches of the same shapes, and prints, per kernel and shape: bytes read per buffer (K /
V against the ideal of one read of each referenced byte; K + V bytes beside those of the bf16
row, half for fp8), bytes
written, dynamic warp-instructions by class, shared-memory bank conflicts per instruction (from
the real addresses), the longest chain of dependent global loads in the launch (kv_indptr ->
kv_indices -> K/V is 3; per KV tile the chain is that minus the indptr load), and what the
speed-of-light model reads (shared-memory wavefronts and bytes per class, mma forms, L2 sector
requests, distinct DRAM bytes, the busiest warp scheduler's instructions, cp.async bytes in
flight; `python -m tools.ptx_harness.speed_of_light` turns them into modelled times).

--json writes pytest-benchmark-compatible JSON: one entry per (kernel, shape, counter) whose
`stats.median` is the counter value (a count, not seconds), so `python -m spec_kernels.bench
compare old.json new.json` flags a counter that grew between two commits. Counters are
deterministic: any change beyond the threshold is real.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


KV_FP8_SCALE = 0.05  # k_scale and v_scale of the fp8 rows


def _cases(L: int):
    """(label, kwargs of make_case, decode?, fp8 cache?) for the tree-verify kernel, L keys per
    request: each shape with a bf16 cache, then with an e4m3 one."""
    shapes = [
        (f"decode_{{}}_d128_L{L}_group8", dict(ns=[1], prefixes=[L - 1], hq=8, hkv=1, d=128), True),
        (f"verify16_{{}}_d128_L{L}_group4", dict(ns=[16], prefixes=[L - 16], hq=4, hkv=1, d=128), False),
        (f"verify16_{{}}_d128_L{L}_group8", dict(ns=[16], prefixes=[L - 16], hq=8, hkv=1, d=128), False),
    ]
    return [(label.format(kind), dict(kw), decode, kind != "bf16")
            for kind in ("bf16", "bf16_kv_fp8e4m3") for label, kw, decode in shapes]


def run(keys: int, arch: str):
    import torch

    import dataclasses

    from spec_kernels.attention.checks import KvScales
    from spec_kernels.testing import make_case
    from tools.ptx_harness.cuda_glue import PtxCudaOps, run_tree_verify

    rows = []
    for label, kw, decode, fp8 in _cases(keys):
        ns, prefixes = kw.pop("ns"), kw.pop("prefixes")
        case = make_case(ns, prefixes, dtype=torch.bfloat16, seed=1, **kw)
        scales = None
        if fp8:
            case = dataclasses.replace(case, k_cache=(case.k_cache.float() / KV_FP8_SCALE).to(torch.float8_e4m3fn),
                                       v_cache=(case.v_cache.float() / KV_FP8_SCALE).to(torch.float8_e4m3fn))
            scales = KvScales(KV_FP8_SCALE, KV_FP8_SCALE)
        ops = PtxCudaOps(arch=arch)
        t0 = time.perf_counter()
        run_tree_verify(case, ops, decode=decode, scales=scales)
        secs = time.perf_counter() - t0
        L = prefixes[0] + ns[0]
        kv_ideal = L * kw["d"] * case.k_cache.element_size()  # one read of each referenced byte
        bf16_bytes = 2 * L * kw["d"] * 2  # K + V of the same shape in bf16
        for name, grid, block, smem, st in ops.launches:
            kernel = name.split("I")[0]
            read = st.region_read
            rows.append(dict(
                kernel=kernel, shape=label, grid=list(grid), block=list(block), smem=smem, seconds=round(secs, 2),
                counters={
                    "k_bytes_read_over_ideal": round(read.get("k_cache", 0) / kv_ideal, 4),
                    "v_bytes_read_over_ideal": round(read.get("v_cache", 0) / kv_ideal, 4),
                    "kv_bytes_read": read.get("k_cache", 0) + read.get("v_cache", 0),
                    "kv_bytes_read_over_bf16_cache": round((read.get("k_cache", 0) + read.get("v_cache", 0))
                                                           / bf16_bytes, 4),
                    "index_bytes_read_over_ideal": round(read.get("kv_indices", 0) / (4 * L), 4),
                    "global_bytes_read": st.global_read, "global_bytes_written": st.global_written,
                    "warp_instructions": sum(st.warp_instr.values()),
                    **{f"warp_instructions.{k}": v for k, v in sorted(st.warp_instr.items())},
                    "bank_conflicts": int(sum(st.bank_conflicts.values())),
                    **{f"bank_conflicts.{k}": int(v) for k, v in sorted(st.bank_conflicts.items())},
                    "dependent_global_load_chain": st.load_chain,
                    # what tools/speed_of_light reads
                    **{f"shared_wavefronts.{k}": v for k, v in sorted(st.shared_wavefronts.items())},
                    **{f"shared_bytes.{k}": v for k, v in sorted(st.shared_bytes.items())},
                    **{f"mma.{k}": v for k, v in sorted(st.mma.items())},
                    "l2_sector_requests": st.l2_sectors,
                    "dram_bytes_distinct": sum(st.unique_read_by_buffer.values()) + sum(st.unique_written_by_buffer.values()),
                    "issue_per_scheduler_max": int(st.issue_per_scheduler().max()),
                    "cp_async_bytes_in_flight_max": st.cp_inflight_max,
                }))
    return rows


def print_table(rows):
    for r in rows:
        c = r["counters"]
        print(f"{r['kernel']}  {r['shape']}  grid {tuple(r['grid'])} block {tuple(r['block'])} smem {r['smem']} B"
              f"  ({r['seconds']} s simulated)")
        print(f"  K read / ideal {c['k_bytes_read_over_ideal']:.3f}   V read / ideal {c['v_bytes_read_over_ideal']:.3f}"
              f"   kv_indices read / ideal {c['index_bytes_read_over_ideal']:.2f}")
        print(f"  K + V read {c['kv_bytes_read']} B = {c['kv_bytes_read_over_bf16_cache']:.3f} x a bf16 cache's")
        print(f"  global read {c['global_bytes_read']} B, written {c['global_bytes_written']} B;"
              f" dependent global-load chain {c['dependent_global_load_chain']}")
        cls = ", ".join(f"{k.split('.', 1)[1]} {v}" for k, v in c.items() if k.startswith("warp_instructions."))
        print(f"  warp-instructions {c['warp_instructions']}: {cls}")
        bc = ", ".join(f"{k.split('.', 1)[1]} {v}" for k, v in c.items() if k.startswith("bank_conflicts."))
        print(f"  bank conflicts {c['bank_conflicts']}" + (f" ({bc})" if bc else ""))
        wf = ", ".join(f"{k.split('.', 1)[1]} {v}" for k, v in c.items() if k.startswith("shared_wavefronts."))
        print(f"  shared wavefronts: {wf}; L2 sector requests {c['l2_sector_requests']}, distinct DRAM bytes "
              f"{c['dram_bytes_distinct']}; busiest scheduler {c['issue_per_scheduler_max']} warp-instructions; "
              f"cp.async in flight <= {c['cp_async_bytes_in_flight_max']} B")


def to_benchmark_json(rows, arch):
    benches = []
    for r in rows:
        for k, v in r["counters"].items():
            benches.append({
                "name": f"ptxsim::{r['kernel']}[{r['shape']}]::{k}", "group": "ptxsim-counters",
                "params": {"shape": r["shape"]},
                "stats": {"min": v, "max": v, "mean": v, "median": v, "rounds": 1, "iterations": 1},
                "extra_info": {"unit": "count (not seconds)", "kernel": r["kernel"], "arch": arch,
                               "grid": r["grid"], "block": r["block"], "smem": r["smem"]},
            })
    return {"machine_info": {"node": "ptxsim", "note": "interpreter counters, deterministic"},
            "commit_info": _commit(), "benchmarks": benches,
            "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": "ptxsim"}


def _commit():
    import subprocess
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "csrc"], capture_output=True, text=True,
                                    cwd=REPO).stdout.strip())
    except OSError:
        sha, dirty = "", False
    return {"id": sha, "dirty": dirty}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.ptx_harness.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=1024, help="keys per request (default 1024; 256 takes ~30 s)")
    ap.add_argument("--json", help="write pytest-benchmark-compatible JSON here")
    ap.add_argument("--arch", default="sm_120a", choices=("sm_120a", "sm_90a"), help="PTX target (default sm_120a)")
    args = ap.parse_args(argv)
    if args.keys < 17:
        ap.error("--keys must be at least 17 (16 drafts + a prefix)")
    rows = run(args.keys, args.arch)
    print_table(rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(to_benchmark_json(rows, args.arch), f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
