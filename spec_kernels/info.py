"""`python -m spec_kernels.info`: versions, the archs in the extension, the GPU, and which
implementation each op will use on each device."""
from __future__ import annotations

import argparse
import platform

import torch

import spec_kernels
from spec_kernels import _ops


def _arch_name(arch: int) -> str:
    return f"sm_{arch // 10}a" if arch >= 900 else f"sm_{arch // 10}"


def report() -> str:
    lines = [f"spec-kernels {spec_kernels.__version__}  (python {platform.python_version()})"]
    lines.append(f"torch {torch.__version__}   CUDA (torch build) {torch.version.cuda}")
    try:
        import triton

        lines.append(f"triton {triton.__version__}   interpreter (TRITON_INTERPRET=1): {_ops.triton_interpreting()}")
    except ImportError as exc:
        lines.append(f"triton: not importable ({exc})")
    err = _ops.extension_error()
    if err is None:
        archs = ", ".join(_arch_name(a) for a in _ops.compiled_archs())
        cu = torch.ops.spec_kernels_cuda.compiled_cuda_version()
        lines.append(f"CUDA extension: loaded, compiled for {archs} with CUDA {cu // 1000}.{cu % 1000 // 10}")
    else:
        lines.append(f"CUDA extension: not available: {err}")
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"GPU {i}: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                         f"{p.total_memory / 2**30:.0f} GiB")
        devices.append(torch.device("cuda", 0))
    else:
        lines.append("GPU: none visible to torch")
    lines.append("")
    lines.append("implementation each op will use (first usable of cuda -> triton -> reference):")
    for name, op in sorted(_ops.REGISTRY.items()):
        for dev in devices:
            why = op.explain(dev)
            chosen = next((impl for impl, reason in why.items() if reason is None), "none")
            lines.append(f"  {name:<28} {str(dev):<7} -> {chosen}")
            for impl, reason in why.items():
                if reason is not None and impl in op.impls:
                    lines.append(f"  {'':<28} {'':<7}    {impl}: {reason}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m spec_kernels.info",
        description="Print the spec-kernels, torch, CUDA and Triton versions, the GPU archs compiled into the "
                    "CUDA extension (or why it is not loaded), the visible GPUs, and which implementation "
                    "(cuda, triton or reference) each op will use on CPU and on GPU 0, with the reason "
                    "each faster one cannot run. Takes no options.").parse_args(argv)
    print(report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
