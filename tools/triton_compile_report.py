#!/usr/bin/env python
"""Compile every Triton kernel of spec_kernels for real NVIDIA targets, without a GPU.

The CPU tests run the kernels under the Triton interpreter (TRITON_INTERPRET=1), which neither
type-checks nor lowers like the real compiler. This tool compiles them the way a GPU run would:

* the launches are the package's own: each launcher (tree_verify, mla, norm, kv_slots) is called
  with meta tensors of realistic shapes and dtypes, and its kernel launches are recorded instead
  of run (pointer dtypes, int / float scalars, constexprs and num_warps exactly as the launcher
  computes them; KV splits from the SM count of the target GPU);
* autotuned launches are expanded into every config the launcher's autotuner can benchmark
  (its config list after its own prune function), fixed launches (SPEC_KERNELS_TRITON_AUTOTUNE=0)
  are recorded separately;
* the arguments are specialised with Triton's own runtime binder (so ints equal to 1 become
  constexprs and 16-divisible ints / 16-byte aligned pointers get tt.divisibility, as at launch;
  pointers are assumed 16-byte aligned, as torch allocations are);
* every distinct compile is done with triton.compile(ASTSource(...), target=GPUTarget("cuda",
  cap, 32)) in a small process pool, and the ptxas -v output of the cubin build (Triton's own
  ptxas invocation, or an explicit `ptxas -v` run on the PTX) gives registers and spills.

Reported per (kernel, case, config, arch): compile ok / error, shared memory (metadata.shared)
vs the per-block limit (sm_90: 227 KB opt-in; sm_120: 99 KB), registers, spill bytes, stack,
num_warps / num_stages and an estimate of resident blocks per SM.

Exit status 1 if a config the launcher can choose fails to compile, exceeds shared memory or
cannot be resident (0 blocks / SM); 0 otherwise (spills are reported, not fatal).

    python tools/triton_compile_report.py [--arch 90,120] [--quick] [--json OUT]

Run time on 2 CPU cores (270 compiles by default): triton 3.8 about 3.5 min (6 min with another
job on the cores), triton 3.6 about 3 min; --quick (106 compiles) 1.5 min; --ci (14) 10 s.
"""
from __future__ import annotations

import os

# Before triton / spec_kernels are imported: the kernels must be real JITFunctions, not
# interpreter functions, and Triton must print the ptxas -v log of every cubin it builds.
os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import contextlib  # noqa: E402
import importlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any, Optional  # noqa: E402

# Run from anywhere without PYTHONPATH: the package is imported from this checkout.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import triton  # noqa: E402

KB = 1024

# Per-arch limits. smem_block: largest dynamic shared memory one block may opt into;
# smem_sm: shared memory per SM (what resident blocks share; 1 KB of it reserved per block).
ARCHS = {
    # sm_80: only for compiling other projects' kernels whose speed was published on an A100
    # (tools/ptx_harness/calibration.py); no launcher here is planned for it
    80: dict(gpu="A100 (sm_80)", ptx_arch="sm_80", smem_block=163 * KB, smem_sm=164 * KB, threads_sm=2048,
             regs_sm=65536, blocks_sm=32, sms=108),
    90: dict(gpu="H200 (sm_90)", ptx_arch="sm_90a", smem_block=227 * KB, smem_sm=228 * KB, threads_sm=2048,
             regs_sm=65536, blocks_sm=32, sms=132),
    120: dict(gpu="RTX PRO 6000 Blackwell (sm_120)", ptx_arch="sm_120a", smem_block=99 * KB, smem_sm=100 * KB,
              threads_sm=1536, regs_sm=65536, blocks_sm=32, sms=188),
}


# --------------------------------------------------------------------------- recording launches
@dataclass
class Launch:
    """One recorded kernel launch: the JITFunction, its arguments and keyword arguments."""
    fn: Any
    args: tuple
    kwargs: dict
    autotune: Any = None  # the launcher's LazyAutotune when it launched the autotuned kernel


class _Recorder:
    """Stands in for a JITFunction (kernel[grid](*args, **kwargs)) and records the launch."""

    def __init__(self, sink: list, fn, autotune=None):
        self.sink, self.fn, self.autotune = sink, fn, autotune

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append(Launch(self.fn, args, kwargs, self.autotune))
        return launch


@contextlib.contextmanager
def _patched(module, **values):
    old = {k: getattr(module, k) for k in values}
    try:
        for k, v in values.items():
            setattr(module, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


_CUDA = types.SimpleNamespace(type="cuda", index=0)  # what the launch plan sees instead of the meta device


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _batch_label(mode, B, drafts, max_draft):
    """How an attention case names its batch: decode B, or B x drafts (and the max_draft bound)."""
    if mode == "decode":
        return f"B{B}"
    return f"B{B}x{drafts}drafts" + (f" max_draft={max_draft}" if max_draft else "")


def _meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def _record(launcher_module, kernel_names, lazy_name, autotune: bool, sms: int, call) -> list[Launch]:
    """Run call() with the launcher module's kernels replaced by recorders; autotune picks the
    path the launcher takes (LazyAutotune returns (tuned, False) or (plain, True))."""
    from spec_kernels.attention import plan, triton_common

    sink: list[Launch] = []
    # The split merge is shared (attention.triton_common): recorded where merge_splits() finds it.
    merge = {"merge_splits_kernel": _Recorder(sink, triton_common.merge_splits_kernel)}
    patches = {name: _Recorder(sink, getattr(launcher_module, name)) for name in kernel_names
               if name not in merge}
    if lazy_name is not None:
        lazy = getattr(launcher_module, lazy_name)
        tuned = _Recorder(sink, lazy.kernel, autotune=lazy)
        patches[lazy_name] = (lambda: (tuned, False)) if autotune else (lambda: (lazy.kernel, True))
    if hasattr(launcher_module, "plan_splits"):
        real_splits = launcher_module.plan_splits
        patches["plan_splits"] = lambda device, *a, **kw: real_splits(_CUDA, *a, **kw)
    with _patched(plan, sm_count=lambda index: sms), _patched(launcher_module, **patches), \
            _patched(triton_common, **{k: v for k, v in merge.items() if k in kernel_names}):
        call()
    return sink


# --------------------------------------------------------------------------- realistic cases
@dataclass
class Case:
    kernel_family: str
    name: str
    run: Any  # run(autotune: bool, sms: int) -> list[Launch]
    level: int = 2  # 0: --ci, <= 1: --quick, <= 2: default, 3: --all only


def _tree_verify_case(dtype, D, group, mode, B, drafts, max_draft=0, lse=True, idx=torch.int32):
    """mode: "decode" (one query per request) or "tree" (drafts per request; max_draft is the
    caller's max_draft_tokens bound, 0 = the launcher's default of min(T, 64))."""
    from spec_kernels.tree_verify import triton_kernel as tv

    Hkv = 8
    Hq = Hkv * group
    S = 1 << 20  # KV slots (token pool)
    ctx = 2048
    T = B if mode == "decode" else B * drafts
    q = _meta((T, Hq, D), dtype)
    k = _meta((S, Hkv, D), dtype)
    v = _meta((S, Hkv, D), dtype)
    kv_indptr = _meta((B + 1,), torch.int32)
    kv_indices = _meta((B * (ctx + drafts),), idx)
    qo = None if mode == "decode" else _meta((B + 1,), torch.int32)
    mask = None if mode == "decode" else _meta((T,), torch.int64)
    out = _meta((T, Hq, D), dtype)
    lse_t = _meta((T, Hq), torch.float32) if lse else None

    def run(autotune, sms):
        return _record(tv, ["_tree_verify_fwd_kernel", "merge_splits_kernel"], "_kernel_for_launch", autotune, sms,
                       lambda: tv.tree_verify_attention(q, k, v, kv_indptr, kv_indices, qo, mask, D ** -0.5, out,
                                                        lse_t, 0, 1 if mode == "decode" else max_draft))
    return f"{_DTYPE_NAMES[dtype]} D{D} GQA{group} {mode} {_batch_label(mode, B, drafts, max_draft)}", run


def _mla_case(dtype, H, mode, B, drafts, max_draft=0, lse=True, dv=512, dr=64):
    from spec_kernels.mla import triton_kernel as mla

    S = 1 << 20
    ctx = 4096
    T = B if mode == "decode" else B * drafts
    q = _meta((T, H, dv + dr), dtype)
    kv = _meta((S, dv + dr), dtype)
    kv_indptr = _meta((B + 1,), torch.int32)
    kv_indices = _meta((B * (ctx + drafts),), torch.int32)
    qo = None if mode == "decode" else _meta((B + 1,), torch.int32)
    mask = None if mode == "decode" else _meta((T,), torch.int64)
    out = _meta((T, H, dv), dtype)
    lse_t = _meta((T, H), torch.float32) if lse else None

    def run(autotune, sms):
        return _record(mla, ["_mla_fwd_kernel", "merge_splits_kernel"], "_kernel_for_launch", autotune, sms,
                       lambda: mla.mla_tree_verify_attention(q, kv, kv_indptr, kv_indices, qo, mask,
                                                             (dv + dr) ** -0.5, dv, out, lse_t, 0,
                                                             1 if mode == "decode" else max_draft))
    return f"{_DTYPE_NAMES[dtype]} H{H} {dv + dr}/{dv} {mode} {_batch_label(mode, B, drafts, max_draft)}", run


def _norm_case(dtype, hidden, fp8=False, rows=64):
    from spec_kernels.norm import triton_kernel as nk

    x = _meta((rows, hidden), dtype)
    res = _meta((rows, hidden), dtype)
    w = _meta((hidden,), dtype)
    out = _meta((rows, hidden), torch.float8_e4m3fn if fp8 else dtype)
    res_out = _meta((rows, hidden), dtype)

    def run(autotune, sms):
        return _record(nk, ["_fused_add_rmsnorm_kernel"], None, autotune, sms,
                       lambda: nk.fused_add_rmsnorm(x, res, w, 1e-6, out, res_out, 0.5 if fp8 else None))
    return f"{_DTYPE_NAMES[dtype]} hidden={hidden}" + (" -> fp8e4m3" if fp8 else ""), run


def _kv_alloc_case(B, page_size, max_draft, rtt=torch.int32, idx=torch.int64):
    from spec_kernels.kv_slots import triton_kernel as kv

    rows, max_ctx, pages = 4096, 32768, (1 << 20) // page_size

    def run(autotune, sms):
        args = (_meta((rows, max_ctx), rtt), _meta((B,), idx), _meta((B,), idx), _meta((B,), idx),
                _meta((pages,), torch.int64), _meta((1,), torch.int64), _meta((pages,), torch.int32), page_size,
                max_draft, _meta((B * max_draft,), torch.int64), _meta((5,), torch.int64))
        return _record(kv, ["_alloc_kernel"], None, autotune, sms, lambda: kv.alloc_draft_slots(*args))
    return f"B{B} page={page_size} max_draft={max_draft} rtt={str(rtt)[6:]}", run


def _kv_commit_case(B, page_size, max_draft, moves=False, unit_bytes=16, num_buffers=122, rtt=torch.int32,
                    idx=torch.int64, width=None):
    """moves: KV buffers given (page_size > 1): the accepted rows move in the same launch
    (num_buffers: e.g. 61 layers x K and V). width: accept_index columns (<= 64; SGLang's
    spec_steps + 1, here max_draft by default: the widest the API accepts)."""
    from spec_kernels.kv_slots import api
    from spec_kernels.kv_slots import triton_kernel as kv

    rows, max_ctx, pages = 4096, 32768, (1 << 20) // page_size
    width = width or max_draft

    def run(autotune, sms):
        table = None
        shares, sync = 1, None
        if moves:
            table = api.KvTable(_meta((3, num_buffers), torch.int64), num_buffers, pages * page_size, unit_bytes)
            with _patched(api, sm_count=lambda index: sms):
                shares = api._kv_shares(_CUDA, B, num_buffers, 1)
            sync = _meta((kv.MOVE_SYNC_WORDS,), torch.int64)
        args = (_meta((rows, max_ctx), rtt), _meta((B,), idx), _meta((B,), idx), _meta((B,), idx),
                _meta((B, width), idx), _meta((B,), idx), _meta((pages,), torch.int64), _meta((1,), torch.int64),
                _meta((pages,), torch.int32), page_size, max_draft, table, _meta((B,), idx), _meta((5,), torch.int64),
                shares, sync)
        return _record(kv, ["_commit_kernel"], None, autotune, sms, lambda: kv.commit_draft_slots(*args))
    what = f"moves unit={unit_bytes}B x{num_buffers} buffers" if moves else "no KV moves"
    return f"B{B} page={page_size} max_draft={max_draft} accept_width={width} {what}", run


def build_cases() -> list[Case]:
    """The shape cases; level 0: --ci, <= 1: --quick, <= 2: the default run, 3: --all only
    (resource twins of default cases: same tiles, other dtype / group / epilogue)."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    cases: list[Case] = []

    def add(family, made, level=2):
        cases.append(Case(family, made[0], made[1], level))

    # tree verify / decode (GQA): head dims 64/128/256, groups 4/8; the batch sizes pick the
    # split / no-split epilogue (PARTIAL) and the row block (BLOCK_M = 16/32/64/128) as in production.
    for D in (64, 128, 256):
        q = 1 if D in (128, 256) else 2
        add("tree_verify", _tree_verify_case(bf16, D, 4, "decode", B=64, drafts=1, lse=False), q)
        add("tree_verify", _tree_verify_case(bf16, D, 8, "decode", B=4, drafts=1), 3)
        add("tree_verify", _tree_verify_case(bf16, D, 4, "tree", B=8, drafts=8, max_draft=8), 0 if D == 128 else q)
        add("tree_verify", _tree_verify_case(bf16, D, 8, "tree", B=32, drafts=8, max_draft=8, lse=False))
        add("tree_verify", _tree_verify_case(bf16, D, 8, "tree", B=4, drafts=16), q)
        add("tree_verify", _tree_verify_case(fp16, D, 8, "decode", B=4, drafts=1, idx=torch.int64))
        add("tree_verify", _tree_verify_case(fp16, D, 8, "tree", B=4, drafts=16), 3)
        # fp32 inputs (allowed on GPU): IEEE fp32 dots
        add("tree_verify", _tree_verify_case(fp32, D, 4, "decode", B=64, drafts=1))
        add("tree_verify", _tree_verify_case(fp32, D, 4, "tree", B=8, drafts=8, max_draft=8), 1 if D == 256 else 2)
    # MLA (DeepSeek-V3 / Kimi K2.5 576 = 512 latent + 64 rope), H = query heads per rank.
    add("mla", _mla_case(bf16, 8, "decode", B=8, drafts=1), 1)  # BLOCK_M 16, 33+ splits (merge BLOCK_S 64)
    add("mla", _mla_case(bf16, 16, "decode", B=64, drafts=1, lse=False), 3)  # BLOCK_M 16 too
    add("mla", _mla_case(bf16, 128, "decode", B=32, drafts=1))  # BLOCK_M 32
    add("mla", _mla_case(bf16, 8, "tree", B=8, drafts=8, max_draft=8), 0)
    add("mla", _mla_case(bf16, 16, "tree", B=64, drafts=4, max_draft=4), 3)
    add("mla", _mla_case(bf16, 128, "tree", B=16, drafts=4), 1)  # no split
    # fused add + RMSNorm: one block per row, BLOCK = next_pow2(hidden).
    add("norm", _norm_case(bf16, 4096))
    add("norm", _norm_case(bf16, 7168), 0)
    add("norm", _norm_case(bf16, 7168, fp8=True), 1)
    add("norm", _norm_case(bf16, 8192))
    add("norm", _norm_case(fp16, 8192))
    add("norm", _norm_case(fp32, 4096))
    add("norm", _norm_case(bf16, 16384), 1)  # MAX_HIDDEN
    add("norm", _norm_case(bf16, 2880))  # not a power of two (gpt-oss)
    add("norm", _norm_case(bf16, 5001))  # odd: no 16-divisibility, masked tail
    add("norm", _norm_case(fp32, 1, rows=3))  # hidden = 1 (specialised to a constexpr)
    # kv_slots: as tests/test_kv_slots.py compiles them, plus the other constexpr branches.
    add("kv_slots", _kv_alloc_case(64, 16, 64), 0)
    add("kv_slots", _kv_alloc_case(64, 1, 64))
    add("kv_slots", _kv_alloc_case(1, 1, 8, rtt=torch.int64, idx=torch.int32))
    add("kv_slots", _kv_commit_case(64, 1, 64), 0)
    add("kv_slots", _kv_commit_case(64, 16, 64))  # PREFIX_ONLY (paged, no KV buffers)
    add("kv_slots", _kv_commit_case(64, 16, 64, moves=True, unit_bytes=16), 0)
    add("kv_slots", _kv_commit_case(8, 64, 8, moves=True, unit_bytes=2, num_buffers=2, width=4))
    add("kv_slots", _kv_commit_case(64, 1, 16, width=6))  # EAGLE-like: 16 drafts, 5 steps
    add("kv_slots", _kv_commit_case(1, 16, 64, moves=True, unit_bytes=4, rtt=torch.int64, idx=torch.int32))
    return cases


# --------------------------------------------------------------------------- compile jobs
@dataclass
class Job:
    key: str
    arch: int
    module: str
    fn_name: str
    args: list  # ("tensor", dtype name) | ("value", python scalar)
    kwargs: dict
    kernel: str
    config: str
    choosable: bool  # False: pruned by the launcher's autotune prune (compiled with --include-pruned)
    fixed: bool = False  # a plain launch (no autotuning): what runs, no alternative
    cases: list = field(default_factory=list)
    groups: list = field(default_factory=list)  # the autotuned launches that benchmark this config


def _arg_spec(a):
    if isinstance(a, torch.Tensor):
        return ("tensor", str(a.dtype).replace("torch.", ""))
    if a is None or isinstance(a, (bool, int, float)):
        return ("value", a)
    raise TypeError(f"cannot describe kernel argument {a!r}")


def _config_label(kw: dict, fixed: bool, pruned: bool) -> str:
    tiles = " ".join(f"{k[6:] if k.startswith('BLOCK_') else k}={kw[k]}" for k in sorted(kw)
                     if k.startswith("BLOCK_"))
    label = f"{tiles} w{kw.get('num_warps', 4)} s{kw.get('num_stages', 3)}".strip()
    return label + (" [pruned]" if pruned else " [fixed]" if fixed else " [autotune]")


_KERNEL_LABELS = {
    "_tree_verify_fwd_kernel": "tree_verify fwd", "merge_splits_kernel": "merge splits",
    "_mla_fwd_kernel": "mla fwd", "_fused_add_rmsnorm_kernel": "add+rmsnorm",
    "_alloc_kernel": "kv_slots alloc", "_commit_kernel": "kv_slots commit",
}


def _specialisation_key(fn, args, kwargs, arch) -> str:
    """The compile's identity as the Triton runtime sees it (signature, constexprs, attrs, options)."""
    signature, constexprs, attrs, options = _specialise(fn, args, kwargs, arch)
    return repr((fn.fn.__module__, fn.fn.__name__, sorted(signature.items()), sorted(constexprs.items(), key=str),
                 sorted(attrs.items(), key=str), sorted(options.__dict__.items(), key=str), arch))


def _specialise(fn, args, kwargs, arch):
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options


def _mock_args(specs):
    from triton.runtime.jit import MockTensor

    return [MockTensor(getattr(torch, v)) if kind == "tensor" else v for kind, v in specs]


def make_jobs(cases: list[Case], archs: list[int], include_pruned: bool):
    """(jobs, notes, groups): the distinct compiles, launcher errors, and for every autotuned
    launch the keys of the configs its autotuner benchmarks."""
    jobs: dict[str, Job] = {}
    notes: list[dict] = []
    groups: dict[str, list[str]] = {}
    for arch in archs:
        sms = ARCHS[arch]["sms"]
        for case in cases:
            for autotune in (True, False):
                try:
                    launches = case.run(autotune, sms)
                except Exception as exc:  # the launcher itself refused the shapes: a finding too
                    notes.append(dict(case=case.name, arch=arch, error=f"launcher raised {exc!r}"))
                    continue
                for li, launch in enumerate(launches):
                    gid = f"{case.name} | sm_{arch} | launch {li}"
                    name = launch.fn.fn.__name__
                    specs = [_arg_spec(a) for a in launch.args]
                    variants = []
                    if launch.autotune is not None:
                        # the launcher's own config list and prune (LazyAutotune in spec_kernels/_autotune.py)
                        configs = launch.autotune._configs()
                        named = dict(zip(launch.fn.arg_names, launch.args))
                        kept = launch.autotune._prune(list(configs), named, **launch.kwargs) or configs[:1]
                        kept_ids = {id(c) for c in kept}
                        for c in configs:
                            pruned = id(c) not in kept_ids
                            if pruned and not include_pruned:
                                continue
                            variants.append(({**launch.kwargs, **c.all_kwargs()}, False, pruned))
                    else:
                        variants.append((dict(launch.kwargs), True, False))
                    for kw, fixed, pruned in variants:
                        mock = _mock_args(specs)
                        key = _specialisation_key(launch.fn, mock, kw, arch)
                        job = jobs.get(key)
                        if job is None:
                            job = jobs[key] = Job(key, arch, launch.fn.fn.__module__, name, specs, kw,
                                                  _KERNEL_LABELS.get(name, name), _config_label(kw, fixed, pruned),
                                                  not pruned)
                        elif not pruned and not job.choosable:
                            job.choosable, job.config = True, _config_label(kw, fixed, False)
                        elif fixed and "[autotune]" in job.config:
                            job.config = job.config.replace("[autotune]", "[autotune+fixed]")
                        elif not fixed and not pruned and "[fixed]" in job.config:
                            job.config = job.config.replace("[fixed]", "[autotune+fixed]")
                        job.fixed = job.fixed or fixed
                        if case.name not in job.cases:
                            job.cases.append(case.name)
                        if not fixed and not pruned:
                            groups.setdefault(gid, []).append(key)
                            job.groups.append(gid)
    return list(jobs.values()), notes, groups


# --------------------------------------------------------------------------- compiling (workers)
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_for(arch: int, override: Optional[str]) -> str:
    if override:
        return override
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(arch).path
    except Exception:  # older layouts
        from triton import knobs
        return (knobs.nvidia.ptxas_blackwell if arch >= 100 else knobs.nvidia.ptxas).path


def _triton_ptxas_flags() -> list[str]:
    """The register-allocation flag this Triton passes its ptxas (3.8: --regAllocOptLevel=2), so
    an explicit ptxas -v run reports what Triton's cubin has."""
    try:
        import inspect

        from triton.backends.nvidia.compiler import CUDABackend
        src = inspect.getsource(CUDABackend.make_cubin)
    except Exception:
        return []
    return ["--regAllocOptLevel=2"] if "--regAllocOptLevel=2" in src else []


def _parse_ptxas(log: str) -> Optional[dict]:
    used, spill = _PTXAS_USED.search(log), _PTXAS_SPILL.search(log)
    if not used or not spill:
        return None
    return dict(regs=int(used.group(1)), stack=int(spill.group(1)), spill_stores=int(spill.group(2)),
                spill_loads=int(spill.group(3)))


def compile_job(job: Job, ptxas_override: Optional[str] = None) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    res = dict(ok=False, error=None, shared=None, regs=None, spill_stores=None, spill_loads=None, stack=None,
               num_warps=job.kwargs.get("num_warps", 4), num_stages=job.kwargs.get("num_stages", 3),
               compile_s=None, ptxas=None)
    t0 = time.time()
    out = io.StringIO()
    try:
        fn = getattr(importlib.import_module(job.module), job.fn_name)
        signature, constexprs, attrs, options = _specialise(fn, _mock_args(job.args), job.kwargs, job.arch)
        with contextlib.redirect_stdout(out):
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                      target=GPUTarget("cuda", job.arch, 32), options=options.__dict__)
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}".strip()
        res.update(error="\n".join(line for line in text.splitlines() if line.strip())[:4000],
                   compile_s=round(time.time() - t0, 2))
        return res
    md = compiled.metadata
    res.update(ok=True, shared=int(getattr(md, "shared", 0) or 0), num_warps=int(md.num_warps),
               num_stages=int(md.num_stages), compile_s=round(time.time() - t0, 2))
    triton_stats = _parse_ptxas(out.getvalue())
    stats = None if ptxas_override else triton_stats
    if stats is not None:
        res["ptxas"] = "triton's ptxas -v"
    else:  # cached compile (no log) or an explicit ptxas: run ptxas -v on the PTX
        ptxas = _ptxas_for(job.arch, ptxas_override)
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.ptx")
            with open(src, "w") as f:
                f.write(compiled.asm["ptx"])
            done = subprocess.run([ptxas, "-v", *_triton_ptxas_flags(), f"--gpu-name={ARCHS[job.arch]['ptx_arch']}",
                                   src, "-o", os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
        stats = _parse_ptxas(done.stdout + done.stderr) if done.returncode == 0 else None
        res["ptxas"] = f"{ptxas} -v (explicit)"
        if stats is None:
            # Triton built its cubin, so the kernel compiles; this ptxas could not (e.g. a PTX
            # .version newer than it knows): fall back to Triton's own ptxas log when there is one.
            why = " ".join((done.stderr or done.stdout).split())[:300]
            res["ptxas"] = (f"triton's ptxas -v (explicit {ptxas} failed: {why})" if triton_stats else
                            f"none: explicit {ptxas} failed: {why}")
            stats = triton_stats
    if stats:
        res.update(stats)
    return res


def _worker_init():
    os.environ.pop("TRITON_INTERPRET", None)


# --------------------------------------------------------------------------- target probe
def probe_arch(arch: int) -> Optional[str]:
    """None when this triton (and its ptxas) can build a cubin for the arch, else why not."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        with contextlib.redirect_stdout(io.StringIO()):
            compiled = triton.compile(ASTSource(_probe_kernel, {"X": "*fp32", "n": "i32"}, {"BLOCK": 128}),
                                      target=GPUTarget("cuda", arch, 32))
        if "cubin" not in compiled.asm:
            return "no cubin produced"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return None


@triton.jit
def _probe_kernel(X, n, BLOCK: triton.language.constexpr):
    offs = triton.language.arange(0, BLOCK)
    triton.language.store(X + offs, triton.language.load(X + offs, mask=offs < n) * 2.0, mask=offs < n)


# --------------------------------------------------------------------------- report
def blocks_per_sm(arch: int, warps: int, regs: Optional[int], smem: int) -> Optional[int]:
    """Resident blocks per SM from threads, registers (256-register warp allocation units) and
    shared memory (1 KB reserved per block). An estimate; 0 means the block cannot launch."""
    if regs is None:
        return None
    a = ARCHS[arch]
    threads = warps * 32
    per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = (a["regs_sm"] // per_warp) // warps
    by_smem = a["smem_sm"] // (smem + KB) if smem else a["blocks_sm"]
    if smem > a["smem_block"]:
        by_smem = 0
    return min(a["threads_sm"] // threads, by_regs, by_smem, a["blocks_sm"])


def finish(job: Job, res: dict) -> dict:
    a = ARCHS[job.arch]
    row = dict(kernel=job.kernel, cases=job.cases, config=job.config, arch=f"sm_{job.arch}", choosable=job.choosable,
               constexprs={k: v for k, v in job.kwargs.items() if k.isupper()}, smem_limit=a["smem_block"], **res)
    problems = []
    if not res["ok"]:
        problems.append("compile error")
    else:
        if res["shared"] > a["smem_block"]:
            problems.append(f"shared memory {res['shared']} B > {a['smem_block']} B")
        occ = blocks_per_sm(job.arch, res["num_warps"], res["regs"], res["shared"])
        row["blocks_per_sm"] = occ
        if occ == 0 and res["shared"] <= a["smem_block"]:
            problems.append("cannot be resident (0 blocks / SM)")
    warnings = []
    if res.get("spill_stores") or res.get("spill_loads"):
        warnings.append(f"spills {res['spill_stores']} B st / {res['spill_loads']} B ld")
    row["problems"], row["warnings"] = problems, warnings
    row["fatal"] = bool(problems) and job.choosable
    row["fixed"] = job.fixed
    row["groups"] = job.groups
    return row


# Errors Triton's autotuner survives while benchmarking (the config just loses).
_AUTOTUNE_SKIPS = ("OutOfResources", "CompileTimeAssertionFailure", "PTXASError")


def classify(rows: list[dict], groups: dict[str, list[str]], keys: list[str]) -> None:
    """severity of each failing choosable row:
    hard: what runs fails: the fixed config (SPEC_KERNELS_TRITON_AUTOTUNE=0), an error the
          autotuner does not catch, or every config of an autotuned launch fails;
    soft: one of several autotune configs cannot run (shared memory, ptxas): the autotuner
          benchmarks it as inf and picks another (a wasted compile on every first call)."""
    by_key = dict(zip(keys, rows))
    runnable = {gid: any(not by_key[k]["problems"] for k in ks if k in by_key) for gid, ks in groups.items()
                if any(k in by_key for k in ks)}
    for r in rows:
        r["severity"] = None
        if not r["fatal"]:
            continue
        err = r["error"] or ""
        uncaught = not r["ok"] and not any(e in err.split(":")[0] for e in _AUTOTUNE_SKIPS)
        dead = [g for g in r["groups"] if not runnable.get(g, True)]
        r["severity"] = "hard" if r["fixed"] or uncaught or dead else "soft"
        if dead:
            r["problems"].append(f"no autotune config of {len(dead)} launch(es) can run")


def _fmt_kb(b):
    return "-" if b is None else f"{b / KB:.1f}"


def _status(r: dict) -> str:
    if not r["ok"]:
        text = "**ERROR**"
    elif r["problems"]:
        text = "**" + "; ".join(r["problems"]) + "**"
    else:
        text = "ok"
    if r.get("severity"):
        text += f" [{r['severity']}]"
    elif r["problems"] and not r["choosable"]:
        text += " [pruned: never chosen]"
    return text


def _cell(r: Optional[dict]) -> str:
    """One arch's result in a paired row: status, smem KB, regs, spill st/ld bytes, blocks/SM."""
    if r is None:
        return "-"
    if not r["ok"]:
        return _status(r)
    spill = f"{r['spill_stores']}/{r['spill_loads']}" if r["spill_stores"] is not None else "-"
    return (f"{_status(r)} {_fmt_kb(r['shared'])}K {r['regs']}r sp {spill} occ {r.get('blocks_per_sm', '-')}")


def print_table(rows: list[dict], paired: bool = True, file=sys.stdout):
    """paired: one row per (kernel, case, config) with the arches side by side; else one row
    per compile with every column."""
    if paired:
        archs = sorted({r["arch"] for r in rows}, key=lambda a: int(a[3:]))
        table: dict[tuple, dict] = {}
        for r in rows:
            table.setdefault((r["kernel"], r["cases"][0], r["config"]), {})[r["arch"]] = r
        print("| kernel | case (+N: other cases, same compile) | config | " + " | ".join(
            f"{a}: status, smem, regs, spill st/ld B, blocks/SM" for a in archs) + " |", file=file)
        print("|---|---|---|" + "---|" * len(archs), file=file)
        for (kernel, case, config), by_arch in table.items():
            more = max(len(r["cases"]) for r in by_arch.values()) - 1
            print(f"| {kernel} | {case}{f' (+{more})' if more else ''} | {config} | "
                  + " | ".join(_cell(by_arch.get(a)) for a in archs) + " |", file=file)
        return
    print("| kernel | case(s) | config | arch | status | smem KB (limit) | regs | spill st/ld B | stack B | "
          "warps/stages | blocks/SM | compile s |", file=file)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", file=file)
    for r in rows:
        cases = r["cases"][0] + (f" (+{len(r['cases']) - 1} more)" if len(r["cases"]) > 1 else "")
        status = _status(r) + (" (" + "; ".join(r["warnings"]) + ")" if r["ok"] and r["warnings"] else "")
        spill = "-" if r["spill_stores"] is None else f"{r['spill_stores']}/{r['spill_loads']}"
        print(f"| {r['kernel']} | {cases} | {r['config']} | {r['arch']} | {status} | "
              f"{_fmt_kb(r['shared'])} ({r['smem_limit'] // KB}) | {r['regs'] if r['regs'] is not None else '-'} | "
              f"{spill} | {r['stack'] if r['stack'] is not None else '-'} | {r['num_warps']}/{r['num_stages']} | "
              f"{r.get('blocks_per_sm', '-')} | {r['compile_s']} |", file=file)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="90,120", help="compute capabilities, comma separated (default 90,120)")
    ap.add_argument("--quick", action="store_true", help="a representative subset of the shape cases")
    ap.add_argument("--all", action="store_true", help="also the resource twins of the default cases "
                    "(fp16 / other GQA group / other H with the same tiles)")
    ap.add_argument("--ci", action="store_true", help="one representative config per kernel (the CI test)")
    ap.add_argument("--kernels", default="", help="only the case families containing one of these words "
                    "(comma separated: tree_verify, mla, norm, kv_slots)")
    ap.add_argument("--include-pruned", action="store_true",
                    help="also compile autotune configs the launcher's prune drops (never chosen; not fatal)")
    ap.add_argument("--jobs", type=int, default=2, help="compile processes (default 2)")
    ap.add_argument("--ptxas", default=None, help="run this ptxas -v on the PTX instead of reading Triton's log")
    ap.add_argument("--cache-dir", default=None, help="Triton cache dir (default: a fresh temporary one)")
    ap.add_argument("--json", default=None, help="write the rows as JSON to this file")
    ap.add_argument("--long-table", action="store_true", help="one table row per compile (default: the "
                    "arches side by side)")
    opts = ap.parse_args(argv)

    t_start = time.time()
    tmp_cache = None
    if opts.cache_dir:
        os.environ["TRITON_CACHE_DIR"] = opts.cache_dir
    else:
        tmp_cache = tempfile.TemporaryDirectory(prefix="triton-compile-report-")
        os.environ["TRITON_CACHE_DIR"] = tmp_cache.name

    archs = [int(a) for a in opts.arch.split(",") if a.strip()]
    for a in archs:
        if a not in ARCHS:
            ap.error(f"unknown arch {a} (known: {sorted(ARCHS)})")
    unsupported = {a: why for a in archs if (why := probe_arch(a)) is not None}
    for a, why in unsupported.items():
        print(f"NOTE: triton {triton.__version__} cannot build a cubin for sm_{a} here: {why}")
    archs_ok = [a for a in archs if a not in unsupported]

    cases = build_cases()
    level = 0 if opts.ci else 1 if opts.quick else 3 if opts.all else 2
    cases = [c for c in cases if c.level <= level]
    if opts.kernels:
        words = [w.strip() for w in opts.kernels.split(",") if w.strip()]
        cases = [c for c in cases if any(w in c.kernel_family for w in words)]
    jobs, notes, groups = make_jobs(cases, archs_ok, opts.include_pruned)
    if opts.ci:  # one config per (kernel, arch): the first choosable one (tree verify: the fixed tile)
        seen, kept = set(), []
        for j in sorted(jobs, key=lambda j: not j.fixed):
            k = (j.kernel, j.arch, j.kwargs.get("MOVES"))
            if j.choosable and k not in seen:
                seen.add(k)
                kept.append(j)
        jobs = kept
    print(f"triton {triton.__version__}: {len(cases)} shape cases -> {len(jobs)} distinct compiles for "
          f"{', '.join(f'sm_{a}' for a in archs_ok) or 'no arch'} ({opts.jobs} processes)", flush=True)

    # Longest first (big tiles) keeps both processes busy to the end.
    order = sorted(jobs, key=lambda j: -(j.kwargs.get("BLOCK_M", 1) * j.kwargs.get("BLOCK_N", 1)
                                         * j.kwargs.get("D", j.kwargs.get("DV", 1))))
    results: dict[str, dict] = {}
    if opts.jobs <= 1:
        for j in order:
            results[j.key] = compile_job(j, opts.ptxas)
    else:
        ctx = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(opts.jobs, mp_context=ctx, initializer=_worker_init) as pool:
            futs = {pool.submit(compile_job, j, opts.ptxas): j for j in order}
            for n, fut in enumerate(concurrent.futures.as_completed(futs), 1):
                j = futs[fut]
                try:
                    results[j.key] = fut.result()
                except Exception as exc:  # a crashed worker
                    results[j.key] = dict(ok=False, error=f"worker failed: {exc!r}", shared=None, regs=None,
                                          spill_stores=None, spill_loads=None, stack=None,
                                          num_warps=j.kwargs.get("num_warps", 4),
                                          num_stages=j.kwargs.get("num_stages", 3), compile_s=None, ptxas=None)
                if n % 25 == 0:
                    print(f"  {n}/{len(order)} compiled ({time.time() - t_start:.0f} s)", file=sys.stderr, flush=True)

    fam = {"tree_verify fwd": 0, "merge splits": 1, "mla fwd": 2, "add+rmsnorm": 3, "kv_slots alloc": 4,
           "kv_slots commit": 5}
    rows = [finish(j, results[j.key]) for j in jobs]
    classify(rows, groups, [j.key for j in jobs])
    rows.sort(key=lambda r: (fam.get(r["kernel"], 9), r["cases"][0], r["config"], r["arch"]))
    elapsed = time.time() - t_start

    print()
    print_table(rows, paired=not opts.long_table)
    fatal = [r for r in rows if r["fatal"]]
    spills = [r for r in rows if r["ok"] and r["warnings"]]
    print()
    print(f"{len(rows)} compiles in {elapsed:.0f} s (triton {triton.__version__}, "
          f"{sum(r['ok'] for r in rows)} ok, {len(fatal)} fatal, {len(spills)} with spills)")
    for a, why in unsupported.items():
        print(f"sm_{a}: not compiled ({why})")
    for n in notes:
        print(f"NOTE {n['case']} sm_{n['arch']}: {n['error']}")
    for r in rows:
        if r["problems"] or r["warnings"]:
            tag = (f"FATAL/{r['severity']}" if r["fatal"] else
                   ("not choosable" if r["problems"] else "WARNING"))
            print(f"\n[{tag}] {r['kernel']} {r['config']} {r['arch']}: {'; '.join(r['problems'] + r['warnings'])}")
            print(f"  cases: {'; '.join(r['cases'])}")
            print(f"  constexprs: {r['constexprs']}")
            if r["error"]:
                print("  " + "\n  ".join(r["error"].splitlines()[:12]))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(dict(triton=triton.__version__, elapsed_s=round(elapsed, 1), archs=archs,
                           unsupported={f"sm_{a}": w for a, w in unsupported.items()}, notes=notes, rows=rows),
                      f, indent=1, default=str)
    if tmp_cache is not None:
        tmp_cache.cleanup()
    return 1 if fatal else 0


if __name__ == "__main__":
    sys.exit(main())
