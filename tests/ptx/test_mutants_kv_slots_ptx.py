"""Deliberate bugs in the KV-slot kernels (csrc/kv_slots/kv_slots.cu) must make their PTX tests fail.

The mutants are the former kv_slots hand emulator's mutants re-expressed as edits of the
.cu: each edit's text must occur exactly once (a refactor that moves it fails here loudly instead
of testing nothing). The edited source is compiled to sm_120a PTX and one small case runs on the
interpreter, next to the reference on a copy of the same arguments. Each mutant names the check it
must be caught by, so a case that stops reaching the bug's path fails here too:
- "differs from the reference": an output, a status word or a state tensor of an accepted call;
- "refusal not given": the reference refuses the call, the kernel accepts it;
- "changed although the call was refused": a state byte (page_state, free stack, KV rows...)
  written by a call that was refused;
- "scratch left": the hand-off scratch not left as [next generation, 0, 0, 0] at the end of the launch;
- a shared-memory race, or a Deadlock (every block polls for a verdict nobody publishes: the
  report shows blocks inside wait_for_verdict).

A removed __syncwarp between reading and rewriting a request's draft slots (page size 1) is a race
on GLOBAL memory between lanes of one warp; the interpreter's intra-CTA global race check finds it
although the converged lanes run in lock-step.
"""
from __future__ import annotations

import concurrent.futures
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from spec_kernels.kv_slots import reference  # noqa: E402
from spec_kernels.kv_slots.api import kv_table  # noqa: E402
from test_kv_slots import (GENERATIONS, _draft_page_foreign, _draft_page_free, _draft_slot_twice,  # noqa: E402
                           _last_page_foreign, make_args, next_generation, tag_word)

from tools.ptx_harness import build  # noqa: E402
from ptxsim.executor import Deadlock  # noqa: E402
from ptxsim.memory import SimError  # noqa: E402

from tools.ptx_harness.cuda_glue import ARCH, REPO, PtxCudaOps  # noqa: E402

pytestmark = pytest.mark.skipif(build.find_nvcc() is None,
                                reason="nvcc not found (set CUDA_HOME): the kernels' PTX cannot be produced")

KV = "kv_slots/kv_slots.cu"
RACE = "shared-memory race"
GLOBAL_RACE = "global-memory race"
DIFFERS = "differs from the reference"
NOT_REFUSED = "refusal not given"
CHANGED = "changed although the call was refused"
SCRATCH = "scratch left"
DEADLOCK = "Deadlock"

# name: (what, old text, new text, case, caught by)
MUTANTS = {
    "no_syncwarp": (
        "page_size 1 commit: no __syncwarp between reading and rewriting the draft slots",
        "        __syncwarp();\n", "", "commit_page1", GLOBAL_RACE),
    "no_analyze_sync": (
        "pass 1: no __syncthreads between analyze_tile and reading the tile",
        "    op.analyze_tile(tile, t0, len, true);\n    __syncthreads();\n",
        "    op.analyze_tile(tile, t0, len, true);\n", "commit_page1", RACE),
    "pop_off_by_one": (
        "alloc pops stack entry top - count - k instead of top - 1 - count - k",
        ": a.free_pages[top - 1 - t.count[i] - ", ": a.free_pages[top - t.count[i] - ", "alloc", DIFFERS),
    "first_freed_page": (
        "commit frees pages from roundup(L + k + 1) instead of roundup(L + k)",
        "const int64_t first = roundup(L + k, log2p);", "const int64_t first = roundup(L + k + 1, log2p);",
        "commit_moves", DIFFERS),
    "moves_reversed": (
        "KV rows moved in reverse path order",
        "    for (int j = 0; j < k; ++j) {\n      if (src[j] == dst[j]) continue;",
        "    for (int j = k - 1; j >= 0; --j) {\n      if (src[j] == dst[j]) continue;", "commit_moves", DIFFERS),
    "no_verdict_wait": (
        "move blocks move rows whatever the verdict",
        "  if (!moves || verdict != kKvSlotsOk) return;", "  if (!moves) return;", "commit_refused_moves", CHANGED),
    "tag_ignored": (
        "the election ignores the tag (the previous generation's word: nobody keeps the books)",
        "  if ((seen >> kTagShift) == tag) return false;", "  if (seen != 0) return false;", "commit_moves",
        DEADLOCK),
    "tag_is_generation": (
        "the tag is the generation itself (0 in a fresh scratch: the cleared verdict word passes for "
        "\"accepted\" and nobody keeps the books)",
        "    tag = generation + 1;", "    tag = generation;", "commit_moves_fresh", DIFFERS),
    "no_scratch_reset": (
        "the last block leaves the election, verdict and count words as they are",
        "      c.move_sync[kElection] = c.move_sync[kVerdict] = c.move_sync[kFinished] = 0;\n", "", "commit_moves",
        SCRATCH),
    "generation_not_advanced": (
        "the last block does not advance the generation (the next launch would reuse the tag)",
        "      c.move_sync[kGeneration] = next_generation(generation);\n", "", "commit_moves", SCRATCH),
    "generation_no_wrap": (
        "the generation is not wrapped after the last one (the tag would outgrow its bits)",
        "  return g + 1 < static_cast<uint64_t>(kKvMoveGenerations) ? g + 1 : 0;", "  return g + 1;",
        "commit_moves_last_generation", SCRATCH),
    "done_not_zeroed": (
        "the bookkeeper does not zero the count of finished blocks (a stale count: no last block)",
        "    c.move_sync[kFinished] = 0;\n", "", "commit_moves", SCRATCH),
    "draft_state_unchecked": (
        "commit pass 1: draft slots not checked against page_state at all",
        "(!check_state || a.page_state[slot >> a.log2_page_size] == page_owner(q.row))", "true",
        "commit_draft_page_free", NOT_REFUSED),
    "commit_owner_unchecked": (
        "commit pass 1: a draft page held by anyone passes (not only the request's own)",
        "a.page_state[slot >> a.log2_page_size] == page_owner(q.row)",
        "a.page_state[slot >> a.log2_page_size] > kPageFree", "commit_draft_page_foreign", NOT_REFUSED),
    "continuation_owner_unchecked": (
        "alloc pass 1: a continued last page held by anyone passes (not only the request's own)",
        "a.page_state[last_page] == page_owner(q.row)", "a.page_state[last_page] > kPageFree",
        "alloc_last_page_foreign", NOT_REFUSED),
    "no_claim_rollback": (
        "commit: a page claimed twice refuses the call but the claims stay (kPageMark left)",
        "    each_draft_page(t, [](int32_t* s, int32_t owner) {\n      atomicExch(s, owner);\n      return false;\n"
        "    });\n    return true;", "    return true;",
        "commit_slot_twice", CHANGED),
    "popped_left_claimed": (
        "alloc: the popped pages keep kPageMark instead of getting their owner",
        "          atomicExch(a.page_state + page, page_owner(t.row[i]));\n", "", "alloc", DIFFERS),
    "popped_owner_row0": (
        "alloc: every popped page gets 1 (row 0 as the owner; the former held) instead of its request's row + 1",
        "          atomicExch(a.page_state + page, page_owner(t.row[i]));\n",
        "          atomicExch(a.page_state + page, 1);\n", "alloc", DIFFERS),
    "kept_page_owner_lost": (
        "commit: a kept draft page gets 1 (row 0) instead of its request's row + 1",
        "released ? kPageFree : page_owner(t.row[i])", "released ? kPageFree : 1", "commit_moves", DIFFERS),
}


def patched(old, new):
    with open(os.path.join(REPO, "csrc", KV), encoding="utf-8") as f:
        text = f.read()
    assert text.count(old) == 1, f"mutant text found {text.count(old)} times in {KV}: {old!r}"
    return text.replace(old, new)


# A block spinning on a verdict nobody publishes is a livelock after this many warp-instructions
# without a global store (the interpreter's default, 2M, takes a minute and a half to reach here);
# an unmutated commit stores far more often than that.
SPIN_LIMIT = 100_000


class Ops(PtxCudaOps):
    """The glue with the shorter livelock limit."""

    def _machine(self):
        m = super()._machine()
        m.spin_limit = SPIN_LIMIT
        return m


@pytest.fixture(scope="module", autouse=True)
def compiled(request):
    """Compiles the selected mutants (and the unmutated .cu) two at a time up front: nvcc is most
    of a cold run. A compile error is left for the mutant's own test to report."""
    mine = [item for item in request.session.items if item.module is sys.modules[__name__]]
    names = sorted({item.callspec.params["name"] for item in mine
                    if hasattr(item, "callspec") and "name" in item.callspec.params})
    jobs = [lambda: build.cuda_ptx(os.path.join(REPO, "csrc", KV), ARCH)]
    jobs += [lambda n=n: build.cuda_ptx_from_source(patched(*MUTANTS[n][1:3]), ARCH, os.path.join("csrc", KV),
                                                    headers={}) for n in names]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(job) for job in jobs]:
            try:
                f.result()
            except (RuntimeError, AssertionError):
                pass


# --------------------------------------------------------------------------- the cases
STATE = ("req_to_token", "free_pages", "num_free", "page_state")


def _copy(args):
    return {k: v.clone() if isinstance(v, torch.Tensor) else [t.clone() for t in v] if isinstance(v, list) else v
            for k, v in args.items()}


def _compare(op, want, got):
    """got (the kernel's call) against want (the reference's call on a copy of the same arguments):
    status first (a refusal the kernel did not give), then every output and state tensor."""
    refused = want["status"][0].item() != reference.STATUS_OK
    ws, gs = want["status"].tolist(), got["status"].tolist()
    if refused and gs[0] == reference.STATUS_OK:
        raise AssertionError(f"{op}: refusal not given: status {gs}, the reference's {ws}")
    assert gs == ws, f"{op}: status {gs} differs from the reference's {ws}"
    names = ["out"] + list(STATE) + [f"kv_buffers[{i}]" for i in range(len(want.get("kv_buffers", [])))]
    for name in names:
        if name.startswith("kv_buffers["):
            i = int(name[11:-1])
            w, g = want["kv_buffers"][i], got["kv_buffers"][i]
        else:
            w, g = want[name], got[name]
        if not torch.equal(w, g):
            bad = (w != g).nonzero()[:4].tolist()
            how = CHANGED if refused and name != "out" else DIFFERS
            raise AssertionError(f"{op}: {name} {how} (first differing indices {bad})")


def run_alloc(ops, page_size=4, spoil=None):
    """make_args' batch (rows [4, 1, 3], lengths [9, 5, 0], drafts [3, 0, 5]): request 0 continues
    a half-filled page, the others pop pages; after `spoil`."""
    args = make_args(page_size=page_size)
    if spoil is not None:
        spoil(args)
    res = {}
    for who in ("reference", "kernel"):
        a = _copy(args)
        a["out"] = torch.full((10,), -9, dtype=torch.int64)
        a["status"] = torch.full((reference.STATUS_LEN,), -9, dtype=torch.int64)
        common = [a[k] for k in ("req_to_token", "req_pool_indices", "seq_lens", "num_draft", "free_pages",
                                 "num_free", "page_state")] + [page_size, 8, a["out"], a["status"]]
        (reference.alloc_draft_slots if who == "reference" else ops.alloc_draft_slots)(*common)
        res[who] = a
    _compare("alloc", res["reference"], res["kernel"])


def run_commit(ops, page_size, spoil=None, paths=None, fill=None, shares=1):
    """make_args' commit (paths [0, 2], [], [1, 3, 4]) or `paths`, after `spoil`; with page size > 1
    the KV rows move through the launch-wide hand-off with `shares` blocks per request and the
    scratch [generation, election, verdict, finished] filled with `fill` (default zeros), which
    must be [next generation, 0, 0, 0] afterwards."""
    args = make_args(page_size=page_size, after_alloc=True)
    if paths is not None:
        width = max(len(p) for p in paths)
        args["accept_index"] = torch.tensor([p + [-1] * (width - len(p)) for p in paths], dtype=torch.int64)
        args["accept_len"] = torch.tensor([len(p) for p in paths], dtype=torch.int64)
    if spoil is not None:
        spoil(args)
    res = {}
    for who in ("reference", "kernel"):
        a = _copy(args)
        a["out"] = torch.full_like(a["seq_lens"], -9)
        a["status"] = torch.full((reference.STATUS_LEN,), -9, dtype=torch.int64)
        common = [a[k] for k in ("req_to_token", "req_pool_indices", "seq_lens", "num_draft", "accept_index",
                                 "accept_len", "free_pages", "num_free", "page_state")] + [page_size, 8]
        if who == "reference":
            reference.commit_draft_slots(*common, a["kv_buffers"], a["out"], a["status"])
        elif page_size == 1:
            ops.commit_draft_slots(*common, None, 0, 1, 1, None, a["out"], a["status"])
        else:
            table = kv_table(a["kv_buffers"])
            fill = fill or [0, 0, 0, 0]
            scratch = torch.tensor(fill, dtype=torch.int64)
            ops.commit_draft_slots(*common, table.table, table.num_rows, table.unit_bytes, shares, scratch,
                                   a["out"], a["status"])
            want = [next_generation(fill[0]), 0, 0, 0]
            assert scratch.tolist() == want, f"commit: scratch left {scratch.tolist()}, not {want}"
        res[who] = a
    _compare("commit", res["reference"], res["kernel"])


# The previous generation's words (its verdict "accepted") and a count above the grid: nothing of it
# may pass for this launch's.
STALE = [5, tag_word(4), tag_word(4, reference.STATUS_OK), 9]


# name: what it runs (each small; the page-size-4 ones are one launch of 3 x shares blocks)
CASES = {
    "alloc": lambda ops: run_alloc(ops),
    "commit_page1": lambda ops: run_commit(ops, 1),
    # request 0 (length 9) keeps drafts 1 and 2: rows 10 -> 9 then 11 -> 10 (the order matters);
    # request 2 (length 0) keeps none: both its pages go back, in position order, onto the stack
    # entries they were popped from in the other order (the first page freed matters); rows move
    # in 3 requests x 2 blocks, after the previous generation's words in the scratch
    "commit_moves": lambda ops: run_commit(ops, 4, paths=[[1, 2], [], []], fill=STALE, shares=2),
    # a fresh (zeroed) scratch, and one at the last generation (the next is 0)
    "commit_moves_fresh": lambda ops: run_commit(ops, 4, paths=[[1, 2], [], [0]]),
    "commit_moves_last_generation": lambda ops: run_commit(
        ops, 4, paths=[[1, 2], [], [0]], fill=[GENERATIONS - 1, tag_word(GENERATIONS - 2), 0, 0]),
    # request 0 accepts 4 > its 3 drafts: refused as a whole, while request 2's rows could move
    "commit_refused_moves": lambda ops: run_commit(ops, 4, spoil=lambda a: a["accept_len"].__setitem__(0, 4)),
    "commit_draft_page_free": lambda ops: run_commit(ops, 1, spoil=_draft_page_free),
    # request 2's second page is row 1's (page_state): the commit would free or keep another's page
    "commit_draft_page_foreign": lambda ops: run_commit(ops, 4, spoil=_draft_page_foreign),
    # request 0's half-filled last page is row 1's: its drafts would land on another's page
    "alloc_last_page_foreign": lambda ops: run_alloc(ops, spoil=_last_page_foreign),
    "commit_slot_twice": lambda ops: run_commit(ops, 1, spoil=_draft_slot_twice),
}


def _lines_of(text, signature):
    """The source lines (1-based) of the function whose definition starts with `signature`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(signature))
    end = next(i for i in range(start, len(lines)) if lines[i] == "}")
    return range(start + 1, end + 2)


def _caught(name, what, expect, run, source):
    with pytest.raises((AssertionError, SimError)) as info:
        run()
    err = info.value
    first = (str(err).strip().splitlines() or [""])[0][:200]
    got = type(err).__name__ if isinstance(err, SimError) else "AssertionError"
    print(f"{name} ({what}) caught by {got}: {first}")
    if expect == DEADLOCK:  # every block of the launch polls for the verdict
        polling = any(f"kv_slots.cu:{n}:" in str(err) for n in _lines_of(source, "__device__ int wait_for_verdict("))
        assert isinstance(err, Deadlock) and polling, \
            f"{name}: expected a Deadlock of blocks polling for the verdict, got {got}: {str(err)[:600]}"
    else:
        assert expect in first, f"{name}: expected to be caught by {expect!r}, got {got}: {first}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_unmutated_case_passes(case):
    CASES[case](Ops())


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_caught(name):
    what, old, new, case, expect = MUTANTS[name]
    source = patched(old, new)
    ops = Ops(patched={KV: source})
    _caught(name, what, expect, lambda: CASES[case](ops), source)
