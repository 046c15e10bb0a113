"""Benchmark set-up shared by benchmarks/test_*.py.

* Without a GPU, Triton kernels run on CPU tensors through the interpreter: TRITON_INTERPRET is
  read when a kernel is defined, so it is set here, before anything imports spec_kernels.
* The preset (SPEC_KERNELS_BENCH_PRESET, see _timing.py) is validated once, at start-up.
* The saved JSON's machine_info gets a "spec_kernels" entry: device, versions, preset, extension.
* The session ends with a side-by-side summary table of what ran (_timing.format_summary) and,
  with --benchmark-json=PATH, the decode-step plots next to PATH (_timing.write_decode_step_plots).
"""
import os
import platform

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import _timing  # noqa: E402
import spec_kernels  # noqa: E402  (after TRITON_INTERPRET is set)
from spec_kernels import _ops  # noqa: E402
from spec_kernels._extras import MissingExtraError  # noqa: E402

RESULTS = pytest.StashKey[list]()


def _json_path(config):
    """--benchmark-json as an absolute path, or None. pytest-benchmark 5 gives a Path (its `.name`
    is the bare file name), older versions an open file (its `.name` is the path as typed)."""
    value = config.getoption("benchmark_json", default=None)
    if value is None:
        return None
    return os.path.abspath(value if isinstance(value, os.PathLike) else value.name)


def pytest_configure(config):
    try:
        _timing.active_preset()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[RESULTS] = []
    json_path = _json_path(config)
    if json_path is not None:  # create OUT/ of --benchmark-json=OUT/x.json now, not fail after the run
        os.makedirs(os.path.dirname(json_path), exist_ok=True)


@pytest.fixture
def bench_results(request) -> list:
    """The rows of the end-of-session summary (filled by _timing.record)."""
    return request.config.stash[RESULTS]


def _device_info(device: torch.device):
    if device.type != "cuda":
        return {"type": "cpu", "name": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    p = torch.cuda.get_device_properties(device)
    return {
        "type": "cuda",
        "name": p.name,
        "sm_count": p.multi_processor_count,
        "capability": f"{p.major}.{p.minor}",
        "memory_gib": round(p.total_memory / 2**30, 1),
        "l2_cache_bytes": getattr(p, "L2_cache_size", None),
    }


def spec_kernels_info() -> dict:
    import triton

    device = _timing.bench_device()
    err = _ops.extension_error()
    return {
        "preset": _timing.active_preset().name,
        "device": _device_info(device),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton.__version__,
        "triton_interpreter": _ops.triton_interpreting(),
        "triton_autotune": os.environ.get("SPEC_KERNELS_TRITON_AUTOTUNE", "1") != "0",
        "spec_kernels": spec_kernels.__version__,
        "extension_error": err,
        "extension_archs": list(_ops.compiled_archs()),
        "extension_cuda": torch.ops.spec_kernels_cuda.compiled_cuda_version() if err is None else None,
        # op -> implemented impl -> None if it runs on the benchmark device, else why not
        "impls": {name: {impl: why for impl, why in op.explain(device).items() if impl in op.impls}
                  for name, op in sorted(_ops.REGISTRY.items())},
    }


def pytest_report_header(config):
    info = spec_kernels_info()
    dev = info["device"]
    lines = [f"spec-kernels benchmarks: preset {info['preset']} ({_timing.PRESET_ENV}=tiny|gpu-quick|gpu) "
             f"on {dev['name']}; extension: {info['extension_error'] or 'loaded'}"]
    for name, why in info["impls"].items():
        lines.append(f"  {name}: " + ", ".join(f"{impl} {'ok' if r is None else 'no (' + r + ')'}"
                                               for impl, r in why.items()))
    return lines


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["spec_kernels"] = spec_kernels_info()


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's own tables
def pytest_terminal_summary(terminalreporter, config):
    rows = config.stash.get(RESULTS, [])
    if not rows:
        return
    terminalreporter.write_sep("-", f"spec-kernels summary (preset {_timing.active_preset().name})")
    for line in _timing.format_summary(rows):
        terminalreporter.write_line(line)
    json_path = _json_path(config)
    if json_path is not None and any(r["kind"] == "decode_step" for r in rows):
        out_dir = os.path.dirname(json_path)  # the plots go next to the JSON
        try:
            for path in _timing.write_decode_step_plots(rows, out_dir):
                terminalreporter.write_line(f"plot -> {path}")
        except MissingExtraError as exc:
            terminalreporter.write_line(f"decode-step plots skipped: {exc}")
