#!/usr/bin/env python
"""Run the allreduce protocol emulator against the package's reference implementations (no GPU needed).

The other kernels' emulators were retired: tests/ptx runs their compiled PTX instead (and their
deliberate bugs live on as .cu edits in tests/ptx/test_mutants*_ptx.py).

    python tools/kernel_emulators/check.py [allreduce|all] [--quick] [-v]
    python tools/kernel_emulators/check.py KERNEL --mutant NAME   # one deliberate bug: must FAIL
    python tools/kernel_emulators/check.py all --mutants --quick  # every deliberate bug must be caught
    python tools/kernel_emulators/check.py --list-mutants

Exit status 0 when every case passes (with --mutants: when every mutant is caught), else 1.
See README.md for what the emulators model and what they cannot show.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
import types
from pathlib import Path

sys.dont_write_bytecode = True  # leave no __pycache__ in the tree (tools/, tests/)
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(HERE), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

KERNELS = ("allreduce",)

# Deliberate bugs, each a one-expression patch of an emulator's source: (what, old text, new text).
# `--mutants` checks that the cases catch every one (by a mismatch, a race or an out-of-bounds).
MUTANTS = {
    "allreduce": {
        "push_slot_not_advanced": ("push: BlockState.push_slot keeps the previous slot (rotation stuck)",
                                   "    k.set_state(1, slot)", "    k.set_state(1, k.state(1))"),
        "push_no_rearm": ("push: the used slot is never re-armed with the sentinel",
                          "    for row in range(k.b, p.rows, k.grid):\n        for q in range(p.world):",
                          "    for row in range(0):\n        for q in range(p.world):"),
        "rearm_gpu_fence": ("push: the re-arm is fenced at GPU scope only (__threadfence), not at system scope",
                            '    k.fence("sys")  # __threadfence_system() after the re-arm',
                            '    k.fence("gpu")  # __threadfence_system() after the re-arm'),
        "sentinel_first_word_only": ("push: has_sentinel checks only the first 32-bit word of the 16-byte vector",
                                     "    for w in range(4):", "    for w in range(1):"),
        "pull_wait_relaxed": ("one-shot pull: the flag wait reads the word again relaxed, not with ld.acquire",
                              "    ok = yield from block_barrier(k, seq, 0)\n    if not ok:\n        return\n"
                              "    for row in range(k.b, p.rows, k.grid):  # the rows this block copied",
                              "    ok = yield from block_barrier(k, seq, 0, acquire=False)\n    if not ok:\n        return\n"
                              "    for row in range(k.b, p.rows, k.grid):  # the rows this block copied"),
        "twoshot_wait0_relaxed": ("two-shot: the first flag wait (before the reduce) without ld.acquire",
                                  "    ok = yield from block_barrier(k, seq, 0)\n    if not ok:\n        return\n"
                                  "    for row in range(share_start(p, p.rank)",
                                  "    ok = yield from block_barrier(k, seq, 0, acquire=False)\n    if not ok:\n"
                                  "        return\n    for row in range(share_start(p, p.rank)"),
        "twoshot_wait1_relaxed": ("two-shot: the second flag wait (before reading the gather buffers) without ld.acquire",
                                  "    ok = yield from block_barrier(k, seq, 1)\n",
                                  "    ok = yield from block_barrier(k, seq, 1, acquire=False)\n"),
        "flag_without_fence": ("block_barrier: no __threadfence_system before the relaxed flag stores",
                               "    k.fence()  # __threadfence_system(), thread 0\n", ""),
        "no_allgather_wait": ("two-shot: no second flag round before reading the peers' gather buffers",
                              "    ok = yield from block_barrier(k, seq, 1)\n", "    ok = True\n"),
        "single_staging": ("one-shot pull: one staging buffer for every call (staging[0] instead of [seq & 1])",
                           "par = seq & 1  # staging[seq & 1]", "par = 0  # staging[seq & 1]"),
        "pull_rows_of_next_block": ("one-shot pull: block b sums the rows block b+1 copied (block-to-row mapping)",
                                    "for row in range(k.b, p.rows, k.grid):  # the rows this block copied",
                                    "for row in range((k.b + 1) % k.grid, p.rows, k.grid):  # the rows this block copied"),
        "runs_after_failure": ("calls queued behind a failure run (no rank_failed() check at kernel entry)",
                               "    return k.first_error_code() != 0", "    return False"),
        "seq_wraps_to_zero": ("the call counter wraps to 0 (stale flag words read as call 0)",
                              "    return 2 if seq == M32 else seq + 1", "    return (seq + 1) & M32"),
    },
}

# Edits that remove an ordering the model says the protocol does not need: every case passes with
# each of them (tests/test_allreduce_emulator.py). Listed, not applied to the kernel: what the
# hardware does beyond the PTX memory model is measured on a GPU, not assumed.
UNNEEDED = {
    "allreduce": {
        "push_header_wait_relaxed": (
            "push: the header wait reads the word again relaxed, not with ld.acquire (the rows that follow are "
            "polled until no sentinel is left: each 16-byte vector proves itself, nothing needs ordering)",
            '        "push header")\n', '        "push header", False)\n'),
        "barrier_release_without_fence": (
            "block_barrier: st.release.sys per flag, no __threadfence_system before them (each release orders "
            "the block's earlier stores)",
            "    k.fence()  # __threadfence_system(), thread 0\n    for peer in range(p.world):\n"
            "        k.store_relaxed(",
            "    for peer in range(p.world):\n        k.store_release_sys("),
    },
}


def load(kernel, mutant=None):
    """The emulator module, or a fresh copy of it with one mutant's patch applied."""
    if mutant is None:
        return importlib.import_module(kernel)
    what, old, new = {**MUTANTS[kernel], **UNNEEDED.get(kernel, {})}[mutant][:3]
    path = HERE / f"{kernel}.py"
    src = path.read_text()
    if src.count(old) != 1:
        raise SystemExit(f"mutant {kernel}:{mutant}: its patch matches {src.count(old)} places of {path.name}, "
                         "not exactly one; update MUTANTS in check.py together with the emulator")
    mod = types.ModuleType(f"{kernel}__{mutant}")
    mod.__file__ = str(path)
    sys.modules[mod.__name__] = mod
    exec(compile(src.replace(old, new), f"{path} [mutant {mutant}]", "exec"), mod.__dict__)
    return mod


def run_case(fn):
    """Run one case; an exception (race, out-of-bounds, assertion) is a failure with its message."""
    t0 = time.time()
    try:
        res = fn()
    except Exception as e:  # noqa: BLE001 - every error is a finding
        # report the emulator's line (the kernel statement), not the ptx.py helper that raised
        frames = traceback.extract_tb(e.__traceback__)
        frame = next((f for f in reversed(frames) if not f.filename.endswith("ptx.py")), frames[-1])
        res = dict(ok=False, note=f"{type(e).__name__}: {e} [{Path(frame.filename).name}:{frame.lineno}]")
    res["time"] = time.time() - t0
    return res


def fmt(x):
    return "-" if x is None else f"{x:.1e}"


def check_kernel(kernel, quick, verbose, mod):
    cases = mod.cases(quick)
    rows, failures = [], []
    for i, (name, fn) in enumerate(cases):
        res = run_case(fn)
        rows.append(res)
        line = f"  [{i + 1}/{len(cases)}] {'ok  ' if res['ok'] else 'FAIL'} {kernel}: {name} ({res['time']:.1f}s)"
        if "err" in res:
            line += f"  out err {res['err']:.1e}  lse err {res['lse_err']:.1e}"
        elif res.get("errs"):  # allreduce, norm: max out error per output type
            line += "  out err " + ", ".join(f"{k} {v:.1e}" for k, v in sorted(res["errs"].items()))
        if verbose or not res["ok"]:
            print(line + (f"\n      {res['note']}" if res.get("note") and (verbose or not res["ok"]) else ""),
                  flush=True)
        if not res["ok"]:
            failures.append(name)
    errs = {}
    for r in rows:
        if "err" in r:
            key = "bf16" if "bfloat16" in str(r["dtype"]) else "fp16"
            errs[key] = max(errs.get(key, 0.0), r["err"])
            errs["lse"] = max(errs.get("lse", 0.0), r["lse_err"])
        for key, v in r.get("errs", {}).items():  # allreduce, norm (fp32 / fp8 keys go to the notes)
            errs[key] = max(errs.get(key, 0.0), v)
    tally = {}
    for r in rows:
        for k, v in r.get("tally", {}).items():
            tally[k] = max(tally.get(k, 0), v) if k.startswith("max_") else tally.get(k, 0) + v
    note = mod.summary_note(tally, errs) if hasattr(mod, "summary_note") else ""
    launches = sum(r.get("launches", 0) for r in rows)
    counts = {}
    for r in rows:
        for k, v in r.get("counts", {}).items():
            counts[k] = counts.get(k, 0) + v
    return dict(kernel=kernel, cases=len(rows), failed=len(failures), errs=errs, launches=launches, counts=counts,
                time=sum(r["time"] for r in rows), note=note)


def print_table(summaries):
    print()
    print(f"{'kernel':<12} {'cases':>5} {'failed':>6}  {'max|out err| bf16':>17} {'fp16':>8} {'max|lse err|':>12}  "
          f"{'time':>6}  notes")
    for s in summaries:
        e = s["errs"]
        note = ""
        if s["counts"]:
            c = s["counts"]
            note = (f"bit-exact lockstep: {c['alloc']} allocs ({c['alloc_refused']} refused), {c['commit']} commits "
                    f"({c['commit_refused']} refused, {c['commit_moves']} moving KV); {c['mismatch']} mismatches, "
                    f"{c['races']} races")
        if s.get("note"):
            note = s["note"]
        print(f"{s['kernel']:<12} {s['cases']:>5} {s['failed']:>6}  {fmt(e.get('bf16')):>17} {fmt(e.get('fp16')):>8} "
              f"{fmt(e.get('lse')):>12}  {s['time']:>5.0f}s  {note}")


def sweep_mutants(kernels, quick):
    """Each mutant must make some case fail; stop at the first that does."""
    survivors = []
    print(f"{'mutant':<42} result")
    for kernel in kernels:
        for name, (what, _, _) in MUTANTS[kernel].items():
            mod = load(kernel, name)
            caught = None
            t0 = time.time()
            for case_name, fn in mod.cases(quick):
                res = run_case(fn)
                if not res["ok"]:
                    caught = (case_name, res.get("note", "") or f"out err {fmt(res.get('err'))}")
                    break
            label = f"{kernel}:{name}"
            if caught:
                reason = caught[1].splitlines()[-1].strip() if caught[1] else ""
                print(f"{label:<42} caught by '{caught[0]}' ({time.time() - t0:.0f}s): {reason[:150]}", flush=True)
            else:
                survivors.append(label)
                print(f"{label:<42} NOT CAUGHT - {what}", flush=True)
    return survivors


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", nargs="?", default="all", choices=KERNELS + ("all",))
    ap.add_argument("--quick", action="store_true", help="a handful of cases per kernel (about a minute)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every case")
    ap.add_argument("--mutant", metavar="NAME", help="run with one deliberate bug (see --list-mutants): must fail")
    ap.add_argument("--mutants", action="store_true", help="check that every deliberate bug is caught")
    ap.add_argument("--list-mutants", action="store_true")
    args = ap.parse_args()
    kernels = KERNELS if args.kernel == "all" else (args.kernel,)
    if args.mutant and args.kernel == "all":
        ap.error("--mutant needs a kernel: check.py KERNEL --mutant NAME (see --list-mutants)")

    if args.list_mutants:
        for k in kernels:
            for name, (what, _, _) in MUTANTS[k].items():
                print(f"{k:<12} {name:<28} {what}")
        return 0
    if args.mutants:
        survivors = sweep_mutants(kernels, args.quick)
        print(f"\n{'every mutant caught' if not survivors else 'NOT caught: ' + ', '.join(survivors)}")
        return 1 if survivors else 0

    summaries = []
    t0 = time.time()
    for kernel in kernels:
        mod = load(kernel)
        if args.mutant:
            if args.mutant not in MUTANTS[kernel]:
                ap.error(f"{kernel} has no mutant {args.mutant!r} (see --list-mutants)")
            mod = load(kernel, args.mutant)
            print(f"MUTANT {kernel}:{args.mutant} applied ({MUTANTS[kernel][args.mutant][0]}): failures expected")
        print(f"{kernel}: {mod.KERNEL} ({'quick' if args.quick else 'full'} case list)", flush=True)
        summaries.append(check_kernel(kernel, args.quick, args.verbose, mod))
    print_table(summaries)
    failed = sum(s["failed"] for s in summaries)
    print(f"\n{'ALL PASSED' if not failed else f'{failed} FAILED'} in {time.time() - t0:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
