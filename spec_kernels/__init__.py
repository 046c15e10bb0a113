"""spec-kernels: kernels that make the verify step of speculative decoding cheap.

Every op is a torch custom op (torch.ops.spec_kernels.*) with CUDA, Triton and PyTorch
reference implementations picked by device (see spec_kernels._ops); `python -m spec_kernels.info`
shows what this machine will run.
"""
from ._checks import set_debug_checks
from .tree_verify import TreeVerifyPlan, decode_attention, tree_mask_from_parents, tree_verify_attention
from .kv_slots import alloc_draft_slots, commit_draft_slots
from .mla import mla_decode_attention, mla_tree_verify_attention
from .norm import fused_add_rmsnorm
from ._ops import triton_interpreting
from ._triton_compat import fix_interpreter_scalar_index

if triton_interpreting():  # before any interpreted kernel runs (the interpreter patches per call)
    fix_interpreter_scalar_index()

__version__ = "0.1.0"

__all__ = [
    "tree_verify_attention",
    "decode_attention",
    "TreeVerifyPlan",
    "tree_mask_from_parents",
    "set_debug_checks",
    "alloc_draft_slots",
    "commit_draft_slots",
    "fused_add_rmsnorm",
    "mla_tree_verify_attention",
    "mla_decode_attention",
]
