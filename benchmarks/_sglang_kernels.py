"""SGLang's Triton attention kernels (extend: the tree-verify anchor the targets name; decode and its
split-count kernel), wherever they can be had.

* An installed SGLang (``pip install sglang==0.5.23``; on CPU machines with the pins of
  requirements/sglang-cpu.txt) is imported as usual.
* The GPU machine has no SGLang and cannot install its ~80 dependencies (no internet), yet the
  kernel needs none of them: with ``SPEC_KERNELS_SGLANG_SRC=DIR``, DIR holding SGLang's five
  source files below (in their ``sglang/...`` folders), the four kernel modules and
  ``sglang/srt/environ.py`` (stdlib only) are loaded from there WITHOUT running
  ``sglang/__init__.py`` (which imports the server), and ``sglang.srt.utils`` is replaced by the
  platform checks the kernels ask (an NVIDIA GPU: CUDA, not HIP). SGLang's code runs as shipped.
  For a device run, stage the files from the SGLang installed here into an ignored folder and
  carry it (scripts/gpu_check.sh picks ``.sglang_src/`` up by itself):

      python benchmarks/_sglang_kernels.py stage .sglang_src

  Only for machines without a working SGLang: the stand-in packages replace ``sglang`` in
  ``sys.modules`` for the whole process.
"""
from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path
from typing import Callable, Optional

import torch

SRC_ENV = "SPEC_KERNELS_SGLANG_SRC"
_KERNEL = "sglang.kernels.ops.attention.extend_attention"
_DECODE = "sglang.kernels.ops.attention.decode_attention"
_METADATA = "sglang.kernels.ops.attention.metadata"
SOURCES = ("sglang/kernels/ops/attention/extend_attention.py", "sglang/kernels/ops/attention/decode_attention.py",
           "sglang/kernels/ops/attention/score_mod.py", "sglang/kernels/ops/attention/metadata.py",
           "sglang/srt/environ.py")
_PACKAGES = ("sglang", "sglang.srt", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.attention")

_loaded: Optional[Callable] = None
_why_not: Optional[str] = None


def _platform_checks() -> types.ModuleType:
    """Stand-in for sglang.srt.utils: only what the extend / decode attention modules import."""
    utils = types.ModuleType("sglang.srt.utils")
    utils.is_cuda = lambda: torch.cuda.is_available() and torch.version.cuda is not None
    utils.is_hip = lambda: False
    utils.is_gfx95_supported = lambda: False
    utils.is_gfx1250_supported = lambda: False
    utils.get_device_core_count = lambda device_id=0: (
        torch.cuda.get_device_properties(device_id).multi_processor_count if torch.cuda.is_available() else 0)
    return utils


def _load_from_sources(root: Path) -> Callable:
    if not (root / "sglang" / "kernels" / "ops" / "attention" / "extend_attention.py").is_file():
        raise ImportError(f"{SRC_ENV}={root}: no sglang/kernels/ops/attention/extend_attention.py under it")
    for name in _PACKAGES:  # empty packages over SGLang's folders: their __init__ files import the server
        module = types.ModuleType(name)
        module.__path__ = [str(root.joinpath(*name.split(".")))]
        sys.modules[name] = module
    sys.modules["sglang.srt.utils"] = _platform_checks()
    return importlib.import_module(_KERNEL).extend_attention_fwd


def _load() -> None:
    global _loaded, _why_not
    if _loaded is not None or _why_not is not None:
        return
    src = os.environ.get(SRC_ENV)
    try:
        if src:
            _loaded = _load_from_sources(Path(src))
        else:
            _loaded = importlib.import_module(_KERNEL).extend_attention_fwd
    except Exception as exc:  # noqa: BLE001 - not installed, or a broken install: either way absent
        how = f"from {SRC_ENV}={src}" if src else f"(installed SGLang; or set {SRC_ENV})"
        _why_not = f"SGLang's extend attention does not import {how}: {type(exc).__name__}: {exc}"


def unavailable_reason() -> Optional[str]:
    """None when extend_attention_fwd() can be had, else why not."""
    _load()
    return _why_not


def extend_attention_fwd() -> Callable:
    """sglang.kernels.ops.attention.extend_attention.extend_attention_fwd (SGLang 0.5.23's signature)."""
    _load()
    if _loaded is None:
        raise ImportError(_why_not)
    return _loaded


def decode_attention_fwd() -> Callable:
    """sglang.kernels.ops.attention.decode_attention.decode_attention_fwd (SGLang 0.5.23's signature)."""
    extend_attention_fwd()  # loads the package the same way (installed, or the staged sources)
    return importlib.import_module(_DECODE).decode_attention_fwd


def num_kv_splits_kernel():
    """sglang.kernels.ops.attention.metadata.get_num_kv_splits_triton: the decode split count
    SGLang's triton backend computes per batch."""
    extend_attention_fwd()
    return importlib.import_module(_METADATA).get_num_kv_splits_triton


def stage(dest: Path) -> list[Path]:
    """Copy SOURCES from the SGLang installed here (found without importing it) to dest/sglang/..."""
    import importlib.util
    import shutil

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("SGLang is not installed here (pip install --no-deps sglang==0.5.23)")
    root = Path(list(spec.submodule_search_locations)[0]).parent
    written = []
    for rel in SOURCES:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / rel, target)
        written.append(target)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "stage":
        raise SystemExit("usage: python benchmarks/_sglang_kernels.py stage DEST")
    for path in stage(Path(sys.argv[2])):
        print(path)
