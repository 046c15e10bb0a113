// torch.ops.spec_kernels_cuda.allreduce_* and fused_allreduce: IPC buffers (raw device pointers
// travel as int64) and the call, checked before anything is launched.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstring>
#include <optional>
#include <vector>

#include "../norm/norm_checks.h"
#include "spec_kernels/norm_allreduce.h"

#include "../bindings.h"
#include "../torch_checks.h"

namespace spec_kernels::binding {

namespace ar = spec_kernels::allreduce;

void* as_ptr(int64_t p, const char* name) {
  TORCH_CHECK(p != 0, name, " is a null pointer");
  return reinterpret_cast<void*>(static_cast<intptr_t>(p));
}

void check_buffer_sizes(int64_t world, int64_t max_bytes, int64_t push_bytes) {
  TORCH_CHECK(world == 2 || world == 4 || world == 8, "world must be 2, 4 or 8, got ", world);
  TORCH_CHECK(max_bytes > 0 && max_bytes < ar::kMaxMessageBytes, "max_bytes must be in (0, ", ar::kMaxMessageBytes,
              "), got ", max_bytes);
  TORCH_CHECK(push_bytes > 0 && push_bytes <= max_bytes, "push_bytes must be in (0, max_bytes], got ", push_bytes);
}

int64_t allreduce_buffer_bytes(int64_t world, int64_t max_bytes, int64_t push_bytes) {
  check_buffer_sizes(world, max_bytes, push_bytes);
  return static_cast<int64_t>(ar::buffer_bytes(static_cast<int>(world), max_bytes, push_bytes));
}

int64_t allreduce_ipc_alloc(int64_t bytes, int64_t device) {
  TORCH_CHECK(bytes > 0, "bytes must be > 0, got ", bytes);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* ptr = nullptr;
  check_launch(ar::ipc_alloc(static_cast<size_t>(bytes), &ptr), "allreduce_ipc_alloc");
  return reinterpret_cast<intptr_t>(ptr);
}

void allreduce_ipc_free(int64_t ptr, int64_t device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  check_launch(ar::ipc_free(as_ptr(ptr, "ptr")), "allreduce_ipc_free");
}

at::Tensor allreduce_ipc_handle(int64_t ptr, int64_t device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  at::Tensor handle = at::empty({64}, at::TensorOptions().dtype(at::kByte));
  check_launch(ar::ipc_handle(as_ptr(ptr, "ptr"), handle.data_ptr<uint8_t>()), "allreduce_ipc_handle");
  return handle;
}

int64_t allreduce_ipc_open(const at::Tensor& handle, int64_t device) {
  TORCH_CHECK(handle.device().is_cpu() && handle.scalar_type() == at::kByte && handle.numel() == 64 &&
                  handle.is_contiguous(),
              "handle must be a contiguous CPU uint8 tensor of 64 bytes (from allreduce_ipc_handle)");
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* ptr = nullptr;
  check_launch(ar::ipc_open(handle.data_ptr<uint8_t>(), &ptr), "allreduce_ipc_open");
  return reinterpret_cast<intptr_t>(ptr);
}

void allreduce_ipc_close(int64_t ptr, int64_t device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  check_launch(ar::ipc_close(as_ptr(ptr, "ptr")), "allreduce_ipc_close");
}

void allreduce_init_buffer(int64_t ptr, int64_t world, int64_t max_bytes, int64_t push_bytes, int64_t num_blocks,
                           int64_t device) {
  check_buffer_sizes(world, max_bytes, push_bytes);
  TORCH_CHECK(num_blocks >= 1 && num_blocks <= ar::kMaxBlocks, "num_blocks must be in [1, ", ar::kMaxBlocks,
              "], got ", num_blocks);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  check_launch(ar::init_buffer(as_ptr(ptr, "ptr"), static_cast<int>(world), max_bytes, push_bytes,
                               static_cast<int>(num_blocks),
                               c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream()),
               "allreduce_init_buffer");
}

void fused_allreduce(int64_t algorithm, int64_t rank, at::IntArrayRef bases, int64_t max_bytes,
                     int64_t push_bytes, int64_t num_blocks, const at::Tensor& x,
                     const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& weight,
                     at::Tensor& out, const std::optional<at::Tensor>& residual_out, double eps,
                     std::optional<double> out_scale, int64_t timeout_ns, int64_t error_word) {
  const int64_t world = static_cast<int64_t>(bases.size());
  check_buffer_sizes(world, max_bytes, push_bytes);
  TORCH_CHECK(algorithm >= ar::kOneShotPush && algorithm <= ar::kOneShotPush1Block, "algorithm must be 0 "
              "(one-shot push), 1 (one-shot pull), 2 (two-shot) or 3 (one-shot push, one block), got ", algorithm);
  TORCH_CHECK(rank >= 0 && rank < world, "rank must be in [0, ", world, "), got ", rank);
  TORCH_CHECK(num_blocks >= 1 && num_blocks <= ar::kMaxBlocks, "num_blocks must be in [1, ", ar::kMaxBlocks,
              "], got ", num_blocks);
  TORCH_CHECK(timeout_ns > 0, "timeout_ns must be > 0, got ", timeout_ns);
  check_rows(x);
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "x must be float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) % 8 == 0, "x's hidden size must be a multiple of 8 (16-byte rows), got ", x.size(1));
  TORCH_CHECK(x.size(0) <= ar::kMaxHeaderRows, "x has ", x.size(0), " rows; one call takes at most ",
              ar::kMaxHeaderRows, " (the rows field of the message header)");
  const int64_t bytes = x.numel() * x.element_size();
  TORCH_CHECK(bytes <= max_bytes, "x has ", bytes, " bytes, more than max_bytes=", max_bytes);
  TORCH_CHECK((algorithm != ar::kOneShotPush && algorithm != ar::kOneShotPush1Block) || bytes <= push_bytes, "x has ",
              bytes,
              " bytes, more than the push path's push_bytes=", push_bytes);
  const bool fused = residual.has_value();
  TORCH_CHECK(fused == weight.has_value() && fused == residual_out.has_value(),
              "residual, weight and residual_out must be given together (fused) or not at all");
  TORCH_CHECK(fused || !out_scale.has_value(), "out_scale needs the fused epilogue (residual, weight)");
  if (fused) {
    check_like(*residual, "residual", x, x.scalar_type());
    check_weight(*weight, x);
    check_like(*residual_out, "residual_out", x, x.scalar_type());
    TORCH_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  }
  check_like(out, "out", x, out_scale.has_value() ? at::kFloat8_e4m3fn : x.scalar_type());
  // The kernels move 16-byte vectors (8-byte ones of an fp8 out); launch() refuses misaligned
  // pointers too, but only here can the error name the tensor.
  const auto check_aligned = [](const at::Tensor& t, const char* name, uintptr_t bytes) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0, name, " must be ", bytes,
                "-byte aligned (the kernels move whole vectors); got a view at an odd offset");
  };
  check_aligned(x, "x", 16);
  check_aligned(out, "out", out_scale.has_value() ? 8 : 16);
  if (fused) {
    check_aligned(*residual, "residual", 16);
    check_aligned(*weight, "weight", 16);
    check_aligned(*residual_out, "residual_out", 16);
  }
  ar::Call call{};
  call.algorithm = static_cast<int>(algorithm);
  call.world = static_cast<int>(world);
  call.rank = static_cast<int>(rank);
  for (int64_t r = 0; r < world; ++r) call.bases[r] = as_ptr(bases[r], "bases[r]");
  call.max_bytes = max_bytes;
  call.push_bytes = push_bytes;
  call.num_blocks = static_cast<int>(num_blocks);
  call.x = x.data_ptr();
  call.residual = fused ? residual->data_ptr() : nullptr;
  call.weight = fused ? weight->data_ptr() : nullptr;
  call.out = out.data_ptr();
  call.residual_out = fused ? residual_out->data_ptr() : nullptr;
  call.rows = x.size(0);
  call.hidden = static_cast<int>(x.size(1));
  call.dtype = norm_dtype(x, "x");
  call.fused = fused;
  call.fp8_out = out_scale.has_value();
  call.eps = static_cast<float>(eps);
  call.inv_scale = inv_out_scale(out_scale);
  call.timeout_ns = static_cast<uint64_t>(timeout_ns);
  call.error = static_cast<ar::ErrorWord*>(as_ptr(error_word, "error_word"));
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(ar::launch(call, c10::cuda::getCurrentCUDAStream(x.get_device()).stream()), "fused_allreduce");
}

}  // namespace spec_kernels::binding
