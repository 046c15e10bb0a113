"""The weak-memory emulator of the IPC allreduce (tools/kernel_emulators/allreduce.py) distinguishes
GPU-scope from system-scope ordering: the push re-arm behind a system-scope fence (the kernel's
order) passes the push-only sequence with a late rank, the same re-arm behind a GPU-scope fence
(the `rearm_gpu_fence` mutant: what the kernel did before) is caught there as an overwrite before
read. The PTX interpreter cannot show this (one sequentially consistent memory), so this is the
test of that part of the protocol; the full emulator run is `python tools/kernel_emulators/check.py`."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

EMULATORS = Path(__file__).resolve().parents[1] / "tools" / "kernel_emulators"


@pytest.fixture(scope="module")
def check():
    sys.path.insert(0, str(EMULATORS))
    try:
        yield importlib.import_module("check")
    finally:
        sys.path.remove(str(EMULATORS))


def _push_only_case(mod):
    label, thunk = next((label, thunk) for label, thunk in mod.cases(quick=True) if "12 push calls" in label)
    return thunk


def test_rearm_behind_a_system_fence_passes(check):
    res = _push_only_case(check.load("allreduce"))()
    assert res["ok"], res


def test_rearm_behind_a_gpu_scope_fence_is_caught(check):
    mutant = check.load("allreduce", "rearm_gpu_fence")
    res = check.run_case(_push_only_case(mutant))
    assert not res["ok"] and "overwrite before read" in res["note"] and "re-arm" in res["note"], res
