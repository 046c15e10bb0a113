"""Fused residual add + RMSNorm: api.py (custom op, checks), reference.py (PyTorch oracle),
triton_kernel.py (Triton kernel); the CUDA kernel is in csrc/norm/."""
from .api import MAX_HIDDEN, fused_add_rmsnorm

__all__ = ["fused_add_rmsnorm", "MAX_HIDDEN"]
