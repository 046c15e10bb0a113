"""Every inline-asm statement in csrc/ that reads or writes memory, or orders memory (cp.async and
its commit / wait, ldmatrix, ld / st, atomics, fences), carries a "memory" clobber, so the compiler
can neither move a plain C++ access across it (for example a read of cp.async data above the
cp.async.wait_group that retires it) nor cache a value in a register across it. Register-only asm
(mma.sync, mov, ex2) needs none."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEMORY_OPS = re.compile(r"\b(cp\.async|ldmatrix|stmatrix|ld\.|st\.|atom\.|red\.|fence|membar|bar\.)")


def asm_statements(text: str):
    """(line, whole statement) of every `asm(...)` / `asm volatile(...)` in a C++ source."""
    for m in re.finditer(r"\basm\s+(?:volatile\s*)?\(", text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        yield text.count("\n", 0, m.start()) + 1, text[m.start():i]


def memory_asm_without_clobber(text: str):
    return [line for line, stmt in asm_statements(text)
            if MEMORY_OPS.search(stmt) and '"memory"' not in stmt]


SOURCES = sorted(p for ext in ("*.cu", "*.cuh", "*.h") for p in (ROOT / "csrc").rglob(ext))


def test_memory_asm_has_a_memory_clobber():
    assert len(SOURCES) > 10
    bad = {str(p.relative_to(ROOT)): lines for p in SOURCES if (lines := memory_asm_without_clobber(p.read_text()))}
    assert not bad, f"asm touching memory without a \"memory\" clobber (file: lines): {bad}"


def test_the_check_sees_the_wrappers_and_can_fail():
    mma = (ROOT / "csrc/include/spec_kernels/mma.cuh").read_text()
    stmts = [s for _, s in asm_statements(mma)]
    assert sum("cp.async" in s for s in stmts) >= 4 and sum("ldmatrix" in s for s in stmts) == 2
    # the mutant: cp.async.wait_group without its clobber
    mutant = mma.replace('::"n"(kPending) : "memory");', '::"n"(kPending));')
    assert mutant != mma and len(memory_asm_without_clobber(mutant)) == 1
    assert memory_asm_without_clobber('asm volatile("mma.sync.aligned.m16n8k16 {%0}, {%1};" : "+f"(d) : "r"(a));') == []
