// What this binary was compiled for, read back by `python -m spec_kernels.info` and the tests.
#include "spec_kernels/launchers.h"

namespace spec_kernels {

int compiled_cuda_archs(int* out, int capacity) {
#ifdef __CUDA_ARCH_LIST__
  constexpr int archs[] = {__CUDA_ARCH_LIST__};
  int n = 0;
  for (int a : archs) {
    if (n < capacity) out[n++] = a;
  }
  return n;
#else
  (void)out;
  (void)capacity;
  return 0;
#endif
}

int compiled_cuda_runtime_version() { return CUDART_VERSION; }

}  // namespace spec_kernels
