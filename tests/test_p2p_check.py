"""The P2P self-test (spec_kernels.comm.p2p_check): patterns and comparison; the copy kernel on
raw addresses; the whole protocol on 2 and 4 gloo CPU ranks whose "IPC buffers" are shared
memory files (mapped by every rank, moved with the same kernel under the Triton interpreter),
with injected faults (a corrupted read, a lost write, a shifted write, a failed mapping, a hung
kernel, a rank whose setup fails): every rank must reach the same verdict naming the pair, and
FusedAllReduce's hook must then report the fallback reason. GPU tests (marked) run it over real
CUDA IPC with 2 ranks on one GPU.
"""
import os

import pytest
import torch

from spec_kernels.comm import launch, p2p_check
from spec_kernels.comm.p2p_check import CORRUPT, OK, SHIFTED, STALE, compare, pattern

HAS_GPU = torch.cuda.is_available()
# The file-backed transport runs the copy kernel in the Triton interpreter on CPU.
RANK_ENV = {"TRITON_INTERPRET": "1"}


def run_ranks(world, fn, *args, timeout=120.0, env=None):
    return launch.run_ranks(world, fn, *args, backend="gloo", timeout=timeout, env=env or RANK_ENV, threads=1)


# --------------------------------------------------------------------------- patterns
def test_patterns_differ_by_every_input_and_are_never_zero():
    base = pattern(1234, 0, 1, 0)
    assert base.dtype == torch.int32 and base.numel() == p2p_check.WORDS
    assert not (base == 0).any()
    assert len(set(base.tolist())) == base.numel()  # position-dependent: no repeats
    assert torch.equal(base, pattern(1234, 0, 1, 0))
    for other in (pattern(1235, 0, 1, 0), pattern(1234, 1, 0, 0), pattern(1234, 0, 2, 0),
                  pattern(1234, 0, 1, 1), pattern(1234, 2, 1, 0)):
        # Independent 32-bit values: a handful of coincidences at most.
        assert int((other == base).sum()) <= 2


def test_compare_detects_byte_flip_shift_and_stale_zeros():
    want = pattern(99, 3, 1, 0)
    assert compare(want.clone(), want)[0] == OK
    for word, byte in ((0, 0), (777, 2), (want.numel() - 1, 3)):
        got = want.clone()
        got.view(torch.uint8)[4 * word + byte] ^= 0x01  # one bit of one byte
        code, index, g, e, nbad = compare(got, want)
        assert (code, index, nbad) == (CORRUPT, word, 1)
        assert g == int(got[word]) & 0xFFFFFFFF and e == int(want[word]) & 0xFFFFFFFF
    assert compare(torch.zeros_like(want), want)[0] == STALE
    for k in (1, 5, -3):
        got = torch.roll(want, k)  # a copy landed k words off (ends wrap: still detected)
        assert compare(got, want)[:2] == [SHIFTED, k]
    wrong_slot = pattern(99, 2, 1, 0)  # another rank's data
    assert compare(wrong_slot, want)[0] == CORRUPT
    half = want.clone()
    half[1000:] = 0  # a partial write
    code, index, _, _, nbad = compare(half, want)
    assert (code, index, nbad) == (CORRUPT, 1000, want.numel() - 1000)
    assert "nothing arrived" in p2p_check.describe(compare(torch.zeros_like(want), want))
    assert "shifted by +5 words" in p2p_check.describe(compare(torch.roll(want, 5), want))
    with pytest.raises(ValueError, match="got has 3 words"):
        compare(want[:3], want)


def test_copy_kernel_on_raw_addresses():
    if HAS_GPU:
        device = torch.device("cuda", 0)
    elif os.environ.get("TRITON_INTERPRET") == "1":
        device = torch.device("cpu")
    else:
        pytest.fail("without a GPU, tests/conftest.py sets TRITON_INTERPRET=1")

    class Local(p2p_check.MappedTransport):
        def allocate(self, nbytes):
            self.buf = torch.zeros(nbytes // 4, dtype=torch.int32, device=device)
            return self.buf.data_ptr()

    t = Local(device)
    t.addrs[0] = t.allocate(4 * 5000)
    values = pattern(7, 0, 0, 1, 3001)  # not a multiple of the block: the mask matters
    t.store(0, 1000, values, timeout_s=30)
    assert torch.equal(t.buf[1000:4001].cpu(), values)
    assert not t.buf[:1000].any() and not t.buf[4001:].any()
    assert torch.equal(t.load(0, 1000, 3001, timeout_s=30), values)


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank must be in"):
        p2p_check.run_self_test(2, 2, None, None)
    with pytest.raises(ValueError, match="timeout_s > 0"):
        p2p_check.run_self_test(0, 2, None, None, timeout_s=0)


# --------------------------------------------------------------------------- CPU ranks
class FileTransport(p2p_check.MappedTransport):
    """Each rank's buffer is a file in a shared directory, mapped (MAP_SHARED) by every rank:
    stores by one process are seen by the others, like CUDA IPC mappings."""

    def __init__(self, directory, rank):
        super().__init__(torch.device("cpu"))
        self.directory, self.rank, self.maps = directory, rank, []

    def _map(self, path):
        words = os.path.getsize(path) // 4
        self.maps.append(torch.from_file(path, shared=True, size=words, dtype=torch.int32))
        return self.maps[-1].data_ptr()

    def allocate(self, nbytes):
        self.path = os.path.join(self.directory, f"rank{self.rank}.buf")
        with open(self.path, "wb") as f:
            f.write(os.urandom(nbytes))  # uninitialised memory: the test must zero it itself
        return self._map(self.path)

    def export(self):
        return self.path.encode()

    def open(self, handle):
        return self._map(handle.decode())


class Faulty(FileTransport):
    def __init__(self, directory, rank, fault):
        super().__init__(directory, rank)
        self.fault, self.stall = fault, False

    def store(self, rank, offset, values, timeout_s):
        if self.fault == "drop_write" and (self.rank, rank) == (0, 1):
            return  # the write is lost on the way
        if self.fault == "shift_write" and (self.rank, rank) == (0, 1):
            offset += 1  # lands one word late
        super().store(rank, offset, values, timeout_s)

    def load(self, rank, offset, words, timeout_s):
        self.stall = self.fault == "hang" and (self.rank, rank) == (1, 0)
        got = super().load(rank, offset, words, timeout_s)
        if self.fault == "corrupt_read" and (self.rank, rank) == (1, 0):
            got.view(torch.uint8)[4 * 100 + 1] ^= 0x40
        return got

    def open(self, handle):
        if self.fault == "map_fail" and self.rank == 1 and handle.endswith(b"rank0.buf"):
            raise RuntimeError("cudaErrorPeerAccessUnsupported (simulated)")
        return super().open(handle)

    def allocate(self, nbytes):
        if self.fault == "setup_fail" and self.rank == 2:
            raise RuntimeError("out of memory (simulated)")
        return super().allocate(nbytes)

    def _done(self, event):
        return not self.stall


def _self_test_worker(rank, world, directory, cases):
    """One spawn for several runs (spawning ranks costs seconds, a run about 0.2 s)."""
    out = []
    for i, (fault, timeout_s) in enumerate(cases):
        sub = os.path.join(directory, str(i))
        os.makedirs(sub, exist_ok=True)
        transport = Faulty(sub, rank, fault)
        result = p2p_check.run_self_test(rank, world, p2p_check.group_gather(), transport, timeout_s=timeout_s)
        out.append((result.pairs, result.reason(), result.local_error))
    return out


def _agreed(results, world):
    pairs = results[0][0]
    assert set(pairs) == {(a, b) for a in range(world) for b in range(world) if a != b}
    assert all(r[0] == pairs for r in results), "ranks reached different verdicts"
    return pairs


FAULTS = {
    # fault: (failing pairs, text every rank's reason must contain)
    "corrupt_read": ({(1, 0)}, "1->0: rank 1 reading back what it wrote into rank 0: word 100 is "),
    "drop_write": ({(0, 1)}, "rank 1 checking what rank 0 wrote there: nothing arrived"),
    "shift_write": ({(0, 1)}, "rank 1 checking what rank 0 wrote there: the data arrived shifted by +1 words"),
    "map_fail": ({(1, 0)}, "1->0: mapping the peer's buffer (cudaIpcOpenMemHandle) failed"),
    "hang": ({(1, 0)}, "1->0: rank 1 reading back what it wrote into rank 0: timed out"),
}


def test_cpu_two_ranks_pass_then_agree_on_each_injected_fault(tmp_path):
    faults = sorted(FAULTS)
    cases = [(None, 30.0)] + [(f, 1.0 if f == "hang" else 30.0) for f in faults]
    runs = run_ranks(2, _self_test_worker, str(tmp_path), cases)
    by_case = [[runs[rank][i] for rank in range(2)] for i in range(len(cases))]
    pairs = _agreed(by_case[0], 2)
    assert pairs == {(0, 1): None, (1, 0): None}
    assert all(reason is None and err is None for _, reason, err in by_case[0])
    for fault, results in zip(faults, by_case[1:]):
        bad, text = FAULTS[fault]
        pairs = _agreed(results, 2)
        assert {p for p, v in pairs.items() if v is not None} == bad, (fault, pairs)
        for rank, (_, reason, _) in enumerate(results):
            assert reason.startswith("the P2P self-test over CUDA IPC failed for rank pair(s) "
                                     + ", ".join(f"{a}->{b}" for a, b in sorted(bad)) + " ("), (fault, rank, reason)
            assert text in reason, (fault, rank, reason)


def test_cpu_four_ranks_pass_then_one_rank_fails_setup(tmp_path):
    ok, failed = zip(*run_ranks(4, _self_test_worker, str(tmp_path), [(None, 30.0), ("setup_fail", 30.0)]))
    pairs = _agreed(ok, 4)
    assert all(v is None for v in pairs.values()) and all(r[1] is None for r in ok)
    pairs = _agreed(failed, 4)
    assert {p for p, v in pairs.items() if v is not None} == {p for p in pairs if 2 in p}
    assert pairs[(0, 2)] == pairs[(2, 3)] == "rank 2 could not allocate or export its test buffer"
    assert "out of memory (simulated)" in failed[2][2] and failed[0][2] is None
    assert all("rank pair(s) 0->2, 1->2, 2->0, 2->1, 2->3, 3->2 (" in r[1] for r in failed)


def _communicator_worker(rank, world, directory):
    from spec_kernels.comm import FusedAllReduce

    comm = FusedAllReduce(max_tokens=4, hidden_size=16, dtype=torch.float32, device="cpu", timeout_s=30)
    out = []
    for fault in (None, "corrupt_read"):
        sub = os.path.join(directory, str(fault))
        os.makedirs(sub, exist_ok=True)
        reason = p2p_check.communicator_reason(comm, Faulty(sub, rank, fault))
        y = comm.all_reduce(torch.full((2, 16), float(rank + 1)))  # the group still works afterwards
        out.append((reason, float(y[0, 0])))
    return out


def test_communicator_hook_names_the_failing_pair_on_every_rank(tmp_path):
    for (ok, ok_sum), (bad, bad_sum) in run_ranks(2, _communicator_worker, str(tmp_path)):
        assert ok is None and ok_sum == 3.0
        assert "failed for rank pair(s) 1->0 (" in bad and bad_sum == 3.0


# --------------------------------------------------------------------------- GPU
def _gpu_worker(rank, world, fault):
    from spec_kernels.comm import FusedAllReduce

    dev = torch.device("cuda", torch.cuda.current_device())
    if fault:  # every rank's FusedAllReduce gets a transport whose reads from rank 0 corrupt one byte
        class Corrupt(p2p_check.ExtensionIpcTransport):
            def load(self, peer, offset, words, timeout_s):
                got = super().load(peer, offset, words, timeout_s)
                if (rank, peer) == (1, 0):
                    got[7] ^= 1
                return got

        p2p_check.ExtensionIpcTransport = Corrupt
    result = p2p_check.run_self_test(rank, world, p2p_check.group_gather(),
                                     p2p_check.ExtensionIpcTransport(dev), timeout_s=10)
    comm = FusedAllReduce(max_tokens=8, hidden_size=1024, dtype=torch.bfloat16, device=dev, timeout_s=10)
    y = comm.all_reduce(torch.full((4, 1024), float(rank + 1), dtype=torch.bfloat16, device=dev))
    torch.distributed.barrier()
    out = (result.pairs, comm.available["oneshot_pull"], str(comm.algorithm_for(4)), float(y[0, 0]))
    comm.close()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("fault", [False, True])
def test_gpu_self_test_two_ranks_on_one_gpu(fault):
    from spec_kernels.comm import ipc

    why = ipc.unavailable_reason(torch.device("cuda", 0), 2, 1024, torch.bfloat16)
    if why is not None:
        pytest.skip(why)
    results = launch.run_ranks(2, _gpu_worker, fault, backend="gloo", timeout=300, env={"TRITON_INTERPRET": None})
    for pairs, unavailable, algo, total in results:
        assert total == 3.0
        if not fault:
            assert pairs == {(0, 1): None, (1, 0): None} and unavailable is None
        else:
            assert pairs[(0, 1)] is None and "rank 1 reading back what it wrote into rank 0: word 7" in pairs[(1, 0)]
            assert "P2P self-test over CUDA IPC failed for rank pair(s) 1->0" in unavailable and algo == "torch"
