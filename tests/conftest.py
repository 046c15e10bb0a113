"""Test set-up shared by all tests.

Without a GPU, Triton kernels run on CPU tensors through the interpreter. Triton reads
TRITON_INTERPRET when a kernel is defined, so it is set here, before anything imports
spec_kernels. Tests marked `gpu` are skipped (and reported as skipped) without a CUDA device.

On a GPU, a kernel that faults (illegal address, misaligned access, trap) leaves the process's
CUDA context unusable: every later test in that process would fail for a reason that is not its
own. So after each gpu test the context is checked; when it is lost, the process stops at once,
naming the test: under pytest-xdist (`-n N`, as scripts/gpu_check.sh runs them) only that worker
exits and xdist replaces it, so the other kernels' tests still run and report their own result.

Plain `pytest` runs on pytest-xdist workers: `SPEC_KERNELS_TEST_WORKERS` of them (default 2, one
per core of the CI machine; 0 runs in this process), `--dist loadgroup` so that the tests of one
`xdist_group` share a worker (the end-to-end servers: one at a time). An explicit `-n` wins. Every
test seeds its own generators, so results do not depend on which worker runs what.
"""
import os
import random
import sys

import pytest
import torch

import quick_tier  # tests/ is on sys.path (pytest prepends a conftest.py folder)

HAS_GPU = torch.cuda.is_available()
DEFAULT_WORKERS = 2


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Default to xdist workers (see the module docstring); runs before xdist reads `-n`."""
    opt = config.option
    if (not config.pluginmanager.hasplugin("xdist") or getattr(opt, "numprocesses", 0) is not None
            or os.environ.get("PYTEST_XDIST_WORKER") or opt.collectonly or getattr(opt, "usepdb", False)):
        return
    workers = os.environ.get("SPEC_KERNELS_TEST_WORKERS", str(DEFAULT_WORKERS))
    if not workers.isdigit():
        raise pytest.UsageError(f"SPEC_KERNELS_TEST_WORKERS must be a worker count, got {workers!r}")
    opt.numprocesses = int(workers)
    if opt.numprocesses and opt.dist == "no":
        opt.dist = "loadgroup"
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if quick_tier.is_quick(item.nodeid, item.keywords):
            item.add_marker(pytest.mark.quick)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu_check.sh runs these on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_every_test():
    """The global generators start from the same state in every test, whichever worker runs it and
    whatever ran before (most tests also pass their own seeded generators)."""
    random.seed(0)
    torch.manual_seed(0)


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
