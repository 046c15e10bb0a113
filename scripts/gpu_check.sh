#!/usr/bin/env bash
# scripts/gpu_check.sh OUTDIR [ARCHIVE.tar.gz]: build, GPU tests and benchmarks on a machine with
# an NVIDIA GPU, in one run bounded in time.
#
# Needs a CUDA GPU, python with torch, triton, pytest, pytest-benchmark and ninja, and nvcc; it
# downloads nothing. Without a CUDA GPU it says "no CUDA GPU visible" and exits 3 at once, before
# building anything. Runs in the repository root wherever it is called from. Everything goes to OUTDIR:
#   steps.tsv                      step, exit code (124: stopped at its time limit), seconds, log
#   nvidia-smi.txt nvidia-smi-q.txt versions.txt git.txt info-before-build.txt   (step env)
#   build.log                      pip install -e . for the local arch (setup.py fallback)
#   info.txt                       python -m spec_kernels.info after the build
#   gpu-tests.xml gpu-tests.log    pytest -m gpu tests/   (every gpu-marked kernel test)
#   gpu-comm.xml gpu-comm.log      pytest -m gpu tests/test_comm.py (ranks sharing one GPU)
#   memcheck.log                   compute-sanitizer memcheck over scripts/sanitizer_case.py
#   <name>.json bench-<name>.log   pytest-benchmark of benchmarks/test_<name>.py (each module)
#   summary.txt                    the summary printed last
# With ARCHIVE, the whole OUTDIR is also packed into that one .tar.gz at the end (one file to copy
# off the GPU machine); `python scripts/save_gpu_results.py ARCHIVE` files it under benchmarks/results/.
# Every step is bounded by `timeout` so that the whole run ends within GPU_CHECK_BUDGET_S
# (default 450 s); a failed step is recorded and the next one still runs (Triton results come
# back even when the CUDA build fails). Exit status: 1 if any step failed (after the summary),
# 2 on bad usage, 3 without a CUDA GPU, else 0.
#
# The sglang-triton column of the tree-verify benchmark (SGLang's Triton extend attention) needs
# no SGLang install: `python benchmarks/_sglang_kernels.py stage .sglang_src` in the checkout
# first (or set SPEC_KERNELS_SGLANG_SRC). `bash scripts/device_versions_check.sh` runs the CPU
# suite under the GPU server's older Python / torch / triton / NumPy beforehand, on any machine.
#
# Time: in one 450 s run the tests keep their caps (about 330 s with the build) and the five
# benchmark modules share what is left (~100 s): enough to see every kernel run, too little for
# the full quick grid. For both, run it twice (the in-place build stays, so the second run does
# not build again):
#   GPU_CHECK_STEPS='env,build,info,gpu-*,memcheck' bash scripts/gpu_check.sh /tmp/gc1 gc1.tar.gz
#   GPU_CHECK_STEPS='info,bench-*' GPU_CHECK_BUDGET_S=400 bash scripts/gpu_check.sh /tmp/gc2 gc2.tar.gz
# (the benchmarks alone: 'info,bench-tree_verify' etc.; patterns are matched as shell globs).
#
# Knobs: GPU_CHECK_BUDGET_S; SPEC_KERNELS_CUDA_ARCHS (default: this GPU's arch, e.g. 9.0a);
# GPU_CHECK_STEPS (a subset of the steps: env build info gpu-tests gpu-comm memcheck bench-<module>);
# SPEC_KERNELS_BENCH_PRESET (default gpu-quick); SPEC_KERNELS_TRITON_AUTOTUNE=0 (no Triton
# autotuning in the benchmarks too: faster start, untuned kernels); GPU_CHECK_TEST_WORKERS
# (pytest-xdist workers for the kernel tests, default 8); PYTHON; MAX_JOBS (parallel nvcc jobs).
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
  echo "usage: $0 OUTDIR [ARCHIVE.tar.gz]" >&2
  exit 2
fi
PY=${PYTHON:-$(command -v python || command -v python3 || true)}
if [[ -z "$PY" ]]; then
  echo "gpu_check: no python found (set PYTHON)" >&2
  exit 2
fi

# No CUDA GPU, nothing to check: say so before anything is built or written. No nvidia-smi and
# no /dev/nvidia* device answers at once; otherwise torch decides.
if ! command -v nvidia-smi > /dev/null && ! compgen -G '/dev/nvidia[0-9]*' > /dev/null; then
  why="no nvidia-smi and no /dev/nvidia* device"
elif ! why=$(timeout 120 "$PY" -c '
import sys
try:
    import torch
except Exception as exc:
    print(f"torch does not import: {exc}")
    sys.exit(1)
if not torch.cuda.is_available():
    no_cuda = "" if torch.version.cuda else f"; torch {torch.__version__} has no CUDA"
    print("torch.cuda.is_available() is False" + no_cuda)
    sys.exit(1)
' 2> /dev/null); then
  why=${why:-the torch check failed or timed out}
fi
if [[ -n "$why" ]]; then
  echo "gpu_check: no CUDA GPU visible ($why): nothing to check" >&2
  exit 3
fi

mkdir -p "$1"
OUTDIR=$(cd "$1" && pwd)
ARCHIVE=${2:-}
if [[ -n "$ARCHIVE" ]]; then
  mkdir -p "$(dirname "$ARCHIVE")"
  ARCHIVE="$(cd "$(dirname "$ARCHIVE")" && pwd)/$(basename "$ARCHIVE")"
fi
cd "$(dirname "$0")/.."
REPO=$(pwd)
BUDGET=${GPU_CHECK_BUDGET_S:-450}
# The in-place build fallback leaves the extension in the source tree: import the package from here;
# tools/ptxsim (the PTX interpreter package the collected tests/ptx modules import) from its source.
export PYTHONPATH="$REPO:$REPO/tools/ptxsim${PYTHONPATH:+:$PYTHONPATH}"
export OUTDIR REPO PY
printf 'step\trc\tseconds\tlog\n' > "$OUTDIR/steps.tsv"

# step NAME CAP RESERVE LOG CMD...: run CMD, output to LOG, for at most CAP seconds and never into
# the last RESERVE seconds of the budget (kept for the steps after it). Records the outcome in
# steps.tsv and always returns 0.
step() {
  local name=$1 cap=$2 reserve=$3 log=$4
  shift 4
  if ! selected "$name"; then
    printf '%s\t%s\t%s\t%s\n' "$name" "skipped:not-selected" 0 - >> "$OUTDIR/steps.tsv"
    return 0
  fi
  if [[ -n "${GPU_CHECK_STEPS:-}" ]]; then
    reserve=0  # a subset: the reserves below are for steps that may not be selected; caps still hold
  fi
  local left=$((BUDGET - SECONDS - reserve))
  local limit=$((cap < left ? cap : left))
  if ((limit < 5)); then
    printf '%s\t%s\t%s\t%s\n' "$name" "skipped:no-time" 0 - >> "$OUTDIR/steps.tsv"
    return 0
  fi
  echo "== $name (limit ${limit}s, log $(basename "$log"))"
  local t0=$SECONDS rc=0
  # SIGINT first: pytest then still writes its junit XML and benchmark JSON. KILL 10 s later.
  timeout -s INT -k 10 "$limit" "$@" > "$log" 2>&1 || rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$(basename "$log")" >> "$OUTDIR/steps.tsv"
}

# selected NAME: whether GPU_CHECK_STEPS (comma-separated shell patterns, e.g. "env,build,gpu-*"
# or "info,bench-*"; unset: every step) names this step.
selected() {
  [[ -z "${GPU_CHECK_STEPS:-}" ]] && return 0
  local pattern
  IFS=',' read -ra patterns <<< "$GPU_CHECK_STEPS"
  for pattern in "${patterns[@]}"; do
    # shellcheck disable=SC2053  # the pattern is meant to match as a glob
    [[ $1 == $pattern ]] && return 0
  done
  return 1
}

# Steps that are more than one command run as exported functions under `timeout bash -c`.
record_env() {
  nvidia-smi > "$OUTDIR/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed"
  nvidia-smi -q > "$OUTDIR/nvidia-smi-q.txt" 2>&1 || true
  {
    "$PY" -VV
    "$PY" -c 'import torch, triton; print("torch", torch.__version__, "CUDA", torch.version.cuda, "triton", triton.__version__)'
    nvcc --version
    "$PY" -m pip list
  } > "$OUTDIR/versions.txt" 2>&1 || true
  { git -C "$REPO" log -1 --format='%H %s' && git -C "$REPO" status --short; } > "$OUTDIR/git.txt" 2>&1 || true
  "$PY" -m spec_kernels.info > "$OUTDIR/info-before-build.txt" 2>&1 || true
}

build_extension() {
  echo "SPEC_KERNELS_CUDA_ARCHS=$SPEC_KERNELS_CUDA_ARCHS MAX_JOBS=$MAX_JOBS"
  # -v: pip shows the compiler output, including ptxas' registers / spills per kernel.
  # --no-index: download nothing, never wait on a package index.
  "$PY" -m pip install --no-build-isolation --no-deps --no-index -v -e . && return 0
  echo "== pip install -e . failed; falling back to: setup.py build_ext --inplace"
  "$PY" setup.py build_ext --inplace
}
export -f record_env build_extension

# The GPU's own arch (9.0 -> 9.0a: the "a" variant exists from sm_90 on), unless given.
cap=$(timeout 60 "$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null) || cap=""
if [[ -z "$cap" ]]; then
  arch_default=9.0a
elif [[ "${cap%%.*}" -ge 9 ]]; then
  arch_default=${cap}a
else
  arch_default=$cap
fi
export SPEC_KERNELS_CUDA_ARCHS=${SPEC_KERNELS_CUDA_ARCHS:-$arch_default}
# SGLang's Triton extend attention, the tree-verify anchor, from sources staged in the checkout
# with `python benchmarks/_sglang_kernels.py stage .sglang_src` (no SGLang install needed).
if [[ -z "${SPEC_KERNELS_SGLANG_SRC:-}" && -d "$REPO/.sglang_src" ]]; then
  export SPEC_KERNELS_SGLANG_SRC="$REPO/.sglang_src"
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

#    name        cap  reserve  log
step env          60  390  "$OUTDIR/env.log"          bash -c record_env
step build       240  200  "$OUTDIR/build.log"        bash -c build_extension
step info         30  180  "$OUTDIR/info.txt"         "$PY" -m spec_kernels.info
# Kernel tests first; the multi-process communicator tests (ranks sharing the GPU) get their own
# bounded step so that a slow or hanging rank cannot eat the kernels' time.
# Parallel workers (pytest-xdist, where installed) spread Triton's compiles over the cores, and a
# kernel that faults takes down only its worker (tests/conftest.py), not every later test. Autotuning
# is off here (one compile per shape instead of six; tests/*::test_gpu_triton_autotuned_* cover it).
PYTEST_PAR=()
if "$PY" -c "import xdist" 2> /dev/null; then
  PYTEST_PAR=(-n "${GPU_CHECK_TEST_WORKERS:-8}" --max-worker-restart 32)
fi
if "$PY" -c "import pytest_timeout" 2> /dev/null; then
  PYTEST_PAR+=(--timeout 120)
fi
step gpu-tests   150  200  "$OUTDIR/gpu-tests.log"    env SPEC_KERNELS_TRITON_AUTOTUNE=0 \
                                                       "$PY" -m pytest -m gpu tests/ -q -p no:cacheprovider "${PYTEST_PAR[@]}" \
                                                       --ignore=tests/test_comm.py --junitxml="$OUTDIR/gpu-tests.xml"
step gpu-comm     90  150  "$OUTDIR/gpu-comm.log"     "$PY" -m pytest -m gpu tests/test_comm.py -q -p no:cacheprovider \
                                                       --junitxml="$OUTDIR/gpu-comm.xml"
# memcheck over one representative case of every CUDA kernel, where the machine has the tool.
if command -v compute-sanitizer > /dev/null; then
  step memcheck   60  120  "$OUTDIR/memcheck.log"     compute-sanitizer --tool memcheck --error-exitcode 1 \
                                                       "$PY" scripts/sanitizer_case.py
fi

# Every benchmark module, each with its own JSON, sharing what is left of the budget fairly.
shopt -s nullglob
modules=(benchmarks/test_*.py)
for i in "${!modules[@]}"; do
  name=$(basename "${modules[$i]}" .py)
  name=${name#test_}
  share=$(((BUDGET - SECONDS - 20) / (${#modules[@]} - i)))
  step "bench-$name" "$share" 20 "$OUTDIR/bench-$name.log" \
    env SPEC_KERNELS_BENCH_PRESET="${SPEC_KERNELS_BENCH_PRESET:-gpu-quick}" \
    "$PY" -m pytest "${modules[$i]}" --benchmark-only --benchmark-json="$OUTDIR/$name.json" -q -p no:cacheprovider
done

# ----------------------------------------------------------------------------- summary
summarize() {
  echo "== gpu_check summary: $(date -u +%Y-%m-%dT%H:%M:%SZ), ${SECONDS}s of a ${BUDGET}s budget, OUTDIR $OUTDIR"
  echo "   rc: 0 ok, 1 failures, 5 no tests collected, 124 stopped at its time limit"
  column -t -s $'\t' "$OUTDIR/steps.tsv" 2>/dev/null || cat "$OUTDIR/steps.tsv"
  grep -E "^(GPU 0|CUDA extension)" "$OUTDIR/info.txt" 2>/dev/null || true
  for xml in "$OUTDIR/gpu-tests.xml" "$OUTDIR/gpu-comm.xml"; do
    [[ -f "$xml" ]] || continue
    "$PY" - "$xml" <<'EOF' || true
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(f"{sys.argv[1].rsplit('/', 1)[-1]}: " + ", ".join(f"{v} {k}" for k, v in count.items()))
for case in root.iter("testcase"):
    if case.find("failure") is not None or case.find("error") is not None:
        print(f"  FAILED {case.get('classname')}::{case.get('name')}")
EOF
  done
  local jsons=("$OUTDIR"/*.json)
  if ((${#jsons[@]})); then
    timeout 60 "$PY" benchmarks/_timing.py "${jsons[@]}" || echo "(benchmark summary failed)"
  else
    echo "no benchmark JSON was written"
  fi
}
summarize 2>&1 | tee "$OUTDIR/summary.txt"
if [[ -n "$ARCHIVE" ]]; then
  tar -czf "$ARCHIVE" -C "$(dirname "$OUTDIR")" "$(basename "$OUTDIR")" && echo "archive: $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1))"
fi

# Fail if any step did (no gpu-marked tests, rc 5, is not a failure).
awk -F'\t' 'NR > 1 && $2 != 0 && $2 != 5 { bad = 1 } END { exit bad }' "$OUTDIR/steps.tsv"
