"""The op layer: custom ops with fake implementations (FakeTensorMode, meta, torch.compile
fullgraph, opcheck), the cuda -> triton -> reference dispatch rule, the build and `info`."""
import shutil
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import spec_kernels
from spec_kernels import _ops
from spec_kernels.testing import make_case


@pytest.fixture
def case():
    return make_case([5, 0, 3], [17, 4, 0], hq=4, hkv=2, seed=0)


def test_fake_tensor_mode_gives_shapes_without_running(case):
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = [mode.from_tensor(t) for t in case.args]
        out, lse = spec_kernels.tree_verify_attention(*fake, return_lse=True)
        q, k_cache, v_cache, kv_indptr, kv_indices = fake[:5]
        dec = spec_kernels.decode_attention(q[:3], k_cache, v_cache, kv_indptr, kv_indices)  # B = 3
        mask = spec_kernels.tree_mask_from_parents(mode.from_tensor(case.parents), fake[5])
    assert out.shape == (8, 4, 64) and out.dtype == torch.float32
    assert lse.shape == (8, 4) and lse.dtype == torch.float32
    assert dec.shape == (3, 4, 64)
    assert mask.shape == (8,) and mask.dtype == torch.int64


def test_meta_tensors(case):
    meta = [t.to("meta") for t in case.args]
    out = spec_kernels.tree_verify_attention(*meta)
    assert out.device.type == "meta" and out.shape == (8, 4, 64)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_torch_compile_fullgraph_matches_eager(case, impl):
    def step(q, k, v, kv_indptr, kv_indices, qo_indptr, parents):
        mask = spec_kernels.tree_mask_from_parents(parents, qo_indptr)
        o, lse = spec_kernels.tree_verify_attention(q, k, v, kv_indptr, kv_indices, qo_indptr, mask,
                                                    return_lse=True, impl=impl)
        return o * 2, lse

    args = (*case.args[:6], case.parents)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got, got_lse = compiled(*args)
    want, want_lse = step(*args)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(got_lse, want_lse, atol=0, rtol=0)


def test_opcheck(case):
    out = torch.empty(8, 4, 64)
    lse = torch.empty(8, 4)
    torch.library.opcheck(torch.ops.spec_kernels.tree_verify_attention.default,
                          (*case.args, 0.125, out, lse, "reference", 0, 0))
    torch.library.opcheck(torch.ops.spec_kernels.tree_verify_attention.default,
                          (*case.args[:5], None, None, 0.125, out[:3].clone(), None, "reference", 0, 1))
    torch.library.opcheck(torch.ops.spec_kernels.tree_mask_from_parents.default,
                          (case.parents, case.qo_indptr, torch.empty(8, dtype=torch.int64), ""))


def test_dispatch_order_and_forcing():
    op = _ops.OpImpls("demo")
    op.register("reference")(lambda: "ref")
    op.register("triton")(lambda: "tri")
    cpu = torch.device("cpu")
    # Under the interpreter (tests/conftest.py) triton runs on CPU and comes before reference.
    assert op.select(cpu)[0] == "triton"
    assert op.select(cpu, "reference")[0] == "reference"
    with pytest.raises(RuntimeError, match="demo: impl='cuda' is not available: demo has no cuda implementation"):
        op.select(cpu, "cuda")
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        _ops.op_impls("tree_mask_from_parents").select(cpu, "cuda")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    op = _ops.op_impls("tree_verify_attention")
    assert op.select(torch.device("cpu"))[0] == "reference"
    with pytest.raises(RuntimeError, match="only under TRITON_INTERPRET=1"):
        op.select(torch.device("cpu"), "triton")


@pytest.mark.skipif(shutil.which("nvcc") is None and not torch.cuda.is_available(),
                    reason="no nvcc here: the package was installed without the CUDA extension")
def test_extension_is_built_for_sm90a_and_sm120a():
    # Where nvcc exists, `pip install -e .` must have built the extension (CI fails otherwise).
    assert _ops.extension_error() is None
    archs = _ops.compiled_archs()
    if torch.cuda.is_available():  # gpu_check.sh builds for the local arch only
        major, minor = torch.cuda.get_device_capability()
        assert archs == (major * 100 + minor * 10,)
    else:
        assert archs == (900, 1200)


def test_info_cli():
    res = subprocess.run([sys.executable, "-m", "spec_kernels.info"], capture_output=True, text=True, check=True)
    for needle in ("torch", "triton", "CUDA extension", "tree_verify_attention", "tree_mask_from_parents"):
        assert needle in res.stdout


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("decode", [False, True])
def test_gpu_cuda_graph_capture_and_replay(decode):
    case = make_case([16, 3, 9], [5000, 70, 0], hq=8, hkv=2, d=128, dtype=torch.bfloat16, seed=1, device="cuda")

    def run():
        if decode:
            q = case.q[:3]
            return spec_kernels.decode_attention(q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices)
        return spec_kernels.tree_verify_attention(*case.args)

    eager = run()  # warm-up: compiles and autotunes outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    case.q.normal_()  # new inputs in the same buffers
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(captured, eager)
    torch.testing.assert_close(captured, run(), atol=0, rtol=0)


@pytest.mark.gpu
def test_gpu_torch_compile_inductor():
    case = make_case([16, 4], [300, 1000], hq=8, hkv=2, d=128, dtype=torch.float16, seed=2, device="cuda")
    fn = torch.compile(lambda *a: spec_kernels.tree_verify_attention(*a) + 1, fullgraph=True)
    torch.testing.assert_close(fn(*case.args), spec_kernels.tree_verify_attention(*case.args) + 1, atol=0, rtol=0)
