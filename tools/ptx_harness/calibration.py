"""Calibration of the speed-of-light model against published measurements of other kernels.

    python -m tools.ptx_harness.calibration [--json out.json]

Each case is a kernel whose speed on a named GPU was published by someone else, compiled here,
one CTA of it run in the interpreter, its counters scaled to the published launch and predicted by
tools/speed_of_light/model.py. predicted / published time is the model's error on that kind of
kernel; `error_band()` is the band every modelled figure of this project is quoted with.

Cases (the kernels are written here from their published descriptions, not copied):
* BabelStream 5.0 CUDA, double, 2^25 elements (268.4 MB per array), 1024 threads per block, one
  element per thread: Copy (c = a) 3055.6 GB/s and Triad (a = b + s c) 3303.8 GB/s on an
  H100 NVL (a public BabelStream run log). Memory-bound.
* Triton's fused-attention tutorial (python/tutorials/06-fused-attention.py of the Triton
  repository), forward, fp16, batch 4, 32 heads, head dim 64, not causal: 141.4 / 159.7 / 160.6 /
  163.4 / 166.6 TFLOPS at N_CTX = 1024 ... 16384 as the tutorial page (triton-lang.org) prints them,
  built by Triton's documentation job on an A100. Compute-bound. Its source is not part of this
  repository: pass the tutorial file with --triton-tutorial (its `_attn_fwd_inner` and `_attn_fwd`
  are taken from it, the autotune decorator dropped; the tile is the one named in TUTORIAL_TILE,
  an assumption: the published run autotuned). Compiled for sm_80 (mma.sync, as on an A100).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Optional

from tools.speed_of_light.gpus import Gpu
from tools.speed_of_light.model import Prediction, predict, work_from_stats

# The H100 NVL the BabelStream figures were measured on (calibration only).
H100_NVL = Gpu(
    "h100-nvl", "NVIDIA H100 NVL (sm_90)", "sm_90a", sms=132, clock_hz=1.785e9,
    dram_peak_bytes_per_s=3.9e12, l2_bytes_per_s=7.8e12,
    mma_flops_per_clk={"bf16": 0.64 * 4096, "f16": 0.64 * 4096},
    dram_latency_s=600e-9, launch_overhead_s=1.5e-6,
    sources={"sms": "NVIDIA H100 NVL product brief: 132 SMs", "clock_hz": "H100 NVL product brief: 1785 MHz boost",
             "dram_peak_bytes_per_s": "H100 NVL product brief: 3.9 TB/s HBM3 (94 GB)",
             "l2_bytes_per_s": "assumed: 2x the DRAM peak", "mma_flops_per_clk": "as the H200 entry",
             "dram_latency_s": "assumed", "launch_overhead_s": "assumed"})

STREAM_SRC = r"""
// One element per thread, as BabelStream's CUDA kernels are described (1024-thread blocks).
extern "C" __global__ void stream_copy(const double* __restrict__ a, double* __restrict__ c) {
  const int i = blockDim.x * blockIdx.x + threadIdx.x;
  c[i] = a[i];
}
extern "C" __global__ void stream_triad(double* __restrict__ a, const double* __restrict__ b,
                                        const double* __restrict__ c, double scalar) {
  const int i = blockDim.x * blockIdx.x + threadIdx.x;
  a[i] = b[i] + scalar * c[i];
}
"""

STREAM_N = 1 << 25
STREAM_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    gpu: Gpu
    published_seconds: float
    published: str  # the figure as published, and where
    bound: str  # "memory" or "compute"


def _stream_case(kernel: str, arrays: int, gbps: float) -> tuple[Case, int]:
    nbytes = arrays * STREAM_N * 8
    return Case(f"babelstream_{kernel}", H100_NVL, nbytes / (gbps * 1e9),
                f"BabelStream 5.0 CUDA {kernel}: {gbps:.1f} GB/s on an H100 NVL (double, 268.4 MB arrays)",
                "memory"), nbytes


def run_stream(kernel: str, arrays: int, gbps: float) -> dict:
    import numpy as np

    from ptxsim.executor import Machine
    from ptxsim.launch import run as run_kernel
    from tools.ptx_harness.build import cuda_ptx_from_source

    case, nbytes = _stream_case(kernel, arrays, gbps)
    ptx = cuda_ptx_from_source(STREAM_SRC, case.gpu.arch, "babelstream_calibration.cu")
    ctas = 2  # a few CTAs of the real launch; the model scales per CTA
    m = Machine(check_races=False, arch="sm_90")
    n = ctas * STREAM_BLOCK
    bufs = [m.upload(np.arange(n, dtype=np.float64) + k, f"array{k}") for k in range(3)]
    args = bufs[:2] if kernel == "copy" else bufs + [0.4]
    st = run_kernel(m, ptx, f"stream_{kernel}", (ctas,), (STREAM_BLOCK,), args)
    w = work_from_stats(st.as_dict(), ctas)
    real_ctas = STREAM_N // STREAM_BLOCK
    resident = 2048 // STREAM_BLOCK
    p = predict(case.gpu, w, real_ctas, resident, ideal_bytes=nbytes)
    return _row(case, p)


def _row(case: Case, p: Prediction) -> dict:
    return dict(case=case.name, gpu=case.gpu.key, bound=case.bound, published=case.published,
                published_seconds=case.published_seconds, predicted_seconds=p.seconds,
                ratio=p.seconds / case.published_seconds, bottleneck=p.bottleneck, units=p.units)


# --------------------------------------------------------------------------- fused attention
TUTORIAL_PUBLISHED_TFLOPS = {1024: 141.4, 2048: 159.7, 4096: 160.6, 8192: 163.4, 16384: 166.6}
TUTORIAL_SHAPE = dict(batch=4, heads=32, head_dim=64)
TUTORIAL_TILE = dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
TUTORIAL_SIM_KEYS = (256, 512)  # N_CTX of the two simulated points (one CTA each)


def tutorial_module(path: str) -> str:
    """Write the tutorial's forward kernels (autotune dropped) as an importable module in the
    harness cache; return its name. The name carries a digest of the text, so an edited tutorial
    is a different module (and a different compile)."""
    import ast
    import hashlib

    from tools.ptx_harness.build import cache_dir, write_atomic

    with open(path, encoding="utf-8") as f:
        text = f.read()
    tree = ast.parse(text)
    parts = ["import triton", "import triton.language as tl", ""]
    for name in ("_attn_fwd_inner", "_attn_fwd"):
        node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
        if node is None:
            raise ValueError(f"--triton-tutorial: {path} has no function {name}")
        body = ast.get_source_segment(text, node)
        parts += ["", "@triton.jit", body[body.index("def "):], ""]
    src = "\n".join(parts)
    mod = "calib_fused_attention_" + hashlib.sha256(src.encode()).hexdigest()[:12]
    folder = os.path.join(cache_dir(), "calibration")
    write_atomic(os.path.join(folder, mod + ".py"), src)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    os.environ["PYTHONPATH"] = folder + os.pathsep + os.environ.get("PYTHONPATH", "")  # the compile process
    return mod


def _tutorial_work(mod_name: str, n_ctx: int):
    import importlib

    import torch

    from tools.ptx_harness.triton_glue import TritonPtxRunner

    fn = importlib.import_module(mod_name)._attn_fwd
    D = TUTORIAL_SHAPE["head_dim"]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn((1, 1, n_ctx, D), generator=gen).to(torch.float16) for _ in range(3))
    M = torch.empty((1, 1, n_ctx), dtype=torch.float32)
    o = torch.empty_like(q)
    runner = TritonPtxRunner(arch=80, check_races=False, max_smem=163 * 1024)
    with runner.active():
        fn[(1, 1, 1)](q, k, v, 0.5, M, o, *q.stride(), *k.stride(), *v.stride(), *o.stride(), 1, 1, N_CTX=n_ctx,
                      HEAD_DIM=D, CAUSAL=False, **TUTORIAL_TILE)
    bm = TUTORIAL_TILE["BLOCK_M"]
    ref = torch.softmax((q[0, 0, :bm].float() @ k[0, 0].float().T) * 0.5, -1) @ v[0, 0].float()
    err = (o[0, 0, :bm].float() - ref).abs().max().item()
    if not err < 2e-2:
        raise RuntimeError(f"the tutorial kernel's output is off by {err} in the interpreter")
    launch = runner.launches[-1]
    return work_from_stats(launch.stats.as_dict(), 1), launch


def run_tutorial(path: str) -> list[dict]:
    from tools.speed_of_light.gpus import GPUS
    from tools.speed_of_light.model import fit_linear

    a100 = GPUS["a100"]
    mod = tutorial_module(path)
    (k0, k1) = TUTORIAL_SIM_KEYS
    (w0, l0), (w1, _) = _tutorial_work(mod, k0), _tutorial_work(mod, k1)
    regs_limited = 2  # resident CTAs: 128 threads and the tile's shared memory; an A100 holds 164 KB
    resident = max(1, min(regs_limited, (164 * 1024) // (l0.shared + 1024)))
    rows = []
    B, H, D = TUTORIAL_SHAPE["batch"], TUTORIAL_SHAPE["heads"], TUTORIAL_SHAPE["head_dim"]
    for n_ctx, tflops in TUTORIAL_PUBLISHED_TFLOPS.items():
        w = fit_linear(k0, w0, k1, w1, n_ctx)
        flops = 4.0 * B * H * n_ctx * n_ctx * D
        ctas = (n_ctx // TUTORIAL_TILE["BLOCK_M"]) * B * H
        nbytes = 4 * B * H * n_ctx * D * 2
        p = predict(a100, w, ctas, resident, ideal_bytes=nbytes, ideal_flops=flops, flops_dtype="f16",
                    launch_dram_bytes=nbytes)  # the CTAs of one head share its K and V (through L2)
        case = Case(f"triton_fused_attention_fwd_N{n_ctx}", a100, flops / (tflops * 1e12),
                    f"Triton tutorial 06 fused attention fwd fp16 d64 B4 H32 N_CTX {n_ctx}: {tflops} TFLOPS "
                    f"(triton-lang.org tutorial page, A100)", "compute")
        rows.append(_row(case, p))
    return rows


def run(tutorial: Optional[str] = None) -> list[dict]:
    rows = [run_stream("copy", 2, 3055.594), run_stream("triad", 3, 3303.794)]
    if tutorial:
        rows += run_tutorial(tutorial)
    return rows


def error_band(rows: list[dict]) -> tuple[float, float]:
    """(lowest, highest) predicted / published time over the cases: a figure the model predicts
    is expected to take between 1/highest and 1/lowest times its prediction on the GPU."""
    ratios = [r["ratio"] for r in rows]
    return min(ratios), max(ratios)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.ptx_harness.calibration", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--triton-tutorial", help="Triton's python/tutorials/06-fused-attention.py (the compute-bound case)")
    args = ap.parse_args(argv)
    if args.triton_tutorial and not os.path.isfile(args.triton_tutorial):
        ap.error(f"--triton-tutorial: no file {args.triton_tutorial}")
    rows = run(args.triton_tutorial)
    for r in rows:
        print(f"{r['case']:<20} {r['gpu']:<9} {r['bound']:<7} predicted {r['predicted_seconds'] * 1e6:8.1f} us"
              f"  published {r['published_seconds'] * 1e6:8.1f} us  predicted/published {r['ratio']:.3f}"
              f"  ({r['bottleneck']}-bound)")
        print(f"  {r['published']}")
    lo, hi = error_band(rows)
    print(f"error band (predicted / published time): {lo:.2f} .. {hi:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "error_band": [lo, hi]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
