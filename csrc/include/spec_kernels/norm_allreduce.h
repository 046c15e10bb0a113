// Host-side entry points of the fused residual add + RMSNorm kernel (csrc/norm/) and of the
// PCIe allreduce kernels with that epilogue fused (csrc/allreduce/). Plain C++ and CUDA runtime
// types only; the bindings (csrc/norm/, csrc/allreduce/) check tensors and call these. Every launcher returns the launch's
// cudaError_t instead of throwing.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace spec_kernels {

// Element type of x / residual / weight / residual_out (out is this type, or fp8 e4m3).
enum class NormDType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

constexpr int kMaxNormHidden = 16384;  // one row is one thread block

// residual_out = x + residual; out = residual_out * rsqrt(mean(residual_out^2) + eps) * weight,
// fp32 math. All tensors are row-major [rows, hidden] (weight [hidden]); out may be x and
// residual_out may be residual (in place). fp8_out: out is __nv_fp8_e4m3 holding
// normed * inv_scale, saturated. 16-byte vector loads when every pointer and the row pitch
// allow, else a scalar path.
cudaError_t launch_fused_add_rmsnorm(const void* x, const void* residual, const void* weight,
                                     void* out, void* residual_out, int64_t rows, int hidden,
                                     NormDType dtype, bool fp8_out, float eps, float inv_scale,
                                     cudaStream_t stream);


// ------------------------------------------------------------------------------------------------
// Allreduce over CUDA IPC buffers with the epilogue above fused (csrc/allreduce/).
//
// Every rank owns one buffer of allreduce_buffer_bytes(), exported with CUDA IPC and mapped by
// every other rank (ipc_* below). A call sums x over the ranks in rank order in fp32, rounds the
// sum to x's dtype once (every rank gets the same bits), then either stores it (fused = false) or
// applies residual add + RMSNorm. Waits spin on flags in the buffers; each gives up after
// timeout_ns and reports into *error (host-mapped memory) instead of hanging. A call that fails
// or is refused (a failure before it, a mismatch) writes NaN into every row of out and
// residual_out its blocks own, so a graph replay that nobody checks computes on NaN, not on
// stale data. Progress counters live in the buffers, so a call captured in a CUDA graph replays
// correctly.
namespace allreduce {

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 64;  // the message header has 6 bits for the grid size
constexpr int kMaxMessageBytes = 268435456;  // 2^28: every message (and max_bytes) is below it

// kOneShotPush1Block: the push protocol in one thread block (one handshake per peer instead of
// one per block and peer): the small-message path (one token of decode).
enum Algorithm : int { kOneShotPush = 0, kOneShotPull = 1, kTwoShot = 2, kOneShotPush1Block = 3 };
// kBlocksMismatch: the launch's grid is not the one the buffers were created for (num_blocks of
// init_buffer; 1 for kOneShotPush1Block).
enum ErrorCode : int { kOk = 0, kTimeout = 1, kSizeMismatch = 2, kBlocksMismatch = 3 };

// What every flag word carries besides the call number, so that ranks launching different calls
// refuse instead of exchanging garbage: op (0 all_reduce, 1 + add_rmsnorm, 2 + fp8 out) << 30 |
// algorithm << 28 | (grid blocks - 1) << 22 | rows. hidden and dtype are not in it: every rank
// of a communicator has the same (FusedAllReduce checks them when it is built), so rows decide
// the message's bytes.
constexpr int kHeaderRowBits = 22;
constexpr int64_t kMaxHeaderRows = (int64_t{1} << kHeaderRowBits) - 1;  // rows of one call
constexpr uint32_t message_header(uint32_t op, uint32_t algorithm, uint32_t blocks, uint32_t rows) {
  return op << 30 | algorithm << 28 | (blocks - 1) << kHeaderRowBits | rows;
}

// What a failed call leaves in host-mapped memory (read by the host after the fact).
struct ErrorWord {
  int32_t code;       // ErrorCode; 0 while no call failed
  uint32_t seq;       // the device-side call number (1 = first call through these buffers)
  int32_t rank;       // this rank
  int32_t peer;       // the rank waited for
  int32_t block;      // the thread block that gave up
  int32_t algorithm;  // Algorithm
  uint32_t mine;      // this rank's message header (message_header)
  uint32_t theirs;    // the peer's header (kSizeMismatch); the launch's grid (kBlocksMismatch)
};

struct Call {
  int algorithm;
  int world, rank;
  void* bases[kMaxRanks];  // every rank's buffer, in this process's address space
  int64_t max_bytes;       // capacity of one message (sizes the buffers)
  int64_t push_bytes;      // capacity of one message on the push path
  int num_blocks;          // what init_buffer got (the same on every rank), <= kMaxBlocks
  const void* x;           // [rows, hidden]
  const void* residual;    // fused only
  const void* weight;      // fused only
  void* out;               // [rows, hidden]: x's dtype, or fp8 e4m3 (fp8_out)
  void* residual_out;      // fused only
  int64_t rows;
  int hidden;              // hidden * element size must be a multiple of 16 bytes
  NormDType dtype;         // kFloat16 or kBFloat16
  bool fused, fp8_out;
  float eps, inv_scale;
  uint64_t timeout_ns;
  ErrorWord* error;        // host-mapped (pinned) memory
};

// Bytes of one rank's buffer, and its one-time initialisation (before any peer maps it). The
// buffer keeps num_blocks: every later call must launch that many blocks (per-block call
// counters and push slots are only consistent across ranks and calls with a fixed grid).
size_t buffer_bytes(int world, int64_t max_bytes, int64_t push_bytes);
cudaError_t init_buffer(void* base, int world, int64_t max_bytes, int64_t push_bytes, int num_blocks,
                        cudaStream_t stream);
cudaError_t launch(const Call& call, cudaStream_t stream);

// CUDA IPC: a cudaMalloc'ed buffer (so the handle covers exactly it), its 64-byte handle, and
// mapping a peer's handle into this process (cudaIpcMemLazyEnablePeerAccess).
cudaError_t ipc_alloc(size_t bytes, void** ptr);
cudaError_t ipc_free(void* ptr);
cudaError_t ipc_handle(void* ptr, unsigned char handle[64]);
cudaError_t ipc_open(const unsigned char handle[64], void** ptr);
cudaError_t ipc_close(void* ptr);

}  // namespace allreduce
}  // namespace spec_kernels
