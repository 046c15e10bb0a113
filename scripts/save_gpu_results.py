"""File a gpu_check.sh run under benchmarks/results/<gpu>/, named as benchmarks/results/README.md says.

    python scripts/save_gpu_results.py gpu_check.tar.gz [--gpu h200] [--date YYYY-MM-DD] [--dry-run]

The argument is the archive `scripts/gpu_check.sh OUTDIR ARCHIVE` wrote on the GPU machine
(or the OUTDIR itself). It copies, unchanged, every benchmark JSON as `<date>-<module>.json`,
`summary.txt` as `<date>-summary.txt` and the decode-step plots as `<date>-decode_step-*.png`;
test logs stay out (the summary lists failures). `<gpu>` comes from the device name the JSON
recorded (`NVIDIA H200` -> `h200`) unless given; the date is the run's (from the summary line),
with `-2`, `-3` appended when that day already has a run. Prints what it wrote; `git add` is yours.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200'; 'NVIDIA RTX PRO 6000 Blackwell Server Edition' -> 'rtx-pro-6000-blackwell-server-edition'."""
    name = re.sub(r"^(nvidia|amd)\s+", "", name.strip(), flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def find_run_dir(root: Path) -> Path:
    """The folder holding summary.txt / steps.tsv (the archive packs OUTDIR as its one top folder)."""
    for cand in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
        if (cand / "steps.tsv").exists() or (cand / "summary.txt").exists():
            return cand
    raise SystemExit(f"{root}: no gpu_check.sh output in it (no steps.tsv or summary.txt)")


def device_name(run: Path) -> str | None:
    for js in sorted(run.glob("*.json")):
        try:
            info = json.loads(js.read_text())["machine_info"]["spec_kernels"]
        except (KeyError, ValueError, TypeError):
            continue
        dev = info.get("device")
        name = dev.get("name") if isinstance(dev, dict) else dev
        if name:
            return str(name)
    return _search(run / "nvidia-smi.txt", r"\|\s+\d+\s+(NVIDIA [^|]*?)\s{2,}")


def run_date(run: Path) -> str | None:
    return _search(run / "summary.txt", r"gpu_check summary: (\d{4}-\d{2}-\d{2})T")


def _search(path: Path, pattern: str) -> str | None:
    """The first group of pattern's first match in the file, None if the file or a match is missing."""
    m = re.search(pattern, path.read_text()) if path.exists() else None
    return m.group(1) if m else None


def plan(run: Path, dest: Path, date: str) -> list[tuple[Path, Path]]:
    sources = sorted(run.glob("*.json")) + [run / "summary.txt"] + sorted(run.glob("decode_step-*.png"))
    sources = [s for s in sources if s.exists()]
    if not any(s.suffix == ".json" for s in sources):
        raise SystemExit(f"{run}: no benchmark JSON in it (did the benchmark steps run? see steps.tsv)")
    prefix, k = date, 1
    while any(dest.glob(f"{prefix}-*")):  # that day already has a run: -2, -3, ...
        k += 1
        prefix = f"{date}-{k}"
    return [(s, dest / f"{prefix}-{s.name}") for s in sources]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="gpu_check.sh archive (.tar.gz) or OUTDIR")
    ap.add_argument("--gpu", help="short lower-case device name (default: from the results)")
    ap.add_argument("--date", help="YYYY-MM-DD (default: the run's, from summary.txt)")
    ap.add_argument("--dry-run", action="store_true", help="print what would be written")
    args = ap.parse_args(argv)

    src = Path(args.source)
    with tempfile.TemporaryDirectory() as tmp:
        if src.is_file():
            with tarfile.open(src) as tar:
                tar.extractall(tmp, filter="data")
            run = find_run_dir(Path(tmp))
        elif src.is_dir():
            run = find_run_dir(src)
        else:
            raise SystemExit(f"{src}: no such archive or folder")
        gpu = args.gpu or (gpu_slug(name) if (name := device_name(run)) else None)
        if not gpu:
            raise SystemExit("could not tell the GPU from the results: pass --gpu NAME (e.g. h200)")
        date = args.date or run_date(run)
        if not date:
            raise SystemExit("could not tell the run's date from summary.txt: pass --date YYYY-MM-DD")
        dest = RESULTS / gpu
        for s, d in plan(run, dest, date):
            print(f"{s.name} -> {d.relative_to(REPO)}")
            if not args.dry_run:
                dest.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(s, d)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
