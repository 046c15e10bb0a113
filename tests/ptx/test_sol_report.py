"""The speed-of-light report and its calibration run on the compiled kernels (interpreter counters
through tools/speed_of_light) and write JSON that spec_kernels.bench compare reads."""
import json

import pytest

from spec_kernels.bench.__main__ import main as bench_main
from tools.ptx_harness import calibration, speed_of_light


def test_report_on_the_quick_shapes(tmp_path, capsys):
    out = tmp_path / "sol.json"
    assert speed_of_light.main(["--quick", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "modelled" in text and "assumed" in text and "error band" in text
    doc = json.loads(out.read_text())
    rows = {b["params"]["shape"]: b for b in doc["benchmarks"]
            if b["params"]["gpu"] == "h200" and b["name"].startswith("sol::tree_verify_cuda")}
    decode, verify = rows["decode_B32_L4096_h32x4_d128"], rows["verify16_B32_L4096_h32x4_d128"]
    # decode streams K/V once: DRAM-bound, near the floor; verify n = 16 at GQA 8 (128 rows per CTA)
    # is bound on the SM (issue or shared memory), slower than decode, not by more than 2x
    assert decode["extra_info"]["bottleneck"] == "DRAM" and decode["extra_info"]["of_floor"] > 0.8
    assert verify["extra_info"]["bottleneck"] in ("issue", "shared memory")
    assert 1.0 < verify["stats"]["median"] / decode["stats"]["median"] < 2.0
    # the anchor (sm_120 only): SGLang's extend kernel reads K/V once per q head through L2 and
    # computes 64-row tiles for 16 drafts; the model puts it behind ours
    anchor = [b for b in doc["benchmarks"] if b["name"].startswith("sol::sglang_triton_extend")]
    assert [b["params"] for b in anchor] == [{"gpu": "rtx-pro-6000", "shape": "verify16_B32_L4096_h32x4_d128"}]
    assert anchor[0]["extra_info"]["ours_faster_by"] > 1.0
    lo, hi = verify["extra_info"]["expected_seconds_on_gpu"]
    assert lo > verify["stats"]["median"] and hi > lo
    assert bench_main(["compare", str(out), str(out)]) == 0


def test_calibration_against_babelstream():
    rows = calibration.run()
    assert [r["case"] for r in rows] == ["babelstream_copy", "babelstream_triad"]
    copy = rows[0]
    assert copy["published_seconds"] == pytest.approx(2 * (1 << 25) * 8 / 3055.594e9)
    for r in rows:
        assert r["bottleneck"] == "DRAM"
        assert 0.5 < r["ratio"] < 1.0  # the model is a speed of light: faster than the measurement
    lo, hi = calibration.error_band(rows)
    assert lo <= hi


def test_the_stated_band_is_the_last_calibration_run():
    """CALIBRATION_BAND, the committed calibration run and a fresh run of its GPU-free cases
    agree: a model change that moves the BabelStream predictions needs a new calibration run."""
    import os

    from tools.speed_of_light.model import CALIBRATION_BAND

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", "model", "calibration.json")
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    ratios = [r["ratio"] for r in saved["rows"]]
    assert tuple(round(x, 2) for x in (min(ratios), max(ratios))) == CALIBRATION_BAND
    assert {r["bound"] for r in saved["rows"]} == {"memory", "compute"}
    fresh = {r["case"]: r["ratio"] for r in calibration.run()}
    for r in saved["rows"]:
        if r["case"] in fresh:
            assert fresh[r["case"]] == pytest.approx(r["ratio"], rel=1e-6), r["case"]
