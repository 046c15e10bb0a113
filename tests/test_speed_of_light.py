"""The speed-of-light model (tools/speed_of_light): which unit bounds a launch, its waves, the
floor, and that every rate names its source."""
import json
import math
import re
from pathlib import Path

import pytest

from tools.speed_of_light.gpus import GPUS
from tools.speed_of_light.model import Work, combine, fit_linear, mma_flops, predict

H200 = GPUS["h200"]


def work(**kw):
    base = dict(issue=0.0, shared_wavefronts=0.0, tensor_flops={}, l2_bytes=0.0, dram_bytes=0.0,
                in_flight_bytes=0.0, load_chain=0)
    base.update(kw)
    return Work(**base)


def test_a_streaming_launch_is_dram_bound_at_the_peak():
    nbytes = 1 << 20
    p = predict(H200, work(dram_bytes=nbytes, l2_bytes=nbytes), ctas=1024, resident=2, ideal_bytes=1024 * nbytes)
    assert p.bottleneck == "DRAM"
    assert p.units["DRAM"] == pytest.approx(1024 * nbytes / H200.dram_peak_bytes_per_s)
    assert p.seconds == pytest.approx(p.units["DRAM"] + H200.launch_overhead_s)
    assert p.floor_unit == "DRAM" and 0.9 < p.of_floor < 1.0
    assert p.waves == math.ceil(1024 / (132 * 2))


def test_tensor_issue_and_shared_memory_bound_launches_name_their_unit():
    flops = {"bf16": 1e9}
    p = predict(H200, work(tensor_flops=flops), ctas=132, resident=1, ideal_bytes=0, ideal_flops=132e9)
    assert p.bottleneck == "tensor" and p.floor_unit == "tensor"
    assert p.units["tensor"] == pytest.approx(1e9 / H200.tensor_flops_per_clk("bf16") / H200.clock_hz)
    assert predict(H200, work(issue=1e6), 132, 1, ideal_bytes=0).bottleneck == "issue"
    assert predict(H200, work(shared_wavefronts=1e6), 132, 1, ideal_bytes=0).bottleneck == "shared memory"
    # twice the CTAs on the same SMs: twice the time of an SM-local unit
    one = predict(H200, work(issue=1e6), 132, 2, ideal_bytes=0).units["issue"]
    assert predict(H200, work(issue=1e6), 264, 2, ideal_bytes=0).units["issue"] == pytest.approx(2 * one)


def test_few_ctas_with_little_in_flight_are_latency_bound():
    # one CTA per SM on 8 SMs, 16 KB in flight each: far below the bandwidth of the whole GPU
    p = predict(H200, work(dram_bytes=1 << 24, in_flight_bytes=16 << 10), ctas=8, resident=1, ideal_bytes=8 << 24)
    assert p.bottleneck == "latency"
    assert p.units["latency"] == pytest.approx((1 << 24) / ((16 << 10) / H200.dram_latency_s))
    assert p.of_floor < 0.05


def test_bad_launch_is_refused():
    with pytest.raises(ValueError, match="ctas"):
        predict(H200, work(), 0, 1, ideal_bytes=0)


def test_fit_linear_is_exact_on_linear_counters():
    w0 = work(issue=100, shared_wavefronts=10, tensor_flops={"bf16": 4096.0}, l2_bytes=320, dram_bytes=256)
    w1 = work(issue=180, shared_wavefronts=30, tensor_flops={"bf16": 3 * 4096.0}, l2_bytes=640, dram_bytes=512)
    w = fit_linear(128, w0, 256, w1, 1024)
    assert (w.issue, w.shared_wavefronts, w.tensor_flops["bf16"], w.dram_bytes) == (660, 150, 15 * 4096, 2048)
    with pytest.raises(ValueError):
        fit_linear(1, w0, 1, w1, 2)


def test_mma_forms_count_flops_by_dtype():
    assert mma_flops({"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32": 3,
                      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32": 1}) == {"bf16": 3 * 4096, "f16": 4096}


def test_combined_launches_add_and_keep_one_floor():
    a = predict(H200, work(dram_bytes=1e6), 132, 1, ideal_bytes=132e6)
    b = predict(H200, work(issue=1e4), 132, 1, ideal_bytes=0)
    c = combine([a, b], ideal_bytes=132e6, gpu=H200)
    assert c.seconds == pytest.approx(a.seconds + b.seconds)
    assert c.floor_seconds == pytest.approx(a.floor_seconds) and c.bottleneck == a.bottleneck


@pytest.mark.parametrize("key", sorted(GPUS))
def test_every_rate_names_its_source(key):
    g = GPUS[key]
    for field in ("sms", "clock_hz", "dram_peak_bytes_per_s", "l2_bytes_per_s", "mma_flops_per_clk",
                  "shared_wavefronts_per_clk", "dram_latency_s", "launch_overhead_s", "dependent_launch_overhead_s",
                  "latency_cycles"):
        assert g.sources.get(field), f"{key}.{field} has no source"
    assert set(g.assumed) <= {"l2_bytes_per_s", "dram_latency_s", "launch_overhead_s", "dependent_launch_overhead_s",
                              "latency_cycles"}


def test_the_docs_b1_bound_table_is_the_reports():
    """docs/speed_of_light.md's B = 1 table (the floors, the one-launch bound floor / (floor +
    launch overhead), the CUDA kernel's fraction of the floor) is read from the committed report."""
    root = Path(__file__).resolve().parents[1]
    report = json.loads((root / "benchmarks/results/model/tree_verify_sol.json").read_text())
    doc = (root / "docs/speed_of_light.md").read_text()
    head = "| GPU | L | GQA | floor | one-launch bound | CUDA kernel, decode .. verify n = 16 |"
    assert head in doc
    rows = [r.strip() for r in doc.split(head, 1)[1].split("\n")[2:]]  # the table sits in a list item
    names = {"h200": "H200", "rtx-pro-6000": "RTX PRO 6000"}
    span = lambda lo, hi, f: f"{lo:{f}}" if f"{lo:{f}}" == f"{hi:{f}}" else f"{lo:{f}}-{hi:{f}}"  # noqa: E731
    want = []
    for gpu, name in names.items():
        launch = GPUS[gpu].launch_overhead_s
        for L in (4096, 32768):
            for hkv, gqa in ((4, 8), (8, 4)):
                got = {}
                for b in report["benchmarks"]:
                    m = re.fullmatch(rf"sol::tree_verify_cuda\[{gpu}-(decode|verify\d+)_B1_L{L}_h32x{hkv}_d128\]", b["name"])
                    if m:
                        t, of = b["stats"]["mean"], b["extra_info"]["of_floor"]
                        got[m.group(1)] = (of * t, of)
                assert set(got) == {"decode", "verify4", "verify8", "verify16"}, (gpu, L, hkv)
                floors = [f for f, _ in got.values()]
                bounds = [f / (f + launch) for f in floors]
                want.append(f"| {name} | {L} | {gqa} | {span(min(floors) * 1e6, max(floors) * 1e6, '.2f')} µs | "
                            f"{span(min(bounds), max(bounds), '.2f')} | "
                            f"{got['decode'][1]:.2f} .. {got['verify16'][1]:.2f} |")
    assert rows[:len(want)] == want
