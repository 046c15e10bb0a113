"""Optional dependencies of the command-line tools around the kernels (the kernels need torch and
triton only): `import_extra` imports one or names the extra that installs it."""
from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtraError(ImportError):
    """An optional dependency is missing; the message names the pip extra that installs it."""


def import_extra(module: str, extra: str, needed_for: str) -> ModuleType:
    """`importlib.import_module(module)`, or MissingExtraError naming `extra` and what needs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(f"{needed_for} needs {module.split('.')[0]}, which is not installed: "
                                f"pip install 'spec-kernels[{extra}]'") from exc
