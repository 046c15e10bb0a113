// Device helpers for tensor-core kernels in the mma.sync + cp.async style, which runs on both
// sm_90 (H100/H200) and sm_120 (RTX PRO 6000 Blackwell: no wgmma, no tcgen05).
//
// Fragment layouts of mma.m16n8k16 (PTX ISA), lane = 4 * g + t (g = lane / 4, t = lane % 4):
//   A 16x16 row-major, 4 regs of 2 halves: a0 (row g, cols 2t..2t+1), a1 (row g+8, same cols),
//                                          a2 (row g, cols 8+2t..), a3 (row g+8, cols 8+2t..)
//   B 16x8  "col":     2 regs:             b0 (k 2t..2t+1, col g), b1 (k 8+2t.., col g)
//   C 16x8  fp32:      4 floats:           c0,c1 (row g, cols 2t, 2t+1), c2,c3 (row g+8, same cols)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace spec_kernels {

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// The asm wrappers that touch shared memory carry a "memory" clobber: the compiler may then not
// move a plain C++ access across them (e.g. a read of cp.async data above the wait that retires
// it); tests/test_asm_clobbers.py keeps it so.
// 16-byte global -> shared copy through L2 only. When !valid nothing is read and the 16 bytes
// are zero-filled (rows past the end of a tile), so callers may pass any mapped address.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// 4- or 8-byte global -> shared copy (through L1: small, e.g. a tile's KV slot ids); zero-fill
// and no read when !valid, as cp_async_16.
template <int kBytes>
__device__ __forceinline__ void cp_async_small(uint32_t dst, const void* src, bool valid) {
  static_assert(kBytes == 4 || kBytes == 8, "cp.async.ca copies 4, 8 or 16 bytes");
  const int src_bytes = valid ? kBytes : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(kBytes), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 b16 matrices; lane i gives the row address of matrix i / 8, row i % 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
// Same, transposed: lane receives elements (rows 2t, 2t+1; col g) of each matrix.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// d += a * b with fp32 accumulation; T selects the f16 or bf16 instruction.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats -> one register of two T (round to nearest), low half = a.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

// float -> T, explicitly: torch builds with __CUDA_NO_HALF_CONVERSIONS__ (no implicit casts).
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Two fp8 values (element 0 in the low byte) -> one register of two T (element 0 in the low half).
// Exact: every float8_e4m3fn and float8_e5m2 value is a half and a bfloat16, NaN stays NaN, an
// e5m2 infinity stays infinite. e5m2: float8_e5m2, else float8_e4m3fn. cvt from fp8 needs sm_89+.
template <typename T>
__device__ __forceinline__ uint32_t fp8x2_to(uint16_t bits, bool e5m2) {
  uint32_t h2;
  if (e5m2) {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(h2) : "h"(bits));
  } else {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"(bits));
  }
  if constexpr (std::is_same_v<T, __half>) {
    return h2;
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
    return pack2<T>(f.x, f.y);
  }
}

// A per-lane constant the tile loop reads: the opaque move keeps ptxas from recomputing it from the
// thread id in every iteration.
__device__ __forceinline__ uint32_t pinned(uint32_t x) {
  asm volatile("mov.b32 %0, %0;" : "+r"(x));
  return x;
}
template <typename T>
__device__ __forceinline__ const T* pinned(const T* x) {
  asm volatile("mov.b64 %0, %0;" : "+l"(x));
  return x;
}

// 2^x in one MUFU.EX2 (exp2f adds a range fix-up for results below 2^-126: here such weights and
// rescale factors are negligible against the row's largest weight, >= 1). ex2(-inf) = 0, NaN stays NaN.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Offset (in elements) of 16-byte chunk `chunk` of row `row` in a [rows][kChunks * 8] tile whose
// chunks are XOR-swizzled by row: the 8 rows read by one ldmatrix hit 8 different bank groups.
template <int kChunks>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  static_assert(kChunks >= 8 && kChunks % 8 == 0, "rows need at least 8 chunks of 16 bytes");
  return row * kChunks * 8 + ((chunk ^ (row & 7)) << 3);
}

}  // namespace spec_kernels
