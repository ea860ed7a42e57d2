"""Writes constraints.txt: the installed version of every package mmad and mmad-client depend on,
directly or not, with the extras scripts/setup.sh --dev installs (vulkan, wgpu, export, dev, progress),
and of their build backend (setuptools, wheel).

    .venv/bin/python scripts/constraints.py > constraints.txt

pip freeze lists whatever else the venv holds (tools, local experiments); this walks the
dependency closure instead: the checkout's pyproject files, then the installed packages' own
metadata. Dependencies that are not
installed (the cuda extra without a GPU, packages for other platforms) are left out, so pip
resolves those freely.
"""

from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# pyproject file: the extras scripts/setup.sh --dev installs from it
PROJECTS = {ROOT / "pyproject.toml": ("vulkan", "wgpu", "export", "dev"), ROOT / "client" / "pyproject.toml": ("progress",)}


def direct() -> list[tuple[str, set[str]]]:
    """The projects' own requirements, read from the checkout (the venv may hold an older install)."""
    found = []
    for path, extras in PROJECTS.items():
        project = tomllib.loads(path.read_text())["project"]
        lines = project["dependencies"] + [d for e in extras for d in project["optional-dependencies"][e]]
        # the build backend too: the image installs mmad without build isolation
        lines += tomllib.loads(path.read_text())["build-system"]["requires"]
        found += [(req.name, set(req.extras)) for req in map(Requirement, lines)
                  if req.marker is None or req.marker.evaluate()]
    return found


def closure() -> dict[str, str]:
    """{distribution name: installed version} of everything the projects need."""
    found: dict[str, str] = {}
    todo = direct()
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        key = (canonicalize_name(name), frozenset(extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        # the public version: a local label (torch's +cpu) names a build that only the index that
        # made it hosts, and ==2.13.0 matches 2.13.0+cpu where that build is what is installed
        found[dist.metadata["Name"]] = Version(dist.version).public
        for line in dist.requires or []:
            req = Requirement(line)
            # a requirement applies when its marker holds for no extra or for one of those asked
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
                todo.append((req.name, set(req.extras)))
    return found


def main() -> int:
    print("# The tested versions of mmad's and mmad-client's dependencies (with the vulkan, wgpu, export, dev and")
    print("# progress extras), used by scripts/setup.sh and docker/Dockerfile as pip constraints.")
    print("# Regenerate after upgrading the venv: .venv/bin/python scripts/constraints.py > constraints.txt")
    for name, version in sorted(closure().items(), key=lambda item: canonicalize_name(item[0])):
        print(f"{canonicalize_name(name)}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
