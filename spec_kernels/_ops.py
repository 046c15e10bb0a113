"""The op layer: loading the CUDA extension once, and the dispatch rule every op follows.

Each public op (torch.ops.spec_kernels.<name>) has up to three implementations:

* ``cuda``      - a kernel from the compiled extension ``spec_kernels._C`` (torch.ops.spec_kernels_cuda.*)
* ``triton``    - a Triton kernel: on a CUDA device, or on CPU tensors under ``TRITON_INTERPRET=1``
* ``reference`` - readable PyTorch, the oracle every kernel is tested against; runs anywhere

``impl=None`` takes the first usable one in that order for the tensors' device; ``impl="..."``
forces one and raises a RuntimeError saying why when it cannot run there.
"""
from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

IMPL_ORDER = ("cuda", "triton", "reference")


# --------------------------------------------------------------------------- extension
@functools.lru_cache(maxsize=None)
def _load_extension() -> Optional[str]:
    """Import spec_kernels._C once. Returns None on success, else why it is unavailable
    (and warns once when a GPU is there to use it: the ops then run the Triton kernels)."""
    try:
        from spec_kernels import _C  # noqa: F401  (registers torch.ops.spec_kernels_cuda.*)
    except ImportError as exc:
        reason = f"spec_kernels._C is not built or does not load ({exc})"
        if torch.cuda.is_available():
            warnings.warn(f"spec-kernels: CUDA kernels unavailable, using Triton: {reason}", stacklevel=2)
        return reason
    return None


def extension_error() -> Optional[str]:
    """None when the CUDA extension is loaded, else the reason it is not."""
    return _load_extension()


@functools.lru_cache(maxsize=None)
def compiled_archs() -> tuple[int, ...]:
    """Archs compiled into the extension as nvcc numbers them (900 = sm_90a, 1200 = sm_120a)."""
    if _load_extension() is not None:
        return ()
    return tuple(torch.ops.spec_kernels_cuda.compiled_archs())


@functools.lru_cache(maxsize=None)
def compiled_constants() -> Optional[dict[str, int]]:
    """The extension's constants (csrc/registration.cpp compiled_constants: the C++ names, e.g.
    kMaxDraftTokens), or None without the extension."""
    if _load_extension() is not None:
        return None
    lines = torch.ops.spec_kernels_cuda.compiled_constants().splitlines()
    return {name: int(value) for name, value in (line.split("=") for line in lines)}


@dataclass(frozen=True)
class LaunchShape:
    """The host half of a CUDA attention launch (csrc/include/spec_kernels/launch_shape.h): the
    configuration compiled for `head_dim` with `block_m` query rows per CTA (0: none), its threads,
    dynamic shared memory, registers per thread (ptxas), __launch_bounds__ CTAs per SM, keys per
    KV tile (`block_n`) and query rows of a warp's unit of work (`warp_rows`), which tell apart
    configurations of equal block_m.
    `kernel` / `template_args` name the instance (e.g. tree_verify_kernel, "128,32,false,1")."""

    head_dim: int
    block_m: int
    threads: int
    smem_bytes: int
    regs: int
    min_ctas_per_sm: int
    kv_fp8: int = 0  # 1: the instance for fp8 KV caches
    block_n: int = 0
    warp_rows: int = 0
    kernel: str = ""
    template_args: str = ""


def _shape(values) -> LaunchShape:
    return LaunchShape(*(int(v) for v in values))


@functools.lru_cache(maxsize=None)
def kernel_configs() -> tuple[LaunchShape, ...]:
    """Every compiled configuration of the CUDA attention kernels, from the extension (the lists in
    csrc/include/spec_kernels/tree_verify_config.h and mla_config.h). Raises RuntimeError
    without the extension."""
    out = []
    for line in cuda_ops().kernel_configs().splitlines():
        kernel, template_args, *fields = line.split()
        values = dict(f.split("=") for f in fields)
        out.append(LaunchShape(**{k: int(v) for k, v in values.items()}, kernel=kernel, template_args=template_args))
    return tuple(out)


def kernel_config(kernel: str, head_dim: int, block_m: int, kv_fp8: bool = False) -> LaunchShape:
    """The compiled configuration of `kernel` for (head_dim, block_m) and the cache kind (kv_fp8:
    the fp8-cache instance; where block_m has several, the first listed: the launch configs name
    the one a device takes); ValueError naming the compiled ones when there is none."""
    for c in kernel_configs():
        if (c.kernel, c.head_dim, c.block_m, c.kv_fp8) == (kernel, head_dim, block_m, int(kv_fp8)):
            return c
    have = ", ".join(f"({c.head_dim}, {c.block_m})" for c in kernel_configs()
                     if c.kernel == kernel and c.kv_fp8 == int(kv_fp8))
    raise ValueError(f"{kernel} has no configuration for head_dim={head_dim}, block_m={block_m}"
                     f"{', fp8 cache' if kv_fp8 else ''}; compiled: {have}")


@functools.lru_cache(maxsize=4096)
def tree_verify_launch_config(head_dim: int, max_rows: int, smem_per_sm: int, smem_reserved_per_cta: int,
                              kv_fp8: bool = False) -> LaunchShape:
    """The configuration a CUDA tree-verify launch of `max_rows` takes on a device with that shared
    memory and that cache kind (the launch's own choice, tree_verify_launch_shape in the C++);
    block_m 0: none."""
    shape = _shape(cuda_ops().tree_verify_launch_config(head_dim, max_rows, smem_per_sm, smem_reserved_per_cta,
                                                        bool(kv_fp8)))
    return _named(shape, "tree_verify_kernel")


@functools.lru_cache(maxsize=4096)
def mla_launch_config(max_rows: int, smem_per_sm: int = 0, smem_reserved_per_cta: int = 0,
                      kv_fp8: bool = False) -> LaunchShape:
    """The configuration a CUDA MLA launch of `max_rows` takes on a device with that shared memory
    (0: not known) and that cache kind (mla_launch_shape in the C++): its rows per CTA are the
    same on every device; at 64 rows the k-split configuration where it fits (sm_90)."""
    shape = _shape(cuda_ops().mla_launch_config(max_rows, smem_per_sm, smem_reserved_per_cta, bool(kv_fp8)))
    return _named(shape, "mla_tree_verify_kernel")


def _named(shape: LaunchShape, kernel: str) -> LaunchShape:
    for c in kernel_configs():
        if ((c.kernel, c.head_dim, c.block_m, c.kv_fp8, c.block_n, c.warp_rows)
                == (kernel, shape.head_dim, shape.block_m, shape.kv_fp8, shape.block_n, shape.warp_rows)):
            return c
    return shape  # block_m 0: no configuration


def cuda_ops():
    """torch.ops.spec_kernels_cuda (raises if the extension is not loaded)."""
    err = _load_extension()
    if err is not None:
        raise RuntimeError(err)
    return torch.ops.spec_kernels_cuda


def triton_interpreting() -> bool:
    """True when Triton kernels run on CPU tensors through the interpreter (TRITON_INTERPRET=1
    must be set before Triton kernels are defined, i.e. before spec_kernels is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _triton_error() -> Optional[str]:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    return None


# --------------------------------------------------------------------------- availability
def cuda_unavailable_reason(device: torch.device, op_name: str) -> Optional[str]:
    if device.type != "cuda":
        return f"the cuda impl needs CUDA tensors, got device {device}"
    err = _load_extension()
    if err is not None:
        return err
    if not hasattr(torch.ops.spec_kernels_cuda, op_name):
        return f"the extension has no kernel for {op_name}"
    major, minor = torch.cuda.get_device_capability(device)
    arch = major * 100 + minor * 10
    if arch not in compiled_archs():
        return (f"the extension was compiled for {list(compiled_archs())}, this GPU is sm_{major}{minor}; "
                "rebuild with SPEC_KERNELS_CUDA_ARCHS")
    return None


def triton_unavailable_reason(device: torch.device) -> Optional[str]:
    err = _triton_error()
    if err is not None:
        return err
    if device.type == "cuda":
        return None
    if device.type == "cpu" and triton_interpreting():
        return None
    if device.type == "cpu":
        return "the triton impl runs on CPU tensors only under TRITON_INTERPRET=1"
    return f"the triton impl does not run on device {device}"


def reference_unavailable_reason(device: torch.device) -> Optional[str]:
    return None if device.type in ("cpu", "cuda") else f"no reference for device {device}"


# --------------------------------------------------------------------------- registry
@dataclass
class OpImpls:
    """The implementations of one op, and the rule that picks one."""

    name: str
    impls: dict[str, Callable] = field(default_factory=dict)
    # impl -> predicate over the call's arguments: None if it handles them, else why not
    # (e.g. the CUDA kernels take fp16/bf16 only); the dispatch then tries the next impl.
    supports: dict[str, Callable[..., Optional[str]]] = field(default_factory=dict)

    def register(self, impl: str, supports: Optional[Callable[..., Optional[str]]] = None) -> Callable[[Callable], Callable]:
        if impl not in IMPL_ORDER:
            raise ValueError(f"impl must be one of {IMPL_ORDER}, got {impl!r}")

        def deco(fn: Callable) -> Callable:
            self.impls[impl] = fn
            if supports is not None:
                self.supports[impl] = supports
            return fn

        return deco

    def unavailable_reason(self, impl: str, device: torch.device, args: tuple = ()) -> Optional[str]:
        """None if `impl` runs on `device` (and, when `args` are given, handles those call
        arguments), else the reason it does not."""
        if impl not in self.impls:
            return f"{self.name} has no {impl} implementation"
        if impl == "cuda":
            reason = cuda_unavailable_reason(device, self.name)
        elif impl == "triton":
            reason = triton_unavailable_reason(device)
        else:
            reason = reference_unavailable_reason(device)
        if reason is None and args and impl in self.supports:
            reason = self.supports[impl](*args)
        return reason

    def select(self, device: torch.device, impl: Optional[str] = None, args: tuple = ()) -> tuple[str, Callable]:
        """(name, function) of the implementation to run for tensors on `device` (and, for
        impls with a `supports` predicate, for these call arguments)."""
        if impl is not None and impl != "":
            if impl not in IMPL_ORDER:
                raise ValueError(f"{self.name}: impl must be one of {IMPL_ORDER} or None, got {impl!r}")
            reason = self.unavailable_reason(impl, device, args)
            if reason is not None:
                raise RuntimeError(f"{self.name}: impl={impl!r} is not available: {reason}")
            return impl, self.impls[impl]
        for cand in IMPL_ORDER:
            if self.unavailable_reason(cand, device, args) is None:
                return cand, self.impls[cand]
        raise RuntimeError(f"{self.name}: no implementation runs on device {device}")

    def explain(self, device: torch.device) -> dict[str, Optional[str]]:
        """impl -> None if usable on `device`, else the reason it is not."""
        return {impl: self.unavailable_reason(impl, device) for impl in IMPL_ORDER}


REGISTRY: dict[str, OpImpls] = {}


def op_impls(name: str) -> OpImpls:
    """The OpImpls of op `name` (created on first use)."""
    if name not in REGISTRY:
        REGISTRY[name] = OpImpls(name)
    return REGISTRY[name]


# --------------------------------------------------------------------------- device facts
@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Number of SMs of a CUDA device (launch sizes are derived from it)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
