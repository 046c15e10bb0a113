"""Draft-token KV slot allocation and commit: api.py (custom ops, checks), reference.py (the
model and PyTorch oracle), triton_kernel.py (Triton kernels); the CUDA kernels are in csrc/kv_slots/."""
from .api import alloc_draft_slots, commit_draft_slots, page_state_from_free_stack
from .reference import PAGE_FREE, PAGE_SHARED, page_owner

__all__ = ["alloc_draft_slots", "commit_draft_slots", "page_state_from_free_stack", "page_owner", "PAGE_FREE",
           "PAGE_SHARED"]
