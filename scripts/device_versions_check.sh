#!/usr/bin/env bash
# scripts/device_versions_check.sh [VENV]: the CPU test suite under the GPU machine's versions.
#
# The H200 server the GPU checks run on has Python 3.12, torch 2.11.0, triton 3.6.0 and NumPy 2.5;
# CI and development use the project's pins (Python 3.11, torch 2.14.1, triton 3.8). Run this on
# any machine, GPU or not, before a GPU run: it checks that the extension builds against torch
# 2.11 and that nothing breaks on the older torch / triton, so a GPU run is not lost to a version
# break. (It found one: Triton 3.6's interpreter with NumPy 2.5, see spec_kernels/_triton_compat.py.)
#
# What it does: a Python 3.12 venv (VENV, default /tmp/spec-kernels-device-venv, reused when it
# exists) with torch 2.11.0 from PyPI installed without its CUDA wheels (the CUDA libraries of the
# system's torch are put on LD_LIBRARY_PATH instead: about 0.7 GB of downloads, once); a copy of
# this working tree (tracked and untracked, not ignored, files) built the way scripts/gpu_check.sh
# builds it; then `pytest` and `pytest benchmarks/ --benchmark-only` there. SGLang is not
# installed in the venv (0.5.23 pins torch 2.14.1; the GPU server has none either): its tests skip.
# Exit status: non-zero when the set-up, the build or a test fails. About 5 minutes on 2 cores
# after the first set-up.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-/tmp/spec-kernels-device-venv}
find_python312() {  # PY312, a working python3.12 on PATH, or pyenv's (its shim may be inactive)
  if [[ -n "${PY312:-}" ]]; then echo "$PY312"; return; fi
  if python3.12 -c '' 2> /dev/null; then command -v python3.12; return; fi
  ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2> /dev/null | tail -1
}
PY312=$(find_python312)
[[ -n "$PY312" ]] || { echo "python3.12 not found (set PY312=/path/to/python3.12)" >&2; exit 2; }

# The CUDA libraries torch 2.11.0+cu130 links against (cu13, as the system torch's nvidia-* wheels).
SYSTEM_SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
NV_LIBS=$(ls -d "$SYSTEM_SITE"/nvidia/*/lib 2>/dev/null | tr '\n' ':' || true)  # none: said below
[[ -n "$NV_LIBS" ]] || { echo "no nvidia-* CUDA wheels under $SYSTEM_SITE (pip install -e . first)" >&2; exit 2; }
export LD_LIBRARY_PATH="$NV_LIBS${LD_LIBRARY_PATH:-}"

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "== venv $VENV (Python 3.12, torch 2.11.0, triton 3.6.0, NumPy >= 2.5)"
  "$PY312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --no-deps torch==2.11.0
  echo "(pip's complaints that torch's CUDA wheels are missing are expected: LD_LIBRARY_PATH has them)"
  "$VENV/bin/python" -m pip install -q filelock typing-extensions sympy networkx jinja2 fsspec \
    "setuptools<82" ninja triton==3.6.0 "numpy>=2.5" pytest pytest-benchmark pytest-xdist \
    hypothesis matplotlib tqdm
fi
# Packages the GPU machine's image has that an older venv of this script may lack.
"$VENV/bin/python" -c "import tqdm" 2> /dev/null || "$VENV/bin/python" -m pip install -q tqdm
"$VENV/bin/python" -c 'import numpy, torch, triton, sys
print("== python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__,
      "numpy", numpy.__version__)'

WORK=$(mktemp -d /tmp/spec-kernels-device-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
(cd "$REPO" && git ls-files -z -co --exclude-standard | xargs -0 cp --parents -t "$WORK")
cd "$WORK"
echo "== build (as scripts/gpu_check.sh: pip install --no-build-isolation -e .)"
MAX_JOBS=${MAX_JOBS:-2} "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps --no-index -e . \
  > build.log 2>&1 || { tail -40 build.log; exit 1; }
"$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps --no-index -e tools/ptxsim \
  >> build.log 2>&1 || { tail -40 build.log; exit 1; }
"$VENV/bin/python" -m spec_kernels.info | grep -E "^CUDA extension" || true

# SGLang's Triton extend attention (the tree-verify anchor) from staged sources, as gpu_check.sh uses it.
if python3 benchmarks/_sglang_kernels.py stage .sglang_src > /dev/null 2>&1; then
  export SPEC_KERNELS_SGLANG_SRC="$WORK/.sglang_src"
fi

PAR=()
if "$VENV/bin/python" -c "import xdist" 2> /dev/null; then PAR=(-n "${PYTEST_WORKERS:-2}"); fi
set +e  # run both suites, then fail on either
echo "== pytest"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "${PAR[@]}" 2>&1 | grep -v "^SKIPPED" | tail -5
status=${PIPESTATUS[0]}
echo "== pytest benchmarks/ --benchmark-only"
"$VENV/bin/python" -m pytest benchmarks/ --benchmark-only -q -p no:cacheprovider 2>&1 | tail -2
bench_status=${PIPESTATUS[0]}
echo "== pytest rc $status, benchmarks rc $bench_status"
[[ $status -eq 0 && $bench_status -eq 0 ]]
