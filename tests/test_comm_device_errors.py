"""A failure that a fused-allreduce kernel reports reaches the host at a point every step passes,
CUDA graph replays included: FusedAllReduce.check_device_errors (host memory only), the SGLang
hooks' check over all communicators, and the attention backend's per-step call of it. The kernel
side (outputs poisoned, the error word of a replay sequence with an injected timeout) is tested on
the compiled kernels in tests/ptx/test_allreduce_ptx.py."""
from __future__ import annotations

import pytest
import torch

from spec_kernels.comm import ipc
from spec_kernels.comm.fused_allreduce import FusedAllReduce
from spec_kernels.sglang import hooks as sg_hooks


def header(op, blocks, rows, algorithm=0):
    """message_header() of csrc/include/spec_kernels/norm_allreduce.h, written out independently."""
    return op * 2 ** 30 + algorithm * 2 ** 28 + (blocks - 1) * 2 ** 22 + rows


class FakeIpc:
    """The error-word side of IpcBuffers: a pinned int32[8] the kernels write."""

    def __init__(self, word=(0,) * 8, num_blocks=4):
        self.error = torch.tensor(word, dtype=torch.int32)
        self.num_blocks = num_blocks
        self.comm = type("C", (), {"timeout_s": 2.5})()

    pending_error = ipc.IpcBuffers.pending_error


def make_comm(word, rank=1, world=4):
    """A communicator as construction leaves it (no process group needed for the error path)."""
    comm = object.__new__(FusedAllReduce)
    comm.rank, comm.world_size, comm._seq, comm._algo, comm._broken = rank, world, 12, "oneshot_push", None
    comm._ipc = FakeIpc(word)
    return comm


def test_header_words_decode():
    assert ipc._header(header(1, 2, 384, 2)) == "all_reduce_add_rmsnorm of 384 row(s) by twoshot in 2 block(s)"
    assert ipc._header(header(0, 64, 2 ** 22 - 1, 1)) == \
        f"all_reduce of {2 ** 22 - 1} row(s) by oneshot_pull in 64 block(s)"
    assert ipc._header(header(2, 1, 0, 3)) == \
        "all_reduce_add_rmsnorm (fp8 out) of 0 row(s) by oneshot_push_1block in 1 block(s)"
    assert ipc.message_header(2, 3, 1, 5) == header(2, 1, 5, 3)


def test_error_words_name_algorithm_call_and_peer():
    assert ipc.describe_error_word([0] * 8, 1.0, 4) is None
    algo, msg = ipc.describe_error_word([1, 7, 1, 3, 0, 2, header(0, 4, 256), 0], 2.5, 4)
    assert algo == "twoshot" and "device call #7" in msg and "rank 3" in msg and "timeout_s=2.5" in msg
    algo, msg = ipc.describe_error_word([2, 9, 1, 0, 1, 0, header(1, 4, 16), header(1, 4, 32)], 2.5, 4)
    assert algo == "oneshot_push" and "device call #9" in msg
    assert "this rank sends all_reduce_add_rmsnorm of 16 row(s) by oneshot_push" in msg and "rank 0 sends" in msg
    assert "32 row(s)" in msg
    algo, msg = ipc.describe_error_word([2, 3, 0, 1, 0, 1, header(0, 4, 8, 1), header(0, 4, 8, 2)], 2.5, 4)
    assert "this rank sends all_reduce of 8 row(s) by oneshot_pull" in msg and "by twoshot" in msg, msg
    algo, msg = ipc.describe_error_word([3, 0, 1, -1, 0, 1, header(0, 2, 64), 2], 2.5, 4)
    assert algo == "oneshot_pull" and "2 thread blocks" in msg and "created for 4" in msg


def test_check_device_errors_raises_once_reported_and_stays_broken():
    comm = make_comm((0,) * 8)
    comm.check_device_errors()  # nothing reported: returns
    comm._ipc.error.copy_(torch.tensor([1, 41, 1, 2, 0, 3, header(0, 1, 14336), 0], dtype=torch.int32))
    with pytest.raises(RuntimeError) as info:
        comm.check_device_errors()
    msg = str(info.value)
    assert msg.startswith("FusedAllReduce rank 1 of 4 (algorithm 'oneshot_push_1block', call #12)"), msg
    assert "device call #41" in msg and "for rank 2" in msg
    with pytest.raises(RuntimeError, match="unusable after an earlier failure.*device call #41"):
        comm.check_device_errors()


def test_sglang_hooks_check_every_communicator(monkeypatch):
    pytest.importorskip("sglang", reason="SGLang 0.5.23 is not installed (CI installs requirements/sglang-cpu.txt)")
    hooks = sg_hooks.FusedAllReduceHooks("auto")
    ok = make_comm((0,) * 8)
    bad = make_comm((2, 5, 1, 0, 0, 1, header(0, 4, 64), header(0, 4, 128)), rank=1, world=2)
    hooks._comms = {"a": ok, "b": "building FusedAllReduce failed: no GPU", "c": bad}
    with pytest.raises(RuntimeError, match="rank 1 of 2 \\(algorithm 'oneshot_pull'.*device call #5") as info:
        hooks.check_device_errors()
    assert "active_fused_allreduce().reset() on every rank" in str(info.value), "the error says how to recover"
    hooks._comms = {"a": ok}
    hooks.check_device_errors()


class RecordingIpc(FakeIpc):
    """FakeIpc whose reset() is recorded and clears the error word as IpcBuffers.reset does."""

    def __init__(self, events, word):
        super().__init__(word)
        self.events = events

    def reset(self):
        self.events.append("ipc.reset")
        self.error.zero_()


def _resettable(word, rows_of_peer=None, fail_at=None):
    """A broken communicator whose barriers are recorded: rows_of_peer replaces rank 0's row in
    the gathered barrier words (a rank that is not resetting); fail_at makes that barrier time out."""
    events = []
    comm = make_comm(word, rank=1, world=2)
    comm._ipc = RecordingIpc(events, word)
    comm._closed, comm.timeout_s, comm.device = False, 2.5, torch.device("cpu")

    def gather(values, what, timeout_s=None):
        events.append(("barrier", timeout_s))
        if fail_at is not None and len([e for e in events if e[0] == "barrier"]) == fail_at:
            comm._fail(f"{what} did not complete within timeout_s={timeout_s:g} s")
        return [list(rows_of_peer) if rows_of_peer else list(values), list(values)]

    comm._all_gather_ints = gather
    return comm, events


def test_reset_rearms_the_buffers_between_two_barriers_and_clears_the_failure():
    word = (1, 41, 1, 0, 0, 2, header(0, 4, 3, 2), 0)
    comm, events = _resettable(word)
    with pytest.raises(RuntimeError, match="device call #41"):
        comm.check_device_errors()
    comm.reset()
    assert events == [("barrier", 5.0), "ipc.reset", ("barrier", 5.0)], events
    assert comm._broken is None and comm.seq == 0 and comm._ipc.error.tolist() == [0] * 8
    comm.check_device_errors()  # usable again


def test_reset_that_fails_leaves_the_communicator_broken():
    word = (1, 41, 1, 0, 0, 2, header(0, 4, 3, 2), 0)
    comm, events = _resettable(word, fail_at=1)
    with pytest.raises(RuntimeError, match="reset barrier.*timeout_s=5"):
        comm.reset()
    assert "ipc.reset" not in events, "the buffers were re-armed although a rank may still be running"
    with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
        comm.check_device_errors()
    from spec_kernels.comm.fused_allreduce import _MAGIC

    comm, events = _resettable(word, rows_of_peer=[_MAGIC, 7])
    with pytest.raises(RuntimeError, match="out of step"):
        comm.reset(timeout_s=1.0)
    assert events == [("barrier", 1.0)] and comm._broken is not None


def test_backend_checks_before_every_step_and_replay(monkeypatch):
    pytest.importorskip("sglang", reason="SGLang 0.5.23 is not installed (CI installs requirements/sglang-cpu.txt)")
    from spec_kernels.sglang import backend

    hooks = sg_hooks.FusedAllReduceHooks("auto")
    hooks._comms = {"c": make_comm((1, 3, 1, 0, 0, 0, header(0, 4, 64), 0))}
    monkeypatch.setattr(backend, "active_fused_allreduce", lambda: hooks)
    with pytest.raises(RuntimeError, match="device call #3"):
        backend.SpecFusedAttnBackend.init_forward_metadata_out_graph(None, None)
    with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
        backend.SpecFusedAttnBackend.init_forward_metadata(None, None)
    monkeypatch.setattr(backend, "active_fused_allreduce", lambda: None)
    backend._check_fused_allreduce()  # no hook installed: nothing to check
