"""Tree-verify attention: api.py (custom ops, checks), reference.py (PyTorch oracle),
triton_kernel.py (Triton kernel and its resource model), cuda.py (binding of csrc/tree_verify/ and
its resource model), plan.py (plan once per batch, run per layer). What it shares with MLA (planning, Triton helpers, checks) is in
spec_kernels.attention."""
from .api import decode_attention, tree_mask_from_parents, tree_verify_attention
from .plan import TreeVerifyPlan

__all__ = ["tree_verify_attention", "decode_attention", "tree_mask_from_parents", "TreeVerifyPlan"]
