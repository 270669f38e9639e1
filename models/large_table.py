"""The bundled `embedding` model with a table too large for one ONNX file: its rows in external data.

    python -m ps_models.large_table OUT.onnx --rows 10000000 --dim 64 [--bag 8] [--seed 0]

ONNX files are protobuf messages, which stop at 2 GiB; a 10^7 x 64 float32 table is 2.56 GB.
This writes the `embedding` model's graph (ps_models.builders.build_embedding_model) with its
table `embedding.weight` in a raw little-endian file beside it (`OUT.onnx.data`, ONNX external
data), filled block by block with N(0, 1/dim) values from `seed`, so no step holds the table in
memory twice. A worker with `--sparse-tables embedding.weight` maps that file and never reads it
whole (worker_client/engine/sparse.py); worker 0 streams it to the shards at initialization.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from ps_models.builders import build_embedding_model

TABLE = "embedding.weight"
#: Rows drawn and written per block (64 MiB of float32 at dim 64).
BLOCK_ROWS = 1 << 18
#: The table's rows in the graph built before the real table replaces it (a placeholder).
PLACEHOLDER_ROWS = 2


def write_large_embedding(path: str | Path, *, rows: int, dim: int, bag: int = 8, num_classes: int = 2,
                          seed: int = 0) -> Path:
    """Writes the model to `path` and its table to `path` + ".data"; returns `path`."""
    if rows < PLACEHOLDER_ROWS or dim < 1:
        raise ValueError(f"rows must be >= {PLACEHOLDER_ROWS} and dim >= 1, got rows={rows}, dim={dim}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = build_embedding_model(vocab_size=PLACEHOLDER_ROWS, dim=dim, bag_size=bag, num_classes=num_classes,
                                  seed=seed)
    data = path.with_name(path.name + ".data")
    rng = np.random.default_rng(seed)
    scale = 1.0 / math.sqrt(dim)
    with open(data, "wb") as out:
        for start in range(0, rows, BLOCK_ROWS):
            count = min(BLOCK_ROWS, rows - start)
            block = rng.standard_normal((count, dim), dtype=np.float32)
            block *= np.float32(scale)
            out.write(block.astype("<f4", copy=False).tobytes())
    tensor = next(t for t in model.graph.initializer if t.name == TABLE)
    tensor.ClearField("float_data")
    tensor.ClearField("raw_data")
    del tensor.dims[:]
    tensor.dims.extend([rows, dim])
    tensor.data_type = TensorProto.FLOAT
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", data.name), ("offset", "0"), ("length", str(rows * dim * 4))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    for prop in model.metadata_props:
        if prop.key == "vocab_size":
            prop.value = str(rows)
    onnx.save_model(model, str(path))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ps_models.large_table", description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--bag", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    write_large_embedding(args.out, rows=args.rows, dim=args.dim, bag=args.bag, seed=args.seed)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
