"""Work-arounds for known bugs of the Triton releases we support (triton >= 3.6).

Only the interpreter (TRITON_INTERPRET=1, CPU tensors) needs one today; compiled kernels on a GPU
are untouched.
"""
from __future__ import annotations

import functools


def _triton_version() -> tuple[int, int]:
    import triton

    major, minor = (triton.__version__.split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@functools.lru_cache(maxsize=None)
def fix_interpreter_scalar_index() -> bool:
    """Make the Triton 3.6 / 3.7 interpreter accept scalar tensors as Python indices with NumPy >= 2.5.

    The interpreter turns a scalar tensor used as an index (a `range` bound loaded from memory,
    as every kernel here has) into an int with `int(handle.data)`, where `data` is a one-element
    array of ndim 1. NumPy deprecated that conversion in 1.25 and 2.5 removed it ("only
    0-dimensional arrays can be converted to Python scalars"), so with triton 3.6 (the GPU
    machine's version) and NumPy 2.5 every interpreted kernel fails. Triton 3.8 converts
    `data.squeeze()` instead; this wraps the older interpreter's tensor patch to do the same.
    Returns True when the wrapper was installed (idempotent; nothing on triton >= 3.8).
    """
    try:
        if _triton_version() >= (3, 8):
            return False
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None:  # a layout this was not written for: leave it alone
        return False

    @functools.wraps(patch)
    def patch_with_squeezed_index(tensor, scope):
        patch(tensor, scope)
        # scope records the attribute it replaces, so the interpreter's restore still unwinds both.
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_with_squeezed_index
    return True
