"""The weak-memory emulator of the IPC allreduce (tools/kernel_emulators/allreduce.py) distinguishes
GPU-scope from system-scope ordering: the push re-arm behind a system-scope fence (the kernel's
order) passes the push-only sequence with a late rank, the same re-arm behind a GPU-scope fence
(the `rearm_gpu_fence` mutant: what the kernel did before) is caught there as an overwrite before
read. Its loads run early back to the block's last acquire: without the ld.acquire after a flag
poll (one mutant per wait of pull and two-shot) a peer's row reads stale; the orderings the model
finds unneeded (check.py UNNEEDED) pass every case. The PTX interpreter cannot show any of this
(one sequentially consistent memory), so this is the test of that part of the protocol; the full
emulator run is `python tools/kernel_emulators/check.py`."""
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


ACQUIRE_MUTANTS = ("pull_wait_relaxed", "twoshot_wait0_relaxed", "twoshot_wait1_relaxed")


def _quick_cases(mod, skip_w8=True):
    return [(label, thunk) for label, thunk in mod.cases(quick=True) if not (skip_w8 and label.startswith("W=8 hidden"))]


@pytest.mark.parametrize("name", ACQUIRE_MUTANTS)
def test_a_flag_wait_without_acquire_reads_a_stale_row(check, name):
    """Caught by the early loads only: the same mutant passes when data loads read what has landed."""
    mutant = check.load("allreduce", name)
    label, thunk = _quick_cases(mutant)[0]
    res = check.run_case(thunk)
    assert not res["ok"] and "stale read" in res["note"] and "before the block's last acquire" in res["note"], res


@pytest.mark.parametrize("name", ["push_header_wait_relaxed", "barrier_release_without_fence"])
def test_orderings_the_model_finds_unneeded_pass_every_case(check, name):
    edited = check.load("allreduce", name)
    for label, thunk in _quick_cases(edited):
        res = check.run_case(thunk)
        assert res["ok"], (name, label, res)


def test_a_barrier_without_its_fence_is_caught(check):
    """block_barrier's one system-scope fence (thread 0, before the relaxed flag stores) is what
    publishes the staged rows: without it a peer reads a row before it lands."""
    mutant = check.load("allreduce", "flag_without_fence")
    notes = [res["note"] for res in map(check.run_case, (thunk for _, thunk in _quick_cases(mutant))) if not res["ok"]]
    assert notes and any("stale read" in n for n in notes), notes
