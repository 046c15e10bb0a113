"""The KV-split planner (spec_kernels/attention/plan.py): occupancy arithmetic, wave efficiency of
the benchmark shapes on the named GPUs, the split bounds, the row bounds, the CLI
(spec_kernels/bench/plan.py), and the launchers' automatic path (MIN_CHUNK) against the reference."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import spec_kernels
from spec_kernels.attention import plan as ap
from spec_kernels.bench import plan as bp
from spec_kernels.mla import cuda as mla_cuda
from spec_kernels.tree_verify import cuda as tv_cuda
from spec_kernels.tree_verify import triton_kernel
from spec_kernels.testing import make_case

ROOT = Path(__file__).resolve().parents[1]
GPUS = sorted(ap.DEVICES)
SHAPES = bp.benchmark_shapes()


# --------------------------------------------------------------------------- occupancy
def test_resident_ctas_follow_the_tightest_limit():
    h200, rtx = ap.DEVICES["h200"], ap.DEVICES["rtx-pro-6000"]
    small = ap.KernelResources(threads=128, regs_per_thread=32, smem_bytes=0)
    assert ap.resident_ctas_per_sm(small, h200) == 16  # 2048 threads / 128
    assert ap.resident_ctas_per_sm(small, rtx) == 12  # 1536 threads / 128
    # 255 registers x 256 threads take the whole 64K register file
    assert ap.resident_ctas_per_sm(ap.KernelResources(256, 255, 0), h200) == 1
    # 168 registers round to 5376 per warp: 12 warps = 3 CTAs of 4 warps by registers
    assert ap.resident_ctas_per_sm(ap.KernelResources(128, 168, 0), h200) == 3
    # shared memory: 80 KB + 1 KB reserved -> 2 on 228 KB, 1 on 100 KB
    big = ap.KernelResources(128, 64, 80 * 1024)
    assert (ap.resident_ctas_per_sm(big, h200), ap.resident_ctas_per_sm(big, rtx)) == (2, 1)
    assert ap.resident_ctas_per_sm(ap.KernelResources(1024, 64, 200 * 1024), rtx) == 1  # never 0


def test_cuda_kernel_slots_match_the_kernels_constants():
    # TileConfig<128>: three K and three V stages of 64 keys = 96 KB (Q in registers) + the slot
    # ids of 4 tiles; <64>: two stages + ids; <256>: Q 64x256 + two 32-key stages + ids; the small
    # decode configuration <128, 32>: three stages of 32 keys + ids = 49 KB; the 128-row one
    # <128, 128>: the stages of <128> (Q in registers), 8 warps
    assert tv_cuda.cuda_tree_verify_resources(128).smem_bytes == 98 * 1024
    assert tv_cuda.cuda_tree_verify_resources(128, 32).smem_bytes == 49 * 1024
    wide = tv_cuda.cuda_tree_verify_resources(128, 128)
    assert (wide.smem_bytes, wide.threads) == (98 * 1024, 256)
    assert tv_cuda.cuda_tree_verify_resources(64).smem_bytes == 34 * 1024
    assert tv_cuda.cuda_tree_verify_resources(256).smem_bytes == 97 * 1024
    # MlaTile<1>: Q 16 rows + two 32-key stages = 90 KB, + P, row maxima, slot ids; MlaTile<2>: 32 + 3 x 16
    assert mla_cuda.cuda_mla_resources(16).smem_bytes == 92 * 1024 + 512
    assert mla_cuda.cuda_mla_resources(32).smem_bytes == 92 * 1024 + 256
    h200, rtx = ap.DEVICES["h200"], ap.DEVICES["rtx-pro-6000"]
    k = tv_cuda.cuda_tree_verify_resources(128)
    assert ap.resident_ctas_per_sm(k, h200) * h200.sms == 264
    assert ap.resident_ctas_per_sm(k, rtx) * rtx.sms == 188



def test_configuration_by_rows():
    h200, rtx = ap.DEVICES["h200"], ap.DEVICES["rtx-pro-6000"]
    block_m = tv_cuda.cuda_tree_verify_block_m
    # sm_120: one 98 KB CTA per 100 KB SM, two of 49 KB (+ 1 KB reserved each); sm_90 holds two large
    assert block_m(128, 8, rtx) == 32 and block_m(128, 8, h200) == 64
    assert block_m(128, 8) == 64  # no device limits: never the small one (same CTA count)
    assert block_m(128, 32, rtx) == 64  # more than 16 rows
    assert block_m(64, 8, rtx) == 64
    assert ap.resident_ctas_per_sm(tv_cuda.cuda_tree_verify_kernel(128, 8)(rtx), rtx) == 2
    assert ap.resident_ctas_per_sm(tv_cuda.cuda_tree_verify_kernel(128, 32)(rtx), rtx) == 1
    # more than 64 rows at D = 128: one 8-warp CTA of 128 rows (1 per SM on both: registers)
    assert block_m(128, 65, rtx) == block_m(128, 128, h200) == block_m(128, 512) == 128
    assert block_m(64, 128, rtx) == block_m(256, 128, rtx) == 64
    wide = tv_cuda.cuda_tree_verify_kernel(128, 128)
    assert ap.resident_ctas_per_sm(wide(rtx), rtx) == ap.resident_ctas_per_sm(wide(h200), h200) == 1

# --------------------------------------------------------------------------- the plans
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("gpu", GPUS)
def test_benchmark_shapes_fill_the_waves(gpu, impl):
    limits = ap.DEVICES[gpu]
    filled = 0
    for shape in SHAPES:
        _, p = bp.plan_shape(shape, limits, impl)
        assert 1 <= p.splits <= p.max_splits <= ap.MAX_KV_SPLITS, shape
        best_allowed = max(ap._efficiency(p.ctas, s, p.slots)[1] for s in range(1, p.max_splits + 1))
        # the fewest splits within the tolerance of the best the bounds allow
        assert p.efficiency >= best_allowed * (1 - ap.EFFICIENCY_TOLERANCE) - 1e-12, shape
        assert all(ap._efficiency(p.ctas, s, p.slots)[1] < best_allowed * (1 - ap.EFFICIENCY_TOLERANCE)
                   for s in range(1, p.splits)), shape
        if p.limit == "waves":
            assert p.efficiency >= 0.9, (shape, p)
            filled += 1
        else:  # bounded by MIN_SPLIT_KEYS / MAX_KV_SPLITS: more splits would have filled it better
            assert p.limit in ("keys", "cap") and p.efficiency < 0.9, (shape, p)
            prefix = shape.L
            assert p.max_splits == max(1, min(ap.MAX_KV_SPLITS, prefix // ap.MIN_SPLIT_KEYS)), shape
    # B >= 70 fills the GPU to >= 0.9 (MLA plain decode excepted: one 16-row CTA per request and
    # 3 per SM on sm_90 would need more than the 8 splits that 2048 keys allow); smaller batches
    # may have too few keys per request for enough splits of MIN_SPLIT_KEYS (checked above).
    big = [s for s in SHAPES if s.B >= 70 and not (s.mla and s.n == 1)]
    low = [s for s in big if bp.plan_shape(s, limits, impl)[1].efficiency < 0.9]
    assert not low and filled >= len(big), low


@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("gpu", GPUS)
def test_kernel_benchmark_grid_plans(gpu, impl):
    limits = ap.DEVICES[gpu]
    for shape in bp.benchmark_shapes("tree-verify"):
        _, p = bp.plan_shape(shape, limits, impl)
        assert 1 <= p.splits <= p.max_splits == max(1, min(ap.MAX_KV_SPLITS, shape.L // ap.MIN_SPLIT_KEYS))
        assert p.efficiency >= 0.9 or p.limit in ("keys", "cap"), (shape, p)
        if shape.L >= 16384:  # 64 splits allowed: fills the waves unless 64 splits cannot fill one
            assert p.efficiency >= 0.9 or (p.limit == "cap" and p.ctas * ap.MAX_KV_SPLITS < p.slots), (shape, p)


@pytest.mark.parametrize("gpu", GPUS)
def test_decode_b16_gqa_32_4(gpu):
    # B=16 decode, Hq/Hkv = 32/4: 64 CTAs per split; 2x-SM sizing gave 5 splits on H200 (320 CTAs on
    # 264 slots: 0.61) and 6 on the RTX PRO 6000 (384 on 188: 0.68).
    shape = bp.Shape("gqa-32/4", 16, 32, 4, 128, 4096, 1)
    _, p = bp.plan_shape(shape, ap.DEVICES[gpu], "cuda")
    assert p.ctas == 64 and p.efficiency >= 0.9 and p.splits * ap.MIN_SPLIT_KEYS <= 4096


def test_split_bounds_min_chunk_and_cap():
    for ctas in (1, 2, 3, 7, 64, 100, 263, 264, 265, 1000, 5000):
        for slots in (132, 188, 264, 396):
            for prefix in (None, 0, 100, 255, 256, 511, 512, 2047, 4096, 10**6):
                p = ap.plan(ctas, slots, 1, prefix)
                assert 1 <= p.splits <= ap.MAX_KV_SPLITS
                if prefix is not None:
                    assert p.splits == 1 or prefix // p.splits >= ap.MIN_SPLIT_KEYS, (ctas, slots, prefix, p)
                assert p.waves == -(-ctas * p.splits // slots)
    # the cap (the fewest splits within the tolerance of the best: 63 of 64 on 264 slots)
    assert ap.plan(1, 264, 2, 10**6).splits >= ap.MAX_KV_SPLITS * (1 - ap.EFFICIENCY_TOLERANCE)
    assert ap.plan(1, 264, 2, 10**6).limit == "cap"
    assert ap.plan(1, 264, 2, 2048).splits == 8 and ap.plan(1, 264, 2, 2048).limit == "keys"
    assert ap.plan(10_000, 264, 2, 10**6).splits <= 2  # many waves already: no (or few) splits


def test_cpu_path_returns_one():
    cpu = torch.device("cpu")
    assert ap.num_kv_splits(cpu, 1, 1, 8, 64) == 1
    assert ap.num_kv_splits(cpu, 1, 1, 8, 64, tv_cuda.cuda_tree_verify_resources(128), 10**6) == 1


def test_named_device_limits_without_a_gpu(monkeypatch):
    # Tools that compile without a GPU stand in a CUDA device and patch sm_count.
    monkeypatch.setattr(ap, "sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fake = type("Dev", (), {"type": "cuda", "index": 0})()
    assert ap.num_kv_splits(fake, 1, 1, 8, 64, tv_cuda.cuda_tree_verify_resources(128), 2047) == 7
    assert ap.num_kv_splits(fake, 1, 1, 8, 64, lambda limits: tv_cuda.cuda_tree_verify_resources(128), None) >= 62


# --------------------------------------------------------------------------- rows
def test_grid_rows_bound_every_valid_batch_and_plan_rows_stay_within():
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        B = int(torch.randint(1, 9, (), generator=gen))
        ns = torch.randint(0, 65, (B,), generator=gen)
        if int(torch.randint(0, 3, (), generator=gen)) == 0:  # one request holds every token
            ns = torch.zeros(B, dtype=torch.long)
            ns[int(torch.randint(0, B, (), generator=gen))] = int(torch.randint(1, 65, (), generator=gen))
        T, group = int(ns.sum()), int(torch.randint(1, 9, (), generator=gen))
        if T == 0:
            continue
        grid = ap.max_rows(T, group, False)
        assert grid >= int(ns.max()) * group  # no valid request is cut by the grid
        assert ap.max_rows(T, group, False, int(ns.max())) >= int(ns.max()) * group
        work = ap.expected_rows(T, B, group, False)
        assert group <= work <= grid
        if bool((ns == ns[0]).all()):  # a uniform batch: exactly its rows
            assert work == int(ns[0]) * group
    assert ap.expected_rows(128, 16, 8, False) == 64  # B=16 x n=8: 8 drafts each, not 64
    assert ap.max_rows(128, 8, False) == 512
    assert ap.expected_rows(5, 5, 4, True) == ap.max_rows(5, 4, True) == 4


# --------------------------------------------------------------------------- the automatic path
@pytest.mark.parametrize("planned", [2, 5])
def test_automatic_split_path_matches_reference(monkeypatch, planned):
    """The launcher's automatic path (planner count, MIN_CHUNK = MIN_SPLIT_KEYS) on the CPU, by
    standing the planner's answer in: prefixes below, at and above the minimum chunk."""
    calls = []

    def fake_plan(device, B, Hkv, rows, block_m, kernel, prefix):
        calls.append((B, Hkv, rows, block_m, prefix))
        return planned

    monkeypatch.setattr(triton_kernel, "plan_splits", fake_plan)
    case = make_case([3, 3, 3], [700, 0, 300], hq=4, hkv=2, seed=11)
    ref, ref_lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl="reference")
    out, lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl="triton")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=0)
    # planned with the even batch's rows (3 drafts x group 2) and the mean prefix (1009 slots / 3 - 3)
    assert calls == [(3, 2, 6, 32, 1009 // 3 - 3)]  # BLOCK_M 32 from the grid bound min(9, 64) x 2 rows


# --------------------------------------------------------------------------- the CLI
def test_cli_prints_the_plan_table():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "spec_kernels.bench", "plan", "--gpu", "rtx-pro-6000",
                           "--model", "llama-3.3-70b-tp8"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "188 SMs" in lines[0] and lines[1].split()[:3] == ["model", "B", "n"]
    rows = [ln.split() for ln in lines[2:]]
    assert len(rows) == 40 and all(r[0] == "llama-3.3-70b-tp8" for r in rows)
    b250_n4 = next(r for r in rows if r[1] == "250" and r[2] == "4")
    assert b250_n4[9] == "188" and float(b250_n4[12]) >= 0.9  # slots, efficiency
