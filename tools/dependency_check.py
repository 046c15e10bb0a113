"""Check that the installed Python distributions are consistent: every requirement of every
installed distribution is installed, at a version it accepts.

    python tools/dependency_check.py [--allow requirements/allowed-missing.txt]

`pip install --no-deps` (how requirements/sglang-cpu.txt is installed, so that SGLang's CUDA-only
dependencies never replace torch) skips dependency resolution entirely: a pin that is too old for
another pin installs silently and breaks an import later. This check closes that gap. It is
`pip check` with one difference: requirements that are *missing* on purpose (SGLang's GPU-only
and serving-only dependencies) are listed, each with a reason, in the allow-list file. A version
conflict is never allowed.

Exit code 0 when consistent, 1 with one line per problem otherwise.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import sys
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

DEFAULT_ALLOW = Path(__file__).resolve().parents[1] / "requirements" / "allowed-missing.txt"


@dataclass(frozen=True)
class Dist:
    """What the check needs of one installed distribution."""
    name: str
    version: str
    requires: tuple[str, ...] = field(default=())


def installed(path: list[str] | None = None) -> list[Dist]:
    """The distributions found on `path` (default: the running interpreter's sys.path); the
    first one of a name wins, as at import time."""
    dists = {}
    for d in importlib.metadata.distributions(**({} if path is None else {"path": path})):
        name = d.metadata["Name"]
        if name:  # a broken leftover .dist-info has no name
            dists.setdefault(canonicalize_name(name), Dist(name, d.version, tuple(d.requires or ())))
    return list(dists.values())


def read_allow_list(path: Path) -> set[tuple[str, str]]:
    """Lines `distribution: missing-requirement  # reason`; blank lines and comments ignored."""
    allowed = set()
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        owner, sep, missing = line.partition(":")
        if not sep or not owner.strip() or not missing.strip():
            raise ValueError(f"{path}:{lineno}: expected 'distribution: requirement', got {raw!r}")
        allowed.add((canonicalize_name(owner.strip()), canonicalize_name(missing.strip())))
    return allowed


def problems(dists: list[Dist], allowed_missing: set[tuple[str, str]] = frozenset()) -> list[str]:
    """One line per unmet requirement. Requirements behind an extra (`; extra == "x"`) are not
    checked (pip does not record which extras were asked for); environment markers are."""
    versions = {canonicalize_name(d.name): d.version for d in dists}
    found = []
    for d in sorted(dists, key=lambda d: canonicalize_name(d.name)):
        owner = canonicalize_name(d.name)
        for text in d.requires:
            try:
                req = Requirement(text)
            except InvalidRequirement as exc:
                found.append(f"{d.name} {d.version}: unparsable requirement {text!r} ({exc})")
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            name = canonicalize_name(req.name)
            have = versions.get(name)
            if have is None:
                if (owner, name) not in allowed_missing:
                    found.append(f"{d.name} {d.version} requires {req}, which is not installed")
                continue
            try:
                ok = req.specifier.contains(Version(have), prereleases=True)
            except InvalidVersion:
                ok = False
            if not ok:
                found.append(f"{d.name} {d.version} requires {req}, but {req.name} {have} is installed")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--allow", type=Path, default=DEFAULT_ALLOW,
                        help="allow-list of requirements missing on purpose (default: %(default)s)")
    parser.add_argument("--path", action="append", metavar="DIR",
                        help="check the distributions in DIR (repeatable) instead of this environment's")
    args = parser.parse_args(argv)
    dists = installed(args.path)
    found = problems(dists, read_allow_list(args.allow))
    for line in found:
        print(line)
    print(f"dependency check: {len(dists)} distributions, "
          + (f"{len(found)} problem(s)" if found else "consistent") + f" (allow-list {args.allow.name})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
