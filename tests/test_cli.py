"""The command-line entry points a newcomer meets first: `python -m spec_kernels.info --help` and
scripts/gpu_check.sh on a machine without a CUDA GPU (it must stop at once, saying why)."""
import glob
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"


def _env(**extra):
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def test_info_help_is_a_usage_text():
    proc = subprocess.run([sys.executable, "-m", "spec_kernels.info", "--help"], capture_output=True, text=True,
                          env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m spec_kernels.info")
    assert "which implementation" in proc.stdout and "CUDA extension" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "spec_kernels.info", "--bogus"], capture_output=True, text=True,
                         env=_env(), timeout=120)
    assert bad.returncode == 2 and "unrecognized arguments: --bogus" in bad.stderr


def _gpu_check(tmp_path, env):
    out = tmp_path / "outdir"
    start = time.monotonic()
    proc = subprocess.run(["bash", str(GPU_CHECK), str(out), str(tmp_path / "run.tar.gz")], capture_output=True,
                          text=True, env=env, timeout=150, cwd=tmp_path)
    return proc, time.monotonic() - start, out


def test_gpu_check_without_a_gpu_stops_before_building(tmp_path):
    """torch decides: an nvidia-smi that fails is on PATH and CUDA_VISIBLE_DEVICES hides every GPU."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    env = _env(PATH=f"{fake_bin}{os.pathsep}{os.environ['PATH']}", CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    proc, seconds, out = _gpu_check(tmp_path, env)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "gpu_check: no CUDA GPU visible (torch.cuda.is_available() is False" in proc.stderr
    assert proc.stdout == "" and not out.exists() and not (tmp_path / "run.tar.gz").exists()  # nothing built
    assert seconds < 120  # one torch import, no build


def test_gpu_check_without_nvidia_devices_answers_at_once(tmp_path):
    if shutil.which("nvidia-smi") or glob.glob("/dev/nvidia[0-9]*"):
        pytest.skip("this machine has NVIDIA devices: the torch path above covers it")
    proc, seconds, out = _gpu_check(tmp_path, _env(PYTHON=sys.executable))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "gpu_check: no CUDA GPU visible (no nvidia-smi and no /dev/nvidia* device)" in proc.stderr
    assert not out.exists() and seconds < 10
