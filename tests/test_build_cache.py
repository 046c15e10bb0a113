"""spec_kernels/_build_cache.py: the cache root and the content keys the extension build
(setup.py) and the PTX compiles (tools/ptx_harness/build.py) store their artifacts under."""
import shutil

from spec_kernels import _build_cache


def _tree(root):
    (root / "csrc" / "include").mkdir(parents=True)
    (root / "csrc" / "a.cu").write_text("kernel a")
    (root / "csrc" / "include" / "h.cuh").write_text("header")
    (root / "setup.py").write_text("setup")
    return root


def test_same_sources_at_another_path_share_a_key_and_any_edit_changes_it(tmp_path):
    one, two = _tree(tmp_path / "one"), tmp_path / "two"
    shutil.copytree(one, two)
    key = _build_cache.content_key(str(one), ("csrc",), ("setup.py",), "flags")
    assert key == _build_cache.content_key(str(two), ("csrc",), ("setup.py",), "flags")
    assert key != _build_cache.content_key(str(one), ("csrc",), ("setup.py",), "other flags")
    (two / "csrc" / "include" / "h.cuh").write_text("header edited")
    assert key != _build_cache.content_key(str(two), ("csrc",), ("setup.py",), "flags")
    (two / "csrc" / "include" / "h.cuh").write_text("header")
    (two / "csrc" / "include" / "new.inc").write_text("")  # a new, empty file counts too
    assert key != _build_cache.content_key(str(two), ("csrc",), ("setup.py",), "flags")
    (two / "csrc" / "include" / "new.inc").unlink()
    (two / "setup.py").write_text("setup edited")
    assert key != _build_cache.content_key(str(two), ("csrc",), ("setup.py",), "flags")


def test_cache_root_is_overridable_and_outside_the_checkout(monkeypatch, tmp_path):
    monkeypatch.setenv("SPEC_KERNELS_CACHE_DIR", str(tmp_path / "c"))
    assert _build_cache.cache_root() == str(tmp_path / "c")
    monkeypatch.delenv("SPEC_KERNELS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _build_cache.cache_root() == str(tmp_path / "xdg" / "spec-kernels")


def test_write_atomic_leaves_no_temporary_files(tmp_path):
    _build_cache.write_atomic(str(tmp_path / "d" / "f.bin"), b"x")
    _build_cache.write_atomic(str(tmp_path / "d" / "f.bin"), "y")
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["f.bin"]
    assert (tmp_path / "d" / "f.bin").read_text() == "y"
