"""Test set-up shared by all tests.

Without a GPU, Triton kernels run on CPU tensors through the interpreter. Triton reads
TRITON_INTERPRET when a kernel is defined, so it is set here, before anything imports
spec_kernels. Tests marked `gpu` are skipped (and reported as skipped) without a CUDA device.

On a GPU, a kernel that faults (illegal address, misaligned access, trap) leaves the process's
CUDA context unusable: every later test in that process would fail for a reason that is not its
own. So after each gpu test the context is checked; when it is lost, the process stops at once,
naming the test: under pytest-xdist (`-n N`, as scripts/gpu_check.sh runs them) only that worker
exits and xdist replaces it, so the other kernels' tests still run and report their own result.
"""
import os
import sys

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu_check.sh runs these on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _stop_on_lost_cuda_context(request):
    yield
    if not HAS_GPU or "gpu" not in request.keywords:
        return
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
    except Exception as exc:  # a sticky CUDA error: no later kernel can run in this process
        msg = f"CUDA context lost after {request.node.nodeid}: {exc}"
        if os.environ.get("PYTEST_XDIST_WORKER"):
            print(msg, file=sys.stderr, flush=True)
            os._exit(70)  # xdist reports this test as crashed and starts a fresh worker
        pytest.exit(msg, returncode=3)
