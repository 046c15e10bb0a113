"""Build spec-kernels: the Python package, plus the CUDA extension `spec_kernels._C` when nvcc is there.

Knobs (environment variables):
  SPEC_KERNELS_CUDA_ARCHS   archs to compile, default "9.0a;12.0a" (H100/H200 and RTX PRO 6000 Blackwell)
  SPEC_KERNELS_NO_CUDA=1    skip the extension (pure Triton / PyTorch install)
  MAX_JOBS                  parallel nvcc jobs, default 2 (one heavy nvcc job takes ~3 GB)
  SPEC_KERNELS_BUILD_CACHE=0  always compile (by default a built extension is kept in the cache
                            folder, see spec_kernels/_build_cache.py, keyed by every input of the
                            build, and a later build with the same inputs copies it)
Without nvcc or without a CUDA build of torch the package installs without the extension and
says so once, here; `python -m spec_kernels.info` says so again at run time.
"""
import glob
import importlib.util
import os
import platform
import shutil
import subprocess
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "9.0a;12.0a"


def _find_cuda_home():
    """Where the CUDA toolkit lives. /usr/local/bin/nvcc may be a wrapper, so prefer CUDA_HOME
    and /usr/local/cuda over guessing from the nvcc on PATH (torch's own guess is wrong there)."""
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and os.path.exists(os.path.join(cand, "bin", "nvcc")):
            return cand
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    return None


def _build_cache():
    """spec_kernels/_build_cache.py, loaded by path: the package is not importable while it builds."""
    spec = importlib.util.spec_from_file_location("_spec_kernels_build_cache",
                                                  os.path.join(HERE, "spec_kernels", "_build_cache.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tool_version(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "unavailable"


def _extension_key(cache, ext, cuda_home):
    """Everything the built extension depends on: every file under csrc/ and this file, the
    sources and flags, the archs, torch, nvcc, the host compiler, Python and the platform."""
    import torch

    cxx = os.environ.get("CXX", "c++")
    return cache.content_key(
        HERE, ("csrc",), ("setup.py",), ext.name, repr(ext.sources), repr(ext.extra_compile_args),
        repr(ext.define_macros), os.environ["TORCH_CUDA_ARCH_LIST"], torch.__version__, str(torch.version.cuda),
        str(getattr(torch.version, "git_version", "")), _tool_version(os.path.join(cuda_home, "bin", "nvcc"), "--version"),
        cxx, _tool_version(cxx, "--version"), sys.version, platform.platform())


def _cached_build_ext(base, cuda_home):
    class CachedBuildExtension(base):
        """torch's BuildExtension, but a build whose inputs were built before is copied from the cache."""

        def build_extension(self, ext):
            cache = _build_cache()
            target = self.get_ext_fullpath(ext.name)
            entry = os.path.join(cache.cache_root(), "extension", _extension_key(cache, ext, cuda_home),
                                 os.path.basename(target))
            if os.environ.get("SPEC_KERNELS_BUILD_CACHE", "1") != "0" and os.path.isfile(entry):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copyfile(entry, target)
                print(f"spec-kernels: {ext.name} copied from the build cache {entry} "
                      "(same sources, flags and toolchain; SPEC_KERNELS_BUILD_CACHE=0 recompiles)", file=sys.stderr)
                return
            super().build_extension(ext)
            with open(target, "rb") as f:
                cache.write_atomic(entry, f.read())

    return CachedBuildExtension


def _extension_or_reason():
    if os.environ.get("SPEC_KERNELS_NO_CUDA", "0") == "1":
        return None, "SPEC_KERNELS_NO_CUDA=1"
    cuda_home = _find_cuda_home()
    if cuda_home is None:
        return None, "no nvcc found (set CUDA_HOME)"
    try:
        import torch
    except ImportError:
        return None, "torch is not installed at build time"
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is a CPU build"
    # torch.utils.cpp_extension reads these when it is imported.
    os.environ["CUDA_HOME"] = cuda_home
    os.environ["TORCH_CUDA_ARCH_LIST"] = os.environ.get("SPEC_KERNELS_CUDA_ARCHS", DEFAULT_ARCHS)
    os.environ.setdefault("MAX_JOBS", "2")
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    # Kernels (.cu) see CUDA headers only; the torch-facing files are the .cpp bindings (one per
    # family) and csrc/registration.cpp.
    sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True)) + sorted(glob.glob("csrc/**/*.cu", recursive=True))
    ext = CUDAExtension(
        name="spec_kernels._C",
        sources=sources,
        include_dirs=[os.path.join(HERE, "csrc", "include")],
        extra_compile_args={
            "cxx": ["-O3"],
            # -Xptxas=-v prints registers / smem / spills per kernel into the build log.
            "nvcc": ["-O3", "-lineinfo", "-Xptxas=-v", "--expt-relaxed-constexpr"],
        },
    )
    return (ext, _cached_build_ext(BuildExtension.with_options(use_ninja=True), cuda_home)), None


ext_and_cmd, reason = _extension_or_reason()
if ext_and_cmd is None:
    # pip runs this file for metadata and again to build: say it in the build run only.
    if any(cmd in sys.argv for cmd in ("build_ext", "bdist_wheel", "editable_wheel", "develop", "install")):
        print(f"spec-kernels: building WITHOUT the CUDA extension ({reason}); "
              "the Triton and PyTorch reference paths still work.", file=sys.stderr)
    setup()
else:
    ext, build_ext = ext_and_cmd
    setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
