"""Prints the project's runtime requirements from pyproject.toml, one a line, for an image's dependency layer.

Usage: python requirements.py PYPROJECT [--onnxruntime PACKAGE]   (e.g. onnxruntime-gpu for the CUDA image)
       python requirements.py PYPROJECT --build-system             (what building the project's wheel needs)
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib


def requirements(pyproject: str, onnxruntime: str = "onnxruntime") -> list[str]:
    """The [project] dependencies, with the onnxruntime requirement's package swapped for `onnxruntime`."""
    with open(pyproject, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return [re.sub(r"^onnxruntime(?=\s*(?:[<>=!~;\[]|$))", onnxruntime, dep) for dep in deps]


def build_requirements(pyproject: str) -> list[str]:
    """The [build-system] requires (to build the wheel without build isolation)."""
    with open(pyproject, "rb") as f:
        return list(tomllib.load(f)["build-system"]["requires"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pyproject")
    p.add_argument("--onnxruntime", default="onnxruntime", help="the onnxruntime package to require")
    p.add_argument("--build-system", action="store_true", help="print the build-system requires instead")
    args = p.parse_args(argv)
    lines = build_requirements(args.pyproject) if args.build_system else requirements(args.pyproject, args.onnxruntime)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
