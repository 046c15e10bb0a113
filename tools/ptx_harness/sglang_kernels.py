"""The benchmarks' loader of SGLang's Triton kernels (benchmarks/_sglang_kernels.py: installed
SGLang, or the staged sources of $SPEC_KERNELS_SGLANG_SRC), for the harness: the speed-of-light
report runs those kernels, and the Triton compile helper must import their modules the same way."""
from __future__ import annotations

import importlib.util
import os
import sys
import types

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def loader() -> types.ModuleType:
    """benchmarks/_sglang_kernels.py, loaded by its path: benchmarks/ on sys.path would shadow the
    tests' modules of the same names."""
    mod = sys.modules.get("_sglang_kernels")
    if mod is None:
        spec = importlib.util.spec_from_file_location("_sglang_kernels",
                                                      os.path.join(REPO, "benchmarks", "_sglang_kernels.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["_sglang_kernels"] = mod
        spec.loader.exec_module(mod)
    return mod
