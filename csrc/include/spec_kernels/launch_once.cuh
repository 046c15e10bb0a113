// Host-side launch facts remembered per device, so that a launch does not repeat a CUDA query or
// attribute call (each costs host time on every decode step).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace spec_kernels {

// Devices whose launch facts are remembered; a device past them queries on every launch.
constexpr int kMaxCachedDevices = 64;

// Opts Kernel in to kSmemBytes of dynamic shared memory (needed above 48 KB) once per device: the
// attribute is per device and kernel. cudaFuncSetAttribute is not a stream operation, so this also
// runs during CUDA-graph capture; two threads racing here both set the same value.
template <auto Kernel, int kSmemBytes>
cudaError_t opt_in_dynamic_smem_once(int device) {
  if (kSmemBytes <= 48 * 1024) return cudaSuccess;  // within the default limit
  static std::atomic<bool> done[kMaxCachedDevices];  // static storage: all false at start
  const bool cached = device >= 0 && device < kMaxCachedDevices;
  if (cached && done[device].load(std::memory_order_acquire)) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err == cudaSuccess && cached) done[device].store(true, std::memory_order_release);
  return err;
}

// For tests: launches choose their configuration as if the device had at most this much shared
// memory per SM (0: its own). One GPU then runs the configurations the launch rule gives a GPU
// with less (an H200 those of sm_120). Process-wide; never raises a device's own figure.
inline std::atomic<int>& launch_smem_limit() {
  static std::atomic<int> limit{0};
  return limit;
}

// Whether the attention kernels' split merges are launched as programmatic dependents
// (programmatic_launch.cuh): on unless the environment sets SPEC_KERNELS_PDL=0; the extension's
// op set_programmatic_launch changes it. Process-wide.
inline std::atomic<bool>& programmatic_launch_enabled() {
  static std::atomic<bool> enabled{[] {
    const char* v = std::getenv("SPEC_KERNELS_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }()};
  return enabled;
}

// The shared memory per SM the launch rule sees: the device's, capped by launch_smem_limit().
constexpr int capped_smem_per_sm(int per_sm, int limit) { return limit > 0 && limit < per_sm ? limit : per_sm; }

// The device's shared memory per SM (as the launch rule sees it) and the part of it reserved per
// CTA, asked once per device.
inline cudaError_t device_smem(int device, int& per_sm, int& reserved) {
  const int limit = launch_smem_limit().load(std::memory_order_relaxed);
  static std::atomic<int> known_per_sm[kMaxCachedDevices];  // 0: not yet asked
  static std::atomic<int> known_reserved[kMaxCachedDevices];
  const bool cached = device >= 0 && device < kMaxCachedDevices;
  if (cached && (per_sm = known_per_sm[device].load(std::memory_order_acquire)) != 0) {
    reserved = known_reserved[device].load(std::memory_order_relaxed);
    per_sm = capped_smem_per_sm(per_sm, limit);
    return cudaSuccess;
  }
  cudaError_t err = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device);
  if (err != cudaSuccess) return err;
  if (cached) {
    known_reserved[device].store(reserved, std::memory_order_relaxed);
    known_per_sm[device].store(per_sm, std::memory_order_release);
  }
  per_sm = capped_smem_per_sm(per_sm, limit);
  return cudaSuccess;
}

}  // namespace spec_kernels
