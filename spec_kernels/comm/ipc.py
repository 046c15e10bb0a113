"""CUDA IPC buffers and the custom allreduce kernels behind FusedAllReduce's CUDA algorithms.

Each rank allocates one buffer (cudaMalloc, so its IPC handle covers exactly it) holding the
flags, a staging and a gather area (two of each, by call parity) and the three rotating push
slots (csrc/allreduce/fused_allreduce.cu has the layout and the protocols). Handles travel
through the communicator's process group once; every rank maps every peer's buffer. After
that a call is one kernel launch with fixed pointers: CUDA-graph capturable.

Failures inside a kernel (a peer that never arrives within timeout_s, a peer sending a different
message, a launch with another grid than the buffers were made for) are written to pinned host
memory that the GPU writes directly; the communicator reads it at its next call, in
synchronize() and in check_device_errors() (which the SGLang integration calls once per step,
also when the step is a CUDA graph replay), without a device sync. A failed call, and every call
after it, writes NaN into its outputs: a replayed graph cannot silently compute on stale data.

Status: compiled for sm_90a / sm_120a and reviewed, NOT yet run on a GPU; the torch-side ops
are bound in csrc/allreduce/allreduce_binding.cpp (torch.ops.spec_kernels_cuda.fused_allreduce and allreduce_*).
"""
from __future__ import annotations

import socket
import zlib
from collections import Counter
from typing import Optional

import torch

from .._ops import cuda_ops, cuda_unavailable_reason, sm_count

PUSH_CAPACITY = 1 << 20  # largest message on the push path: 3 slots x W senders of it per rank
# The kernels' constants (csrc/include/spec_kernels/norm_allreduce.h; tests/test_limits.py checks
# them against the built extension).
MAX_RANKS = 8
MAX_BLOCKS = 64  # thread blocks per call (the kernels' limit); the minimum over ranks is used
ALGORITHM_CODES = {"oneshot_push": 0, "oneshot_pull": 1, "twoshot": 2, "oneshot_push_1block": 3}
ERROR_OK, ERROR_TIMEOUT, ERROR_SIZE_MISMATCH, ERROR_BLOCKS_MISMATCH = 0, 1, 2, 3  # ErrorCode
HEADER_ROW_BITS = 22  # kHeaderRowBits: the rows field of a message header
MAX_HEADER_ROWS = (1 << HEADER_ROW_BITS) - 1  # rows of one call on the CUDA algorithms
MAX_MESSAGE_BYTES = 1 << 28  # kMaxMessageBytes: every message is below it
OPERATIONS = ("all_reduce", "all_reduce_add_rmsnorm", "all_reduce_add_rmsnorm (fp8 out)")  # op of the header


def message_header(op: int, algorithm: int, blocks: int, rows: int) -> int:
    """message_header() of norm_allreduce.h: the 32-bit header every flag word carries."""
    return op << 30 | algorithm << 28 | (blocks - 1) << HEADER_ROW_BITS | rows


def unavailable_reason(device: torch.device, world_size: int, hidden_size: int, dtype: torch.dtype,
                       max_tokens: int = 1) -> Optional[str]:
    """None if the CUDA algorithms can run for this communicator, else why not."""
    if max_tokens > MAX_HEADER_ROWS:
        return f"they take at most {MAX_HEADER_ROWS} rows per call (max_tokens is {max_tokens})"
    if max_tokens * hidden_size * dtype.itemsize >= MAX_MESSAGE_BYTES:
        return (f"a message of max_tokens x hidden_size = {max_tokens} x {hidden_size} {dtype} would exceed "
                f"their {MAX_MESSAGE_BYTES} bytes")
    if dtype not in (torch.float16, torch.bfloat16):
        return f"they take float16/bfloat16 (dtype is {str(dtype).replace('torch.', '')})"
    if world_size not in (2, 4, 8):
        return f"they run on 2, 4 or 8 ranks (world size {world_size})"
    if hidden_size % 8:
        return f"hidden_size must be a multiple of 8 (16-byte rows), got {hidden_size}"
    return cuda_unavailable_reason(device, "fused_allreduce")


def _handle_to_ints(handle: torch.Tensor) -> list[int]:
    return handle.view(torch.int64).tolist()


def _ints_to_handle(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).view(torch.uint8)


class IpcBuffers:
    """This rank's registered buffer and its mappings of the peers' (collective to build)."""

    def __init__(self, comm) -> None:
        """Allocate, exchange handles (one collective, which every rank reaches even when its
        local steps failed, so a failure raises on every rank instead of stranding the others),
        then map the peers' buffers (local: a failure here is agreed on by the caller)."""
        self._ops = cuda_ops()
        self.comm = comm
        self.index = comm.device.index if comm.device.index is not None else torch.cuda.current_device()
        row = comm.hidden_size * comm.dtype.itemsize
        self.max_bytes = comm.max_tokens * row
        self.push_bytes = min(self.max_bytes, max(row, PUSH_CAPACITY // row * row))
        self.opened: list[int] = []
        self.base = 0
        local_error, handle = None, [0] * 8
        try:
            size = self._ops.allreduce_buffer_bytes(comm.world_size, self.max_bytes, self.push_bytes)
            self.base = self._ops.allreduce_ipc_alloc(size, self.index)
            handle = _handle_to_ints(self._ops.allreduce_ipc_handle(self.base, self.index))
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            local_error = exc
        host = zlib.crc32(socket.gethostname().encode())
        rows = comm._all_gather_ints([int(local_error is None), sm_count(self.index), host, _gpu_id(self.index),
                                      *handle], "the IPC handle exchange")
        failed = [r for r, row_ in enumerate(rows) if not row_[0]]
        problem = None
        if failed:
            problem = f"allocating or exporting the buffer failed on rank(s) {failed}"
            problem += f": {local_error}" if local_error else ""
        if problem is None and len({row_[2] for row_ in rows}) != 1:
            problem = "the ranks are on different hosts (CUDA IPC works within one host)"
        if problem is not None:
            self.close()
            raise RuntimeError(problem)
        # Block b of a rank spins until block b of every peer has arrived. Ranks sharing one GPU
        # (the GPU tests) can only meet if all their blocks are resident together (MPS), so each
        # gets its share of that GPU's SMs (one block per SM fits: __launch_bounds__(1024, 1)).
        sharing = Counter((row_[2], row_[3]) for row_ in rows)
        self.num_blocks = max(1, min(min(row_[1] // sharing[(row_[2], row_[3])], MAX_BLOCKS) for row_ in rows))
        try:
            # The buffer records num_blocks: every call launches that grid (the kernels refuse
            # another). No peer touches the buffer before the caller's next collective.
            self._ops.allreduce_init_buffer(self.base, comm.world_size, self.max_bytes, self.push_bytes,
                                            self.num_blocks, self.index)
            torch.cuda.synchronize(comm.device)
            self.bases = []
            for r, row_ in enumerate(rows):
                if r == comm.rank:
                    self.bases.append(self.base)
                else:
                    self.opened.append(self._ops.allreduce_ipc_open(_ints_to_handle(row_[4:]), self.index))
                    self.bases.append(self.opened[-1])
        except Exception:
            self.close()
            raise
        # The GPU writes failures here directly (pinned memory is mapped under UVA).
        self.error = torch.zeros(8, dtype=torch.int32, pin_memory=True)
        self.timeout_ns = int(comm.timeout_s * 1e9)

    def limits(self) -> dict[str, int]:
        """Largest message in bytes per algorithm."""
        return {"oneshot_push": self.push_bytes, "oneshot_push_1block": self.push_bytes, "oneshot_pull": self.max_bytes,
                "twoshot": self.max_bytes}

    def run(self, algorithm: str, x: torch.Tensor, seq: int, *, out: torch.Tensor,
            residual: Optional[torch.Tensor] = None, weight: Optional[torch.Tensor] = None, eps: float = 0.0,
            residual_out: Optional[torch.Tensor] = None, out_scale: Optional[float] = None) -> None:
        self._ops.fused_allreduce(ALGORITHM_CODES[algorithm], self.comm.rank, self.bases, self.max_bytes,
                                  self.push_bytes, self.num_blocks, x, residual, weight, out, residual_out,
                                  float(eps), out_scale, self.timeout_ns, self.error.data_ptr())

    def reset(self) -> None:
        """Re-initialise this rank's buffer in place, as at registration (init_buffer: zeroed
        call counters, flags and error slot, the push slots re-armed with the sentinel), and
        clear the host error word. Addresses, IPC mappings and the pinned error word stay, so
        CUDA graphs that captured calls stay valid. Only when no kernel of any rank can touch
        the buffers any more (FusedAllReduce.reset orders that with barriers around it)."""
        torch.cuda.synchronize(self.index)
        self._ops.allreduce_init_buffer(self.base, self.comm.world_size, self.max_bytes, self.push_bytes,
                                        self.num_blocks, self.index)
        torch.cuda.synchronize(self.index)
        self.error.zero_()

    def pending_error(self) -> Optional[tuple[str, str]]:
        """A failure reported by an earlier kernel as (algorithm, message), read from host memory
        (no device sync), or None."""
        return describe_error_word(self.error.tolist(), self.comm.timeout_s, self.num_blocks)

    def close(self) -> None:
        if self.opened or self.base:
            # This rank's queued kernels still read the mapped peer buffers and write self.error:
            # let them finish before unmapping / freeing (close() is called without a sync).
            torch.cuda.synchronize(self.index)
        for ptr in self.opened:
            self._ops.allreduce_ipc_close(ptr, self.index)
        self.opened = []
        if self.base:
            self._ops.allreduce_ipc_free(self.base, self.index)
            self.base = 0


def _gpu_id(index: int) -> int:
    """Identifies the physical GPU across processes (device indices differ with CUDA_VISIBLE_DEVICES)."""
    props = torch.cuda.get_device_properties(index)
    ident = getattr(props, "uuid", None) or f"{props.pci_domain_id}:{props.pci_bus_id}:{props.pci_device_id}"
    return zlib.crc32(str(ident).encode())


def describe_error_word(word: list[int], timeout_s: float, num_blocks: int) -> Optional[tuple[str, str]]:
    """(algorithm, message) for the ErrorWord fields (code, seq, rank, peer, block, algorithm,
    mine, theirs) a kernel left in host memory; None when code is 0."""
    code, seq, _rank, peer, block, algo, mine, theirs = (int(v) for v in word)
    if code == ERROR_OK:
        return None
    name = {v: k for k, v in ALGORITHM_CODES.items()}.get(algo, f"algorithm#{algo}")
    if code == ERROR_BLOCKS_MISMATCH:
        return name, (f"a {name} kernel was launched with {theirs & 0xFFFFFFFF} thread blocks; the buffers were "
                      f"created for {num_blocks} (1 for oneshot_push_1block): refused")
    where = f"device call #{seq & 0xFFFFFFFF} (block {block})"
    if code == ERROR_TIMEOUT:
        return name, (f"{where}: waited more than timeout_s={timeout_s:g} s for rank {peer}; it is dead, "
                      f"stuck, or not making the same calls")
    if code == ERROR_SIZE_MISMATCH:
        return name, (f"{where}: ranks disagree on the message: this rank sends {_header(mine)}, rank {peer} "
                      f"sends {_header(theirs)}")
    return name, f"{where}: error code {code}"


def _header(h: int) -> str:
    """A message header (message_header in csrc/include/spec_kernels/norm_allreduce.h) in words."""
    h &= 0xFFFFFFFF
    op, algo = h >> 30, (h >> 28) & 3
    kind = OPERATIONS[op] if op < len(OPERATIONS) else f"op#{op}"
    name = {v: k for k, v in ALGORITHM_CODES.items()}[algo]
    blocks = ((h >> HEADER_ROW_BITS) & 63) + 1
    return f"{kind} of {h & MAX_HEADER_ROWS} row(s) by {name} in {blocks} block(s)"
