"""Produce the PTX the project's kernels compile to, without a GPU, with an on-disk cache.

CUDA: every csrc/**/*.cu is compiled with nvcc -ptx using the flags setup.py builds the extension
with (setup.py's own nvcc list, torch's COMMON_NVCC_FLAGS and -std, the two defines torch's
BuildExtension adds, -Icsrc/include), for sm_120a (RTX PRO 6000 Blackwell) or sm_90a (H100/H200).

Triton: every compile tools/triton_compile_report.py enumerates (the launchers' own launches and
the autotune configs they can pick) is compiled with triton.compile for GPUTarget("cuda", cap, 32)
and its PTX kept, with the metadata a launch needs (num_warps, shared memory, the PTX parameter
list including Triton's two trailing scratch pointers).

Everything lands in cache_dir() (outside the checkout, so every clone on a machine shares it),
keyed by a sha256 over what decides the output, so an edited .cu / header / kernel file is recompiled on the next call and an
unchanged one is read back. Writes go to a temporary file first and are renamed into place, so
concurrent processes never see a partial entry.

    python -m tools.ptx_harness.build cuda  [--arch sm_120a,sm_90a]      # compile (or read back) every .cu
    python -m tools.ptx_harness.build triton [--level default] [--arch 120] [--jobs 2]
"""
from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Optional

from ptxsim.nvcc import find_nvcc, nvcc_version, require_nvcc  # noqa: F401 (find_nvcc: for callers)

from spec_kernels._build_cache import cache_root, write_atomic

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(REPO, "csrc")
INCLUDE = os.path.join(CSRC, "include")
CUDA_ARCHS = ("sm_120a", "sm_90a")
# Bump when the layout of a cache entry or the way it is produced changes.
_FORMAT = "ptxsim-build-1"

# torch.utils.cpp_extension.COMMON_NVCC_FLAGS and the -std BuildExtension adds, as of torch 2.14;
# used only when torch's source cannot be read (tests check that these equal torch's).
FALLBACK_TORCH_NVCC_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]
FALLBACK_STD = "-std=c++20"
# Defines BuildExtension adds to every compile of an extension named spec_kernels._C.
EXTENSION_DEFINES = ["-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C"]
# setup.py nvcc flags that only affect what ptxas prints, not the PTX (ptxas does not run with -ptx).
_PTXAS_ONLY = ("-Xptxas=-v", "-Xptxas", "--ptxas-options=-v")


def cache_dir() -> str:
    """Where compiled PTX and cubins are kept: $PTXSIM_CACHE_DIR if set, else `ptxsim/` under the
    project's cache root (spec_kernels/_build_cache.py: $SPEC_KERNELS_CACHE_DIR, else
    ~/.cache/spec-kernels). It lies outside the checkout so that every clone on one machine shares
    it; entries are keyed by content, so a shared entry is never stale."""
    if os.environ.get("PTXSIM_CACHE_DIR") and not os.environ.get("SPEC_KERNELS_CACHE_DIR"):
        return os.environ["PTXSIM_CACHE_DIR"]
    return os.path.join(cache_root(), "ptxsim")


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


# --------------------------------------------------------------------------- nvcc and its flags
# CPython 3.11's ast.parse is not thread-safe: two threads parsing at once can fail with
# "AST constructor recursion depth mismatch", and the PTX builds run in threads.
_AST_LOCK = threading.Lock()


def _parse(source: str) -> ast.AST:
    with _AST_LOCK:
        return ast.parse(source)


def setup_py_nvcc_flags() -> list[str]:
    """The "nvcc" list of extra_compile_args in setup.py, read from its source (not run)."""
    with open(os.path.join(REPO, "setup.py"), encoding="utf-8") as f:
        tree = _parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == "nvcc" and isinstance(v, ast.List):
                    return [ast.literal_eval(e) for e in v.elts]
    raise RuntimeError("setup.py has no extra_compile_args['nvcc'] list")


@lru_cache(maxsize=None)
def torch_nvcc_flags() -> tuple[list[str], str, str]:
    """(COMMON_NVCC_FLAGS, the -std flag BuildExtension appends, where they came from). Read from
    torch/utils/cpp_extension.py's source without importing torch (no CUDA probing, no logging)."""
    spec = importlib.util.find_spec("torch")
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "utils", "cpp_extension.py")
    if path is None or not os.path.exists(path):
        return list(FALLBACK_TORCH_NVCC_FLAGS), FALLBACK_STD, "fixed list (torch not found)"
    with open(path, encoding="utf-8") as f:
        tree = _parse(f.read())
    common, std = None, None
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "COMMON_NVCC_FLAGS"):
            common = ast.literal_eval(node.value)
        if isinstance(node, ast.FunctionDef) and node.name.startswith("append_std"):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str) \
                        and re.fullmatch(r"c\+\+\d+", sub.value):
                    std = "-std=" + sub.value
    if common is None or std is None:
        return list(FALLBACK_TORCH_NVCC_FLAGS), FALLBACK_STD, f"fixed list ({path} not understood)"
    return list(common), std, path


def nvcc_flags(arch: str = "sm_120a") -> list[str]:
    """The flags of one .cu -> PTX compile, in the order torch's BuildExtension passes them."""
    if arch not in CUDA_ARCHS:
        raise ValueError(f"arch must be one of {CUDA_ARCHS}, got {arch!r}")
    common, std, _ = torch_nvcc_flags()
    ours = [f for f in setup_py_nvcc_flags() if f not in _PTXAS_ONLY]
    return [f"-I{INCLUDE}", *common, *ours, *EXTENSION_DEFINES, f"-arch={arch}", std, "-ptx"]


def cu_sources() -> list[str]:
    """Every .cu under csrc/, as paths relative to the repository root (the ones setup.py compiles)."""
    return sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(CSRC, "**", "*.cu"), recursive=True))


def compile_key(*parts: str) -> str:
    """sha256 over the parts of a compile, with this checkout's path written as <repo>, so that
    clones at other paths share an entry."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.replace(REPO, "<repo>").encode() + b"\0")
    return h.hexdigest()


def headers_digest() -> str:
    """sha256 over every file under csrc/include and every csrc/**/*.cuh (names and contents)."""
    paths = set(glob.glob(os.path.join(INCLUDE, "**", "*"), recursive=True))
    paths |= set(glob.glob(os.path.join(CSRC, "**", "*.cuh"), recursive=True))
    h = hashlib.sha256()
    for p in sorted(p for p in paths if os.path.isfile(p)):
        h.update(os.path.relpath(p, REPO).encode() + b"\0")
        with open(p, "rb") as f:
            h.update(f.read())
        h.update(b"\0")
    return h.hexdigest()


@dataclass
class CudaPTX:
    ptx: str
    source: str  # the .cu compiled (a repository path, or the cache copy of a patched source)
    arch: str
    key: str
    seconds: float  # nvcc wall time of this compile (the original compile's when read from the cache)
    cached: bool
    flags: list = field(default_factory=list)


def _compile_cu(src_file: str, text: str, arch: str, extra_includes: list[str], label: str) -> CudaPTX:
    nvcc = require_nvcc()
    flags = nvcc_flags(arch)
    inc = [f"-I{d}" for d in extra_includes]
    # The paths the PTX's .file lines carry are moved to this checkout when an entry is read back.
    key = compile_key(_FORMAT, label, text, headers_digest(), "\0".join(inc + flags), nvcc_version(nvcc))
    base = os.path.splitext(os.path.basename(src_file))[0]
    entry = os.path.join(cache_dir(), "cuda", f"{base}.{arch}.{key[:24]}")
    ptx, meta = _read(entry + ".ptx"), _read(entry + ".json")
    if ptx is not None and meta is not None:
        m = json.loads(meta)
        def here(t, written_in=m.get("repo", REPO)):
            return t.replace(written_in, REPO)

        return CudaPTX(here(ptx), here(m["source"]), arch, key, m["seconds"], True, [here(f) for f in m["flags"]])
    with tempfile.TemporaryDirectory(prefix="ptxsim-nvcc-") as tmp:
        out = os.path.join(tmp, base + ".ptx")
        cmd = [nvcc, *inc, *flags, src_file, "-o", out]  # a patched copy's folders before csrc/include
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        seconds = time.perf_counter() - t0
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed on {label} ({arch}), exit {done.returncode}:\n"
                               f"{' '.join(cmd)}\n{(done.stderr or done.stdout)[-6000:]}")
        with open(out, encoding="utf-8") as f:
            ptx = f.read()
    flags_used = cmd[1:-3]  # without the nvcc path, the source and the output file
    write_atomic(entry + ".ptx", ptx)
    write_atomic(entry + ".json", json.dumps(dict(source=src_file, arch=arch, seconds=round(seconds, 3),
                                                   flags=flags_used, nvcc=nvcc_version(nvcc), repo=REPO), indent=1))
    return CudaPTX(ptx, src_file, arch, key, seconds, False, flags_used)


def cuda_ptx_info(cu_path: str, arch: str = "sm_120a") -> CudaPTX:
    """cuda_ptx() with the compile time, cache key and flags."""
    path = cu_path if os.path.isabs(cu_path) else os.path.join(REPO, cu_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such .cu file: {cu_path}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return _compile_cu(path, text, arch, [], os.path.relpath(path, REPO))


def cuda_ptx(cu_path: str, arch: str = "sm_120a") -> str:
    """The PTX of one csrc .cu file (path absolute or relative to the repository root) for arch
    (sm_120a or sm_90a), compiled with the extension's flags; read back from the cache when the
    .cu, the headers, the flags and nvcc are unchanged. RuntimeError when nvcc is missing or fails."""
    return cuda_ptx_info(cu_path, arch).ptx


def cuda_ptx_from_source_info(text: str, arch: str = "sm_120a", name: str = "patched.cu",
                              headers: Optional[dict] = None) -> CudaPTX:
    """cuda_ptx_from_source() with the compile time, cache key and flags."""
    origin = name if os.path.isabs(name) else os.path.join(REPO, name)
    extra = [os.path.dirname(origin)] if os.path.isfile(origin) else []
    label = os.path.relpath(origin, REPO) if extra else os.path.basename(name)
    headers = {os.path.normpath(k): v for k, v in (headers or {}).items()}
    if headers and not extra:
        raise ValueError("patched headers need name to be the repository path of the .cu they are included by")
    for hdr in headers:
        if hdr.startswith("..") or os.path.isabs(hdr) or not os.path.isfile(os.path.join(CSRC, hdr)):
            raise ValueError(f"patched header must be an existing csrc-relative header: {hdr}")
    blob = "".join(f"\0{k}\0{v}" for k, v in sorted(headers.items()))
    h = hashlib.sha256((label + "\0" + text + blob).encode()).hexdigest()[:24]
    # The source is kept (named like the original) so the PTX's .file / .loc lines point at real text.
    src_file = os.path.join(cache_dir(), "src", h, os.path.basename(name) or "patched.cu")
    if headers:
        # Patched headers: the .cu and every csrc/**/*.cuh outside csrc/include (the patched ones
        # edited) are laid out as under csrc/, so a quoted include ("x.cuh", "../norm/x.cuh") finds
        # the copy next to its includer before the -I path of the original's directory.
        # Patched headers of csrc/include (included as <spec_kernels/...>) go to a copy of that
        # folder holding only them, searched before csrc/include.
        root = os.path.join(cache_dir(), "src", h, "csrc")
        src_file = os.path.join(root, os.path.relpath(origin, CSRC))
        if any(k.startswith("include" + os.sep) for k in headers):
            extra = [os.path.join(root, "include")] + extra
        for p in glob.glob(os.path.join(CSRC, "**", "*.cuh"), recursive=True):
            rel = os.path.relpath(p, CSRC)
            if not rel.startswith("include" + os.sep) and rel not in headers:
                with open(p, encoding="utf-8") as f:
                    headers = {**headers, rel: f.read()}
        for rel, body in headers.items():
            if _read(os.path.join(root, rel)) != body:
                write_atomic(os.path.join(root, rel), body)
    if _read(src_file) != text:
        write_atomic(src_file, text)
    return _compile_cu(src_file, text + blob, arch, extra, "patched:" + label)


def cuda_ptx_from_source(text: str, arch: str = "sm_120a", name: str = "patched.cu",
                         headers: Optional[dict] = None) -> str:
    """The PTX of an edited copy of a .cu file (e.g. a mutant), compiled like cuda_ptx(). name is
    the .cu the text was edited from (repository path): its directory is put on the include path
    so the original's quoted relative includes resolve; csrc/include is on the path as always.
    headers: {csrc-relative path of a header (csrc/include's too): edited text}, used instead of
    the file by the quoted includes of this compile (the .cu's text may be the unedited one)."""
    return cuda_ptx_from_source_info(text, arch, name, headers).ptx


def cuda_ptx_all(archs=CUDA_ARCHS, processes: int = 2) -> list[CudaPTX]:
    """cuda_ptx_info() of every csrc .cu for every arch, `processes` nvcc runs at a time."""
    import concurrent.futures

    todo = [(cu, arch) for arch in archs for cu in cu_sources()]
    with concurrent.futures.ThreadPoolExecutor(max(1, processes)) as pool:
        return list(pool.map(lambda t: cuda_ptx_info(*t), todo))


# --------------------------------------------------------------------------- Triton
_LEVELS = {"ci": 0, "quick": 1, "default": 2, "all": 3}


@dataclass
class TritonJob:
    """One distinct Triton compile: a kernel with one specialisation and one config."""
    kernel: str  # the JIT function's name, e.g. _tree_verify_fwd_kernel
    label: str  # the report's family label, e.g. "tree_verify fwd"
    config: str  # e.g. "M=64 N=64 w4 s2 [autotune]"
    cases: list  # the shape cases whose launches produce this compile
    arch: int
    module: str
    key: str  # the specialisation key (signature, constexprs, attrs, options, arch)
    args: list = field(default_factory=list)  # [("tensor", dtype name) | ("value", scalar)] per argument
    kwargs: dict = field(default_factory=dict)  # constexprs and launch options (num_warps, num_stages)

    def __iter__(self):  # `for kernel, config in triton_jobs()`
        return iter((self.kernel, self.config))

    def describe(self) -> str:
        return f"{self.kernel} {self.config} sm_{self.arch} ({self.cases[0]}" + (
            f" +{len(self.cases) - 1}" if len(self.cases) > 1 else "") + ")"


@dataclass
class TritonPTX:
    ptx: str
    name: str  # the .entry name
    arch: int
    num_warps: int
    num_stages: int
    shared: int  # shared memory bytes (dynamic, what the launch requests)
    params: list  # [[ptx param name, ptx type, kernel argument name or "global_scratch"/"profile_scratch"]]
    constexprs: dict  # constexpr arguments (names -> values), including ints specialised to 1 and Nones
    triton_version: str
    key: str
    seconds: float
    cached: bool = False


def _report_module():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set in this process, so the kernels are interpreter functions and "
                           "cannot be compiled: use triton_ptx_all() (it compiles in a subprocess)")
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    os.environ.pop("TRITON_DUMP_PTXAS_LOG", None)
    spec = importlib.util.spec_from_file_location("_ptxsim_triton_report", os.path.join(REPO, "tools",
                                                                                       "triton_compile_report.py"))
    mod = sys.modules.get(spec.name)
    if mod is None:
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        os.environ.pop("TRITON_DUMP_PTXAS_LOG", None)  # the report turns ptxas logs on; no ptxas runs here
    return mod


def triton_jobs(level: str = "default", arch: int = 120) -> list[TritonJob]:
    """Every distinct compile the launchers can pick at this case level ("ci", "quick", "default",
    "all" as in tools/triton_compile_report.py): launches recorded from the package's launchers,
    autotuned launches expanded into their configs after the launcher's prune."""
    if level not in _LEVELS:
        raise ValueError(f"level must be one of {sorted(_LEVELS)}, got {level!r}")
    rep = _report_module()
    cases = [c for c in rep.build_cases() if c.level <= _LEVELS[level]]
    jobs, notes, _ = rep.make_jobs(cases, [arch], include_pruned=False)
    if notes:
        raise RuntimeError("a launcher refused its shape case: " + "; ".join(f"{n['case']}: {n['error']}"
                                                                          for n in notes))
    return [TritonJob(j.fn_name, j.kernel, j.config, list(j.cases), j.arch, j.module, j.key,
                      [list(a) for a in j.args], dict(j.kwargs))
            for j in jobs if j.choosable]


def _triton_cache_key(job: TritonJob) -> str:
    import triton

    rep = _report_module()
    fn = getattr(importlib.import_module(job.module), job.kernel)
    path = sys.modules[job.module].__file__
    with open(path, "rb") as f:
        src = f.read()
    h = hashlib.sha256()
    for part in (_FORMAT.encode(), src, fn.cache_key.encode(), job.key.encode(), triton.__version__.encode(),
                 str(rep.ARCHS[job.arch]).encode()):
        h.update(part + b"\0")
    return h.hexdigest()


def _triton_entry(job: TritonJob, key: str) -> str:
    return os.path.join(cache_dir(), "triton", f"sm_{job.arch}", f"{job.kernel}.{key[:24]}")


def _ptx_params(ptx: str) -> list[tuple[str, str]]:
    m = re.search(r"\.entry\s+\w+\s*\((.*?)\)", ptx, re.S)
    if not m:
        return []
    out = []
    for decl in m.group(1).split(","):
        words = decl.split()
        if words:
            out.append((words[-1], next((w for w in words[1:] if re.fullmatch(r"\.[busf]\d+", w)), words[1])))
    return out


def _compile_triton(job: TritonJob) -> dict:
    """Compile one job to PTX (in a throwaway Triton cache: ptxas is not run, see below)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rep = _report_module()
    fn = getattr(importlib.import_module(job.module), job.kernel)
    args = rep._mock_args(job.args)
    signature, constexprs, attrs, options = rep._specialise(fn, args, job.kwargs, job.arch)
    t0 = time.perf_counter()
    old_cache = os.environ.get("TRITON_CACHE_DIR")
    backend_cls, old_cubin = None, None
    try:
        from triton.backends.nvidia.compiler import CUDABackend
        backend_cls, old_cubin = CUDABackend, CUDABackend.__dict__.get("make_cubin")
    except ImportError:
        pass
    with tempfile.TemporaryDirectory(prefix="ptxsim-triton-") as tmp:
        os.environ["TRITON_CACHE_DIR"] = tmp  # the stubbed cubin below must never reach a real cache
        try:
            if old_cubin is not None:
                # Only the PTX is wanted: skip ptxas (the cubin stage), about half of a compile.
                backend_cls.make_cubin = lambda self, src, metadata, opt, capability: b""
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                      target=GPUTarget("cuda", job.arch, 32), options=options.__dict__)
        finally:
            if old_cubin is not None:
                backend_cls.make_cubin = old_cubin
            if old_cache is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = old_cache
    seconds = time.perf_counter() - t0
    ptx = compiled.asm["ptx"]
    md = compiled.metadata
    names = list(fn.arg_names)
    const_names = {names[k[0] if isinstance(k, tuple) else k] for k in constexprs}
    runtime_args = [n for n in names if n not in const_names and signature.get(n) != "constexpr"]
    ptx_params = _ptx_params(ptx)
    arg_names = runtime_args + ["global_scratch", "profile_scratch"]
    if len(arg_names) != len(ptx_params):  # a Triton whose scratch arguments differ: keep the PTX names
        arg_names = runtime_args + [p for p, _ in ptx_params[len(runtime_args):]]
    params = [[p, t, a] for (p, t), a in zip(ptx_params, arg_names)]
    consts = {}
    for k, v in constexprs.items():
        consts[names[k[0] if isinstance(k, tuple) else k]] = v if isinstance(v, (int, float, bool, str, type(None))) \
            else repr(v)
    return dict(ptx=ptx, name=md.name, arch=job.arch, num_warps=int(md.num_warps), num_stages=int(md.num_stages),
                shared=int(getattr(md, "shared", 0) or 0), params=params, constexprs=consts,
                triton_version=triton.__version__, seconds=round(seconds, 3))


def triton_ptx_for_job(job: TritonJob) -> TritonPTX:
    """The PTX and launch metadata of one job from triton_jobs(), from the cache when the kernel's
    source, the specialisation / config and the Triton version are unchanged."""
    key = _triton_cache_key(job)
    entry = _triton_entry(job, key)
    ptx, meta = _read(entry + ".ptx"), _read(entry + ".json")
    if ptx is not None and meta is not None:
        m = json.loads(meta)
        m.pop("job", None)
        return TritonPTX(ptx=ptx, key=key, cached=True, **m)
    res = _compile_triton(job)
    ptx = res.pop("ptx")
    write_atomic(entry + ".ptx", ptx)
    write_atomic(entry + ".json", json.dumps(dict(res, job=asdict(job)), indent=1, default=repr))
    return TritonPTX(ptx=ptx, key=key, cached=False, **res)


def _worker(job: TritonJob) -> tuple[str, Optional[str], float, bool]:
    t0 = time.perf_counter()
    try:
        res = triton_ptx_for_job(job)
    except Exception as exc:
        return job.key, f"{type(exc).__name__}: {exc}"[:4000], time.perf_counter() - t0, False
    return job.key, None, res.seconds, res.cached


def _fill_triton_cache(level: str, arch: int, processes: int, manifest: Optional[str]) -> int:
    """Enumerate, compile the missing jobs (process pool), write a manifest of cache entries."""
    import concurrent.futures
    import multiprocessing

    t0 = time.perf_counter()
    jobs = triton_jobs(level, arch)
    t_enum = time.perf_counter() - t0
    todo = [j for j in jobs if _read(_triton_entry(j, _triton_cache_key(j)) + ".json") is None]
    # Big tiles first keeps both processes busy to the end.
    todo.sort(key=lambda j: -(j.kwargs.get("BLOCK_M", 1) * j.kwargs.get("BLOCK_N", 1)
                              * j.kwargs.get("D", j.kwargs.get("DV", 1))))
    errors = {}
    if todo and processes > 1:
        ctx = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(processes, mp_context=ctx) as pool:
            for key, err, _, _ in pool.map(_worker, todo):
                if err:
                    errors[key] = err
    else:
        for j in todo:
            key, err, _, _ = _worker(j)
            if err:
                errors[key] = err
    entries = []
    for j in jobs:
        key = _triton_cache_key(j)
        entries.append(dict(job=asdict(j), entry=_triton_entry(j, key), key=key, error=errors.get(j.key)))
    summary = dict(level=level, arch=arch, jobs=len(jobs), compiled=len(todo), errors=len(errors),
                   enumerate_s=round(t_enum, 2), total_s=round(time.perf_counter() - t0, 2), entries=entries)
    if manifest:
        write_atomic(manifest, json.dumps(summary, indent=1, default=repr))
    print(f"triton sm_{arch} level={level}: {len(jobs)} compiles, {len(todo)} compiled now, {len(errors)} errors, "
          f"{summary['total_s']} s (enumeration {summary['enumerate_s']} s)", file=sys.stderr)
    for key, err in errors.items():
        print(f"ERROR {key[:200]}:\n{err}", file=sys.stderr)
    return 1 if errors else 0


def triton_ptx_all(level: str = "default", arch: int = 120, processes: int = 2,
                   timeout: float = 1800) -> list[tuple[TritonJob, TritonPTX]]:
    """Every job of triton_jobs(level, arch) with its PTX. Runs the enumeration and the missing
    compiles in a subprocess without TRITON_INTERPRET (so it works from a test process where the
    kernels are interpreter functions), `processes` compiles at a time; reads the results back
    from the cache. RuntimeError naming the failures if a compile fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory(prefix="ptxsim-manifest-") as tmp:
        manifest = os.path.join(tmp, "manifest.json")
        done = subprocess.run([sys.executable, "-m", "tools.ptx_harness.build", "triton", "--level", level, "--arch",
                               str(arch), "--jobs", str(processes), "--manifest", manifest],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if not os.path.exists(manifest):
            raise RuntimeError(f"the Triton PTX build failed (exit {done.returncode}):\n{done.stderr[-6000:]}")
        with open(manifest, encoding="utf-8") as f:
            summary = json.load(f)
    failed = [f"{e['job']['kernel']} {e['job']['config']}: {e['error']}" for e in summary["entries"] if e["error"]]
    if failed:
        raise RuntimeError("Triton compile errors:\n" + "\n\n".join(failed))
    out = []
    for e in summary["entries"]:
        job = TritonJob(**{k: v for k, v in e["job"].items() if k in TritonJob.__dataclass_fields__})
        with open(e["entry"] + ".json", encoding="utf-8") as f:
            m = json.load(f)
        m.pop("job", None)
        with open(e["entry"] + ".ptx", encoding="utf-8") as f:
            out.append((job, TritonPTX(ptx=f.read(), key=e["key"], cached=True, **m)))
    return out


# --------------------------------------------------------------------------- command line
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    cu = sub.add_parser("cuda", help="compile every csrc .cu to PTX")
    cu.add_argument("--arch", default=",".join(CUDA_ARCHS))
    cu.add_argument("--jobs", type=int, default=2, help="nvcc processes (default 2)")
    tr = sub.add_parser("triton", help="compile every Triton config the launchers can pick to PTX")
    tr.add_argument("--level", default="default", choices=sorted(_LEVELS))
    tr.add_argument("--arch", type=int, default=120)
    tr.add_argument("--jobs", type=int, default=2)
    tr.add_argument("--manifest", default=None, help="write the job list and cache entries as JSON here")
    opts = ap.parse_args(argv)
    if opts.what == "triton":
        return _fill_triton_cache(opts.level, opts.arch, opts.jobs, opts.manifest)
    t0 = time.perf_counter()
    for r in cuda_ptx_all(opts.arch.split(","), opts.jobs):
        print(f"{os.path.relpath(r.source, REPO):45s} {r.arch:8s} {'cached' if r.cached else f'{r.seconds:6.1f} s'} "
              f"{len(r.ptx.splitlines()):7d} lines")
    print(f"total {time.perf_counter() - t0:.1f} s; flags: {' '.join(nvcc_flags('sm_120a'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
