"""scripts/save_gpu_results.py files a gpu_check.sh archive under benchmarks/results/<gpu>/."""
import importlib.util
import json
import tarfile
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "save_gpu_results", Path(__file__).resolve().parent.parent / "scripts" / "save_gpu_results.py")
save = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(save)


def _fake_run(tmp_path: Path, device="NVIDIA H200") -> Path:
    out = tmp_path / "gpu_check"
    out.mkdir()
    (out / "steps.tsv").write_text("step\trc\tseconds\tlog\nenv\t0\t3\tenv.log\n")
    (out / "summary.txt").write_text("== gpu_check summary: 2026-12-03T10:00:00Z, 400s of a 450s budget\n")
    info = {"machine_info": {"spec_kernels": {"device": {"type": "cuda", "name": device}}}, "benchmarks": []}
    for module in ("tree_verify", "decode_step"):
        (out / f"{module}.json").write_text(json.dumps(info))
    (out / "decode_step-llama-3.1-8b-L4096.png").write_bytes(b"\x89PNG")
    (out / "gpu-tests.log").write_text("log stays out")
    archive = tmp_path / "gpu_check.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(out, arcname="gpu_check")
    return archive


def test_gpu_slug():
    assert save.gpu_slug("NVIDIA H200") == "h200"
    assert save.gpu_slug("NVIDIA RTX PRO 6000 Blackwell Server Edition") == "rtx-pro-6000-blackwell-server-edition"


def test_files_archive_by_gpu_and_date_and_numbers_a_second_run(tmp_path, monkeypatch):
    archive = _fake_run(tmp_path)
    results = tmp_path / "results"
    monkeypatch.setattr(save, "RESULTS", results)
    monkeypatch.setattr(save, "REPO", tmp_path)
    assert save.main([str(archive)]) == 0
    assert sorted(p.name for p in (results / "h200").iterdir()) == [
        "2026-12-03-decode_step-llama-3.1-8b-L4096.png", "2026-12-03-decode_step.json",
        "2026-12-03-summary.txt", "2026-12-03-tree_verify.json"]
    # Copied unchanged.
    assert json.loads((results / "h200" / "2026-12-03-tree_verify.json").read_text())["benchmarks"] == []
    assert save.main([str(archive)]) == 0  # the same day again: -2, nothing overwritten
    assert len(list((results / "h200").glob("2026-12-03-2-*"))) == 4
    assert len(list((results / "h200").iterdir())) == 8


def test_refuses_a_folder_without_benchmark_json(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "steps.tsv").write_text("step\trc\tseconds\tlog\n")
    (out / "summary.txt").write_text("== gpu_check summary: 2026-12-03T10:00:00Z\n")
    monkeypatch.setattr(save, "RESULTS", tmp_path / "results")
    with pytest.raises(SystemExit, match="no benchmark JSON"):
        save.main([str(out), "--gpu", "h200"])
    assert not (tmp_path / "results").exists()


def test_device_name_falls_back_to_nvidia_smi(tmp_path):
    (tmp_path / "nvidia-smi.txt").write_text(
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A |\n"
        "|   0  NVIDIA H200                    On  |   00000000:1B:00.0 Off |\n")
    assert save.gpu_slug(save.device_name(tmp_path)) == "h200"
    assert save.run_date(tmp_path) is None  # no summary.txt
