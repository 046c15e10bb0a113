"""The counters a throughput model reads (Stats): L2 sector requests and distinct DRAM sectors,
shared-memory bytes and wavefronts per class, warp-instructions per scheduler, mma forms and
cp.async bytes in flight, on small kernels whose values follow from their access patterns."""
import numpy as np
import pytest

from ptxsim.executor import Machine
from ptxsim.launch import run

SRC = r"""
extern "C" __global__ void strided_load(const float* a, float* out, int stride) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  out[t] = a[t * stride];
}
extern "C" __global__ void load_twice(const float* a, float* out) {
  int t = threadIdx.x;
  float x = a[t];
  __syncwarp();
  out[t] = x + ((volatile const float*)a)[t];
}
extern "C" __global__ void smem_stride(float* out, int stride) {
  __shared__ float s[64 * 33];
  int t = threadIdx.x;
  s[(t * stride) % (64 * 33)] = t;
  __syncthreads();
  out[t] = s[(t * stride) % (64 * 33)];
}
extern "C" __global__ void busy_warp0(float* out, int n) {
  float x = threadIdx.x;
  if (threadIdx.x < 32)
    for (int i = 0; i < n; ++i) x = x * 1.0001f + 1.0f;
  out[threadIdx.x] = x;
}
extern "C" __global__ void fma_chain(const float* a, float* out, int dependent) {
  float x = a[threadIdx.x], y = x, z = x, w = x;
  if (dependent)  // four fma, each reading the last one's result
    asm volatile("fma.rn.f32 %0, %0, %0, %0;\n\tfma.rn.f32 %0, %0, %0, %0;\n\t"
                 "fma.rn.f32 %0, %0, %0, %0;\n\tfma.rn.f32 %0, %0, %0, %0;" : "+f"(x), "+f"(y), "+f"(z), "+f"(w));
  else  // four fma on four registers
    asm volatile("fma.rn.f32 %0, %0, %0, %0;\n\tfma.rn.f32 %1, %1, %1, %1;\n\t"
                 "fma.rn.f32 %2, %2, %2, %2;\n\tfma.rn.f32 %3, %3, %3, %3;" : "+f"(x), "+f"(y), "+f"(z), "+f"(w));
  out[threadIdx.x] = x + y + z + w;
}
extern "C" __global__ void busy_then_barrier(float* out, int n) {
  float x = threadIdx.x;
  if (threadIdx.x < 32)
    for (int i = 0; i < n; ++i) x = x * 1.0001f + 1.0f;
  __syncthreads();
  out[threadIdx.x] = x;
}
extern "C" __global__ void cp_stages(const int4* a, int4* out) {
  __shared__ int4 s[4 * 64];
  int t = threadIdx.x;
  for (int k = 0; k < 4; ++k) {
    unsigned dst = (unsigned)__cvta_generic_to_shared(&s[k * 64 + t]);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(a + k * 64 + t));
  }
  asm volatile("cp.async.commit_group;");
  asm volatile("cp.async.wait_group 0;");
  __syncthreads();
  out[t] = s[t];
}
"""


@pytest.fixture(scope="module")
def ptx(nvcc_ptx):
    return nvcc_ptx(SRC, name="throughput_counters.cu")


@pytest.mark.parametrize("stride, sectors_per_warp", [(1, 4), (2, 8), (8, 32), (64, 32)])
def test_l2_sectors_and_distinct_dram_bytes_follow_the_stride(ptx, stride, sectors_per_warp):
    m = Machine()
    n = 128
    a, o = m.upload(np.arange(n * stride, dtype=np.float32), "a"), m.alloc(4 * n, "out")
    st = run(m, ptx, "strided_load", (1,), (n,), [a, o, stride])
    d = st.as_dict()
    # loads: sectors_per_warp per warp; the store: 4 sectors per warp (128 contiguous bytes)
    assert d["l2_sector_requests"] == 4 * sectors_per_warp + 4 * 4
    assert d["unique_bytes_read_by_buffer"]["a"] == 4 * sectors_per_warp * 32
    assert d["unique_bytes_written_by_buffer"]["out"] == 4 * n
    assert d["bytes_written_by_buffer"]["out"] == 4 * n


def test_a_second_load_of_the_same_bytes_is_an_l2_request_not_dram_traffic(ptx):
    m = Machine()
    a, o = m.upload(np.arange(64, dtype=np.float32), "a"), m.alloc(4 * 64, "out")
    d = run(m, ptx, "load_twice", (1,), (64,), [a, o]).as_dict()
    assert d["l2_sector_requests"] == 2 * (2 * 4) + 2 * 4  # two loads and one store, 2 warps x 4 sectors
    assert d["unique_bytes_read_by_buffer"]["a"] == 256


@pytest.mark.parametrize("stride, wavefronts", [(1, 1), (2, 2), (4, 4), (32, 32), (33, 1)])
def test_shared_wavefronts_count_the_bank_that_serves_most_words(ptx, stride, wavefronts):
    m = Machine()
    o = m.alloc(4 * 64, "out")
    d = run(m, ptx, "smem_stride", (1,), (64,), [o, stride]).as_dict()
    # one store and one load per warp, two warps
    assert d["shared_wavefronts"] == {"st.shared": 2 * wavefronts, "ld.shared": 2 * wavefronts}
    assert d["shared_bytes"] == {"st.shared": 256, "ld.shared": 256}


def test_issue_per_scheduler_sees_the_busy_warp(ptx):
    m = Machine()
    o = m.alloc(4 * 128, "out")
    st = run(m, ptx, "busy_warp0", (2,), (128,), [o, 200])
    sched = st.issue_per_scheduler()
    assert sched.shape == (2, 4)
    assert (sched[:, 0] > sched[:, 1] + 100).all() and (sched[:, 1:] == sched[:, 1:2]).all()
    assert st.as_dict()["issue_per_scheduler_max"] == sched.max()
    assert sched.sum() == sum(st.warp_instr.values())


def test_cp_async_bytes_in_flight(ptx):
    m = Machine()
    a, o = m.upload(np.arange(4 * 64 * 4, dtype=np.int32), "a"), m.alloc(16 * 64, "out")
    d = run(m, ptx, "cp_stages", (2,), (64,), [a, o]).as_dict()
    assert d["cp_async_bytes_in_flight_max"] == 4 * 64 * 16  # one CTA's four stages, before its wait
    assert d["shared_bytes"]["cp.async"] == 2 * 4 * 64 * 16
    assert d["shared_wavefronts"]["cp.async"] == 2 * 4 * 2 * 4  # CTAs x copies x warps x 512 B / 128 B


def test_warp_latency_clock_without_latencies_is_not_kept(ptx):
    m = Machine()
    o = m.alloc(4 * 128, "out")
    assert run(m, ptx, "busy_warp0", (1,), (128,), [o, 10]).as_dict()["warp_latency_cycles_max"] == 0


def test_warp_latency_clock_follows_dependences(ptx):
    """Four dependent fma wait the latency L between each two, four independent ones start
    together: the chain's critical path is longer by 3 L, less at most the L of the copies that
    make the independent operands (the sums after both are a chain of three adds either way)."""
    L = 10

    def cycles(dependent):
        m = Machine(latencies={"other": L, "ld.global": 1, "st.global": 1, "branch": 1})
        a, o = m.upload(np.ones(32, np.float32), "a"), m.alloc(4 * 32, "out")
        return int(run(m, ptx, "fma_chain", (1,), (32,), [a, o, dependent]).warp_cycles[0])

    dep, ind = cycles(1), cycles(0)
    assert 2 * L <= dep - ind <= 3 * L, (dep, ind)
    assert dep >= 7 * L  # four fma and three adds in one chain


def test_warp_latency_clock_in_program_order(ptx):
    """Issued in PTX order, every instruction also waits for the one before it: at latency 1 the
    clock is the warp's instruction count, and it is never below the dataflow clock."""
    m = Machine(latencies={"other": 1, "ld.global": 1, "st.global": 1, "branch": 1, "barrier": 1})
    o = m.alloc(4 * 128, "out")
    st = run(m, ptx, "busy_warp0", (1,), (128,), [o, 50])
    assert (st.warp_cycles_in_order == st.per_warp).all()
    m = Machine(latencies={"other": 4})
    o = m.alloc(4 * 128, "out")
    st = run(m, ptx, "busy_then_barrier", (1,), (128,), [o, 50])
    assert (st.warp_cycles_in_order >= st.warp_cycles).all() and st.warp_cycles_in_order.max() > st.warp_cycles.max()
    assert st.as_dict()["warp_latency_cycles_in_order_max"] == st.warp_cycles_in_order.max()


def test_a_barrier_aligns_the_warps_clocks(ptx):
    m = Machine(latencies={"other": 4})
    o = m.alloc(4 * 128, "out")
    st = run(m, ptx, "busy_then_barrier", (2,), (128,), [o, 100])
    wc = st.warp_cycles.reshape(2, 4)
    # warp 0's loop (a dependent chain: >= 4 cycles per iteration) holds every warp at the
    # barrier; after it the warps run the same few instructions
    assert (wc.min(axis=1) > 4 * 100).all() and (wc.max(axis=1) - wc.min(axis=1) < 20).all()
    m = Machine(latencies={"other": 4})
    o = m.alloc(4 * 128, "out")
    alone = run(m, ptx, "busy_warp0", (1,), (128,), [o, 100]).warp_cycles
    assert alone[0] > 4 * 100 > 20 > alone[1:].max()  # without the barrier the others finish at once
