"""Generates the Python modules of protos/ps/v1 (and of protos/inference) from the .proto files: the one way to make them.

The folder protos/ps installs as the package `ps_proto` (pyproject.toml's package-dir): a
generic top-level name such as `protos` would collide with a user's own package. protoc
sees the folder under that name (a virtual include path, `-Ips_proto=protos/ps`), so the
generated modules import each other as `ps_proto.v1.<name>_pb2`.

protos/inference holds the messages of the Open Inference Protocol (KServe v2) that ps-serve
speaks over gRPC; protoc sees that folder as ps_serve/proto, where its modules are written
(`ps_serve.proto.grpc_service_pb2`). It declares no service, so it gets no gRPC stub module.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path("protos/ps/v1")
#: The installed package name of protos/ps, and the folder it maps to.
PACKAGE, PACKAGE_DIR = "ps_proto", Path("protos/ps")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
#: ps-serve's protocol: the .proto folder, and the package folder its modules are generated into.
INFERENCE_PROTO_DIR, INFERENCE_PACKAGE_DIR = Path("protos/inference"), Path("ps_serve/proto")


def proto_files() -> list[Path]:
    """The contract's .proto files, relative to the repository root."""
    return sorted(p.relative_to(ROOT) for p in (ROOT / PROTO_DIR).glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc (from grpcio-tools) into out_dir and returns the files it wrote.

    Paths are given relative to the repository root, so the generated modules import each
    other as `ps_proto.v1.<name>_pb2`, the installed package's name.
    """
    from grpc_tools import protoc  # only needed to generate, not to run

    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PACKAGE}={ROOT / PACKAGE_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(Path(PACKAGE) / p.relative_to(PACKAGE_DIR)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = out_dir / PACKAGE / PROTO_DIR.relative_to(PACKAGE_DIR)
    return sorted(p for p in written.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def inference_proto_files() -> list[Path]:
    """ps-serve's .proto files, relative to the repository root."""
    return sorted(p.relative_to(ROOT) for p in (ROOT / INFERENCE_PROTO_DIR).glob("*.proto"))


def generate_inference(out_dir: Path) -> list[Path]:
    """Runs protoc on protos/inference into out_dir and returns the files it wrote (messages only: no service).

    protoc sees the folder as ps_serve/proto, so the modules are ``ps_serve.proto.<name>_pb2``.
    """
    from grpc_tools import protoc

    args = [
        "grpc_tools.protoc",
        f"-I{INFERENCE_PACKAGE_DIR.as_posix()}={ROOT / INFERENCE_PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *[(INFERENCE_PACKAGE_DIR / p.relative_to(INFERENCE_PROTO_DIR)).as_posix() for p in inference_proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = out_dir / INFERENCE_PACKAGE_DIR
    return sorted(p for p in written.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / PROTO_DIR, help="folder to write the *_pb2*.py modules to")
    parser.add_argument("--inference-out", type=Path, default=ROOT / INFERENCE_PACKAGE_DIR,
                        help="folder to write ps-serve's *_pb2*.py modules to")
    args = parser.parse_args(argv)
    for make, out in ((generate, args.out), (generate_inference, args.inference_out)):
        with tempfile.TemporaryDirectory() as scratch:
            for path in make(Path(scratch)):
                target = out / path.name
                shutil.copyfile(path, target)
                print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
