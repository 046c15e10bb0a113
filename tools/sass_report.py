#!/usr/bin/env python
"""Registers, shared memory, occupancy and the inner KV loop of the CUDA attention kernels, read
from the SASS ptxas produces, without a GPU.

For every kernel entry (every template instance) of csrc/tree_verify/tree_verify_attention.cu and
csrc/mla/mla_tree_verify_attention.cu, for each --arch, the .cu is compiled to a cubin with the
extension's own nvcc flags (tools/ptx_harness/build.py: nvcc_flags(arch), with -cubin instead of -ptx)
in a temporary directory, then read back with cuobjdump (-res-usage and -sass; the one shipped in
the Triton wheel, triton/backends/nvidia/bin, or the toolkit's). Reported per kernel and arch:

* registers per thread, spill bytes and static shared memory (SHARED). Spill bytes are the bytes
  the function's STL instructions store (ptxas -v's "spill stores": ptxas spills into the stack
  frame, so -res-usage LOCAL reads 0 while it spills; STACK is kept as `stack_bytes`) plus LOCAL
  (local arrays). The kernels declare only dynamic shared memory; on sm_90 and later SHARED still
  reads 1024: the 1 KB the runtime reserves per CTA, which the occupancy below counts once;
* dynamic shared memory: the launch's third <<<>>> argument, TileConfig<D, rows>::kSmemBytes (tree
  verify) and MlaTile<kMTiles>::kSmemBytes (MLA), for every instance the cubin holds. Those constants are evaluated by the compiler
  itself: a probe translation unit includes the .cu and names `_SassReportShow<kSmemBytes>`, an
  incomplete type, so the compiler's error message prints the value. So the figure is the
  source's formula at that revision, never a copy of it;
* resident CTAs per SM on the arch's GPU (sm_90a: H200, sm_120a: RTX PRO 6000 Blackwell), from
  spec_kernels/attention/plan.py (resident_ctas_per_sm over DEVICES), with the CTA's
  threads from the launch (kThreads of the configuration, the merges' kTreeVerifyMergeThreads /
  kMlaMergeThreads), evaluated by the same probe;
* the inner KV loop. Heuristic: every backward branch (a BRA whose target address is <= its own)
  spans a loop body [target, branch]. Candidates are the bodies holding at least one HMMA and one
  LDGSTS (cp.async); a candidate that contains another candidate is an outer loop and dropped; of
  the rest the one with the most HMMAs is the KV loop (others are counted in `loops`). Figures:
  the static instruction count of the body, its HMMAs, and instructions per HMMA (static: every
  path through the body's forward branches counted once, so an over-estimate of what one
  iteration issues when the body has masked / unmasked variants);
* dependent global-load round trips per tile: a def-use walk over the body in address order
  (one iteration, registers R/UR/P untainted at entry). A global load (LDG, generic LD, LDGSTS)
  has depth 1 + the largest depth among the registers of its global address operand and its
  guard predicate; an LDG's destination registers take that depth; any other instruction gives
  its destinations the largest depth of its sources. The largest depth is the round trips one
  tile waits for: 1 = every load's address is computed without waiting for another global load.
  It approximates the memory dependency chain: data passed through shared memory (an LDGSTS
  writing slot ids, an LDS reading them a later tile) breaks the chain, as it does in the
  pipeline, and a chain carried from the previous iteration in registers is reported separately
  (`carried`: the walk run over two consecutive copies of the body).

    python tools/sass_report.py [--arch sm_120a,sm_90a] [--json OUT] [--rev GIT_REV] [--filter SUBSTR]

--rev compiles the two .cu files as of a git revision (headers from the checkout, so revisions
with the configuration headers of csrc/include/spec_kernels/*_config.h), for before / after
comparisons. One file and arch takes about 10-20 s on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tools.ptx_harness.build import (CUDA_ARCHS, cache_dir, compile_key, find_nvcc, headers_digest,  # noqa: E402
                                nvcc_flags, nvcc_version, write_atomic)

SOURCES = ("csrc/tree_verify/tree_verify_attention.cu", "csrc/mla/mla_tree_verify_attention.cu")
# The compile-time constants each kernel launches with, (dynamic shared memory, threads per CTA),
# per template instance ({P}: its template arguments after the element type), evaluated by the
# compiler. The instances are the cubin's own entries, so a configuration added to the list in
# csrc/include/spec_kernels/*_config.h is reported without an edit here.
LAUNCH_EXPRS = {
    "tree_verify_kernel": ("TileConfig<{P}>::kSmemBytes", "TileConfig<{P}>::kThreads"),
    "mla_tree_verify_kernel": ("MlaTile<{P}>::kSmemBytes", "MlaTile<{P}>::kThreads"),
    "merge_splits_kernel": ("0", "kTreeVerifyMergeThreads"),
    "mla_merge_splits_kernel": ("0", "kMlaMergeThreads"),
}
ARCH_DEVICE = {"sm_90a": "h200", "sm_120a": "rtx-pro-6000"}


def find_cuobjdump() -> Optional[str]:
    try:
        import triton

        cand = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        if os.path.exists(cand):
            return cand
    except ImportError:
        pass
    nvcc = find_nvcc()
    if nvcc and os.path.exists(os.path.join(os.path.dirname(nvcc), "cuobjdump")):
        return os.path.join(os.path.dirname(nvcc), "cuobjdump")
    return shutil.which("cuobjdump")


# --------------------------------------------------------------------------- compiling
def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def _source_text(rel: str, rev: Optional[str]) -> str:
    if rev is None:
        with open(os.path.join(REPO, rel), encoding="utf-8") as f:
            return f.read()
    done = _run(["git", "show", f"{rev}:{rel}"], cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"git show {rev}:{rel} failed: {done.stderr.strip()}")
    return done.stdout


def compile_cubin(rel: str, arch: str, tmp: str, rev: Optional[str] = None) -> str:
    """nvcc -cubin of one source (the checkout's, or its text at `rev`), the extension's flags. The
    cubin is kept in cache_dir()/cubin under a sha256 of the source text, the headers, the flags and
    `nvcc --version`, so an unchanged kernel is not compiled again; an edited one always is."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME)")
    text = _source_text(rel, rev)
    # Quoted includes of the .cu's own directory resolve as they would in place.
    flags = [x for x in nvcc_flags(arch) if x != "-ptx"] + [f"-I{os.path.join(REPO, os.path.dirname(rel))}"]
    key = compile_key("sass-report-cubin-1", rel, text, headers_digest(), "\0".join(flags), nvcc_version(nvcc))
    entry = os.path.join(cache_dir(), "cubin", f"{os.path.basename(rel)}.{arch}.{key[:24]}.cubin")
    if os.path.isfile(entry):
        return entry
    src = os.path.join(tmp, os.path.basename(rel))
    with open(src, "w", encoding="utf-8") as f:
        f.write(text)
    out = os.path.join(tmp, f"{os.path.basename(rel)}.{arch}.cubin")
    done = _run([nvcc, *flags, "-cubin", src, "-o", out])
    if done.returncode != 0:
        raise RuntimeError(f"nvcc -cubin {rel} ({arch}) failed:\n{done.stderr[-4000:]}")
    with open(out, "rb") as f:
        write_atomic(entry, f.read())
    return entry


def instance_key(name: str) -> tuple[str, str]:
    """(kernel base name, template arguments after the element type) of a demangled instance."""
    base = re.match(r"\w+", name).group(0)
    params = re.search(r"<[^,<>]+,\s*([^<>]+)>$", name)
    return base, params.group(1) if params else ""


def launch_constants(rel: str, tmp: str, instances: list[str], rev: Optional[str] = None
                     ) -> dict[str, tuple[int, int]]:
    """{"base/params": (dynamic shared memory, threads)} of the demangled `instances` that
    LAUNCH_EXPRS knows, evaluated by the compiler (see the module docstring)."""
    nvcc = find_nvcc()
    text = _source_text(rel, rev)
    probes = []
    for name in sorted(set(instances)):
        base, params = instance_key(name)
        if base in LAUNCH_EXPRS:
            probes += [(f"{base}/{params}", expr.format(P=params)) for expr in LAUNCH_EXPRS[base]]
    if not probes:
        return {}
    src = os.path.join(tmp, "launch_probe_" + os.path.basename(rel))
    with open(src, "w", encoding="utf-8") as f:
        f.write(text)
        f.write("\ntemplate <int N> struct _SassReportShow;\nnamespace spec_kernels {\nnamespace {\n")
        for i, (_, expr) in enumerate(probes):
            f.write(f"_SassReportShow<{expr}> _sass_report_probe_{i};\n")
        f.write("}\n}\n")
    flags = [x for x in nvcc_flags("sm_120a") if x != "-ptx"]
    done = _run([nvcc, *flags, f"-I{os.path.join(REPO, os.path.dirname(rel))}", "-cubin", src,
                 "-o", os.path.join(tmp, "probe.cubin")])
    # One "incomplete type" error per probe, in the order of the probes.
    vals = [int(v) for v in re.findall(r'incomplete type "?_SassReportShow<(\d+)>', done.stderr)]
    if len(vals) != len(probes):
        raise RuntimeError(f"launch-constant probe of {rel}: expected {len(probes)} values, compiler said:\n"
                           f"{done.stderr[-3000:]}")
    return {key: (vals[i], vals[i + 1]) for i, (key, _) in enumerate(probes) if i % 2 == 0}


# --------------------------------------------------------------------------- reading the cubin
def demangle(name: str) -> str:
    cf = shutil.which("c++filt")
    if cf:
        done = _run([cf, name])
        if done.returncode == 0:
            name = done.stdout.strip()
    return re.sub(r"\(anonymous namespace\)::|spec_kernels::|\(.*\)$", "", name).replace("void ", "")


def res_usage(cuobjdump: str, cubin: str) -> dict[str, dict[str, int]]:
    done = _run([cuobjdump, "-res-usage", cubin])
    out, cur = {}, None
    for line in done.stdout.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            cur = m.group(1)
            continue
        if cur and "REG:" in line:
            out[cur] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
            cur = None
    return out


@dataclass
class Ins:
    addr: int
    guard: str  # "" or the predicate, e.g. "!P0"
    op: str
    operands: list[str]


_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")


def sass_functions(cuobjdump: str, cubin: str) -> dict[str, list[Ins]]:
    done = _run([cuobjdump, "-sass", cubin])
    funcs, cur = {}, None
    for line in done.stdout.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = _INS.search(line)
        if m and cur is not None:
            ops = _split_operands(m.group(4))
            cur.append(Ins(int(m.group(1), 16), (m.group(2) or "").strip().lstrip("@"), m.group(3), ops))
    return funcs


def _split_operands(s: str) -> list[str]:
    out, depth, tok = [], 0, ""
    for ch in s:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(tok.strip())
            tok = ""
        else:
            tok += ch
    if tok.strip():
        out.append(tok.strip())
    return out


def spill_store_bytes(ins: list[Ins]) -> int:
    """Bytes stored to local memory by the function's STL instructions (static, as ptxas -v counts
    spill stores): 4 per 32-bit register, .64 / .128 wider."""
    return sum(4 * _width(i.op) for i in ins if re.match(r"STL(\.|$)", i.op))


# --------------------------------------------------------------------------- loop analysis
def _width(op: str) -> int:
    for suffix, w in ((".128", 4), (".64", 2), (".WIDE", 2)):
        if suffix in op:
            return w
    return 1


def _regs(operand: str, width: int = 1) -> list[str]:
    """Registers an operand names (R/UR/P/UP), a 64-bit pair for `R2.64` / `width`."""
    out = []
    for m in re.finditer(r"\b(U?R|U?P)(\d+)(\.64)?", operand):
        kind, n, pair = m.group(1), int(m.group(2)), m.group(3)
        w = 2 if pair else (width if kind.endswith("R") else 1)
        out += [f"{kind}{n + i}" for i in range(w)]
    return out


_GLOBAL_LOADS = re.compile(r"^(LDG|LD|LDGSTS)(\.|$)")
_NO_DEST = re.compile(r"^(ST|STS|STG|STL|RED|BAR|BRA|BSYNC|BSSY|EXIT|RET|CALL|DEPBAR|LDGDEPBAR|WARPSYNC|NOP|"
                      r"MEMBAR|ERRBAR|CCTL|YIELD|ARRIVES|SYNCS)(\.|$)")


def _global_addr(ins: Ins) -> str:
    brackets = [o for o in ins.operands if "[" in o]
    return brackets[-1] if brackets else ""


def chain_depth(body: list[Ins], passes: int = 1) -> int:
    depth: dict[str, int] = {}
    best = 0
    for _ in range(passes):
        for ins in body:
            guard = depth.get(ins.guard.lstrip("!"), 0) if ins.guard else 0
            if _GLOBAL_LOADS.match(ins.op):
                d = 1 + max([guard] + [depth.get(r, 0) for r in _regs(_global_addr(ins))])
                best = max(best, d)
                if not ins.op.startswith("LDGSTS") and ins.operands:
                    for r in _regs(ins.operands[0], _width(ins.op)):
                        depth[r] = d
                continue
            if _NO_DEST.match(ins.op) or not ins.operands:
                continue
            dests = [ins.operands[0]]
            for o in ins.operands[1:]:
                if re.fullmatch(r"!?U?P(\d+|T)", o) and o[0] != "!" and len(dests) < 3:
                    dests.append(o)
                else:
                    break
            srcs = ins.operands[len(dests):]
            w = 4 if ins.op.startswith(("HMMA", "LDSM")) else _width(ins.op)
            d = max([guard] + [depth.get(r, 0) for o in srcs for r in _regs(o, 1)])
            for o in dests:
                for r in _regs(o, w):  # a predicated write counts as done (@P / @!P pairs cover both)
                    depth[r] = d
    return best


def _target(ins: Ins) -> Optional[int]:
    if not ins.op.startswith("BRA") or not ins.operands:
        return None
    m = re.search(r"0x([0-9a-f]+)", ins.operands[-1])
    return int(m.group(1), 16) if m else None


@dataclass
class LoopFigures:
    start: int
    end: int
    instructions: int
    hmma: int
    ldgsts: int
    per_hmma: float
    round_trips: int
    carried: int
    loops: int  # innermost loops holding HMMA + LDGSTS


def kv_loop(ins: list[Ins]) -> Optional[LoopFigures]:
    cands = []
    for i, x in enumerate(ins):
        t = _target(x)
        if t is not None and t <= x.addr:
            body = [y for y in ins if t <= y.addr <= x.addr]
            h = sum(y.op.startswith("HMMA") for y in body)
            g = sum(y.op.startswith("LDGSTS") for y in body)
            if h and g:
                cands.append((t, x.addr, body, h, g))
    inner = [c for c in cands if not any(o is not c and c[0] <= o[0] and o[1] <= c[1] and (o[0], o[1]) != (c[0], c[1])
                                         for o in cands)]
    if not inner:
        return None
    t, e, body, h, g = max(inner, key=lambda c: (c[3], c[1] - c[0]))
    return LoopFigures(t, e, len(body), h, g, round(len(body) / h, 2), chain_depth(body, 1), chain_depth(body, 2),
                       len(inner))


# --------------------------------------------------------------------------- report
@dataclass
class KernelRow:
    source: str
    kernel: str
    arch: str
    registers: int
    spill_bytes: int
    static_smem: int
    dynamic_smem: Optional[int]
    threads: int
    resident_ctas: Optional[int]
    device: str
    loop: Optional[dict] = field(default=None)
    stack_bytes: int = 0


def report(archs: list[str], rev: Optional[str] = None, sources=SOURCES, name_filter: str = "") -> list[KernelRow]:
    from spec_kernels.attention.plan import DEVICES, KernelResources, resident_ctas_per_sm

    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        raise RuntimeError("cuobjdump not found (the Triton wheel ships one; or a CUDA toolkit)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="sass-report-") as tmp:
        for rel in sources:
            compiled = {}
            for arch in archs:
                cubin = compile_cubin(rel, arch, tmp, rev)
                compiled[arch] = (res_usage(cuobjdump, cubin), sass_functions(cuobjdump, cubin))
            names = {m: demangle(m) for usage, _ in compiled.values() for m in usage}
            launch = launch_constants(rel, tmp, list(names.values()), rev)
            for arch in archs:
                usage, funcs = compiled[arch]
                for mangled in sorted(usage):
                    name = names[mangled]
                    if name_filter and name_filter not in name:
                        continue
                    base, params = instance_key(name)
                    dyn, threads = launch.get(f"{base}/{params}", (None, 128))
                    u = usage[mangled]
                    dev = DEVICES[ARCH_DEVICE[arch]]
                    ctas = None
                    if dyn is not None:
                        # SHARED already holds the CTA's reserved 1 KB, which resident_ctas_per_sm adds.
                        static = max(0, u["SHARED"] - dev.smem_reserved_per_cta)
                        ctas = resident_ctas_per_sm(KernelResources(threads, u["REG"], static + dyn), dev)
                    body = funcs.get(mangled, [])
                    lp = kv_loop(body)
                    spill = spill_store_bytes(body) + u.get("LOCAL", 0)
                    rows.append(KernelRow(rel, name, arch, u["REG"], spill, u["SHARED"], dyn, threads,
                                          ctas, dev.name, asdict(lp) if lp else None, u.get("STACK", 0)))
    return rows


def format_rows(rows: list[KernelRow]) -> str:
    head = (f"{'kernel':44s} {'arch':8s} {'regs':>4s} {'spill':>5s} {'smem s+d':>12s} {'CTAs/SM':>7s} "
            f"{'loop ins':>8s} {'HMMA':>5s} {'ins/HMMA':>8s} {'trips':>5s} {'carried':>7s}")
    out = [head, "-" * len(head)]
    for r in rows:
        lp = r.loop or {}
        smem = f"{r.static_smem}+{r.dynamic_smem if r.dynamic_smem is not None else '?'}"
        out.append(f"{r.kernel:44s} {r.arch:8s} {r.registers:4d} {r.spill_bytes:5d} {smem:>12s} "
                   f"{r.resident_ctas if r.resident_ctas is not None else '?':>7} "
                   f"{lp.get('instructions', '-'):>8} {lp.get('hmma', '-'):>5} {lp.get('per_hmma', '-'):>8} "
                   f"{lp.get('round_trips', '-'):>5} {lp.get('carried', '-'):>7}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default=",".join(CUDA_ARCHS))
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    ap.add_argument("--rev", default=None, help="compile the .cu files as of this git revision")
    ap.add_argument("--filter", default="", help="only kernels whose name contains this")
    ap.add_argument("--source", action="append", default=None, help=f"a .cu to report (default: {SOURCES})")
    opts = ap.parse_args(argv)
    archs = [a for a in opts.arch.split(",") if a]
    for a in archs:
        if a not in ARCH_DEVICE:
            ap.error(f"--arch: {a!r} is not one of {sorted(ARCH_DEVICE)}")
    rows = report(archs, opts.rev, tuple(opts.source or SOURCES), opts.filter)
    print(format_rows(rows))
    print("smem s+d: static (cuobjdump SHARED) + dynamic (the launch's kSmemBytes); CTAs/SM on "
          + ", ".join(f"{a}: {ARCH_DEVICE[a]}" for a in archs)
          + "; trips: dependent global-load round trips per KV tile (SASS def-use walk); carried: over two iterations")
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
