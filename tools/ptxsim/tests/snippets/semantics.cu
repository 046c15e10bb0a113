// Small kernels that pin the interpreter's instruction semantics and its error reports
// (tests/ptx/test_ptxsim_semantics.py). Compiled with the extension's flags for sm_120a.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

extern "C" __global__ void shfl_modes(const int* in, int* out) {
  const int v = in[threadIdx.x];
  const int lane = threadIdx.x % 32;
  int* o = out + (threadIdx.x / 32) * 32 * 5 + lane;
  o[0] = __shfl_sync(0xffffffffu, v, (lane * 7 + 3) % 32);
  o[32] = __shfl_up_sync(0xffffffffu, v, 3);
  o[64] = __shfl_down_sync(0xffffffffu, v, 5);
  o[96] = __shfl_xor_sync(0xffffffffu, v, 9);
  o[128] = __shfl_sync(0xffffffffu, v, lane ^ 1, 8);  // width 8 segments
}

extern "C" __global__ void convert(const float* x, uint16_t* bf, uint16_t* hf, float* back, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const __nv_bfloat16 b = __float2bfloat16_rn(x[i]);
  const __half h = __float2half_rn(x[i]);
  bf[i] = __bfloat16_as_ushort(b);
  hf[i] = __half_as_ushort(h);
  back[i] = __bfloat162float(b) + __half2float(h);
}

extern "C" __global__ void int_ops(const uint32_t* a, const uint32_t* b, uint32_t* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const uint32_t x = a[i], y = b[i];
  uint32_t* o = out + i * 8;
  o[0] = __byte_perm(x, y, y & 0xffff);
  o[1] = __funnelshift_l(x, y, y);
  o[2] = __umulhi(x, y);
  o[3] = static_cast<uint32_t>(static_cast<int32_t>(x) >> (y & 31));
  o[4] = __popc(x) + __clz(y | 1);
  o[5] = (y & 0xff) ? x / (y & 0xff) : 0u;
  o[6] = static_cast<uint32_t>(static_cast<int32_t>(x) % (static_cast<int32_t>(y & 0xff) | 1));
  o[7] = __brev(x) ^ (x << (y & 7));
}

extern "C" __global__ void float_cmp(const float* a, const float* b, int* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = a[i], y = b[i];
  out[i] = (x < y) | ((x <= y) << 1) | ((x != y) << 2) | ((!(x >= y)) << 3) | ((fminf(x, y) == x) << 4) |
           ((x == y) << 5);
}

// Divergence inside warps and between warps, a data-dependent loop, then reconvergence at a
// warp-wide reduction.
extern "C" __global__ void diverge(const int* in, int* out) {
  int v = in[blockIdx.x * blockDim.x + threadIdx.x];
  if (threadIdx.x % 3 == 0) {
    v = v * 2 + 1;
  } else if (threadIdx.x < 40) {
    for (int k = 0; k < (v & 7); ++k) v += k;
  } else {
    v = -v;
  }
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

// A block-wide sum through shared memory; `skip_sync` drops the barrier (a race).
extern "C" __global__ void block_sum(const float* in, float* out, int skip_sync) {
  __shared__ float s[256];
  s[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
  if (!skip_sync) __syncthreads();
  if (threadIdx.x == 0) {
    float acc = 0.f;
    for (int i = 0; i < blockDim.x; ++i) acc += s[i];
    out[blockIdx.x] = acc;
  }
}

// Lanes of one warp exchange through shared memory; `skip_syncwarp` drops __syncwarp (a race that
// lock-step execution alone would hide).
extern "C" __global__ void warp_exchange(int* out, int skip_syncwarp) {
  __shared__ int s[32];
  s[threadIdx.x] = threadIdx.x * 3;
  if (!skip_syncwarp) __syncwarp();
  out[threadIdx.x] = s[(threadIdx.x + 1) % 32];
}

// A collective inside a divergent branch: undefined behaviour, reported.
extern "C" __global__ void diverged_shfl(int* out) {
  int v = threadIdx.x;
  if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

// Out of bounds by one element.
extern "C" __global__ void oob(const float* in, float* out, int n) {
  out[threadIdx.x] = in[threadIdx.x + n];
}

// CTA 0 waits for a flag that CTA 1 sets after a long computation (a cross-CTA hand-off).
extern "C" __global__ void handoff(volatile int* flag, int* out, int spins) {
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      while (atomicAdd((int*)flag, 0) == 0) __nanosleep(100);
      out[0] = *flag + 1;
    }
  } else if (threadIdx.x == 0) {
    int x = 0;
    for (int i = 0; i < spins; ++i) x += i;
    out[1] = x;
    __threadfence();
    atomicExch((int*)flag, 41);
  }
}

// Lanes 0-1 of two one-warp CTAs wait for flags[2 * cta + lane]. All are set from the start but
// CTA 1's lane 1's, which CTA 0's lane 1 sets after its wait: at the first poll CTA 0's warp
// leaves the loop whole while CTA 1's warp diverges inside it; CTA 0 must go on meanwhile.
extern "C" __global__ void uneven_wait(volatile int* flags, int* out) {
  if (threadIdx.x < 2) {
    const int me = 2 * blockIdx.x + threadIdx.x;
    while (flags[me] == 0) {
    }
    out[me] = 1;
    if (me == 1) flags[3] = 1;
  }
}

// Half of the CTA waits at a barrier, the other half for a flag that the first half sets only
// after the barrier: nothing can progress.
extern "C" __global__ void bad_barrier(volatile int* flag) {
  if (threadIdx.x < 64) {
    __syncthreads();
    *flag = 1;
  } else {
    while (*flag == 0) {
    }
  }
}

// A flag nobody sets: livelock.
extern "C" __global__ void spin_forever(volatile int* flag) {
  while (*flag == 0) {
  }
}

extern "C" __global__ void bfi_op(const uint32_t* a, const uint32_t* b, const uint32_t* pos_len, uint32_t* out) {
  const int i = threadIdx.x;
  uint32_t r;
  asm("bfi.b32 %0, %1, %2, %3, %4;" : "=r"(r) : "r"(a[i]), "r"(b[i]), "r"(pos_len[i] & 0xff), "r"(pos_len[i] >> 8));
  out[i] = r;
}

// Two fp8 bytes -> two halves (cvt.rn.f16x2.{e4m3x2,e5m2x2}), for every 16-bit input.
extern "C" __global__ void fp8x2_to_half2(uint32_t* e4m3_out, uint32_t* e5m2_out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 65536) return;
  const uint16_t bits = static_cast<uint16_t>(i);
  uint32_t a, b;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(a) : "h"(bits));
  asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(b) : "h"(bits));
  e4m3_out[i] = a;
  e5m2_out[i] = b;
}

// Programmatic dependent launch: a producer grid and a consumer that reads the producer's output
// before and after griddepcontrol.wait.
extern "C" __global__ void pdl_producer(int* buf, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (i < n) buf[i] = i + 1;
}

extern "C" __global__ void pdl_consumer(const int* buf, int* before, int* after, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) before[i] = *(volatile const int*)(buf + i);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (i < n) after[i] = *(volatile const int*)(buf + i);
}
