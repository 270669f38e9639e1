"""Generates the Python modules of protos/ps/v1 from the .proto files: the one way to make them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path("protos/ps/v1")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """The contract's .proto files, relative to the repository root."""
    return sorted(p.relative_to(ROOT) for p in (ROOT / PROTO_DIR).glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc (from grpcio-tools) into out_dir and returns the files it wrote.

    Paths are given relative to the repository root, so the generated modules import each
    other as `protos.ps.v1.<name>_pb2`, the installed package's name.
    """
    from grpc_tools import protoc  # only needed to generate, not to run

    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(ROOT / p) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in (out_dir / PROTO_DIR).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write protos/ps/v1/*_pb2*.py under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
