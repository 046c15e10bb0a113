"""Where compiled artifacts are kept between builds and clones (standard library only: setup.py
loads this file before the package is installed).

`cache_root()` is `$SPEC_KERNELS_CACHE_DIR`, else `$XDG_CACHE_HOME` (default `~/.cache`) +
`/spec-kernels`: outside the checkout, so every clone on one machine shares it. Everything stored
below it is keyed by a hash of all its inputs, so an entry can be shared but never stale.
"""
from __future__ import annotations

import glob
import hashlib
import os
import tempfile


def cache_root() -> str:
    if os.environ.get("SPEC_KERNELS_CACHE_DIR"):
        return os.environ["SPEC_KERNELS_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "spec-kernels")


def write_atomic(path: str, data: str | bytes) -> None:
    """Write to a temporary file in the same directory, then rename: readers see all or nothing,
    so several processes may fill one cache."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def content_key(root: str, folders: tuple[str, ...], files: tuple[str, ...], *parts: str) -> str:
    """sha256 over every file below `root`/`folders` and the `files` (paths relative to `root`, and
    contents) and the `parts`: the same sources at another path give the same key."""
    paths = [p for folder in folders for p in glob.glob(os.path.join(root, folder, "**", "*"), recursive=True)]
    paths += [os.path.join(root, f) for f in files]
    h = hashlib.sha256()
    for path in sorted(set(paths)):
        if os.path.isfile(path):
            with open(path, "rb") as f:
                h.update(os.path.relpath(path, root).encode() + b"\0" + f.read() + b"\0")
    for part in parts:
        h.update(part.encode() + b"\0")
    return h.hexdigest()
