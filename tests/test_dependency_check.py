"""tools/dependency_check.py: the consistency check .ci/run runs after installing.

The case that motivated it: anyio 4.16 (pinned for SGLang, installed with --no-deps) needs
typing_extensions >= 4.16, and a machine image that ships 4.15 kept it: `import anyio` then failed
at test collection. The check must catch exactly that, from real .dist-info metadata on disk.
"""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import dependency_check as dc  # noqa: E402

ANYIO_REQUIRES = ['idna>=2.8', 'typing_extensions>=4.16.0; python_version < "3.15"',
                  'trio>=0.32.0; extra == "trio"']


def _site(tmp_path, dists):
    """A site-packages folder holding only .dist-info metadata for `dists` (name, version, requires)."""
    site = tmp_path / "site"
    for name, version, requires in dists:
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        lines += [f"Requires-Dist: {r}" for r in requires]
        (info / "METADATA").write_text("\n".join(lines) + "\n")
    return site


def _run(site, *extra):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "dependency_check.py"), "--path", str(site), *extra],
                          capture_output=True, text=True, timeout=60)


def test_fails_on_anyio_416_with_typing_extensions_415(tmp_path):
    site = _site(tmp_path, [("anyio", "4.16.0", ANYIO_REQUIRES), ("idna", "3.20", []),
                            ("typing_extensions", "4.15.0", [])])
    proc = _run(site)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "anyio 4.16.0 requires typing_extensions>=4.16.0" in proc.stdout
    assert "typing_extensions 4.15.0 is installed" in proc.stdout
    assert "trio" not in proc.stdout  # behind an extra that nobody asked for


def test_passes_once_the_pin_is_right(tmp_path):
    site = _site(tmp_path, [("anyio", "4.16.0", ANYIO_REQUIRES), ("idna", "3.20", []),
                            ("typing_extensions", "4.16.0", [])])
    proc = _run(site)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "consistent" in proc.stdout


def test_missing_requirement_fails_unless_allowed_and_conflicts_never_are(tmp_path):
    dists = [dc.Dist("sglang", "0.5.23", ("flashinfer-python==0.7.2", "python-dateutil<3")),
             dc.Dist("python-dateutil", "4.0.0")]
    found = dc.problems(dists)
    assert any("flashinfer-python" in p and "not installed" in p for p in found)
    assert any("python-dateutil<3" in p and "4.0.0 is installed" in p for p in found)

    allow = tmp_path / "allow.txt"
    allow.write_text("# reasons\nsglang: flashinfer_python  # GPU only\nsglang: python-dateutil\n")
    allowed = dc.read_allow_list(allow)
    found = dc.problems(dists, allowed)
    assert found == ["sglang 0.5.23 requires python-dateutil<3, but python-dateutil 4.0.0 is installed"]


def test_allow_list_lines_are_checked(tmp_path):
    allow = tmp_path / "allow.txt"
    allow.write_text("sglang flashinfer-python\n")
    with pytest.raises(ValueError, match="allow.txt:1"):
        dc.read_allow_list(allow)


def test_project_allow_list_parses_and_names_only_sglang():
    allowed = dc.read_allow_list(dc.DEFAULT_ALLOW)
    assert allowed and {owner for owner, _ in allowed} == {"sglang"}
