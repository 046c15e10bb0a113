"""The interpreter's instruction semantics and error reports, on small kernels compiled by nvcc
(snippets/semantics.cu) and checked against NumPy / torch computations of the same
definitions (PTX ISA)."""
import os

import numpy as np
import pytest
import torch

from ptxsim.executor import Deadlock, Machine
from ptxsim.launch import run
from ptxsim.memory import Hazard, SimError

SNIPPETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "snippets", "semantics.cu")


@pytest.fixture(scope="module")
def ptx(nvcc_ptx):
    with open(SNIPPETS, encoding="utf-8") as f:
        return nvcc_ptx(f.read(), name="semantics.cu")


def test_shfl_modes(ptx):
    rng = np.random.default_rng(0)
    x = rng.integers(-1000, 1000, 64).astype(np.int32)
    m = Machine()
    a, o = m.upload(x), m.alloc(64 * 5 * 4)
    run(m, ptx, "shfl_modes", (1,), (64,), [a, o])
    got = m.download(o, np.int32, (2, 5, 32))
    for w in range(2):
        v = x[w * 32:(w + 1) * 32]
        lane = np.arange(32)
        np.testing.assert_array_equal(got[w, 0], v[(lane * 7 + 3) % 32])
        np.testing.assert_array_equal(got[w, 1], np.where(lane >= 3, v[np.maximum(lane - 3, 0)], v))
        np.testing.assert_array_equal(got[w, 2], np.where(lane + 5 <= 31, v[np.minimum(lane + 5, 31)], v))
        np.testing.assert_array_equal(got[w, 3], v[lane ^ 9])
        np.testing.assert_array_equal(got[w, 4], v[(lane & ~7) | ((lane ^ 1) & 7)])


def test_float_to_half_conversions_round_to_nearest_even(ptx):
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(200).astype(np.float32) * 10 ** rng.uniform(-6, 6, 200),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 1e-8, 3.0e38,
                                  1.00390625, 1.01171875], np.float32)]).astype(np.float32)
    n = x.size
    m = Machine()
    xa, bf, hf, back = m.upload(x), m.alloc(2 * n), m.alloc(2 * n), m.alloc(4 * n)
    run(m, ptx, "convert", (-(-n // 128),), (128,), [xa, bf, hf, back, n])
    t = torch.from_numpy(x)
    want_bf = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    want_hf = t.to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    got_bf = m.download(bf, np.uint16, (n,))
    finite = np.isfinite(x)
    np.testing.assert_array_equal(got_bf[finite], want_bf[finite])
    assert np.isnan(torch.from_numpy(got_bf.view(np.int16)).view(torch.bfloat16).float().numpy()[~np.isfinite(x) & np.isnan(x)]).all()
    np.testing.assert_array_equal(m.download(hf, np.uint16, (n,))[finite], want_hf[finite])
    want_back = t.to(torch.bfloat16).float() + t.to(torch.float16).float()
    np.testing.assert_array_equal(m.download(back, np.float32, (n,))[finite], want_back.numpy()[finite])


def _brev(x):
    return np.array([int(f"{int(v):032b}"[::-1], 2) for v in x], np.uint32)


def test_integer_ops(ptx):
    rng = np.random.default_rng(2)
    n = 96
    a = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    a[:4] = [0, 0xFFFFFFFF, 0x80000000, 7]
    m = Machine()
    pa, pb, po = m.upload(a), m.upload(b), m.alloc(n * 32)
    run(m, ptx, "int_ops", (1,), (n,), [pa, pb, po, n])
    got = m.download(po, np.uint32, (n, 8))
    for i in range(n):
        x, y = int(a[i]), int(b[i])
        sel = y & 0xFFFF
        bytes_ = (x | (y << 32)).to_bytes(8, "little")
        perm = 0
        for k in range(4):
            s = (sel >> (4 * k)) & 7   # __byte_perm uses the low 3 bits of each selector
            perm |= bytes_[s] << (8 * k)
        sh = y & 31
        funnel = ((((y << 32) | x) << sh) >> 32) & 0xFFFFFFFF
        sx = x - (1 << 32) if x >> 31 else x
        clz = 32 - (y | 1).bit_length()
        ydiv = y & 0xFF
        md = (y & 0xFF) | 1
        rem = int(np.fmod(sx, md))
        want = [perm, funnel, (x * y) >> 32, (sx >> (y & 31)) & 0xFFFFFFFF, bin(x).count("1") + clz,
                x // ydiv if ydiv else 0, rem & 0xFFFFFFFF,
                int(_brev([x])[0]) ^ ((x << (y & 7)) & 0xFFFFFFFF)]
        assert [int(v) for v in got[i]] == want, (i, hex(x), hex(y))


def test_float_compare_nan_rules(ptx):
    vals = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan], np.float32)
    a = np.repeat(vals, vals.size)
    b = np.tile(vals, vals.size)
    n = a.size
    m = Machine()
    pa, pb, po = m.upload(a), m.upload(b), m.alloc(4 * n)
    run(m, ptx, "float_cmp", (1,), (64,) if n <= 64 else (n,), [pa, pb, po, n])
    got = m.download(po, np.int32, (n,))
    with np.errstate(invalid="ignore"):
        want = ((a < b) | ((a <= b) << 1) | ((a != b) << 2) | ((~(a >= b)) << 3) |
                ((np.fmin(a, b) == a) << 4) | ((a == b) << 5)).astype(np.int32)
    np.testing.assert_array_equal(got, want)


def test_divergence_and_reconvergence(ptx):
    rng = np.random.default_rng(3)
    x = rng.integers(-50, 50, 3 * 96).astype(np.int32)
    m = Machine()
    pi, po = m.upload(x), m.alloc(x.nbytes)
    run(m, ptx, "diverge", (3,), (96,), [pi, po])
    want = np.empty_like(x)
    for blk in range(3):
        v = x[blk * 96:(blk + 1) * 96].astype(np.int64)
        t = np.arange(96)
        w = v.copy()
        for i in range(96):
            if t[i] % 3 == 0:
                w[i] = v[i] * 2 + 1
            elif t[i] < 40:
                k = 0
                while k < (int(w[i]) & 7):    # the bound is re-read after each update, as in C
                    w[i] += k
                    k += 1
            else:
                w[i] = -v[i]
        for o in (16, 8, 4, 2, 1):
            w = w + w.reshape(3, 32)[:, np.arange(32) ^ o].reshape(-1)
        want[blk * 96:(blk + 1) * 96] = w.astype(np.int32)
    np.testing.assert_array_equal(m.download(po, np.int32, x.shape), want)


def test_block_sum_and_missing_barrier_is_a_race(ptx):
    x = np.arange(2 * 256, dtype=np.float32)
    m = Machine()
    pi, po = m.upload(x), m.alloc(8)
    run(m, ptx, "block_sum", (2,), (256,), [pi, po, 0])
    np.testing.assert_array_equal(m.download(po, np.float32, (2,)), x.reshape(2, 256).sum(1))
    with pytest.raises(Hazard, match="race"):
        run(Machine(), ptx, "block_sum", (2,), (256,), [Machine().upload(x) * 0 + pi, po, 1]) if False else \
            _race_run(ptx)


def _race_run(ptx):
    m = Machine()
    x = np.arange(256, dtype=np.float32)
    run(m, ptx, "block_sum", (1,), (256,), [m.upload(x), m.alloc(4), 1])


def test_missing_syncwarp_is_a_race(ptx):
    m = Machine()
    o = m.alloc(128)
    run(m, ptx, "warp_exchange", (1,), (32,), [o, 0])
    np.testing.assert_array_equal(m.download(o, np.int32, (32,)), ((np.arange(32) + 1) % 32) * 3)
    with pytest.raises(Hazard, match="__syncwarp"):
        run(m, ptx, "warp_exchange", (1,), (32,), [o, 1])


def test_diverged_collective_is_an_error(ptx):
    m = Machine()
    with pytest.raises(SimError, match="diverged warp"):
        run(m, ptx, "diverged_shfl", (1,), (32,), [m.alloc(128)])


def test_out_of_bounds_names_the_buffer_and_source_line(ptx):
    m = Machine()
    src = m.upload(np.zeros(32, np.float32), "src")
    with pytest.raises(SimError, match=r"out of bounds(.|\n)*semantics\.cu:\d+"):
        run(m, ptx, "oob", (1,), (32,), [src, m.alloc(128), 1])


def test_cross_cta_handoff_makes_progress(ptx):
    m = Machine()
    flag, out = m.upload(np.zeros(1, np.int32)), m.alloc(8)
    run(m, ptx, "handoff", (2,), (32,), [flag, out, 500])
    np.testing.assert_array_equal(m.download(out, np.int32, (2,)), [42, sum(range(500))])


def test_a_warp_leaving_a_loop_does_not_wait_for_another_warp_diverging_in_it(ptx):
    """Both CTAs run in one group; at one branch CTA 0's warp goes one way whole and CTA 1's warp
    splits. CTA 0 must not wait at the reconvergence point for CTA 1's spinning lane (a SIMT
    stack shared by the two warps would livelock here: CTA 1's flag is set only by CTA 0)."""
    m = Machine(spin_limit=20_000)
    flags, out = m.upload(np.array([1, 1, 1, 0], np.int32)), m.upload(np.zeros(4, np.int32))
    run(m, ptx, "uneven_wait", (2,), (32,), [flags, out])
    np.testing.assert_array_equal(m.download(out, np.int32, (4,)), [1, 1, 1, 1])


def test_deadlock_reports_every_waiting_group(ptx):
    m = Machine(spin_limit=20_000)
    with pytest.raises(Deadlock) as info:
        run(m, ptx, "bad_barrier", (1,), (128,), [m.upload(np.zeros(1, np.int32))])
    msg = str(info.value)
    assert "(64 threads, bar)" in msg and "(64 threads, run)" in msg, msg
    assert msg.count("semantics.cu:") >= 2, msg


def test_livelock_is_reported_with_the_spinning_line(ptx):
    m = Machine(spin_limit=20_000)
    with pytest.raises(Deadlock, match=r"livelock(.|\n)*semantics\.cu:\d+"):
        run(m, ptx, "spin_forever", (2,), (32,), [m.upload(np.zeros(1, np.int32))])


def test_uninitialised_shared_read_is_reported(nvcc_ptx):
    src = """extern "C" __global__ void k(float* out) { __shared__ float s[64];
             if (threadIdx.x < 32) s[threadIdx.x] = 1.f; __syncthreads(); out[threadIdx.x] = s[threadIdx.x]; }"""
    p = nvcc_ptx(src, name="uninit_shared.cu")
    m = Machine()
    with pytest.raises(SimError, match="nothing wrote"):
        run(m, p, "k", (1,), (64,), [m.alloc(256)])


def test_bfi(ptx):
    rng = np.random.default_rng(4)
    a = rng.integers(0, 2 ** 32, 64, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2 ** 32, 64, dtype=np.uint64).astype(np.uint32)
    pos = rng.integers(0, 40, 64).astype(np.uint32)
    ln = rng.integers(0, 40, 64).astype(np.uint32)
    m = Machine()
    o = m.alloc(256)
    run(m, ptx, "bfi_op", (1,), (64,), [m.upload(a), m.upload(b), m.upload(pos | (ln << 8)), o])
    got = m.download(o, np.uint32, (64,))
    for i in range(64):
        p, l, want = int(pos[i]), int(ln[i]), int(b[i])
        if l and p < 32:
            mask = (((1 << l) - 1) << p) & 0xFFFFFFFF
            want = (want & ~mask & 0xFFFFFFFF) | ((int(a[i]) << p) & mask)
        assert int(got[i]) == want, (i, p, l)


def test_fp8_pairs_convert_to_halves_exactly(ptx):
    """cvt.rn.f16x2.{e4m3x2,e5m2x2} over all 65536 inputs: element 0 from the low byte into the low
    half; every value exact (torch's fp8 -> half conversion), signs and infinities kept, NaN bytes
    give a NaN."""
    m = Machine()
    a, b = m.alloc(4 * 65536), m.alloc(4 * 65536)
    run(m, ptx, "fp8x2_to_half2", (256,), (256,), [a, b])
    pairs = np.arange(65536, dtype=np.uint32)
    for out, dt in ((a, torch.float8_e4m3fn), (b, torch.float8_e5m2)):
        got = m.download(out, np.uint32, (65536,))
        got_halves = np.stack([got & 0xFFFF, got >> 16], 1).astype(np.uint16).view(np.float16)
        fp8 = np.stack([pairs & 0xFF, pairs >> 8], 1).astype(np.uint8)
        want = torch.from_numpy(fp8).view(dt).to(torch.float16).numpy()
        nan = np.isnan(want)
        assert nan.any() and (np.isnan(got_halves) == nan).all()
        np.testing.assert_array_equal(got_halves[~nan], want[~nan])
        np.testing.assert_array_equal(np.signbit(got_halves[~nan]), np.signbit(want[~nan]))
        if dt == torch.float8_e5m2:
            assert np.isinf(got_halves).sum() == 2 * 2 * 256


def _pdl_launches(ptx, m, n, after):
    from ptxsim.executor import Launch
    from ptxsim.launch import module_of, pack_params

    mod = module_of(ptx)
    prod, cons = mod.entry("pdl_producer"), mod.entry("pdl_consumer")
    buf, before, after_buf = m.alloc(4 * n), m.alloc(4 * n), m.alloc(4 * n)
    grid = (-(-n // 64),)
    launches = [Launch(prod, grid, (64,), pack_params(prod, [buf, n])),
                Launch(cons, grid, (64,), pack_params(cons, [buf, before, after_buf, n]), after=after)]
    return mod, launches, before, after_buf


def test_griddepcontrol_wait_holds_a_dependent_until_its_prerequisite_exits(ptx):
    """A consumer launched as the producer's programmatic dependent (Launch.after) runs first: its
    read before griddepcontrol.wait sees the buffer as it was (zeros), its read after the wait the
    producer's values."""
    n = 200
    m = Machine()
    mod, launches, before, after = _pdl_launches(ptx, m, n, after=(0,))
    m.run(*launches, module=mod)
    np.testing.assert_array_equal(m.download(before, np.int32, (n,)), np.zeros(n, np.int32))
    np.testing.assert_array_equal(m.download(after, np.int32, (n,)), np.arange(1, n + 1, dtype=np.int32))


def test_griddepcontrol_without_prerequisites_returns_at_once(ptx):
    """Launched one after the other (no Launch.after), the wait does not wait and
    launch_dependents does nothing: both reads see the producer's values."""
    n = 70
    m = Machine()
    mod, launches, before, after = _pdl_launches(ptx, m, n, after=())
    m.run(launches[0], module=mod)
    m.run(launches[1], module=mod)
    want = np.arange(1, n + 1, dtype=np.int32)
    np.testing.assert_array_equal(m.download(before, np.int32, (n,)), want)
    np.testing.assert_array_equal(m.download(after, np.int32, (n,)), want)


def test_launch_after_must_name_another_launch_of_the_run(ptx):
    m = Machine()
    mod, launches, _, _ = _pdl_launches(ptx, m, 8, after=(1,))
    with pytest.raises(SimError, match="after"):
        m.run(*launches, module=mod)
