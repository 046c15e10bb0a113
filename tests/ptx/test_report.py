"""The counter report runs and writes JSON that spec_kernels.bench compare reads."""
import json

from spec_kernels.bench.__main__ import main as bench_main
from tools.ptx_harness.report import main


def test_report_runs_and_compares(tmp_path, capsys):
    out = tmp_path / "r" / "counters.json"
    assert main(["--keys", "80", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    # decode and verify read K once: group 4 (64 rows) and group 8 (128 rows, one 8-warp CTA) alike
    reads = [line.split("K read / ideal ")[1].split()[0] for line in text.splitlines() if "K read / ideal" in line]
    assert len(reads) >= 3 and set(reads) == {"1.000"}, text
    doc = json.loads(out.read_text())
    names = {b["name"] for b in doc["benchmarks"]}
    assert "ptxsim::tree_verify_kernel[verify16_bf16_d128_L80_group8]::k_bytes_read_over_ideal" in names
    # the fp8-cache rows read each referenced byte once too: half the bytes of the bf16 rows
    ratios, header = {}, ""
    for line in text.splitlines():
        if not line.startswith(" "):
            header = line
        elif "x a bf16 cache's" in line and header.startswith("tree_verify_kernel"):
            ratios[header.split()[1]] = line.split(" x a bf16")[0].split()[-1]
    assert len(ratios) == 6, text
    assert {s: r for s, r in ratios.items() if "kv_fp8e4m3" in s} == {s: "0.500" for s in ratios if "kv_fp8e4m3" in s}
    assert {r for s, r in ratios.items() if "kv_fp8e4m3" not in s} == {"1.000"}
    assert bench_main(["compare", str(out), str(out)]) == 0
