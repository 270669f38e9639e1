"""Command line: write the bundled models as ONNX files (python -m ps_models.build --help)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import onnx

from ps_models.builders import BUILDERS, IR_VERSION, OPSET, write_model


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ps_models.build",
        description=f"Write a bundled model ({', '.join(BUILDERS)}) as an ONNX file\n"
                    f"(opset {OPSET}, IR version {IR_VERSION}) with its default sizes and "
                    f"weights drawn\nfrom --seed. Every float initializer is a trainable "
                    f"parameter; the batch\ndimension is symbolic ('batch').",
        epilog="examples:\n"
               "  python -m ps_models.build --model mlp --out models/mlp.onnx\n"
               "  python -m ps_models.build --model lenet --out /tmp/lenet.onnx --seed 3\n"
               "  python -m ps_models.build --all models/onnx",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", choices=sorted(BUILDERS),
                      help="which model to write (needs --out)")
    what.add_argument("--all", metavar="DIR", type=Path,
                      help="write every model to DIR/<name>.onnx")
    parser.add_argument("--out", type=Path, metavar="PATH",
                        help="output file for --model (parent folders are created)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initial weights (default: 0)")
    return parser


def _summary(path: Path) -> str:
    model = onnx.load_model(str(path))
    count = sum(math.prod(t.dims) for t in model.graph.initializer)
    inputs = ", ".join(i.name for i in model.graph.input)
    return f"{path}: inputs {inputs}; {len(model.graph.initializer)} tensors, {count} parameters"


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.model is not None:
        if args.out is None:
            parser.error("--model needs --out PATH")
        targets = [(args.model, args.out)]
    else:
        if args.out is not None:
            parser.error("--out goes with --model; --all writes DIR/<name>.onnx")
        targets = [(name, args.all / f"{name}.onnx") for name in BUILDERS]
    for name, out in targets:
        path = write_model(name, out, seed=args.seed)
        print(_summary(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
