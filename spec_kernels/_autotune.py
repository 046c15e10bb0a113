"""Triton autotuning that stays out of the way where it cannot help.

On a GPU a kernel is wrapped in `triton.autotune` on first use (a compile per config of each
shape bucket, so warm up before CUDA-graph capture). Under the interpreter (CPU tests) or with
SPEC_KERNELS_TRITON_AUTOTUNE=0 the plain kernel runs with the caller's fixed tile instead.
"""
from __future__ import annotations

import os
from typing import Callable

import triton

from ._ops import triton_interpreting


class LazyAutotune:
    def __init__(self, kernel, configs: Callable[[], list], key: list[str], prune: Callable):
        self.kernel, self._configs, self._key, self._prune = kernel, configs, key, prune
        self._tuned = None

    def __call__(self):
        """(kernel, fixed): fixed is True when the caller must pass the tile sizes itself."""
        if triton_interpreting() or os.environ.get("SPEC_KERNELS_TRITON_AUTOTUNE", "1") == "0":
            return self.kernel, True
        if self._tuned is None:
            self._tuned = triton.autotune(configs=self._configs(), key=self._key,
                                          prune_configs_by={"early_config_prune": self._prune})(self.kernel)
        return self._tuned, False
