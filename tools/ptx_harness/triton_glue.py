"""Run the package's Triton kernels as the PTX Triton compiles for a GPU, on the PTX interpreter.

How a launch gets here (`TritonPtxRunner.active()`, a context manager):

* The launchers (spec_kernels/*/triton_kernel.py) run unchanged, called through the public ops
  (impl="triton") on CPU tensors. Inside the context they take their GPU path: the launcher
  modules' `triton_interpreting` reads False (bf16 / fp16 arithmetic, num_warps and the fixed
  tiles a GPU launch uses, kv_slots' ON_GPU hand-off), the automatic KV split count is planned for
  a CUDA device with `sms` SMs, and an autotuned launch runs the fixed path or, with
  `config=...`, one config of the launcher's own autotune list (after its prune).
* `InterpretedFunction.run` (what `kernel[grid](*args, **kwargs)` calls under TRITON_INTERPRET=1;
  `JITFunction.run` likewise when the interpreter is off) is replaced, so every launch arrives
  here with the launcher's own grid, arguments, constexprs,
  num_warps and num_stages. The grid callable is evaluated with the launch's meta-parameters.
* The exact specialisation is compiled for GPUTarget("cuda", arch, 32): Triton's own binder
  decides which ints become constexprs (== 1) and which ints / pointers carry divisibility 16
  (pointers: the simulated device addresses). The compile needs real JITFunctions, which a
  TRITON_INTERPRET=1 process does not have, so it runs in one helper process (started on the
  first compile, kept for the session) through tools/ptx_harness/build.py, whose cache
  (tools.ptx_harness.build.cache_dir()/triton) it fills. This process keeps an index (cache_dir()/
  triton-glue) from the specialisation class (per tensor: dtype and 16-byte alignment; per int:
  its Triton type and whether it is 1 / a multiple of 16; every constexpr and option; the kernel
  sources; the Triton version) to the PTX, so a warm run starts no compiler at all.
* The launch runs like Triton's launcher would start it: grid as computed, block = num_warps x 32,
  dynamic shared memory = metadata.shared (over the machine's 99 KB limit raises Triton's
  OutOfResources, which the fixed-tile launchers catch to try their next tile, as on a GPU),
  parameters in the PTX's order: tensors -> device addresses, ints / floats by value, constexprs
  absent, Triton's two trailing scratch pointers 0 (no kernel here uses global scratch; a load
  through them would fault in the interpreter).
* Launches are synchronous: before each launch the host contents of every tensor it gets (and of
  the tensors registered with `register()`) are written to the simulated device; afterwards they
  are copied back. Host code between launches therefore sees and changes what a CUDA stream
  would. `register()` also maps host addresses inside those tensors to device addresses, for
  kernels that read pointers out of a table (kv_slots' KV buffer table: its column 0 is
  translated for the launch).

Every launch is recorded in `runner.launches` (kernel, config, grid, block, shared, Stats).
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

_MARK = "@@triton-glue@@ "
_INDEX_FORMAT = "triton-glue-1"


# --------------------------------------------------------------------------- compile side
def _serve() -> None:
    """The helper process: JSON requests on stdin, one `_MARK`-prefixed JSON answer per line."""
    os.environ.pop("TRITON_INTERPRET", None)
    from tools.ptx_harness import build, sglang_kernels
    from triton.runtime.jit import MockTensor

    rep = build._report_module()
    import torch

    class _Unaligned(MockTensor):
        @staticmethod
        def data_ptr():
            return 8

    def mock(specs):
        out = []
        for s in specs:
            if s[0] == "tensor":
                dt = getattr(torch, s[1])
                out.append(MockTensor(dt) if s[2] else _Unaligned(dt))
            else:
                out.append(s[1])
        return out

    rep._mock_args = mock  # build._compile_triton mocks the arguments through this
    for line in sys.stdin:
        req = json.loads(line)
        try:
            import importlib

            if req["module"].split(".")[0] == "sglang":  # as the test process has it: installed, or staged
                sglang_kernels.loader().extend_attention_fwd()
            fn = getattr(importlib.import_module(req["module"]), req["kernel"])
            key = rep._specialisation_key(fn, mock(req["args"]), req["kwargs"], req["arch"])
            # Triton reads DISABLE_MMA_V3 while it lowers dots: Hopper's wgmma off, mma.sync instead
            if req.get("mma_v2_only"):
                os.environ["DISABLE_MMA_V3"] = "1"
                key += " DISABLE_MMA_V3=1"
            else:
                os.environ.pop("DISABLE_MMA_V3", None)
            job = build.TritonJob(req["kernel"], req["kernel"], req.get("config", ""), [], req["arch"], req["module"],
                                  key, args=req["args"], kwargs=req["kwargs"])
            res = build.triton_ptx_for_job(job)
            ans = dict(ok=True, **{k: getattr(res, k) for k in ("ptx", "name", "arch", "num_warps", "num_stages",
                                                               "shared", "params", "constexprs", "triton_version",
                                                               "seconds", "cached")})
        except Exception as exc:  # reported to the test process
            import traceback

            ans = dict(ok=False, error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}")
        sys.stdout.write(_MARK + json.dumps(ans) + "\n")
        sys.stdout.flush()


class _Compiler:
    """The helper process (one per test session), started on the first cache miss."""

    _lock = threading.Lock()
    _proc = None

    @classmethod
    def compile(cls, req: dict) -> dict:
        with cls._lock:
            if cls._proc is None or cls._proc.poll() is not None:
                env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
                env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
                cls._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"], cwd=REPO,
                                             env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            p = cls._proc
            p.stdin.write(json.dumps(req) + "\n")
            p.stdin.flush()
            while True:
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError("the Triton compile process exited (its stderr is above)")
                if line.startswith(_MARK):
                    ans = json.loads(line[len(_MARK):])
                    break
        if not ans.pop("ok"):
            raise RuntimeError(f"Triton compile of {req['kernel']} failed: {ans['error']}")
        return ans


def _sources_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(glob.glob(os.path.join(REPO, "spec_kernels", "**", "*.py"), recursive=True)):
        if "triton" in os.path.basename(p):
            with open(p, "rb") as f:
                h.update(os.path.relpath(p, REPO).encode() + b"\0" + f.read() + b"\0")  # clones share entries
    return h.hexdigest()


def _int_class(v: int, specialise: bool) -> str:
    """The Triton type of an int argument and its specialisation (constexpr 1 / divisible by 16)."""
    if -(1 << 31) <= v < (1 << 31):
        t = "i32"
    elif -(1 << 63) <= v < (1 << 63):
        t = "i64"
    else:
        t = "u64"
    return t + ("=1" if v == 1 and specialise else ":16" if v % 16 == 0 else "")


# --------------------------------------------------------------------------- the device side
@dataclass
class PtxLaunch:
    kernel: str
    config: dict  # the launch's keyword arguments: constexprs, num_warps, num_stages
    grid: tuple
    block: tuple
    shared: int
    stats: Any
    seconds: float = 0.0  # interpreter wall time


class _HostSync:
    """Host tensors <-> device regions (one per storage), copied around each launch."""

    def __init__(self, machine):
        self.m = machine
        self.regions = {}  # storage data_ptr -> (device address, storage)

    def addr(self, t) -> int:
        import torch

        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in self.regions:
            n = max(st.nbytes(), 1)
            self.regions[key] = (self.m.alloc(n, f"tensor{len(self.regions)}"), st)
        base, _ = self.regions[key]
        assert isinstance(t, torch.Tensor)
        return base + t.storage_offset() * t.element_size()

    def translate(self, host_ptr: int) -> int:
        """The device address of a host address inside a registered / uploaded storage."""
        for key, (base, st) in self.regions.items():
            if key <= host_ptr < key + max(st.nbytes(), 1):
                return base + host_ptr - key
        raise ValueError(f"host address {host_ptr:#x} is not inside any tensor given to the launch or registered")

    def _raw(self, st):
        import torch

        return torch.empty(0, dtype=torch.uint8).set_(st)

    def to_device(self):
        for base, st in self.regions.values():
            if st.nbytes():
                self.m.write(base, self._raw(st).numpy())

    def to_host(self):
        import torch

        for base, st in self.regions.values():
            if st.nbytes():
                self._raw(st).copy_(torch.from_numpy(self.m.download(base, np.uint8, (st.nbytes(),))))


# Launcher modules, what must read False in them, and their lazily autotuned kernels.
_LAUNCHERS = {
    "spec_kernels.tree_verify.triton_kernel": "_kernel_for_launch",
    "spec_kernels.mla.triton_kernel": "_kernel_for_launch",
    "spec_kernels.norm.triton_kernel": None,
    "spec_kernels.kv_slots.triton_kernel": None,
}
# Pointer-table arguments: (kernel, argument) whose int64 tensor holds host addresses in column 0
# of a [3, n] table (api.KvTable: addresses, row strides, row bytes).
_ADDRESS_TABLES = {("_commit_kernel", "KV_TABLE")}


class TritonPtxRunner:
    """Runs every Triton launch made inside `active()` as compiled PTX on one simulated GPU.
    config: None (the launcher's fixed tile, as with SPEC_KERNELS_TRITON_AUTOTUNE=0) or a
    callable (kernel name, configs after the launcher's prune) -> the triton.Config to run.
    mma_v2_only: compile dots as mma.sync even for sm_90 (Triton's DISABLE_MMA_V3), where Triton
    would emit wgmma, which the interpreter does not execute: a stand-in for Hopper's code."""

    def __init__(self, arch: int = 120, sms: int = 8, mma: str = "fast", check_races: bool = True,
                 config=None, max_smem: int = 99 * 1024, mma_v2_only: bool = False):
        from ptxsim.executor import Machine

        self.arch, self.sms, self.config = arch, sms, config
        self.mma_v2_only = mma_v2_only
        self.max_smem = max_smem
        self.machine = Machine(mma=mma, check_races=check_races, max_smem=max_smem,
                               arch="sm_120" if arch >= 120 else "sm_90")
        self.sync = _HostSync(self.machine)
        self.launches: list[PtxLaunch] = []
        self.compiles: list[tuple[str, dict]] = []  # (kernel, {"cached": bool, "seconds": ...})
        from tools.ptx_harness.build import cache_dir

        self._index_dir = os.path.join(cache_dir(), "triton-glue")

    def register(self, *tensors):
        """Tensors a kernel reaches through addresses stored in another tensor (KV buffers)."""
        for t in tensors:
            self.sync.addr(t)

    # ------------------------------------------------------------------ compile with a cache
    def _ptx(self, fn, args: list, kwargs: dict, config_label: str) -> dict:
        import triton

        specs, klass = [], []
        dns = getattr(fn, "kwargs", {}).get("do_not_specialize") or getattr(fn, "do_not_specialize", ()) or ()
        dns = {fn.arg_names[d] if isinstance(d, int) else d for d in dns}
        for name, a in zip(fn.arg_names, args):
            if hasattr(a, "data_ptr"):
                aligned = self.sync.addr(a) % 16 == 0
                specs.append(["tensor", str(a.dtype).replace("torch.", ""), aligned])
                klass.append(specs[-1])
            elif isinstance(a, bool) or a is None or isinstance(a, float):
                specs.append(["value", a])
                klass.append(["value", type(a).__name__, a if a is None or isinstance(a, bool) else None])
            elif isinstance(a, int):
                specs.append(["value", a])
                klass.append(["int", _int_class(a, name not in dns)])
            else:
                raise TypeError(f"{fn.fn.__name__}: cannot pass argument {name}={a!r} to a compiled kernel")
        req = dict(module=fn.fn.__module__, kernel=fn.fn.__name__, args=specs, kwargs=kwargs, arch=self.arch,
                   config=config_label, mma_v2_only=self.mma_v2_only)
        key_src = json.dumps([_INDEX_FORMAT, req["module"], req["kernel"], klass, sorted(kwargs.items()), self.arch,
                              triton.__version__, _sources_digest()] + (["mma_v2_only"] if self.mma_v2_only else []),
                             default=repr)
        key = hashlib.sha256(key_src.encode()).hexdigest()[:32]
        path = os.path.join(self._index_dir, f"{req['kernel']}.{key}.json")
        try:
            with open(path, encoding="utf-8") as f:
                res = json.load(f)
            self.compiles.append((req["kernel"], dict(cached=True, seconds=0.0)))
            return res
        except FileNotFoundError:
            pass
        res = _Compiler.compile(req)
        self.compiles.append((req["kernel"], dict(cached=res["cached"], seconds=res["seconds"])))
        from tools.ptx_harness.build import write_atomic

        write_atomic(path, json.dumps(res))
        return res

    # ------------------------------------------------------------------ one launch
    def _launch(self, fn, args, grid, kwargs):
        import torch
        from triton.runtime.errors import OutOfResources

        from ptxsim.executor import Launch
        from ptxsim.launch import module_of, pack_params

        names = list(fn.arg_names)
        if len(args) > len(names):
            raise TypeError(f"{fn.fn.__name__}: too many arguments")
        bound = dict(zip(names, args))
        # kwargs that are kernel arguments (constexprs) vs compile options (num_warps, ...)
        consts = {k: v for k, v in kwargs.items() if k in names}
        bound.update(consts)
        missing = [n for n in names if n not in bound]
        if missing:
            raise TypeError(f"{fn.fn.__name__}: arguments {missing} not given")
        label = " ".join(f"{k}={v}" for k, v in sorted(kwargs.items()) if k.startswith("BLOCK") or k.startswith("num_"))
        meta = self._ptx(fn, list(args), kwargs, label)
        if meta["shared"] > self.max_smem:
            raise OutOfResources(meta["shared"], self.max_smem, "shared memory")
        g = grid(dict(bound, **kwargs)) if callable(grid) else grid
        g = tuple(int(x) for x in g) + (1,) * (3 - len(g))
        if min(g) <= 0:
            return
        block = (meta["num_warps"] * 32, 1, 1)
        values = []
        for _pname, _ptype, aname in meta["params"]:
            if aname in ("global_scratch", "profile_scratch") or aname not in bound:
                values.append(0)
                continue
            v = bound[aname]
            if isinstance(v, torch.Tensor):
                values.append(self.sync.addr(v))
            elif isinstance(v, bool):
                values.append(int(v))
            else:
                values.append(v)
        # Tables of host addresses: translate column 0 for the launch, restore afterwards.
        restore = []
        for kname, aname in _ADDRESS_TABLES:
            t = bound.get(aname)
            if kname == fn.fn.__name__ and isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] == 3:
                host = t[0].clone()
                t[0] = torch.tensor([self.sync.translate(int(x)) for x in host.tolist()], dtype=t.dtype)
                restore.append((t, host))
        self.sync.to_device()
        t0 = time.perf_counter()
        try:
            mod = module_of(meta["ptx"])
            entry = mod.entry(meta["name"])
            stats = self.machine.run(Launch(entry, g, block, pack_params(entry, values), meta["shared"],
                                            name=fn.fn.__name__), module=mod)[0]
        finally:
            self.sync.to_host()
            for t, host in restore:
                t[0] = host
        self.launches.append(PtxLaunch(fn.fn.__name__, dict(kwargs), g, block,
                                       meta["shared"], stats, time.perf_counter() - t0))

    # ------------------------------------------------------------------ patching the launchers
    @contextlib.contextmanager
    def active(self):
        import importlib

        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        from spec_kernels import _ops as spec_ops
        from spec_kernels.attention import plan

        runner = self
        saved = []

        def setattr_saved(obj, name, value):
            saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)

        def run(fn_self, *args, grid, warmup, **kwargs):
            if warmup:
                return None
            return runner._launch(fn_self, args, grid, kwargs)

        setattr_saved(InterpretedFunction, "run", run)
        setattr_saved(JITFunction, "run", run)  # the kernels are JITFunctions when TRITON_INTERPRET is off
        setattr_saved(plan, "sm_count", lambda index: runner.sms)
        # the ops' dispatch takes CPU tensors for Triton only when interpreting: so it does here
        # (the PTX interpreter runs them), with or without TRITON_INTERPRET in this process
        setattr_saved(spec_ops, "triton_interpreting", lambda: True)
        cuda = types.SimpleNamespace(type="cuda", index=0)
        for modname, lazy_name in _LAUNCHERS.items():
            mod = importlib.import_module(modname)
            if hasattr(mod, "triton_interpreting"):
                setattr_saved(mod, "triton_interpreting", lambda: False)
            if hasattr(mod, "_ops"):
                proxy = types.SimpleNamespace(**{k: getattr(mod._ops, k) for k in dir(mod._ops)
                                                 if not k.startswith("__")})
                proxy.triton_interpreting = lambda: False
                setattr_saved(mod, "_ops", proxy)
            if hasattr(mod, "plan_splits"):
                real = mod.plan_splits
                setattr_saved(mod, "plan_splits", lambda device, *a, _real=real, **kw: _real(cuda, *a, **kw))
            if lazy_name is not None:
                lazy = getattr(mod, lazy_name)
                setattr_saved(mod, lazy_name, self._lazy(lazy))
        try:
            yield self
        finally:
            for obj, name, value in reversed(saved):
                setattr(obj, name, value)

    def _lazy(self, lazy):
        """What a patched `_kernel_for_launch()` returns: the fixed path, or one autotune config."""
        if self.config is None:
            return lambda: (lazy.kernel, True)
        choose = self.config

        class _Tuned:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    named = dict(zip(lazy.kernel.arg_names, args))
                    configs = list(lazy._configs())
                    kept = lazy._prune(list(configs), named, **kwargs) or configs[:1]
                    cfg = choose(lazy.kernel.fn.__name__, kept)
                    kw = dict(kwargs, **cfg.all_kwargs())
                    kw = {k: v for k, v in kw.items() if v is not None}
                    return lazy.kernel.run(*args, grid=grid, warmup=False, **kw)
                return launch

        tuned = _Tuned()
        return lambda: (tuned, False)


if __name__ == "__main__" and "--serve" in sys.argv:
    _serve()
