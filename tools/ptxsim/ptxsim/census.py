"""Census of the PTX instruction forms in PTX modules, and the forms the interpreter lacks.

A form is an instruction's opcode with all its dot-modifiers, e.g.
`mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`, `ld.global.nc.v4.u32`,
`cp.async.wait_group`. Instructions inside inline-asm `{ }` scopes count; directives (.reg, .loc,
.shared, ...), labels, guards (@%p / @!%p) and comments do not.

`forms(ptx)` counts them; `Source` names one module; `table(sources)` and
`unsupported_report(sources)` summarise many (the latter against `ptxsim.isa.unsupported`).
"""
from __future__ import annotations

import collections
import re
from typing import Optional

# Directives that end at the end of their line (no ';'), e.g. `.loc 1 15 3`; their text can
# contain anything, so the whole line goes before the statement scan.
_LINE_DIRECTIVES = re.compile(r"^[ \t]*\.(loc|file|version|target|address_size|maxntid|reqntid|minnctapersm|"
                              r"maxnctapersm|maxnreg|maxclusterrank|reqnctapercluster|explicitcluster|"
                              r"noreturn)\b[^\n]*", re.M)
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_SECTIONS = re.compile(r"\.section\b[^{;]*\{.*?\}", re.S)  # DWARF sections: data, no code
_BRACES = re.compile(r"[{}]")
_LABEL = re.compile(r"^[$%\w.]+:(?!:)\s*")
_GUARD = re.compile(r"^@!?[$%\w.]+\s+")
_OPCODE = re.compile(r"^[a-z][\w.:]*")
_ENTRY = re.compile(r"\.(?:entry|func)\s+(?:\([^)]*\)\s*)?([$\w]+)")


def _blank(m: re.Match) -> str:
    """Replace a match by as many newlines as it spans, so line numbers stay right."""
    return "\n" * m.group(0).count("\n")


def _strip_labels(text: str) -> tuple[str, int]:
    """The statement without its leading labels ($L__BB0_2:), and the newlines they spanned."""
    lines = 0
    while True:
        m = _LABEL.match(text)
        if not m:
            return text, lines
        lines += text[:m.end()].count("\n")
        text = text[m.end():]


_LOWER = frozenset("abcdefghijklmnopqrstuvwxyz")


def _statements(ptx: str, want_lines: bool = True):
    """Yield (line, entry, statement) for every instruction statement of the PTX text (guards
    removed, operands kept; line is 0 unless want_lines). Braces are told apart by where they
    stand: after an opcode they hold a vector operand ({%r1, %r2}), after `=` an initializer,
    anywhere else a scope."""
    text = _COMMENTS.sub(_blank, ptx)
    text = _LINE_DIRECTIVES.sub("", text)
    text = _SECTIONS.sub(_blank, text)
    line, entry = 1, None

    def finish(stmt: str, at: int):
        nonlocal entry
        stripped = stmt.strip()
        if not stripped:
            return None
        if want_lines:
            at += stmt[:len(stmt) - len(stmt.lstrip())].count("\n")
        first = stripped[0]
        if first in _LOWER:  # the common case: an opcode, unless it is a label (name:)
            tok = _OPCODE.match(stripped).group(0)
            if ":" not in tok.replace("::", ""):
                return at, entry, stripped
        elif first == "@":
            g = _GUARD.match(stripped)
            if g:
                return at, entry, stripped[g.end():]
        stripped, n = _strip_labels(stripped)
        at += n
        if not stripped:
            return None
        if stripped.startswith("."):
            em = _ENTRY.search(stripped)
            if em:
                entry = em.group(1)
            return None
        g = _GUARD.match(stripped)
        if g:
            stripped = stripped[g.end():]
        return at, entry, stripped

    # No ';' stands inside a vector operand or an initializer, so each ';'-separated chunk is
    # read on its own; only chunks with braces need the brace scan.
    for chunk in text.split(";"):
        if "{" not in chunk and "}" not in chunk:
            got = finish(chunk, line)
            if want_lines:
                line += chunk.count("\n")
            if got is not None:
                yield got
            continue
        pos, pending, pending_line, vector, skip = 0, "", line, 0, 0
        for m in _BRACES.finditer(chunk):
            seg = chunk[pos:m.start()]
            pos = m.end()
            if pending:
                pending += seg
            else:
                pending, pending_line = seg, line
            if want_lines:
                line += seg.count("\n")
            d = m.group(0)
            if skip:  # inside an initializer { ... }
                skip += 1 if d == "{" else -1
                if not skip:
                    pending = ""
                continue
            if vector:  # inside a vector operand {%r1, %r2}
                pending += d
                vector += 1 if d == "{" else -1
                continue
            if d == "{":
                head, _ = _strip_labels(pending.strip())
                if head.endswith("="):
                    skip = 1
                    continue
                if head.startswith("@") or _OPCODE.match(head):
                    pending += d
                    vector = 1
                    continue
            got = finish(pending, pending_line)  # a scope brace ends what came before it
            pending = ""
            if got is not None:
                yield got
        seg = chunk[pos:]
        if pending:
            pending += seg
        else:
            pending, pending_line = seg, line
        if want_lines:
            line += seg.count("\n")
        got = finish(pending, pending_line)
        if got is not None:
            yield got


def _form(statement: str) -> Optional[str]:
    m = _OPCODE.match(statement)
    return m.group(0) if m else None


def forms(ptx_text: str) -> collections.Counter:
    """Static count of every instruction form in the PTX text."""
    out: collections.Counter = collections.Counter()
    for _, _, st in _statements(ptx_text, want_lines=False):
        f = _form(st)
        if f is None:
            raise ValueError(f"cannot read an opcode from the PTX statement {st[:120]!r}")
        out[f] += 1
    return out


def forms_by_entry(ptx_text: str) -> dict[str, collections.Counter]:
    """forms() per .entry / .func."""
    out: dict[str, collections.Counter] = {}
    for _, entry, st in _statements(ptx_text, want_lines=False):
        out.setdefault(entry or "?", collections.Counter())[_form(st)] += 1
    return out


def first_lines(ptx_text: str) -> dict[str, int]:
    """The 1-based PTX line of each form's first occurrence."""
    out: dict[str, int] = {}
    for line, _, st in _statements(ptx_text):
        out.setdefault(_form(st), line)
    return out


# --------------------------------------------------------------------------- many modules
class Source:
    """One PTX module of the census: a CUDA file for one arch, or one Triton compile."""

    def __init__(self, group: str, where: str, detail: str, ptx: str):
        self.group, self.where, self.detail, self.ptx = group, where, detail, ptx
        self.forms = forms(ptx)


def unsupported_report(sources: list[Source], unsupported=None) -> list[str]:
    """One line per unsupported form: the reason and where it occurs (module, count, first line).
    `unsupported` defaults to ptxsim.isa.unsupported."""
    if unsupported is None:
        from .isa import unsupported
    total = collections.Counter()
    for s in sources:
        total.update(s.forms)
    bad = unsupported(sorted(total))
    lines = []
    for form in sorted(bad):
        where = [s for s in sources if form in s.forms]
        shown = "; ".join(f"{s.detail}: {s.forms[form]}x, first at PTX line {first_lines(s.ptx)[form]}"
                          for s in where[:4])
        more = f"; and {len(where) - 4} more modules" if len(where) > 4 else ""
        lines.append(f"{form} ({bad[form]}) in {shown}{more}")
    return lines


def table(sources: list[Source]) -> tuple[list[str], dict]:
    groups = list(dict.fromkeys(s.group for s in sources))
    by_group = {g: collections.Counter() for g in groups}
    where: dict[str, dict[str, collections.Counter]] = {}
    for s in sources:
        by_group[s.group].update(s.forms)
        for f, n in s.forms.items():
            where.setdefault(f, {}).setdefault(s.group, collections.Counter())[s.where] += n
    all_forms = sorted(set().union(*by_group.values())) if by_group else []
    rows = ["| form | " + " | ".join(groups) + " | where |", "|---|" + "---|" * len(groups) + "---|"]
    for f in all_forms:
        w = "; ".join(f"{g}: " + ", ".join(f"{k} {n}" for k, n in sorted(where[f][g].items()))
                      for g in groups if g in where[f])
        rows.append(f"| `{f}` | " + " | ".join(str(by_group[g].get(f, "")) for g in groups) + f" | {w} |")
    stats = {g: dict(distinct=len(c), static=sum(c.values())) for g, c in by_group.items()}
    return rows, dict(groups=stats, by_group={g: dict(c) for g, c in by_group.items()})
