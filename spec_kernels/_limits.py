"""Limits every op family shares; the kernels' C++ has the same values (tests/test_limits.py)."""

MAX_DRAFT_TOKENS = 64  # draft tokens per request: one 64-bit ancestor mask word (kMaxDraftTokens)
