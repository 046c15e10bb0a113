"""Parse the PTX that nvcc and Triton emit into entries of decoded-ready instructions.

Covers what those compilers produce: module directives, `.global` / `.shared` / `.extern .shared`
variables, `.entry` functions with their `.param` lists, `.reg` declarations (`%r<12>` ranges and
plain names), labels, predicated instructions, inline-asm `{ }` scopes with their own `.reg` names
(renamed per scope so two scopes never share a register), `.loc` source positions, and the
operand kinds below. Anything else raises PtxSyntaxError naming the line, so an unknown construct
is never skipped silently.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

__all__ = ["PtxSyntaxError", "Operand", "Instr", "Param", "Var", "Entry", "Module", "parse"]


class PtxSyntaxError(ValueError):
    pass


@dataclasses.dataclass
class Operand:
    """kind: 'reg' (name), 'imm' (int value), 'fimm' (bits of a 0f/0d literal, width 32/64),
    'sym' (a variable or param name), 'mem' (base: reg name or symbol, offset), 'vec' (items),
    'special' (name like %tid.x), 'label', 'sink' ('_'), 'negpred' (reg name, for `!%p`)."""
    kind: str
    name: str = ""
    value: int = 0
    width: int = 0
    base_kind: str = ""
    items: tuple = ()

    def __repr__(self):
        if self.kind == "reg":
            return self.name
        if self.kind == "imm":
            return str(self.value)
        if self.kind == "mem":
            return f"[{self.name}+{self.value}]"
        if self.kind == "vec":
            return "{" + ",".join(map(repr, self.items)) + "}"
        return f"{self.kind}:{self.name or self.value}"


@dataclasses.dataclass
class Instr:
    opcode: str                      # full form with modifiers, e.g. "ld.global.nc.v4.u32"
    operands: list
    guard: Optional[str] = None      # predicate register name
    guard_neg: bool = False
    loc: tuple = ("?", 0)            # (file, line) of the latest .loc
    text: str = ""

    @property
    def parts(self):
        return self.opcode.split(".")


@dataclasses.dataclass
class Param:
    name: str
    type: str            # e.g. "u64", "b8"
    size: int            # bytes
    align: int
    offset: int = 0      # within the param space, C ABI layout
    is_ptr: bool = False


@dataclasses.dataclass
class Var:
    name: str
    space: str           # "shared" | "global" | "const"
    size: int            # bytes; 0 for `.extern .shared x[]`
    align: int
    extern: bool = False
    init: Optional[bytes] = None


@dataclasses.dataclass
class Entry:
    name: str
    params: list
    regs: dict           # name -> type ("pred", "b16", "b32", "b64", "f32", ...)
    instrs: list
    labels: dict         # label -> instruction index
    shared: list         # function-scope .shared variables
    param_bytes: int = 0
    files: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Module:
    version: str
    target: str
    entries: dict
    variables: list
    files: dict          # file index -> path

    def entry(self, pattern: str) -> Entry:
        """The one entry whose (mangled) name contains every '*'-separated piece of `pattern`."""
        if pattern in self.entries:
            return self.entries[pattern]
        pieces = [p for p in pattern.split("*") if p]
        hits = [e for n, e in self.entries.items() if all(p in n for p in pieces)]
        if len(hits) != 1:
            raise KeyError(f"{len(hits)} entries match {pattern!r}: {sorted(self.entries)[:20]}")
        return hits[0]


_TYPE_SIZE = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
              "b32": 4, "u32": 4, "s32": 4, "f32": 4, "f16x2": 4, "bf16x2": 4,
              "b64": 8, "u64": 8, "s64": 8, "f64": 8, "pred": 1}

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_LABEL = re.compile(r"^([$%\w.]+):(?!:)")  # not "st.shared::cta"
_ENTRY = re.compile(r"\.entry\s+([\w$.]+)\s*\(")
_REG_RANGE = re.compile(r"^(%?[\w$.]+)<(\d+)>$")
_NUM = re.compile(r"^-?(0[xX][0-9a-fA-F]+|\d+)[uU]?$")


def _strip_comments(text):
    return _COMMENT.sub("", text)


def _split_top(s, sep=","):
    """Split on `sep` outside brackets/braces."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur or out:
        out.append("".join(cur))
    return [x.strip() for x in out]


def _int(tok):
    t = tok.rstrip("uU")
    neg = t.startswith("-")
    t = t[1:] if neg else t
    v = int(t, 16) if t.lower().startswith("0x") else int(t, 10)
    return -v if neg else v


class _Scopes:
    """Register-name scopes of one entry: `{ .reg .b32 a; ... }` names are renamed uniquely."""

    def __init__(self, regs):
        self.regs = regs
        self.stack = [{}]
        self.counter = 0

    def push(self):
        self.stack.append({})

    def pop(self, where):
        if len(self.stack) == 1:
            raise PtxSyntaxError(f"unbalanced '}}' at {where}")
        self.stack.pop()

    def declare(self, name, typ):
        if len(self.stack) == 1:
            self.regs[name] = typ
            self.stack[0][name] = name
        else:
            self.counter += 1
            uniq = f"{name}@s{self.counter}"
            self.regs[uniq] = typ
            self.stack[-1][name] = uniq

    def resolve(self, name):
        for scope in reversed(self.stack):
            if name in scope:
                return scope[name]
        return None


def _parse_operand(tok, scopes, symbols, where):
    tok = tok.strip()
    if not tok:
        raise PtxSyntaxError(f"empty operand at {where}")
    if tok == "_":
        return Operand("sink")
    if tok.startswith("{"):
        if not tok.endswith("}"):
            raise PtxSyntaxError(f"bad vector operand {tok!r} at {where}")
        return Operand("vec", items=tuple(_parse_operand(t, scopes, symbols, where)
                                          for t in _split_top(tok[1:-1])))
    if tok.startswith("["):
        if not tok.endswith("]"):
            raise PtxSyntaxError(f"bad address {tok!r} at {where}")
        inner = tok[1:-1].replace(" ", "")
        m = re.match(r"^([%\w$.@]+?)(?:([+-])(-?(?:0[xX][0-9a-fA-F]+|\d+)))?$", inner)
        if not m:
            raise PtxSyntaxError(f"unsupported address form {tok!r} at {where}")
        base, sign, off = m.group(1), m.group(2), m.group(3)
        offset = _int(off) * (-1 if sign == "-" else 1) if off else 0
        if _NUM.match(base):
            return Operand("mem", base_kind="imm", value=_int(base) + offset)
        r = scopes.resolve(base)
        if r is not None:
            return Operand("mem", name=r, base_kind="reg", value=offset)
        if base in symbols:
            return Operand("mem", name=base, base_kind="sym", value=offset)
        raise PtxSyntaxError(f"unknown name {base!r} in address at {where}")
    if tok.startswith("!"):
        r = scopes.resolve(tok[1:])
        if r is None:
            raise PtxSyntaxError(f"unknown predicate {tok!r} at {where}")
        return Operand("negpred", name=r)
    m = re.match(r"^0([fFdD])([0-9a-fA-F]+)$", tok)
    if m:
        return Operand("fimm", value=int(m.group(2), 16), width=32 if m.group(1) in "fF" else 64)
    if _NUM.match(tok):
        return Operand("imm", value=_int(tok))
    if tok.startswith("%") and scopes.resolve(tok) is None and re.match(
            r"^%(tid|ntid|ctaid|nctaid|laneid|warpid|globaltimer|clock|clock64|smid|nsmid|"
            r"lanemask_\w+|dynamic_smem_size|total_smem_size)(\.[xyz])?(_lo|_hi)?$", tok):
        return Operand("special", name=tok)
    r = scopes.resolve(tok)
    if r is not None:
        return Operand("reg", name=r)
    if "|" in tok:
        a, b = tok.split("|")
        return Operand("vec", items=(_parse_operand(a, scopes, symbols, where),
                                     _parse_operand(b, scopes, symbols, where)), name="|")
    if tok in symbols:
        return Operand("sym", name=tok)
    if re.match(r"^[$\w.]+$", tok):
        return Operand("label", name=tok)
    raise PtxSyntaxError(f"cannot parse operand {tok!r} at {where}")


def _parse_var(stmt, where):
    """`[.extern] .shared|.global|.const .align N .b8 name[size] [= {...}]`."""
    m = re.match(r"^(\.extern\s+|\.visible\s+|\.weak\s+)?\.(shared|global|const)\s+(?:\.align\s+(\d+)\s+)?"
                 r"\.(\w+)\s+([\w$.]+)(?:\[(\d*)\])?\s*(?:=\s*(.*))?$", stmt, re.S)
    if not m:
        raise PtxSyntaxError(f"unsupported declaration {stmt!r} at {where}")
    extern, space, align, typ, name, count, init = m.groups()
    esz = _TYPE_SIZE.get(typ)
    if esz is None:
        raise PtxSyntaxError(f"unsupported variable type .{typ} at {where}")
    n = int(count) if count else (0 if count == "" else 1)
    data = None
    if init is not None:
        vals = [_int(v) for v in _split_top(init.strip().strip("{}"))]
        data = b"".join(int(v).to_bytes(esz, "little", signed=v < 0) for v in vals)
        data = data.ljust(n * esz, b"\0")
    return Var(name, space, n * esz, int(align) if align else esz, bool(extern and "extern" in extern), data)


def _layout_params(params):
    off = 0
    for p in params:
        off = (off + p.align - 1) // p.align * p.align
        p.offset = off
        off += p.size
    return off


def _parse_params(text, where):
    params = []
    for decl in _split_top(text):
        if not decl:
            continue
        m = re.match(r"^\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+(\.ptr\s+(?:\.\w+\s+)?)?"
                     r"(?:\.align\s+(\d+)\s+)?([\w$.]+)(?:\[(\d+)\])?$", decl.strip())
        if not m:
            raise PtxSyntaxError(f"unsupported .param {decl!r} in {where}")
        align0, typ, ptr, align, name, count = m.groups()
        align = align0 if ptr else (align or align0)  # `.ptr .align N` is the pointee's alignment
        esz = _TYPE_SIZE[typ]
        n = int(count) if count else 1
        params.append(Param(name, typ, esz * n, int(align) if align else esz, is_ptr=bool(ptr)))
    return params


def _statements(body):
    """Split an entry body into (kind, text, lineno) with kinds: open, close, label, loc, stmt."""
    out = []
    pending, pend_line = "", 0
    for lineno, raw in enumerate(body.split("\n"), 1):
        line = raw.strip()
        while line:
            if pending:
                j = line.find(";")
                if j < 0:
                    pending += " " + line
                    line = ""
                    continue
                out.append(("stmt", (pending + " " + line[:j]).strip(), pend_line))
                pending, line = "", line[j + 1:].strip()
                continue
            if line[0] == "{":
                out.append(("open", "", lineno))
                line = line[1:].strip()
                continue
            if line[0] == "}":
                out.append(("close", "", lineno))
                line = line[1:].strip()
                continue
            m = _LABEL.match(line)
            if m:
                out.append(("label", m.group(1), lineno))
                line = line[m.end():].strip()
                continue
            is_loc = re.match(r"\.loc\s", line) is not None  # not .local
            if is_loc or line.startswith(".pragma") and ";" not in line:
                out.append(("loc" if is_loc else "skip", line, lineno))
                line = ""
                continue
            j = line.find(";")
            if j < 0:
                pending, pend_line, line = line, lineno, ""
                continue
            out.append(("stmt", line[:j].strip(), lineno))
            line = line[j + 1:].strip()
    if pending:
        raise PtxSyntaxError(f"statement without ';': {pending!r}")
    return out


def _parse_entry(name, header, body, module_syms, line0):
    params = _parse_params(header, name)
    param_bytes = _layout_params(params)
    regs = {}
    scopes = _Scopes(regs)
    symbols = dict(module_syms)
    for p in params:
        symbols[p.name] = "param"
    instrs, labels, shared = [], {}, []
    loc = ("?", 0)
    pending_labels = []
    for kind, text, ln in _statements(body):
        where = f"{name}: PTX line {line0 + ln}"
        if kind == "open":
            scopes.push()
        elif kind == "close":
            scopes.pop(where)
        elif kind == "label":
            labels[text] = len(instrs)
        elif kind == "loc":
            parts = text.split()
            loc = (int(parts[1]), int(parts[2].rstrip(",")))
        elif kind == "skip":
            pass
        else:
            stmt = text
            if stmt.startswith(".reg"):
                m = re.match(r"^\.reg\s+(?:\.v\d\s+)?\.(\w+)\s+(.*)$", stmt)
                if not m:
                    raise PtxSyntaxError(f"bad .reg {stmt!r} at {where}")
                for nm in _split_top(m.group(2)):
                    mr = _REG_RANGE.match(nm)
                    if mr:
                        for i in range(int(mr.group(2))):
                            scopes.declare(f"{mr.group(1)}{i}", m.group(1))
                    else:
                        scopes.declare(nm, m.group(1))
                continue
            if stmt.startswith(".shared") or stmt.startswith(".extern"):
                v = _parse_var(stmt, where)
                shared.append(v)
                symbols[v.name] = "shared"
                continue
            if stmt.startswith(".pragma") or stmt.startswith(".maxnreg") or stmt.startswith(".maxntid") \
                    or stmt.startswith(".reqntid") or stmt.startswith(".minnctapersm"):
                continue
            if stmt.startswith(".local"):
                raise PtxSyntaxError(f"local memory (a register spill or a dynamically indexed array) is not "
                                     f"interpreted: {stmt!r} at {where}")
            if stmt.startswith("."):
                raise PtxSyntaxError(f"unsupported directive {stmt!r} at {where}")
            guard, neg = None, False
            if stmt.startswith("@"):
                m = re.match(r"^@(!?)([%\w$.]+)\s+(.*)$", stmt, re.S)
                if not m:
                    raise PtxSyntaxError(f"bad guard {stmt!r} at {where}")
                neg, gname, stmt = m.group(1) == "!", m.group(2), m.group(3)
                guard = scopes.resolve(gname)
                if guard is None:
                    raise PtxSyntaxError(f"unknown guard predicate {gname} at {where}")
            m = re.match(r"^([\w.:]+)\s*(.*)$", stmt, re.S)
            if not m:
                raise PtxSyntaxError(f"cannot parse {stmt!r} at {where}")
            opcode, rest = m.group(1), m.group(2).strip()
            ops = [_parse_operand(t, scopes, symbols, where) for t in _split_top(rest)] if rest else []
            instrs.append(Instr(opcode, ops, guard, neg, loc, stmt))
    # resolve label operands
    for ins in instrs:
        for op in ins.operands:
            if op.kind == "label" and op.name not in labels and op.name not in symbols:
                raise PtxSyntaxError(f"unknown label or symbol {op.name!r} in {ins.text!r}")
    return Entry(name, params, regs, instrs, labels, shared, param_bytes)


def parse(text: str) -> Module:
    """Parse a whole PTX module."""
    text = _strip_comments(text)
    # drop debug sections (their braces hold data, not code)
    text = re.sub(r"\.section\s+\.debug\w*\s*\{.*?\n\s*\}", "", text, flags=re.S)
    files = {int(m.group(1)): m.group(2) for m in re.finditer(r'\.file\s+(\d+)\s+"([^"]+)"', text)}
    version = (re.search(r"\.version\s+([\d.]+)", text) or [None, "?"])[1]
    target = (re.search(r"\.target\s+([\w,\s]+?)\n", text) or [None, "?"])[1].strip()
    variables, entries = [], {}
    syms = {}
    pos = 0
    while True:
        m = _ENTRY.search(text, pos)
        # module-level declarations between pos and the next entry
        chunk = text[pos:m.start() if m else len(text)]
        for stmt in re.findall(r"^\s*((?:\.extern\s+|\.visible\s+|\.weak\s+)?\.(?:shared|global|const)\s[^;]*);",
                               chunk, re.M):
            v = _parse_var(" ".join(stmt.split()), "module scope")
            variables.append(v)
            syms[v.name] = v.space
        if not m:
            break
        name = m.group(1)
        depth, i = 1, m.end()
        while depth:
            c = text[i]
            depth += c == "("
            depth -= c == ")"
            i += 1
        header = text[m.end():i - 1]
        j = text.index("{", i)
        depth, k = 1, j + 1
        while depth:
            c = text[k]
            depth += c == "{"
            depth -= c == "}"
            k += 1
        body = text[j + 1:k - 1]
        e = _parse_entry(name, header, body, syms, text.count("\n", 0, j))
        e.files = files
        entries[name] = e
        pos = k
    return Module(version, target, entries, variables, files)
