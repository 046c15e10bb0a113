// The host half of a kernel launch, as a value: what a configuration needs of the device. The
// attention families' *_config.h compute it from their compiled-instance lists.
#pragma once

namespace spec_kernels {

struct LaunchShape {
  int head_dim;         // the head dim the configuration is compiled for
  int block_m;          // query rows per CTA; 0: no compiled configuration
  int threads;          // per CTA
  int smem_bytes;       // dynamic shared memory per CTA
  int regs;             // registers per thread (ptxas; the larger of the compiled archs)
  int min_ctas_per_sm;  // __launch_bounds__' second argument (0: none given)
  int kv_fp8;           // 1: the instance for fp8 KV caches
  int block_n;          // keys per KV tile: tells apart configurations of equal block_m
  int warp_rows;        // query rows of a warp's unit of work (so does this)
};

}  // namespace spec_kernels
