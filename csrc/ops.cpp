// The one registration file for the C++ ops: torch.ops.spec_kernels_cuda.*
//
// These are the raw CUDA implementations. The public ops (torch.ops.spec_kernels.*, with fake
// implementations and the cuda -> triton -> reference dispatch) live in Python and call these.
// Every input is checked here with TORCH_CHECK, so a direct call cannot crash on bad metadata.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "spec_kernels/launchers.h"

namespace {

void check_cuda_vector(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.dim() == 1, name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

void tree_mask_from_parents(const at::Tensor& parents, const at::Tensor& qo_indptr,
                            at::Tensor& tree_mask) {
  check_cuda_vector(parents, "parents", at::kLong);
  check_cuda_vector(qo_indptr, "qo_indptr", at::kInt);
  check_cuda_vector(tree_mask, "tree_mask", at::kLong);
  TORCH_CHECK(qo_indptr.numel() >= 1, "qo_indptr must have B+1 >= 1 entries");
  TORCH_CHECK(tree_mask.numel() == parents.numel(), "tree_mask must have ", parents.numel(),
              " entries (one per draft token), got ", tree_mask.numel());
  TORCH_CHECK(parents.device() == qo_indptr.device() && parents.device() == tree_mask.device(),
              "parents, qo_indptr and tree_mask must be on one device");
  const c10::cuda::CUDAGuard guard(parents.device());
  check_launch(spec_kernels::launch_tree_mask_from_parents(
                   parents.data_ptr<int64_t>(), qo_indptr.data_ptr<int32_t>(),
                   tree_mask.data_ptr<int64_t>(), static_cast<int>(qo_indptr.numel() - 1),
                   c10::cuda::getCurrentCUDAStream(parents.get_device()).stream()),
               "tree_mask_from_parents");
}

std::vector<int64_t> compiled_archs() {
  int archs[16];
  const int n = spec_kernels::compiled_cuda_archs(archs, 16);
  return std::vector<int64_t>(archs, archs + n);
}

int64_t compiled_cuda_version() { return spec_kernels::compiled_cuda_runtime_version(); }

}  // namespace

TORCH_LIBRARY(spec_kernels_cuda, m) {
  m.def("compiled_archs() -> int[]", &compiled_archs);
  m.def("compiled_cuda_version() -> int", &compiled_cuda_version);
  m.def("tree_mask_from_parents(Tensor parents, Tensor qo_indptr, Tensor(a!) tree_mask) -> ()");
  m.impl("tree_mask_from_parents", c10::DispatchKey::CUDA, &tree_mask_from_parents);
}

// `import spec_kernels._C` loads the library above; the module itself is empty.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
