"""Host time of the attention calls on the CUDA path, one-call functions against plan once / run
per layer (spec_kernels.TreeVerifyPlan, spec_kernels.mla.MlaPlan).

    pytest benchmarks/test_host_overhead.py --benchmark-only

What is timed is the Python and dispatch work a model step spends per layer before the kernel
launches: argument checks, implementation choice, launch sizing, split planning and split-buffer
allocation. The launch itself is stubbed (torch.ops.spec_kernels_cuda replaced by no-ops, as the
PTX glue replaces it), the tensors are CPU tensors standing in for CUDA ones, the CUDA path is
forced, index values are not read (as on CUDA tensors without debug mode) and the split plan is
made for an H200 (spec_kernels.attention.plan.DEVICES["h200"]). So the figures are host CPU time
on this machine, measured, and include no GPU time; they have no bandwidth.

Cases: one layer's call, and a 61-layer step (DeepSeek-V3 / Kimi K2.5 have 61 layers): 61 one-call
calls against one plan + 61 runs. GQA: B 32 requests, n 8 drafts, Hq 8 / Hkv 1, D 128, L 4k;
MLA: B 32, n 8, H 16, L 4k.
"""
from __future__ import annotations

import pytest
import torch

import spec_kernels
from spec_kernels import _ops
from spec_kernels.attention import batch as attention_batch
from spec_kernels.attention import plan as attention_plan
from spec_kernels.mla import MlaPlan
from spec_kernels.mla import api as mla_api
from spec_kernels.mla import cuda as mla_cuda
from spec_kernels.tree_verify import TreeVerifyPlan
from spec_kernels.tree_verify import api as tv_api
from spec_kernels.tree_verify import cuda as tv_cuda

LAYERS = 61
B, N, L = 32, 8, 4096
H200 = attention_plan.DEVICES["h200"]


class _NoLaunch:
    """torch.ops.spec_kernels_cuda with the attention launches stubbed out."""

    def tree_verify_attention(self, *args):
        return None

    def mla_tree_verify_attention(self, *args):
        return None


def _h200_splits(device, num_requests, num_kv_heads, rows, block_m, kernel=None, prefix_keys=None, traffic=None):
    kernel = kernel(H200) if callable(kernel) else kernel
    return attention_plan.split_plan(H200, kernel, num_requests, num_kv_heads, rows, block_m, prefix_keys,
                                     traffic).splits


@pytest.fixture(scope="module")
def cuda_path():
    mp = pytest.MonkeyPatch()
    mp.setattr(_ops, "cuda_unavailable_reason", lambda device, name: None)
    for mod in (tv_cuda, mla_cuda):
        mp.setattr(mod, "cuda_ops", lambda: _NoLaunch())
        mp.setattr(mod, "plan_splits", _h200_splits)
    for mod in (tv_api, mla_api, attention_batch):
        mp.setattr(mod, "values_checkable", lambda *tensors: False)
    yield
    mp.undo()


def _layout(heads_per_token_rows):
    gen = torch.Generator().manual_seed(0)
    kv_indptr = torch.arange(0, (B + 1) * (L + N), L + N, dtype=torch.int32)
    kv_indices = torch.randperm(B * (L + N) + 64, generator=gen)[: B * (L + N)].to(torch.int32)
    qo_indptr = torch.arange(0, (B + 1) * N, N, dtype=torch.int32)
    tree_mask = torch.tensor([(1 << (i + 1)) - 1 for i in range(N)] * B, dtype=torch.int64)
    return kv_indptr, kv_indices, qo_indptr, tree_mask


def _gqa():
    layout = _layout(8)
    S = layout[1].numel() + 64
    q = torch.randn(B * N, 8, 128, dtype=torch.float16)
    k = torch.randn(S, 1, 128, dtype=torch.float16)
    v = torch.randn(S, 1, 128, dtype=torch.float16)
    out = torch.empty_like(q)

    def one_call():
        return spec_kernels.tree_verify_attention(q, k, v, *layout, out=out, max_draft_tokens=N)

    def plan():
        return TreeVerifyPlan(*layout, num_q_heads=8, num_kv_heads=1, head_dim=128, dtype=torch.float16,
                              max_draft_tokens=N)

    return one_call, plan, lambda p: p.run(q, k, v, out=out)


def _mla():
    layout = _layout(16)
    S = layout[1].numel() + 64
    q = torch.randn(B * N, 16, 576, dtype=torch.bfloat16)
    kv = torch.randn(S, 1, 576, dtype=torch.bfloat16)
    out = torch.empty(B * N, 16, 512, dtype=torch.bfloat16)

    def one_call():
        return spec_kernels.mla_tree_verify_attention(q, kv, *layout, out=out, max_draft_tokens=N)

    def plan():
        return MlaPlan(*layout, num_heads=16, dtype=torch.bfloat16, max_draft_tokens=N)

    return one_call, plan, lambda p: p.run(q, kv, out=out)


FAMILIES = {"gqa": _gqa, "mla": _mla}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("case", ["layer-one-call", "layer-plan-run", "step-one-call", "step-plan-run"])
def test_host_time(benchmark, cuda_path, family, case):
    one_call, make_plan, run = FAMILIES[family]()
    plan = make_plan()
    assert plan.impl == "cuda"  # the path being measured
    one_call()  # warm caches (launch configurations, device limits)
    fn = {
        "layer-one-call": one_call,
        "layer-plan-run": lambda: run(plan),
        "step-one-call": lambda: [one_call() for _ in range(LAYERS)],
        "step-plan-run": lambda: [run(p) for p in [make_plan()] for _ in range(LAYERS)],
    }[case]
    benchmark.extra_info.update(family=family, case=case, layers=LAYERS if case.startswith("step") else 1,
                                splits=plan.num_kv_splits, measured="host CPU time, launches stubbed")
    benchmark(fn)
