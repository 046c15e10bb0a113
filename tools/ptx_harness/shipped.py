"""What the PTX glue takes from the code that ships instead of keeping copies: parameter-struct
layouts parsed from the C++ headers (checked against the built extension's sizeof), kernel entry
points found by their demangled template instance, and the device figures the launches are
sized for."""
from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INCLUDE = os.path.join(REPO, "csrc", "include", "spec_kernels")

# C scalar types of the parameter structs; every pointer is a 64-bit device address.
_SCALARS = {"bool": ctypes.c_bool, "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
            "uint32_t": ctypes.c_uint32, "uint64_t": ctypes.c_uint64, "size_t": ctypes.c_uint64,
            "float": ctypes.c_float, "double": ctypes.c_double}
_POINTER = ctypes.c_uint64


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


@functools.lru_cache(maxsize=None)
def _declarations(source: str = "") -> tuple[dict[str, str], dict[str, int]]:
    """({struct name: body}, {constant: value}) of csrc/include/spec_kernels/*.h and, when given,
    one csrc-relative source (its definitions win). Constants: `constexpr <type> kName = <int
    literal>;` only."""
    paths = [os.path.join(INCLUDE, n) for n in sorted(os.listdir(INCLUDE)) if n.endswith(".h")]
    if source:
        paths.append(os.path.join(REPO, "csrc", source))
    bodies, constants = {}, {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = _strip_comments(f.read())
        for m in re.finditer(r"\bstruct\s+(\w+)\s*\{([^{}]*)\};", text):
            bodies[m.group(1)] = m.group(2)
        for m in re.finditer(r"\bconstexpr\s+[\w:]+\s+(\w+)\s*=\s*(0x[0-9a-fA-F]+|\d+)[uUlL]*\s*;", text):
            constants[m.group(1)] = int(m.group(2), 0)
    return bodies, constants


def source_constant(name: str, source: str = "") -> int:
    """The value of `constexpr ... name = <literal>;` in the headers or `source`."""
    constants = _declarations(source)[1]
    if name not in constants:
        raise KeyError(f"no literal constexpr {name} in csrc/include/spec_kernels or {source or '-'}")
    return constants[name]


def header_struct(name: str, source: str = "") -> type:
    """A ctypes.Structure with the fields of the C++ struct `name` as csrc/include/spec_kernels/*.h
    (or `source`, csrc-relative) declares them: same order, types, array sizes and natural
    alignment, i.e. the layout nvcc gives the kernel's .param. One class per (name, source)."""
    return _header_struct(name, source)


@functools.lru_cache(maxsize=None)
def _header_struct(name: str, source: str) -> type:
    bodies, constants = _declarations(source)
    body = bodies.get(name)
    if body is None:
        raise KeyError(f"no struct {name} in csrc/include/spec_kernels or {source or '-'}")
    fields = []
    for decl in body.split(";"):
        decl = decl.strip()
        if not decl:
            continue
        if re.search(r"\(|\bstatic\b|\bconstexpr\b", decl):
            raise ValueError(f"struct {name}: cannot lay out member declaration {decl!r}")
        m = re.match(r"((?:const\s+)?\w+(?:\s*\*)?)\s+(.+)", decl, flags=re.S)
        if m is None:
            raise ValueError(f"struct {name}: cannot parse {decl!r}")
        base = m.group(1)
        for declarator in m.group(2).split(","):
            dm = re.fullmatch(r"\s*(\*?)\s*(\w+)((?:\s*\[\s*\w+\s*\])*)\s*", declarator)
            if dm is None:
                raise ValueError(f"struct {name}: cannot parse declarator {declarator!r}")
            tname = base.replace("const", "").replace("*", "").strip()
            if "*" in base or dm.group(1):
                ctype = _POINTER
            elif tname in _SCALARS:
                ctype = _SCALARS[tname]
            else:
                ctype = header_struct(tname, source)
            for dim in reversed(re.findall(r"\[\s*(\w+)\s*\]", dm.group(3))):
                ctype = ctype * (int(dim) if dim.isdigit() else constants[dim])
            fields.append((dm.group(2), ctype))
    return type(name, (ctypes.Structure,), {"_fields_": fields, "__doc__": f"struct {name} (parsed from the C++)."})


def _demangle_all(names: list[str]) -> list[str]:
    cf = shutil.which("c++filt")
    if cf is None:
        raise RuntimeError("c++filt (binutils) is needed to find kernel instances by their template arguments")
    done = subprocess.run([cf], input="\n".join(names), capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


@functools.lru_cache(maxsize=None)
def _demangled(entry_names: tuple[str, ...]) -> dict[str, str]:
    """{normalised demangled instance, e.g. "tree_verify_kernel<__half,128,32>": mangled name}."""
    out = {}
    for mangled, plain in zip(entry_names, _demangle_all(list(entry_names))):
        plain = re.sub(r"\(anonymous namespace\)::|spec_kernels::|^void |\(.*\)$", "", plain)
        out[plain.replace(" ", "")] = mangled
    return out


def entry_of(module, kernel: str, *template_args) -> str:
    """The mangled entry of the instance kernel<template_args...> in a parsed PTX module (e.g.
    entry_of(mod, "tree_verify_kernel", "__half", "128,32,false,1"))."""
    want = f"{kernel}<{','.join(str(a) for a in template_args)}>".replace(" ", "")
    found = _demangled(tuple(sorted(module.entries)))
    if want not in found:
        have = sorted(k for k in found if k.startswith(kernel + "<"))
        raise KeyError(f"no PTX entry {want}; the module has {have}")
    return found[want]


def short_name(mangled: str) -> str:
    """An entry's name without namespaces and parameter list, template arguments kept mangled
    (e.g. tree_verify_kernelI6__halfLi128ELi32E): what the tests read from a launch record."""
    at = 3 if mangled.startswith("_ZN") else 2 if mangled.startswith("_Z") else len(mangled)
    while at < len(mangled):  # the nested name's <length><identifier> parts, in order
        m = re.match(r"\d+", mangled[at:])
        if m is None:
            break
        n, at = int(m.group(0)), at + m.end()
        ident, at = mangled[at:at + n], at + n
        if ident.endswith("kernel") and mangled[at:at + 1] == "I":
            rest = mangled[at:]
            end = rest.find("EEv")  # the template list closes, then the nested name, then void
            return ident + (rest[:end] if end > 0 else rest)
    return mangled


# PTX arch -> the named GPU whose limits the launch is sized for (spec_kernels.attention.plan.DEVICES).
ARCH_DEVICE = {"sm_90a": "h200", "sm_120a": "rtx-pro-6000"}


def _arch_limits(arch: str):
    from spec_kernels.attention.plan import DEVICES

    return DEVICES[ARCH_DEVICE.get(arch, "rtx-pro-6000" if "120" in arch else "h200")]


def device_max_smem(arch: str) -> int:
    """The most dynamic shared memory a CTA may have on the GPU the arch stands for."""
    return _arch_limits(arch).max_smem_per_cta


def device_smem(arch: str) -> tuple[int, int]:
    """(shared memory per SM, reserved per CTA) of the GPU the arch stands for."""
    limits = _arch_limits(arch)
    return limits.smem_per_sm, limits.smem_reserved_per_cta
