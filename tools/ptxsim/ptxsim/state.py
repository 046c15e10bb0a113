"""The SIMT state of a thread group: its reconvergence stack of frames (pc, reconvergence pc, active
mask), shared by the executor and the control-flow ops."""
from __future__ import annotations

EXIT = -1  # the pc of a finished frame


class Frame:
    __slots__ = ("pc", "rpc", "mask")

    def __init__(self, pc, rpc, mask):
        self.pc, self.rpc, self.mask = pc, rpc, mask


class Group:
    __slots__ = ("launch", "threads", "stack", "state", "penalty", "backedges", "bar_pc", "gid")
    _next = 0

    def __init__(self, launch, threads, stack):
        self.launch, self.threads, self.stack = launch, threads, stack
        self.state = "run"
        self.penalty = 0
        self.backedges = 0
        self.bar_pc = None
        Group._next += 1
        self.gid = Group._next

    def signature(self):
        return (id(self.launch), self.state, self.bar_pc, tuple((f.pc, f.rpc) for f in self.stack))

    def sel(self):
        f = self.stack[-1]
        if f.mask.all():
            t = self.threads
            if t.size and t[-1] - t[0] + 1 == t.size:
                return slice(int(t[0]), int(t[-1]) + 1), t
            return t, t
        t = self.threads[f.mask]
        return t, t
