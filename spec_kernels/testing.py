"""Random tree-verify batches for testing attention kernels: random trees, scattered slots, odd sizes.

Used by this library's tests and its PTX-interpreter harness, and usable by code built on it
(for example an attention backend checking its metadata against `naive_attention`). A case is built from per-request draft counts `ns` and prefix lengths `prefixes`; every
request gets a random tree of the requested kind and its KV slots are a random subset of a
pool larger than needed, so kernels that ignore kv_indices cannot pass.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

TREE_KINDS = ("chain", "wide", "random", "forest")


def random_parents(n: int, kind: str, gen: torch.Generator) -> list[int]:
    """Parent index of each of n drafts (-1 = root), parents before children."""
    if n == 0:
        return []
    if kind == "chain":  # topk = 1: each draft extends the previous one
        return [-1] + list(range(n - 1))
    if kind == "wide":  # one root, every other draft a child of it
        return [-1] + [0] * (n - 1)
    if kind == "random":  # one root, random deep tree
        return [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]
    if kind == "forest":  # several roots
        return [int(torch.randint(-1, i, (), generator=gen)) for i in range(n)]
    raise ValueError(kind)


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    qo_indptr: torch.Tensor
    tree_mask: torch.Tensor
    parents: torch.Tensor  # int64 [T], within-request indices

    @property
    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.kv_indptr, self.kv_indices, self.qo_indptr, self.tree_mask)


def make_case(ns, prefixes, *, hq=4, hkv=2, d=64, dv=None, dtype=torch.float32, kind="random",
              index_dtype=torch.int32, seed=0, device="cpu") -> Case:
    """A batch with len(ns) requests; request b has ns[b] drafts and prefixes[b] prefix slots."""
    dv = dv or d
    gen = torch.Generator().manual_seed(seed)
    kinds = [kind] * len(ns) if isinstance(kind, str) else list(kind)
    kv_lens = [p + n for p, n in zip(prefixes, ns)]
    num_slots = sum(kv_lens) + 7  # spare slots that no request uses
    slots = torch.randperm(num_slots, generator=gen)[: sum(kv_lens)]
    parents = [p for n, k in zip(ns, kinds) for p in random_parents(n, k, gen)]
    T = sum(ns)
    case = Case(
        q=torch.randn(T, hq, d, generator=gen).to(dtype),
        k_cache=torch.randn(num_slots, hkv, d, generator=gen).to(dtype),
        v_cache=torch.randn(num_slots, hkv, dv, generator=gen).to(dtype),
        kv_indptr=torch.tensor([0] + kv_lens, dtype=torch.int64).cumsum(0).to(torch.int32),
        kv_indices=slots.to(index_dtype),
        qo_indptr=torch.tensor([0] + list(ns), dtype=torch.int64).cumsum(0).to(torch.int32),
        tree_mask=torch.zeros(T, dtype=torch.int64),
        parents=torch.tensor(parents, dtype=torch.int64),
    )
    case.tree_mask = ancestor_mask_bits(case.parents, case.qo_indptr)
    return Case(*(t.to(device) for t in vars(case).values()))


def ancestors(parents: list[int], i: int) -> set[int]:
    """Draft i and all its ancestors, by walking parent links (the definition, in plain Python)."""
    out = set()
    while i >= 0:
        out.add(i)
        i = parents[i]
    return out


def ancestor_mask_bits(parents: torch.Tensor, qo_indptr: torch.Tensor) -> torch.Tensor:
    """The tree-mask words computed in plain Python from the definition."""
    qo = qo_indptr.tolist()
    par = parents.tolist()
    words = []
    for b in range(len(qo) - 1):
        local = par[qo[b]:qo[b + 1]]
        for i in range(len(local)):
            w = sum(1 << j for j in ancestors(local, i) if j < 64)  # > 64 drafts: invalid-input cases
            words.append(w - (1 << 64) if w >= 1 << 63 else w)  # as a signed int64
    return torch.tensor(words, dtype=torch.int64)


def visible_slots(case, decode: bool = False):
    """Yield (query token, slot ids it sees) from the definition: the request's whole prefix plus
    the slots of the draft itself and its ancestors (decode: every slot of the request). Queries
    that see nothing are skipped. `case` needs kv_indptr, kv_indices, qo_indptr and parents."""
    kv = case.kv_indptr.tolist()
    qo = list(range(len(kv))) if decode else case.qo_indptr.tolist()
    par = case.parents.tolist()
    for b in range(len(kv) - 1):
        slots = case.kv_indices[kv[b]:kv[b + 1]].long()
        n = qo[b + 1] - qo[b]
        prefix = len(slots) - n
        for i in range(n):
            if decode:
                visible = list(range(len(slots)))
            else:
                seen = ancestors(par[qo[b]:qo[b + 1]], i)
                visible = list(range(prefix)) + [prefix + j for j in sorted(seen)]
            if visible:
                yield qo[b] + i, slots[visible]


def mask_visible_slots(case, decode=False):
    """Yield (query token, slot ids it sees) from the tree-mask words (unlike visible_slots,
    which walks the parents): the whole prefix, and draft j iff bit j of the row's word is set
    (the words must hold no later-draft bits). Queries that see nothing are skipped. `case` on CPU
    with kv_indptr, kv_indices, qo_indptr and tree_mask."""
    kv = case.kv_indptr.tolist()
    qo = list(range(len(kv))) if decode else case.qo_indptr.tolist()
    for b in range(len(kv) - 1):
        slots = case.kv_indices[kv[b]:kv[b + 1]].long()
        n = qo[b + 1] - qo[b]
        for i in range(n):
            if decode:
                visible = list(range(len(slots)))
            else:
                word = int(case.tree_mask[qo[b] + i])
                visible = list(range(len(slots) - n)) + [len(slots) - n + j for j in range(n) if (word >> j) & 1]
            if visible:
                yield qo[b] + i, slots[visible]


def naive_attention(case: Case, sm_scale: float | None = None, decode: bool = False):
    """Float64 softmax attention with a dense list of visible slots per query, written
    independently of spec_kernels' reference (no bit tricks, no log-sum-exp)."""
    q, k, v = case.q.double(), case.k_cache.double(), case.v_cache.double()
    T, hq, d = q.shape
    group = hq // k.shape[1]
    scale = sm_scale if sm_scale is not None else 1 / math.sqrt(d)
    out = torch.zeros(T, hq, v.shape[2], dtype=torch.float64)
    lse = torch.full((T, hq), -math.inf, dtype=torch.float64)
    for t, rows in visible_slots(case, decode):
        for h in range(hq):
            s = (k[rows, h // group] @ q[t, h]) * scale
            out[t, h] = torch.softmax(s, 0) @ v[rows, h // group]
            lse[t, h] = torch.logsumexp(s, 0)
    return out, lse


@contextlib.contextmanager
def programmatic_launch(enabled: bool):
    """Inside, the CUDA attention kernels' split merges are launched as programmatic dependents
    (enabled, the default outside: SPEC_KERNELS_PDL=0 turns it off) or as plain launches; the two
    give the same bytes. Process-wide; the previous setting is restored on exit."""
    from ._ops import cuda_ops

    previous = cuda_ops().set_programmatic_launch(bool(enabled))
    try:
        yield
    finally:
        cuda_ops().set_programmatic_launch(previous)


@contextlib.contextmanager
def launch_rule_as_on(smem_per_sm: int):
    """For GPU tests: inside, CUDA attention launches choose their configuration as if the device
    had at most `smem_per_sm` bytes of shared memory per SM (never more than its own), so one GPU
    runs the configurations the launch rule gives a GPU with less (an H200 those of an RTX PRO
    6000: DeviceLimits.smem_per_sm). Process-wide; the previous cap is restored on exit. The split
    planner still plans for the real device (the split count never changes a result)."""
    from ._ops import cuda_ops

    previous = cuda_ops().set_launch_smem_limit(smem_per_sm)
    try:
        yield
    finally:
        cuda_ops().set_launch_smem_limit(previous)
