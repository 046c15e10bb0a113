"""SGLang integration: the `specfused` attention backend, loaded as an SGLang plugin.

    plugin.py   entry point of the ``sglang.srt.plugins`` group (`register`), no SGLang import
                at module level, a no-op without SGLang
    backend.py  SpecFusedAttnBackend (imports SGLang 0.5.23)
    masks.py    SGLang verify masks -> tree_verify_attention's 64-bit ancestor words
    hooks.py    optional, off by default: TP allreduce + residual + RMSNorm on
                spec_kernels.comm.FusedAllReduce (SPEC_KERNELS_SGLANG_FUSED_ALLREDUCE)

See docs/sglang.md for the launch command and what is supported.
"""
from .plugin import BACKEND_NAME, register

__all__ = ["BACKEND_NAME", "register"]
