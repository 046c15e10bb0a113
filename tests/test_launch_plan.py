"""The KV-split planner (spec_kernels/attention/plan.py): occupancy arithmetic, wave efficiency of
the benchmark shapes on the named GPUs, the split bounds, the row bounds, the CLI
(spec_kernels/bench/plan.py), and the launchers' automatic path (MIN_CHUNK) against the reference."""
import dataclasses
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
    # 17-64 rows: sm_120 holds one 98 KB CTA per SM, so the 8-warp configuration (two warps per
    # scheduler, same shared memory); sm_90 holds two 4-warp ones; no device limits: 64
    assert block_m(128, 17, rtx) == block_m(128, 32, rtx) == block_m(128, 64, rtx) == 128
    assert block_m(128, 17, h200) == block_m(128, 64, h200) == block_m(128, 64) == 64
    assert block_m(128, 32, rtx, kv_fp8=True) == 128  # the fp8 instance: 82 KB, one per SM as well
    assert block_m(64, 8, rtx) == block_m(64, 32, rtx) == block_m(256, 32, rtx) == 64
    assert ap.resident_ctas_per_sm(tv_cuda.cuda_tree_verify_kernel(128, 8)(rtx), rtx) == 2
    assert ap.resident_ctas_per_sm(tv_cuda.cuda_tree_verify_kernel(128, 32)(rtx), rtx) == 1
    assert tv_cuda.cuda_tree_verify_kernel(128, 32)(rtx).threads == 256
    # more than 64 rows at D = 128: one 8-warp CTA of 128 rows (1 per SM on both: registers)
    assert block_m(128, 65, rtx) == block_m(128, 128, h200) == block_m(128, 512) == 128
    assert block_m(64, 128, rtx) == block_m(256, 128, rtx) == 64
    wide = tv_cuda.cuda_tree_verify_kernel(128, 128)
    assert ap.resident_ctas_per_sm(wide(rtx), rtx) == ap.resident_ctas_per_sm(wide(h200), h200) == 1

# --------------------------------------------------------------------------- the plans
def _check_cheapest(p, cost, prefix, where):
    """The plan is the fewest splits within COST_TOLERANCE of the cheapest the bounds allow, and
    its bound names the binding term."""
    assert 1 <= p.splits <= p.max_splits <= ap.MAX_KV_SPLITS, where
    secs = [cost.seconds(p.ctas, p.per_sm, k, prefix) for k in range(1, p.max_splits + 1)]
    limit = min(secs) / (1 - ap.COST_TOLERANCE)
    assert secs[p.splits - 1] <= limit + 1e-15 and all(t > limit for t in secs[:p.splits - 1]), (where, p)
    assert p.seconds == pytest.approx(secs[p.splits - 1])
    terms = cost.terms(p.ctas, p.per_sm, p.splits, prefix)
    binding = max(("DRAM", "L2", "latency", "compute"), key=terms.get)
    if p.limit == "bandwidth":  # DRAM or L2: no split count does better
        assert binding in ("DRAM", "L2"), (where, p, terms)
    elif p.limit in ("keys", "cap"):
        assert p.splits == p.max_splits and binding not in ("DRAM", "L2"), (where, p, terms)
    else:
        assert p.limit == binding and p.splits < p.max_splits, (where, p, terms)


def _plan_pieces(shape, limits, impl):
    """(plan, cost, prefix) of a benchmark shape as its launcher plans it."""
    lp = bp.launch_plan(shape, limits, impl)
    return lp.plan, lp.cost, lp.prefix


@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("gpu", GPUS)
def test_benchmark_shapes_take_the_cheapest_split(gpu, impl):
    limits = ap.DEVICES[gpu]
    for shape in SHAPES + bp.benchmark_shapes("tree-verify"):
        p, cost, prefix = _plan_pieces(shape, limits, impl)
        _check_cheapest(p, cost, prefix, shape)
        # B >= 70 keeps the GPU busy: the stream is bound by DRAM or by the SMs' own work, and
        # never waits on latency (too few CTAs) where more splits would have paid
        if shape.B >= 70:
            assert p.limit in ("bandwidth", "compute"), (shape, p)


@pytest.mark.parametrize("gpu", GPUS)
def test_modelled_time_at_a_forced_count_is_the_planners_own(gpu):
    """The forced-split benchmark's model column: at the planned count it is the plan's time, and
    no count within the plan's bounds is modelled cheaper by more than the planner's tolerance."""
    limits = ap.DEVICES[gpu]
    for shape in bp.benchmark_shapes("tree-verify")[::7]:
        lp = bp.launch_plan(shape, limits, "cuda")
        assert lp.seconds_at(lp.plan.splits) == lp.plan.seconds, shape
        cheapest = min(lp.seconds_at(k) for k in range(1, lp.plan.max_splits + 1))
        assert lp.plan.seconds <= cheapest / (1 - ap.COST_TOLERANCE), shape


def test_the_docs_forced_split_table_is_the_planners_cost():
    """docs/speed_of_light.md prints the planner's cost of the forced-split benchmark's shapes at
    each forced count (what a GPU run is compared with): the table must be today's cost."""
    from benchmarks._timing import PRESETS, SPLIT_COUNTS, SPLIT_SHAPES

    preset = next(p for p in PRESETS.values() if p.split_shapes == SPLIT_SHAPES)
    (hq, hkv), d = preset.heads[0], preset.head_dim

    doc = (ROOT / "docs" / "speed_of_light.md").read_text()
    names = {"H200": "h200", "RTX PRO 6000": "rtx-pro-6000"}
    head = "| GPU | B | planned | " + " | ".join(map(str, SPLIT_COUNTS)) + " |"
    assert head in doc, "the forced-split table's header names other counts than SPLIT_COUNTS"
    rows = doc.split(head, 1)[1].split("\n")[2:]
    want = []
    for gpu in names:
        for B, L, n in SPLIT_SHAPES:
            lp = bp.launch_plan(bp.Shape("bench", B, hq, hkv, d, L, n), ap.DEVICES[names[gpu]], "cuda")
            cells = [gpu, str(B), f"{lp.plan.splits} ({lp.plan.limit})"]
            want.append("| " + " | ".join(cells + [f"{lp.seconds_at(k) * 1e6:.1f}" for k in SPLIT_COUNTS]) + " |")
    assert rows[:len(want)] == want


def test_the_partials_are_weighed_against_the_waves():
    """A 128-row CTA (n = 16 at GQA 8) writes 64 KB of fp32 partials per split, half of what a
    256-key split reads: at B = 32 on the RTX PRO 6000 the wave rule split each request 10 ways
    (2560 CTAs, 0.97 of the waves full); with the bytes, 256 CTAs already stream at full DRAM
    bandwidth and no split pays for its partials and merge."""
    rtx = ap.DEVICES["rtx-pro-6000"]
    shape = bp.Shape("gqa-32/4", 32, 32, 4, 128, 4096, 16)
    p, cost, prefix = _plan_pieces(shape, rtx, "cuda")
    waves = bp.launch_plan(shape, rtx, "cuda").wave_rule()  # without the bytes: wave efficiency alone
    assert (waves.splits, waves.limit) == (10, "waves") and waves.efficiency > 0.9
    assert (p.splits, p.limit) == (1, "bandwidth")
    assert cost.seconds(p.ctas, p.per_sm, 10, prefix) > 1.3 * p.seconds  # partials + merge: +30% and more
    # at B = 1 the GPU waits on latency and the SMs' work: splits pay for their partials there
    one = bp.Shape("gqa-32/4", 1, 32, 4, 128, 32768, 16)
    p1, _, _ = _plan_pieces(one, rtx, "cuda")
    assert p1.splits >= 8 and p1.partial_fraction < 0.25, p1


def test_cost_terms_by_hand():
    """One SplitCost evaluated by hand: 8 CTAs of 64 rows per split (two row blocks of each K/V
    stream: its bytes read from DRAM once, through L2 twice), 2 resident per SM, 4096 keys."""
    c = ap.SplitCost(sms=4, dram_bytes_per_s=1e12, l2_bytes_per_s=2e12, dram_latency_s=1e-6, launch_overhead_s=2e-6,
                     tensor_flops_per_s_per_sm=1e12, clock_hz=1e9, kv_bytes_per_key=512, flops_per_key=64 * 512,
                     issue_per_key=20.0, issue_per_cta=2000.0, in_flight_bytes=100_000,
                     partial_bytes_per_cta=64 * 516, out_bytes_per_cta=64 * 256, row_blocks=2)
    t1 = c.terms(8, 2, 1, 4096)  # 8 CTAs on 4 SMs: k = 2, both resident together
    assert t1["DRAM"] == pytest.approx(4 * 4096 * 512 / 1e12)
    assert t1["L2"] == pytest.approx(8 * 4096 * 512 / 2e12)
    assert t1["latency"] == pytest.approx(2 * 4096 * 512 / (2 * 100_000 / 1e-6))
    assert t1["compute"] == pytest.approx(2 * max(4096 * 64 * 512 / 1e12, (2000 + 4096 * 20) / 1e9))
    assert t1["merge"] == 0.0
    t2 = c.terms(8, 2, 2, 4096)  # 16 CTAs: k = 4, 2048 keys each, partials written and merged
    cta = 2048 * 512 + 64 * 516
    assert t2["DRAM"] == pytest.approx(16 * (2048 * 512 / 2 + 64 * 516) / 1e12)
    assert t2["L2"] == pytest.approx(16 * cta / 2e12)
    assert t2["latency"] == pytest.approx(4 * cta / (2 * 100_000 / 1e-6))
    assert t2["merge"] == pytest.approx((16 * 64 * 516 + 8 * 64 * 256) / 1e12 + 2e-6)
    assert c.seconds(8, 2, 2, 4096) == pytest.approx(max(t2["DRAM"], t2["L2"], t2["latency"], t2["compute"]) +
                                                     t2["merge"])


def test_random_costs_take_the_cheapest_split():
    gen = torch.Generator().manual_seed(3)
    for _ in range(300):
        r = lambda lo, hi: int(torch.randint(lo, hi, (), generator=gen))  # noqa: E731
        cost = ap.SplitCost(sms=r(1, 200), dram_bytes_per_s=r(1, 50) * 1e11, l2_bytes_per_s=r(1, 100) * 1e11,
                            dram_latency_s=r(1, 20) * 1e-7,
                            launch_overhead_s=r(0, 50) * 1e-7, tensor_flops_per_s_per_sm=r(1, 50) * 1e11,
                            clock_hz=r(1, 30) * 1e8, kv_bytes_per_key=r(1, 2000), flops_per_key=r(0, 100_000),
                            issue_per_key=float(r(0, 60)), issue_per_cta=float(r(0, 6000)),
                            in_flight_bytes=r(0, 200_000), partial_bytes_per_cta=r(0, 300_000),
                            out_bytes_per_cta=r(0, 100_000), row_blocks=r(1, 5))
        ctas, per_sm, prefix = r(1, 3000), r(1, 9), r(1, 200_000)
        p = ap.plan(ctas, per_sm * cost.sms, per_sm, prefix, cost)
        assert p.max_splits == max(1, min(ap.MAX_KV_SPLITS, prefix // ap.MIN_SPLIT_KEYS))
        _check_cheapest(p, cost, prefix, (cost, ctas, per_sm, prefix))


@pytest.mark.parametrize("gpu", GPUS)
def test_decode_b16_gqa_32_4(gpu):
    # B=16 decode, Hq/Hkv = 32/4: 64 CTAs per split with 2048 prefix keys each. 2x-SM sizing gave
    # 5 splits on H200 and 6 on the RTX PRO 6000, the wave rule fills the waves to 0.9; by bytes,
    # one or two splits of 64 CTAs, their stages in flight, already stream at DRAM bandwidth (on
    # the H200 one split's SM work is about as long: a few % over, which a second split's merge
    # does not repay)
    shape = bp.Shape("gqa-32/4", 16, 32, 4, 128, 4096, 1)
    p, cost, prefix = _plan_pieces(shape, ap.DEVICES[gpu], "cuda")
    assert p.ctas == 64 and p.splits * ap.MIN_SPLIT_KEYS <= 4096
    _check_cheapest(p, cost, prefix, shape)
    assert p.limit in ("bandwidth", "compute") and p.splits <= 2, p
    terms = cost.terms(p.ctas, p.per_sm, p.splits, prefix)
    assert terms["compute"] <= 1.1 * terms["DRAM"], terms
    assert ap.plan(p.ctas, p.slots, p.per_sm, prefix).efficiency >= 0.9  # the wave rule's plan


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
    assert ap.plan(1, 264, 2, 2048).splits == 2048 // ap.MIN_SPLIT_KEYS and ap.plan(1, 264, 2, 2048).limit == "keys"
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
    splits = ap.num_kv_splits(fake, 1, 1, 8, 64, tv_cuda.cuda_tree_verify_resources(128), 2047)
    assert splits == 2047 // ap.MIN_SPLIT_KEYS  # one CTA: as many splits as the keys allow
    assert ap.num_kv_splits(fake, 1, 1, 8, 64, lambda limits: tv_cuda.cuda_tree_verify_resources(128), None) >= 62


@pytest.mark.parametrize("major,named", [(9, "h200"), (12, "rtx-pro-6000")])
def test_device_limits_take_what_torch_reports_and_the_rest_from_the_named_gpu(monkeypatch, major, named):
    """A GPU's limits: the counts torch reports, every rate it does not report from the named GPU
    of the same architecture (so a rate added to DeviceLimits needs no second copy here)."""
    props = type("Props", (), {"name": "Some GPU", "major": major, "minor": 0, "regs_per_multiprocessor": 1234,
                               "shared_memory_per_multiprocessor": 5678, "max_threads_per_multi_processor": 1536,
                               "shared_memory_per_block_optin": 4321, "clock_rate": 1_500_000})()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    ap._device_limits.cache_clear()
    try:
        got = ap._device_limits(0, 77)
    finally:
        ap._device_limits.cache_clear()
    reported = dict(name="Some GPU", sms=77, regs_per_sm=1234, smem_per_sm=5678, max_threads_per_sm=1536,
                    max_smem_per_cta=4321, clock_hz=1.5e9)
    for field in dataclasses.fields(ap.DeviceLimits):
        want = reported.get(field.name, getattr(ap.DEVICES[named], field.name))
        if field.name != "max_ctas_per_sm":
            assert getattr(got, field.name) == want, field.name


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

    def fake_plan(device, B, Hkv, rows, block_m, kernel, prefix, traffic=None):
        assert traffic is not None  # the launcher plans by bytes
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
    assert b250_n4[9] == "188" and b250_n4[-1] == "bandwidth"  # slots; 250 CTAs stream at DRAM bandwidth
