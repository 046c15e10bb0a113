"""Test set-up shared by all tests.

Without a GPU, Triton kernels run on CPU tensors through the interpreter. Triton reads
TRITON_INTERPRET when a kernel is defined, so it is set here, before anything imports
spec_kernels. Tests marked `gpu` are skipped (and reported as skipped) without a CUDA device.
"""
import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu_check.sh runs these on a device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
