"""Every PTX instruction form the kernels compile to is one the interpreter supports.

The PTX is produced as a GPU build would produce it (tools/ptx_harness/build.py): every csrc .cu with
nvcc -ptx and the extension's flags for sm_120a and sm_90a, and every Triton config the
launchers can pick (tools/triton_compile_report.py's default case list) for sm_120. The forms
are counted by ptxsim.census and checked against ptxsim.isa.unsupported. A new
nvcc, Triton or kernel edit that emits a form the interpreter does not model fails here, naming
the form, the reason and the PTX module and line where it occurs.

Compiles are cached in tools.ptx_harness.build.cache_dir() (keyed by sources, flags and compiler versions), so
only the first run after an edit pays for them.
"""
import collections
import json
import os
import re

import pytest

from ptxsim.census import Source, unsupported_report
from ptxsim.isa import unsupported

from tools.ptx_harness import build, census

needs_nvcc = pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not found (set CUDA_HOME): the CUDA "
                                "PTX cannot be produced")

def _pinned_torch() -> str:
    """The torch version the build pins (pyproject.toml's build-system requires)."""
    import tomllib
    with open(os.path.join(build.REPO, "pyproject.toml"), "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    return next(r.split("==")[1] for r in requires if r.startswith("torch=="))


def test_torch_flag_fallback_matches_torch():
    """The fixed flag list used without torch equals what the pinned torch's BuildExtension passes
    nvcc (another torch may differ: 2.11 passes -std=c++17)."""
    cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
    import torch
    if torch.__version__.split("+")[0] != _pinned_torch():
        pytest.skip(f"the fallback mirrors the pinned torch {_pinned_torch()}; this is torch {torch.__version__}")
    common, std, origin = build.torch_nvcc_flags()
    assert "fixed list" not in origin, origin
    assert common == list(cpp_extension.COMMON_NVCC_FLAGS)
    assert common == build.FALLBACK_TORCH_NVCC_FLAGS
    assert std == build.FALLBACK_STD
    flags = build.nvcc_flags("sm_120a")
    for f in ("-O3", "-lineinfo", "--expt-relaxed-constexpr", "-arch=sm_120a", "-ptx", std,
              f"-I{build.INCLUDE}", *common):
        assert f in flags, f


def _private_cache(monkeypatch, path):
    """This test's own cache folder: PTXSIM_CACHE_DIR counts only without SPEC_KERNELS_CACHE_DIR
    (build.cache_dir), which CI and the cold/warm measurements set."""
    monkeypatch.delenv("SPEC_KERNELS_CACHE_DIR", raising=False)
    monkeypatch.setenv("PTXSIM_CACHE_DIR", str(path))
    assert build.cache_dir() == str(path)


@needs_nvcc
def test_patched_source_is_recompiled_then_cached(tmp_path, monkeypatch):
    _private_cache(monkeypatch, tmp_path)  # a warm shared cache already holds "edit 1"
    name = "csrc/tree_verify/tree_mask.cu"
    with open(os.path.join(build.REPO, name)) as f:
        text = f.read()
    first = build.cuda_ptx_from_source_info(text + "\n// edit 1\n", "sm_120a", name)
    again = build.cuda_ptx_from_source_info(text + "\n// edit 1\n", "sm_120a", name)
    other = build.cuda_ptx_from_source_info(text + "\n// edit 2\n", "sm_120a", name)
    assert (first.cached, again.cached, other.cached) == (False, True, False)
    assert first.ptx == again.ptx and first.key == again.key != other.key
    assert ".entry" in first.ptx and Source("", "", "", first.ptx).forms
    with pytest.raises(RuntimeError, match="nvcc failed"):
        build.cuda_ptx_from_source(text + "\nthis does not compile;\n", "sm_120a", name)


@needs_nvcc
def test_header_edit_is_recompiled(tmp_path, monkeypatch):
    """The cache key covers csrc/include: editing a header recompiles the .cu files using it."""
    import shutil

    csrc = tmp_path / "csrc"
    shutil.copytree(os.path.join(build.REPO, "csrc"), csrc)
    monkeypatch.setattr(build, "CSRC", str(csrc))
    monkeypatch.setattr(build, "INCLUDE", str(csrc / "include"))
    _private_cache(monkeypatch, tmp_path / "cache")
    cu = str(csrc / "tree_verify" / "tree_mask.cu")
    first = build.cuda_ptx_info(cu, "sm_120a")
    assert build.cuda_ptx_info(cu, "sm_120a").cached
    header = csrc / "include" / "spec_kernels" / "kv_index.cuh"
    header.write_text(header.read_text() + "\n// edited\n")
    edited = build.cuda_ptx_info(cu, "sm_120a")
    assert not first.cached and not edited.cached and edited.key != first.key
    assert f"-I{csrc / 'include'}" in edited.flags


def _check(sources):
    bad = unsupported_report(sources, unsupported)
    assert not bad, (f"{len(bad)} PTX instruction forms the interpreter does not support:\n  "
                     + "\n  ".join(bad))


@needs_nvcc
@pytest.mark.parametrize("arch", build.CUDA_ARCHS)
def test_cuda_ptx_forms_are_supported(arch):
    sources = census.cuda_sources((arch,))
    with_code = {s.where for s in sources if s.forms}
    # every kernel file produced code (build_info.cu has no device code)
    expected = {os.path.basename(p) for p in build.cu_sources()} - {"build_info.cu"}
    assert with_code == expected, sorted(with_code ^ expected)
    total = collections.Counter()
    for s in sources:
        total.update(s.forms)
    assert total["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"] > 0
    assert any(f.startswith("cp.async.cg.shared.global") for f in total)
    _check(sources)


@needs_nvcc
def test_triton_ptx_forms_are_supported():
    results = build.triton_ptx_all("default", 120)
    kernels = {job.kernel for job, _ in results}
    assert kernels == {"_tree_verify_fwd_kernel", "merge_splits_kernel", "_mla_fwd_kernel",
                       "_fused_add_rmsnorm_kernel", "_alloc_kernel", "_commit_kernel"}, kernels
    for job, res in results:
        # the launch metadata the interpreter needs: the PTX parameter list ends with Triton's two
        # scratch pointers, and every other parameter is named after a kernel argument
        header = res.ptx[res.ptx.index(".entry"):res.ptx.index("{", res.ptx.index(".entry"))]
        params = re.findall(r"(\w+_param_\d+)\s*[,)]", header)
        assert [p for p, _, _ in res.params] == params, job.describe()
        assert [a for _, _, a in res.params][-2:] == ["global_scratch", "profile_scratch"], job.describe()
        assert res.num_warps in (1, 2, 4, 8, 16) and res.shared >= 0, job.describe()
    sources = [Source("triton sm_120", job.kernel, job.describe(), res.ptx) for job, res in results]
    _check(sources)


def test_cache_dir_is_outside_the_checkout_and_overridable(tmp_path, monkeypatch):
    for var in ("SPEC_KERNELS_CACHE_DIR", "PTXSIM_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.cache_dir() == str(tmp_path / "xdg" / "spec-kernels" / "ptxsim")
    monkeypatch.setenv("PTXSIM_CACHE_DIR", str(tmp_path / "old"))
    assert build.cache_dir() == str(tmp_path / "old")
    monkeypatch.setenv("SPEC_KERNELS_CACHE_DIR", str(tmp_path / "sk"))
    assert build.cache_dir() == str(tmp_path / "sk" / "ptxsim")


@needs_nvcc
def test_two_clones_share_one_cache_entry(tmp_path):
    """A clone at another path reads the entry the first clone compiled, with its own paths in the
    PTX's .file lines; an edit in one clone is a miss."""
    import shutil
    import subprocess
    import sys

    clones = [tmp_path / "a" / "spec-kernels", tmp_path / "b" / "elsewhere"]
    for c in clones:
        c.mkdir(parents=True)
        shutil.copy(os.path.join(build.REPO, "setup.py"), c)
        for d in ("csrc", "tools"):
            shutil.copytree(os.path.join(build.REPO, d), c / d, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "SPEC_KERNELS_CACHE_DIR": str(tmp_path / "cache")}
    probe = ("import json; from tools.ptx_harness.build import cuda_ptx_info as f; r = f('csrc/tree_verify/tree_mask.cu'); "
             "print(json.dumps([r.cached, r.key, [l for l in r.ptx.splitlines() if l.strip().startswith('.file')]]))")

    def run(clone):
        done = subprocess.run([sys.executable, "-c", probe], cwd=clone, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run(clones[0]), run(clones[1])
    assert (first[0], second[0]) == (False, True) and first[1] == second[1]
    assert any(str(clones[0]) in line for line in first[2])
    assert second[2] and all(str(clones[0]) not in line for line in second[2])
    assert any(str(clones[1]) in line for line in second[2])
    cu = clones[1] / "csrc" / "tree_verify" / "tree_mask.cu"
    cu.write_text(cu.read_text() + "\n// edited\n")
    edited = run(clones[1])
    assert edited[0] is False and edited[1] != first[1]
