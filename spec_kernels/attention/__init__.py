"""What the attention families (spec_kernels.tree_verify, spec_kernels.mla) share, below both:

* `plan`: device limits, resident CTAs, rows per request and the wave-aware KV-split planner;
* `triton_common`: the Triton helpers of both kernels (mask bits, indptr ranges, the split merge);
* `checks`: the argument checks of the attention ops.
"""
