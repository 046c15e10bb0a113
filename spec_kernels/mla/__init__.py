"""MLA (multi-head latent attention) tree-verify and decode attention for DeepSeek-V3 / Kimi K2.5:
api.py (custom op, checks), reference.py (PyTorch oracle), triton_kernel.py (Triton kernel),
cuda.py (binding of csrc/mla/), plan.py (plan once per batch, run per layer)."""
from .api import mla_decode_attention, mla_tree_verify_attention
from .plan import MlaPlan

__all__ = ["mla_tree_verify_attention", "mla_decode_attention", "MlaPlan"]
