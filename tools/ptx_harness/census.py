"""Census of the PTX instruction forms the project's kernels compile to.

    python -m tools.ptx_harness.census [--no-triton] [--level default] [--json OUT]

prints every form (ptxsim.census) with its static count in the CUDA PTX (sm_120a and sm_90a, every
csrc .cu) and the Triton PTX (sm_120, every config the launchers can pick), where it occurs, and
the forms the interpreter (ptxsim.isa.unsupported) does not support. Exit status 1 when there are any.
"""
from __future__ import annotations

import argparse
import os
import json
import sys

from ptxsim.census import Source, table, unsupported_report


def cuda_sources(archs=("sm_120a", "sm_90a"), processes: int = 2) -> list[Source]:
    from tools.ptx_harness import build

    out = []
    for r in build.cuda_ptx_all(archs, processes):
        cu = os.path.relpath(r.source, build.REPO)
        out.append(Source(f"cuda {r.arch}", os.path.basename(cu), f"{cu} ({r.arch})", r.ptx))
    return out


def triton_sources(level: str = "default", arch: int = 120, processes: int = 2) -> list[Source]:
    from tools.ptx_harness import build

    return [Source(f"triton sm_{arch}", job.kernel, job.describe(), res.ptx)
            for job, res in build.triton_ptx_all(level, arch, processes)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-triton", action="store_true", help="CUDA PTX only")
    ap.add_argument("--no-cuda", action="store_true", help="Triton PTX only")
    ap.add_argument("--level", default="default", help="Triton case level: ci, quick, default, all")
    ap.add_argument("--jobs", type=int, default=2, help="nvcc / Triton compile processes (default 2)")
    ap.add_argument("--json", default=None, help="write the per-group counts as JSON here")
    opts = ap.parse_args(argv)

    sources: list[Source] = []
    if not opts.no_cuda:
        sources += cuda_sources(processes=opts.jobs)
    if not opts.no_triton:
        sources += triton_sources(opts.level, 120, opts.jobs)
    rows, stats = table(sources)
    print("\n".join(rows))
    print()
    g = stats["groups"]
    for name, s in g.items():
        n = sum(1 for src in sources if src.group == name)
        print(f"{name}: {s['distinct']} distinct forms, {s['static']} static instructions in {n} PTX modules")
    bg = {k: set(v) for k, v in stats["by_group"].items()}
    sm120 = set().union(*(v for k, v in bg.items() if "120" in k)) if bg else set()
    if "cuda sm_120a" in bg and "triton sm_120" in bg:
        shared = bg["cuda sm_120a"] & bg["triton sm_120"]
        print(f"sm_120(a), CUDA + Triton: {len(sm120)} distinct forms ({len(shared)} in both)")
    only90 = set().union(*(v for k, v in bg.items() if "90" in k)) - sm120 if bg else set()
    if only90:
        print(f"only in sm_90a PTX ({len(only90)}): " + ", ".join(sorted(only90)))
    bad = unsupported_report(sources)
    print(f"\nforms the interpreter does not support: {len(bad)}")
    for line in bad:
        print("  " + line)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(stats, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
