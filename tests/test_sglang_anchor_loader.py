"""benchmarks/_sglang_kernels.py: SGLang's Triton extend attention from staged sources, with none of
SGLang's server dependencies (how the GPU machine, which has no SGLang, gets the tree-verify anchor)."""
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="SGLang is not installed here: nothing to stage the anchor from")

SCRIPT = textwrap.dedent("""
    import builtins, os, sys
    os.environ.setdefault("TRITON_INTERPRET", "1")
    real_import = builtins.__import__
    def guarded(name, *args, **kwargs):  # the server stack must stay untouched
        if name.split(".")[0] in ("orjson", "pydantic", "zmq", "transformers", "fastapi", "uvicorn"):
            raise ImportError("the staged anchor imported " + name)
        return real_import(name, *args, **kwargs)
    builtins.__import__ = guarded
    import torch
    import _sglang_kernels
    import spec_kernels
    sys.path.insert(0, os.path.join(os.environ["ROOT"], "tests"))
    from spec_kernels.testing import make_case

    assert _sglang_kernels.unavailable_reason() is None, _sglang_kernels.unavailable_reason()
    fwd = _sglang_kernels.extend_attention_fwd()
    assert sys.modules["sglang"].__path__ == [os.path.join(os.environ["SPEC_KERNELS_SGLANG_SRC"], "sglang")]
    ns, prefixes = [3, 5], [7, 0]
    case = make_case(ns, prefixes, hq=4, hkv=2, d=64, seed=3)
    want = spec_kernels.tree_verify_attention(*case.args, impl="reference")
    # SGLang's layout: prefix through indices, the drafts' K/V contiguous, an n x (L + n) bool mask each.
    prefix_idx, draft_idx, mask, at = [], [], [], 0
    for n, L in zip(ns, prefixes):
        slots = case.kv_indices[at:at + L + n].long()
        prefix_idx.append(slots[:L]); draft_idx.append(slots[L:]); at += L + n
    q0 = 0
    for n, L in zip(ns, prefixes):
        bits = case.tree_mask[q0:q0 + n]; q0 += n
        drafts = ((bits.view(n, 1) >> torch.arange(n)) & 1).bool()
        mask.append(torch.cat([torch.ones(n, L, dtype=torch.bool), drafts], 1).flatten())
    draft_idx = torch.cat(draft_idx)
    out = torch.empty_like(want)
    qo = torch.tensor([0, 3, 8], dtype=torch.int32)
    fwd(case.q, case.k_cache[draft_idx], case.v_cache[draft_idx], out, case.k_cache, case.v_cache, qo,
        torch.tensor([0, 7, 7], dtype=torch.int32), torch.cat(prefix_idx), torch.cat(mask), True,
        torch.tensor([0, 30, 55]), 5, 1.0, 1.0, sm_scale=64 ** -0.5)
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
    print("ok")
""")


def test_staged_sources_load_without_sglang_dependencies_and_match_the_reference(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _sglang_kernels
    finally:
        sys.path.pop(0)
    staged = _sglang_kernels.stage(tmp_path / "src")
    assert sorted(p.relative_to(tmp_path / "src").as_posix() for p in staged) == sorted(_sglang_kernels.SOURCES)
    env = {**os.environ, "ROOT": str(ROOT), "SPEC_KERNELS_SGLANG_SRC": str(tmp_path / "src"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]
