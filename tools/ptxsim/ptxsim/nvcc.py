"""nvcc -> PTX text for the interpreter: locate the compiler, compile one CUDA source.

`compile_ptx(source, arch="sm_120a")` returns the PTX of a CUDA C++ source text. With
`cache_dir` (or $PTXSIM_CACHE_DIR) the PTX is kept there under the sha256 of the source, the flags
and `nvcc --version`, so a cached entry is never stale. Projects with their own build flags and
cache (include paths, torch's flags) only need `find_nvcc` and `nvcc_version` from here.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from typing import Optional, Sequence

DEFAULT_FLAGS = ("-O3", "-lineinfo", "-std=c++17")


def find_nvcc() -> Optional[str]:
    """$CUDA_HOME/bin/nvcc, $CUDA_PATH/bin/nvcc, /usr/local/cuda/bin/nvcc, then the nvcc on PATH."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def require_nvcc() -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found: set CUDA_HOME to a CUDA toolkit (or put nvcc on PATH)")
    return nvcc


@lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    done = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{nvcc} --version failed: {done.stderr.strip()}")
    return done.stdout.strip()


def compile_ptx(source: str, arch: str = "sm_120a", flags: Sequence[str] = DEFAULT_FLAGS,
                name: str = "kernel.cu", cache_dir: Optional[str] = None) -> str:
    """The PTX of CUDA source text `source` for `arch`. `name` is the file name the PTX's .file
    lines (and so the interpreter's error reports) carry. RuntimeError when nvcc is missing or fails."""
    nvcc = require_nvcc()
    cmd_flags = [*flags, f"-arch={arch}", "-ptx"]
    cache_dir = cache_dir or os.environ.get("PTXSIM_CACHE_DIR")
    entry = None
    if cache_dir:
        h = hashlib.sha256("\0".join([source, name, *cmd_flags, nvcc_version(nvcc)]).encode()).hexdigest()
        entry = os.path.join(cache_dir, "nvcc", f"{os.path.splitext(os.path.basename(name))[0]}.{arch}.{h[:24]}.ptx")
        if os.path.exists(entry):
            with open(entry, encoding="utf-8") as f:
                return f.read()
    with tempfile.TemporaryDirectory(prefix="ptxsim-nvcc-") as tmp:
        src = os.path.join(tmp, os.path.basename(name))
        with open(src, "w", encoding="utf-8") as f:
            f.write(source)
        out = os.path.join(tmp, "out.ptx")
        done = subprocess.run([nvcc, *cmd_flags, src, "-o", out], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed on {name} ({arch}), exit {done.returncode}:\n"
                               f"{(done.stderr or done.stdout)[-6000:]}")
        with open(out, encoding="utf-8") as f:
            ptx = f.read()
    if entry:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        tmp_entry = f"{entry}.{os.getpid()}.tmp"
        with open(tmp_entry, "w", encoding="utf-8") as f:
            f.write(ptx)
        os.replace(tmp_entry, entry)  # atomic: a concurrent reader sees all of it or nothing
    return ptx
