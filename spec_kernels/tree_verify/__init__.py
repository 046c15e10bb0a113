"""Tree-verify attention: api.py (custom ops, checks), reference.py (PyTorch oracle),
triton_kernel.py (Triton kernel); the CUDA kernels are in csrc/tree_verify/."""
from .api import decode_attention, tree_mask_from_parents, tree_verify_attention

__all__ = ["tree_verify_attention", "decode_attention", "tree_mask_from_parents"]
