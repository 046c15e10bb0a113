"""Launch glue: pack a kernel's parameters exactly as the host would, run it, read results back.

`pack_params(entry, values)` lays the values out at the offsets of the PTX `.param` list (the C ABI
layout the driver uses); a struct parameter (`.param .align A .b8 name[N]`) takes `bytes` of
exactly N bytes, so a packed struct whose size drifts from the kernel's is refused.
"""
from __future__ import annotations

import struct

import numpy as np

from .executor import Launch, Machine
from .memory import SimError
from .parser import Entry, parse

_FMT = {"u8": "<B", "s8": "<b", "b8": "<B", "u16": "<H", "s16": "<h", "b16": "<H", "u32": "<I", "s32": "<i",
        "b32": "<I", "f32": "<f", "u64": "<Q", "s64": "<q", "b64": "<Q", "f64": "<d"}


def pack_params(entry: Entry, values) -> bytes:
    if len(values) != len(entry.params):
        raise SimError(f"{entry.name}: {len(values)} arguments for {len(entry.params)} parameters")
    buf = bytearray(entry.param_bytes)
    for p, v in zip(entry.params, values):
        if isinstance(v, (bytes, bytearray)):
            if len(v) != p.size:
                raise SimError(f"parameter {p.name}: {len(v)} bytes given, the PTX declares {p.size}")
            buf[p.offset:p.offset + p.size] = v
            continue
        fmt = _FMT.get(p.type)
        if fmt is None or struct.calcsize(fmt) != p.size:
            raise SimError(f"parameter {p.name} (.{p.type}[{p.size}]) needs bytes")
        if p.type.startswith("f"):
            v = float(v)
        else:
            v = int(v)
            bits = 8 * p.size
            if p.type.startswith("s"):
                v = (v + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))
            else:
                v &= (1 << bits) - 1
        buf[p.offset:p.offset + p.size] = struct.pack(fmt, v)
    return bytes(buf)


_PARSED = {}


def module_of(ptx: str):
    key = hash(ptx)
    m = _PARSED.get(key)
    if m is None:
        m = _PARSED[key] = parse(ptx)
    return m


def run(machine: Machine, ptx: str, entry: str, grid, block, args, dynamic_smem: int = 0):
    """Run one kernel. `args`: per parameter an int/float (scalars and device pointers, e.g. from
    machine.upload) or bytes (a packed struct)."""
    mod = module_of(ptx)
    e = mod.entry(entry)
    stats = machine.run(Launch(e, tuple(grid), tuple(block), pack_params(e, args), dynamic_smem), module=mod)
    return stats[0]
