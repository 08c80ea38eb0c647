#!/usr/bin/env python3
"""Print the requirements that pyproject.toml lists, one a line, for pip's -r (standard library only).

    python scripts/requirements_of.py [--core] [EXTRA ...] [--pyproject PATH]

``--core``: the package's own dependencies; each EXTRA: that optional-dependencies group. docker/Dockerfile
installs from these before it copies the source, so that a change of the source rebuilds no dependency layer.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, core: bool, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    groups = project.get("optional-dependencies", {})
    unknown = [name for name in extras if name not in groups]
    if unknown:
        raise SystemExit(
            f"requirements_of: no extra {', '.join(unknown)} in {pyproject} (it has: {', '.join(sorted(groups))})"
        )
    return (project["dependencies"] if core else []) + [req for name in extras for req in groups[name]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("extras", nargs="*", help="optional-dependencies groups")
    parser.add_argument("--core", action="store_true", help="the package's own dependencies too")
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    args = parser.parse_args(argv)
    print("\n".join(requirements(args.pyproject, args.core, args.extras)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
