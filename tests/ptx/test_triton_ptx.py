"""The Triton kernels as Triton 3.x compiles them for sm_120 (GPUTarget("cuda", 120, 32)), run by
the PTX interpreter through the package's own launchers (tools/ptx_harness/triton_glue.py), against the
PyTorch reference.

Covered: tree-verify forward (split-KV partials, no split, decode with the automatic split count,
the fixed tile and autotune configs), the split merge, MLA forward (+ merge), fused add + RMSNorm
(bf16 / fp16 / fp32, fp8 output, odd and size-1 hidden), kv_slots alloc and commit (page size 1,
paged without moves, paged with KV row moves across programs) in lockstep with the reference.

Tolerances. The reference runs in fp32 on the same (upcast) bf16 / fp16 inputs. Under the CPU
Triton interpreter the launchers compute in fp32 (its bf16 arithmetic is wrong); here the
compiled GPU path runs instead: Q.K^T and P.V are bf16 / fp16 mma with fp32 accumulation, P is
rounded to the input type before the P.V mma, exp2 is ex2.approx and the output is rounded once
to the input type. That is <= ~2 ulp of the input type at the output's magnitude (|out| < 4 with
these random inputs): 2e-2 for bf16 (ulp 2^-7 at 2..4), 5e-3 for fp16 (2^-9). lse is fp32 from
fp32 logits (only the inputs' products are rounded, exactly, in the mma): 1e-4. RMSNorm: the sum of
squares is reduced in another order and rsqrt is rsqrt.approx (~1 fp32 ulp), so an output may
round to the neighbouring value of its type: 1 ulp of the output type (bf16 2^-7 relative, fp16
2^-10, fp8 e4m3 2^-3); the residual output h = x + residual is one fp32 add rounded once: exact.
kv_slots is integer logic: every tensor must equal the reference's, byte for byte.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: test_mla, test_kv_slots_invariants
sys.path.insert(0, HERE)

import spec_kernels  # noqa: E402
from spec_kernels.attention.plan import MIN_SPLIT_KEYS  # noqa: E402
from spec_kernels.tree_verify import triton_kernel as tv  # noqa: E402
from spec_kernels.testing import make_case  # noqa: E402

from tools.ptx_harness.triton_glue import TritonPtxRunner  # noqa: E402

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def _f32(args):
    return [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


def _check_attention(out, lse, ref, ref_lse, dtype):
    assert out.dtype == dtype
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- tree verify
@pytest.mark.parametrize("dtype", HALF)
def test_tree_verify_split_kv_and_merge(dtype):
    """Mixed draft counts (one request with none, one with an empty prefix), 2 KV splits:
    the forward writes fp32 partials + lse per split, the merge kernel combines them."""
    case = make_case([3, 0, 6], [37, 20, 0], hq=4, hkv=2, d=64, dtype=dtype, kind="random", seed=1)
    ref, ref_lse = spec_kernels.tree_verify_attention(*_f32(case.args), return_lse=True, impl="reference")
    runner = TritonPtxRunner()
    with runner.active():
        out, lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl="triton", num_kv_splits=2)
    assert [x.kernel for x in runner.launches] == ["_tree_verify_fwd_kernel", "merge_splits_kernel"]
    assert runner.launches[0].grid[1] == 2
    _check_attention(out, lse, ref, ref_lse, dtype)


def test_tree_verify_no_split_head_dim_128_int64_indices():
    """One split (the forward writes out and lse itself), head dim 128, int64 kv_indices, GQA 4."""
    dtype = torch.float16
    case = make_case([5, 2], [30, 9], hq=8, hkv=2, d=128, dtype=dtype, kind="forest", index_dtype=torch.int64,
                     seed=2)
    ref, ref_lse = spec_kernels.tree_verify_attention(*_f32(case.args), return_lse=True, impl="reference")
    runner = TritonPtxRunner()
    with runner.active():
        out, lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl="triton", num_kv_splits=1)
    assert [x.kernel for x in runner.launches] == ["_tree_verify_fwd_kernel"]
    _check_attention(out, lse, ref, ref_lse, dtype)


def test_decode_automatic_splits():
    """Decode (IS_DECODE) with the split count the launch plan picks for a small GPU (8 SMs;
    MIN_CHUNK: >= MIN_SPLIT_KEYS prefix keys per split), prefixes of 0..1100 keys."""
    dtype = torch.bfloat16
    case = make_case([1, 1, 1], [1100, 0, 600], hq=4, hkv=2, d=64, dtype=dtype, seed=3)
    args = (case.q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices)
    ref, ref_lse = spec_kernels.decode_attention(*_f32(args), return_lse=True, impl="reference")
    runner = TritonPtxRunner(sms=8)
    with runner.active():
        out, lse = spec_kernels.decode_attention(*args, return_lse=True, impl="triton")
    fwd = runner.launches[0]
    assert fwd.config["MIN_CHUNK"] == MIN_SPLIT_KEYS and fwd.config["IS_DECODE"]
    splits = fwd.grid[1]
    assert [x.kernel for x in runner.launches] == ["_tree_verify_fwd_kernel"] + ["merge_splits_kernel"] * (splits > 1)
    _check_attention(out, lse, ref, ref_lse, dtype)


@pytest.mark.parametrize("tile", [(32, 4, 2), (64, 8, 3), (128, 8, 2)], ids=lambda t: "N%d-w%d-s%d" % t)
def test_tree_verify_autotune_configs(tile):
    """Configs of the launcher's autotune list (the GPU path with autotuning on), as compiled."""
    dtype = torch.bfloat16
    case = make_case([4, 7], [150, 3], hq=4, hkv=2, d=64, dtype=dtype, kind="chain", seed=4)
    ref, ref_lse = spec_kernels.tree_verify_attention(*_f32(case.args), return_lse=True, impl="reference")

    def choose(kernel, configs):
        match = [c for c in configs if (c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) == tile]
        assert match, f"{tile} not among the launcher's configs after its prune"
        return match[0]

    runner = TritonPtxRunner(config=choose)
    with runner.active():
        out, lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl="triton", num_kv_splits=2)
    fwd = runner.launches[0]
    assert (fwd.config["BLOCK_N"], fwd.block[0] // 32, fwd.config["num_stages"]) == tile
    _check_attention(out, lse, ref, ref_lse, dtype)


def test_tree_verify_head_dim_256_without_lse():
    """Head dim 256 (the launcher's narrower fixed tile: 32 keys, 2 stages, 8 warps) and no lse
    output (WRITE_LSE off), 2 splits + merge."""
    dtype = torch.bfloat16
    case = make_case([2, 3], [20, 45], hq=2, hkv=1, d=256, dtype=dtype, kind="wide", seed=7)
    ref = spec_kernels.tree_verify_attention(*_f32(case.args), impl="reference")
    runner = TritonPtxRunner()
    with runner.active():
        out = spec_kernels.tree_verify_attention(*case.args, impl="triton", num_kv_splits=2)
    fwd = runner.launches[0]
    assert (fwd.config["BLOCK_N"], fwd.config["num_stages"], fwd.block[0]) == (32, 2, 256)
    assert not fwd.config["WRITE_LSE"]
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_tree_verify_fp32_ieee():
    """fp32 inputs: exact fp32 dots (IEEE_DOT, FMA loops instead of mma), 16-key tiles, 8 warps.
    Only the exp2 (ex2.approx, ~2 ulp) and the summation order differ from the reference: 1e-4."""
    case = make_case([4, 1], [33, 0], hq=4, hkv=2, d=64, dtype=torch.float32, seed=8)
    ref, ref_lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl="reference")
    runner = TritonPtxRunner()
    with runner.active():
        out, lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl="triton", num_kv_splits=1)
    assert runner.launches[0].config["IEEE_DOT"] and runner.launches[0].config["BLOCK_N"] == 16
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN / inf through numpy in the interpreter
def test_tree_verify_nan_and_inf_inputs():
    """The non-finite rules in compiled code (max.f32 ignores NaN operands, ex2.approx of -inf):
    a NaN / inf logit a row sees makes its output and lse NaN, a NaN V entry its column, a row
    that sees nothing gets zeros and lse -inf; every other row as the reference (3 splits)."""
    from test_tree_verify import _expected_nonfinite, _nonfinite_case

    dtype = torch.bfloat16
    case = _nonfinite_case(dtype=dtype)
    row_nan, col_nan, seen = _expected_nonfinite(case)
    ref, ref_lse = spec_kernels.tree_verify_attention(*_f32(case.args), return_lse=True, impl="reference")
    runner = TritonPtxRunner()
    with runner.active():
        out, lse = spec_kernels.tree_verify_attention(*case.args, return_lse=True, impl="triton", num_kv_splits=3)
    assert torch.equal(torch.isnan(lse), row_nan)
    assert torch.equal(torch.isnan(out), row_nan[..., None] | col_nan)
    assert torch.all(out[~seen] == 0) and torch.all(lse[~seen] == float("-inf"))
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4, equal_nan=True)


def test_tree_verify_launch_configs_are_the_enumerated_ones():
    """The fixed tile the launcher picks for a GPU (the glue's default) is the one
    tools/triton_compile_report.py lists for that shape class (64 keys, 3 stages, 4 warps at D 64)."""
    assert tv._fixed_tiles(64, False)[0] == (64, 3) and tv._fixed_warps(16, 64, False) == 4


# --------------------------------------------------------------------------- MLA
def _mla_case(ns, prefixes, heads, dtype, dv, dr, seed):
    from test_mla import make_mla_case

    return make_mla_case(ns, prefixes, heads=heads, dv=dv, dr=dr, dtype=dtype, kind="random", seed=seed)


@pytest.mark.parametrize("dtype", HALF)
def test_mla_tree_split_and_merge(dtype):
    """DeepSeek-V3 dims (512 latent + 64 rope), 2 heads, mixed drafts, 2 KV splits + merge."""
    from spec_kernels.mla import mla_tree_verify_attention

    case = _mla_case([2, 3], [17, 0], 2, dtype, 512, 64, seed=5)
    ref, ref_lse = mla_tree_verify_attention(*_f32(case.args), return_lse=True, impl="reference")
    runner = TritonPtxRunner()
    with runner.active():
        out, lse = mla_tree_verify_attention(*case.args, return_lse=True, impl="triton", num_kv_splits=2)
    assert [x.kernel for x in runner.launches] == ["_mla_fwd_kernel", "merge_splits_kernel"]
    _check_attention(out, lse, ref, ref_lse, dtype)


def test_mla_decode_no_split():
    from spec_kernels.mla import mla_decode_attention

    dtype = torch.bfloat16
    case = _mla_case([1, 1], [40, 7], 4, dtype, 512, 64, seed=6)
    ref, ref_lse = mla_decode_attention(*_f32(case.decode_args), return_lse=True, impl="reference")
    runner = TritonPtxRunner()
    with runner.active():
        out, lse = mla_decode_attention(*case.decode_args, return_lse=True, impl="triton", num_kv_splits=1)
    assert [x.kernel for x in runner.launches] == ["_mla_fwd_kernel"]
    _check_attention(out, lse, ref, ref_lse, dtype)


# --------------------------------------------------------------------------- fused add + RMSNorm
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 1e-6, torch.float8_e4m3fn: 2.0 ** -3}


@pytest.mark.parametrize("dtype,hidden,rows,fp8", [
    pytest.param(torch.bfloat16, 1000, 3, False, id="bf16-1000"),
    pytest.param(torch.float16, 4096, 2, False, id="fp16-4096"),
    pytest.param(torch.float32, 1, 3, False, id="fp32-hidden1"),
    pytest.param(torch.bfloat16, 2880, 2, True, id="bf16-2880-fp8"),
])
def test_fused_add_rmsnorm(dtype, hidden, rows, fp8):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    r = torch.randn(rows, hidden, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    scale = 0.05 if fp8 else None
    want, want_res = spec_kernels.fused_add_rmsnorm(x, r, w, 1e-6, impl="reference", out_scale=scale)
    runner = TritonPtxRunner()
    with runner.active():
        out, res = spec_kernels.fused_add_rmsnorm(x, r, w, 1e-6, impl="triton", out_scale=scale)
    assert [k.kernel for k in runner.launches] == ["_fused_add_rmsnorm_kernel"]
    assert runner.launches[0].grid == (rows, 1, 1)
    assert out.dtype == want.dtype and res.dtype == dtype
    torch.testing.assert_close(res, want_res, atol=0, rtol=0)
    ulp = ULP[out.dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=ulp * (1 if not fp8 else 2 ** -6), rtol=ulp)


# --------------------------------------------------------------------------- kv_slots
@pytest.mark.parametrize("page_size,moves", [(1, False), (16, False), (16, True)],
                         ids=["page1", "page16-prefix", "page16-moves"])
def test_kv_slots_alloc_commit_lockstep(page_size, moves):
    """Admit requests, then speculative steps (alloc with mixed draft counts incl. 0 -> write the
    drafts' KV -> commit random root paths) with the reference and the compiled kernels in
    lockstep: after every op every tensor (req_to_token, free stack, page_state, KV buffers) equal."""
    from test_kv_slots_invariants import Draw, Sim, random_path

    runner = TritonPtxRunner()
    sim = Sim([("reference", "cpu"), ("triton", "cpu")], num_pages=64, page_size=page_size, rows=4, max_context=64,
              max_draft=8, draw=Draw(seed=page_size + moves))
    runner.register(*sim.states[1].kv)
    with runner.active():
        assert sim.admit([0, 1, 2], [5, 16, 0])
        for _ in range(2):
            rows = sim.draw.permutation([0, 1, 2])
            counts = [sim.draw.int(0, 8) for _ in rows]
            # Paged without KV buffers, the accepted paths must be prefixes (no row can move).
            paths = [random_path(sim.draw, n) if moves or page_size == 1 else list(range(sim.draw.int(0, n)))
                     for n in counts]
            assert sim.step(rows, counts, paths, kv_buffers=moves, check=False)  # lockstep only
    kernels = [x.kernel for x in runner.launches]
    assert kernels.count("_alloc_kernel") == 2 and kernels.count("_commit_kernel") == 2
    commits = [x for x in runner.launches if x.kernel == "_commit_kernel"]
    assert all(c.config["MOVES"] == moves and c.config["ON_GPU"] for c in commits)
    if moves:
        assert commits[0].grid[0] >= 3  # one program (or more) per request: rows move in parallel


def test_kv_slots_chunked_batch():
    """More requests than one program's chunk (BLOCK_B = 64): 100 requests of a 130-row pool, page
    size 4, prefix commits: the running prefix sums (pages popped, slots written) carry across
    chunks in the compiled loop."""
    from test_kv_slots_invariants import Draw, Sim

    runner = TritonPtxRunner()
    sim = Sim([("reference", "cpu"), ("triton", "cpu")], num_pages=400, page_size=4, rows=130, max_context=24,
              max_draft=8, draw=Draw(seed=11))
    with runner.active():
        assert sim.admit(list(range(130)), [i % 7 for i in range(130)])
        rows = sim.draw.permutation(list(range(130)))[:100]
        counts = [sim.draw.int(0, 8) for _ in rows]
        assert sim.step(rows, counts, [list(range(sim.draw.int(0, n))) for n in counts], kv_buffers=False, check=False)
    assert [x.kernel for x in runner.launches] == ["_alloc_kernel", "_commit_kernel"]
    assert runner.launches[0].config["BLOCK_B"] == 64
