"""fused_add_rmsnorm: the reference against an inline fp64 formula, the Triton kernel (CPU
interpreter here, GPU on a device) and the CUDA kernel (gpu) against the reference, the custom
op layer (fake, compile, opcheck), in-place use, fp8 output, and bad input."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from spec_kernels.norm import fused_add_rmsnorm
from spec_kernels.norm.api import FUSED_ADD_RMSNORM

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Outputs are rounded once from fp32; implementations may differ by one rounding step.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=1e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=8e-3)}
FP8_TOL = dict(atol=2e-3, rtol=0.0625)  # one e4m3 step (3 mantissa bits), after dequantising


def naive(x, residual, weight, eps):
    h = x.double() + residual.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double(), h


def make(tokens, hidden, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(tokens, hidden, generator=g) * s for s in (1.0, 3.0))
    w = 1.0 + 0.1 * torch.randn(hidden, generator=g)
    return x.to(device, dtype), r.to(device, dtype), w.to(device, dtype)


def check_against_reference(impl, tokens, hidden, dtype, device="cpu", out_scale=None):
    x, r, w = make(tokens, hidden, dtype, device)
    want_out, want_res = fused_add_rmsnorm(x, r, w, 1e-6, impl="reference", out_scale=out_scale)
    out, res = fused_add_rmsnorm(x, r, w, 1e-6, impl=impl, out_scale=out_scale)
    torch.testing.assert_close(res, want_res, atol=0, rtol=0)  # one fp32 add, one rounding
    if out_scale is None:
        torch.testing.assert_close(out, want_out, **TOL[dtype])
    else:
        assert out.dtype == torch.float8_e4m3fn
        torch.testing.assert_close(out.float() * out_scale, want_out.float() * out_scale, **FP8_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_fp64_formula(dtype):
    x, r, w = make(6, 257, dtype)
    out, res = fused_add_rmsnorm(x, r, w, 1e-5, impl="reference")
    want_out, want_res = naive(x, r, w, 1e-5)
    torch.testing.assert_close(res, want_res.to(dtype), atol=0, rtol=0)
    torch.testing.assert_close(out.double(), want_out.to(dtype).double(), **TOL[dtype])
    assert out.dtype == res.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(5, 123), (1, 4096), (3, 7168), (2, 16384), (4, 1), (0, 64)])
def test_triton_matches_reference(tokens, hidden, dtype):
    check_against_reference("triton", tokens, hidden, dtype)


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_output(impl, dtype):
    check_against_reference(impl, 5, 123, dtype, out_scale=0.005)  # 0.005: some values saturate
    x, r, w = make(5, 123, dtype)
    out, _ = fused_add_rmsnorm(x, r, w, out_scale=0.005, impl=impl)
    assert out.float().abs().max() == 448.0


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_in_place(impl):
    x, r, w = make(5, 123, torch.bfloat16)
    want_out, want_res = fused_add_rmsnorm(x, r, w, impl="reference")
    out, res = fused_add_rmsnorm(x, r, w, impl=impl, out=x, residual_out=r)
    assert out is x and res is r
    torch.testing.assert_close(r, want_res, atol=0, rtol=0)
    torch.testing.assert_close(x, want_out, **TOL[torch.bfloat16])


def test_zero_rows_and_eps():
    x, r, w = make(3, 16, torch.float32)
    zeros = torch.zeros_like(x)
    out, res = fused_add_rmsnorm(zeros, zeros, w, eps=0.0, impl="reference")
    assert torch.isnan(out).all()  # 0 * rsqrt(0): eps = 0 is the caller's choice
    out, _ = fused_add_rmsnorm(zeros, zeros, w, eps=1e-6, impl="triton")
    assert (out == 0).all()


def test_dispatch_on_cpu():
    cpu = torch.device("cpu")
    assert FUSED_ADD_RMSNORM.select(cpu)[0] == "triton"  # interpreter (tests/conftest.py)
    x, r, w = make(2, 8, torch.float32)
    with pytest.raises(RuntimeError, match="fused_add_rmsnorm: impl='cuda' is not available: .*needs CUDA tensors"):
        fused_add_rmsnorm(x, r, w, impl="cuda")


def test_fake_meta_compile_opcheck():
    x, r, w = make(5, 123, torch.bfloat16)
    with FakeTensorMode() as mode:
        out, res = fused_add_rmsnorm(*(mode.from_tensor(t) for t in (x, r, w)), out_scale=0.5)
    assert out.shape == (5, 123) and out.dtype == torch.float8_e4m3fn and res.dtype == torch.bfloat16
    out, res = fused_add_rmsnorm(x.to("meta"), r.to("meta"), w.to("meta"))
    assert out.device.type == "meta" and res.shape == (5, 123)

    def layer(x, r, w):
        out, res = fused_add_rmsnorm(x * 2, r, w, impl="reference")
        return out + 1, res

    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, r, w)
    for a, b in zip(got, layer(x, r, w)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.library.opcheck(torch.ops.spec_kernels.fused_add_rmsnorm.default,
                          (x, r, w, 1e-6, torch.empty_like(x), torch.empty_like(x), None, "reference"))


def _bad_cases():
    f32 = torch.float32
    x, r, w = make(5, 123, f32)
    buf = torch.randn(5 * 123 + 1)
    return [
        (dict(x=x.numpy()), TypeError, "x must be a torch.Tensor"),
        (dict(x=x.to(torch.int32)), ValueError, "x must have dtype float16, bfloat16, float32"),
        (dict(x=x[0]), ValueError, r"x must be 2-D, got shape \(123,\)"),
        (dict(x=x.t().contiguous().t()), ValueError, "x must be contiguous"),
        (dict(residual=r.half()), ValueError, "residual must have dtype float32"),
        (dict(residual=r[:4]), ValueError, r"residual must have shape \(5, 123\)"),
        (dict(residual=r.to("meta")), ValueError, "residual must be on cpu"),
        (dict(weight=w[:100]), ValueError, r"weight must have shape \(123,\)"),
        (dict(weight=w.half()), ValueError, "weight must have dtype float32"),
        (dict(x=torch.zeros(2, 16385), residual=torch.zeros(2, 16385), weight=torch.zeros(16385)),
         ValueError, "1 <= hidden <= 16384"),
        (dict(eps=float("nan")), ValueError, "eps must be a finite number >= 0"),
        (dict(eps=-1e-6), ValueError, "eps must be a finite number >= 0"),
        (dict(out_scale=0.0), ValueError, "out_scale must be a finite number > 0"),
        (dict(out=torch.empty(5, 123, dtype=torch.half)), ValueError, "out must have dtype float32"),
        (dict(out=torch.empty(5, 123), out_scale=1.0), ValueError, "out must have dtype float8_e4m3fn"),
        (dict(out=torch.empty(5, 122)), ValueError, r"out must have shape \(5, 123\)"),
        (dict(residual_out=torch.empty(5, 123, dtype=torch.bfloat16)), ValueError,
         "residual_out must have dtype float32"),
        (dict(residual=buf[:615].view(5, 123), out=buf[1:].view(5, 123)), ValueError, "out partly overlaps residual"),
        (dict(out=buf[:615].view(5, 123), residual_out=buf[:615].view(5, 123)), ValueError,
         "residual_out must not overlap out"),
        (dict(out=w.view(1, 123).expand(5, 123)), ValueError, "out must be contiguous"),
    ], (x, r, w)


@pytest.mark.parametrize("i", range(len(_bad_cases()[0])))
def test_bad_input(i):
    cases, (x, r, w) = _bad_cases()
    over, exc, match = cases[i]
    args = dict(x=x, residual=r, weight=w)
    args.update({k: over.pop(k) for k in list(over) if k in args})
    with pytest.raises(exc, match=match):
        fused_add_rmsnorm(**args, impl="reference", **over)


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(5, 123), (1, 4096), (7, 7168), (3, 16384), (300, 1024), (2, 8)])
def test_gpu_matches_reference(impl, tokens, hidden, dtype):
    check_against_reference(impl, tokens, hidden, dtype, device="cuda")
    check_against_reference(impl, tokens, hidden, dtype, device="cuda", out_scale=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cuda", "triton"])
def test_gpu_misaligned_views_and_in_place(impl):
    # Rows offset by one element: not 16-byte aligned, the CUDA kernel takes its scalar path.
    x, r, w = make(6, 4097, torch.bfloat16, "cuda")
    xv, rv = x.view(-1)[1:4097 * 5 + 1].view(5, 4097), r.view(-1)[1:4097 * 5 + 1].view(5, 4097)
    want = fused_add_rmsnorm(xv, rv, w, impl="reference")
    out, res = fused_add_rmsnorm(xv, rv, w, impl=impl, out=xv, residual_out=rv)
    torch.testing.assert_close(res, want[1], atol=0, rtol=0)
    torch.testing.assert_close(out, want[0], **TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    x, r, w = make(4, 7168, torch.bfloat16, "cuda")
    out, res = torch.empty_like(x), torch.empty_like(x)
    fused_add_rmsnorm(x, r, w, out=out, residual_out=res)  # warm up (Triton compiles here)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_add_rmsnorm(x, r, w, out=out, residual_out=res)
    x.mul_(2)
    graph.replay()
    want = fused_add_rmsnorm(x, r, w, impl="reference")
    torch.testing.assert_close(res, want[1], atol=0, rtol=0)
    torch.testing.assert_close(out, want[0], **TOL[torch.bfloat16])
