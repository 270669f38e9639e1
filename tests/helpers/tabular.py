"""A small two-input click model and its data, in .npz and Parquet, for the tests of data in and sparse by default.

The model takes `dense` (batch, 4) float32 and `cat` (batch, 3) int64, as real exports do:
each field's ids are taken from `cat` by Gather on axis 1 (the `cat[:, f]` of an export),
field 0 looks a small table up directly, field 1 through `% BUCKETS` (a hash computed in
the graph) in a table large enough to train sparsely by default, field 2 adds an offset.
The embeddings and a linear layer on `dense` sum to one logit (batch, 1).

The data's label is 1 with probability sigmoid(true logit), the true logit a linear function
of `dense` plus a per-id effect of each field, so a model learns it to an AUC well above 0.5.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

BUCKETS = 8192          # field 1's table: 8192 x 32 float32 = 1 MiB, sparse by default
SMALL = 50              # field 0's table rows
OFFSET_ROWS = 40        # field 2's table rows; its ids are raw - 100, in [0, 40)
DIM = 32
DENSE = 4


def write_model(path: Path, *, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.05, (SMALL, DIM)).astype(np.float32), "emb0.weight"),
        numpy_helper.from_array(rng.normal(0, 0.05, (BUCKETS, DIM)).astype(np.float32), "emb1.weight"),
        numpy_helper.from_array(rng.normal(0, 0.05, (OFFSET_ROWS, DIM)).astype(np.float32), "emb2.weight"),
        numpy_helper.from_array(rng.normal(0, 0.1, (DENSE, DIM)).astype(np.float32), "dense.weight"),
        numpy_helper.from_array(rng.normal(0, 0.1, (DIM, 1)).astype(np.float32), "out.weight"),
        numpy_helper.from_array(np.zeros(1, np.float32), "out.bias"),
        numpy_helper.from_array(np.array(0, np.int64), "f0"),
        numpy_helper.from_array(np.array(1, np.int64), "f1"),
        numpy_helper.from_array(np.array(2, np.int64), "f2"),
        numpy_helper.from_array(np.array(BUCKETS, np.int64), "buckets"),
        numpy_helper.from_array(np.array(100, np.int64), "offset"),
    ]
    nodes = [
        helper.make_node("Gather", ["cat", "f0"], ["ids0"], axis=1),
        helper.make_node("Gather", ["cat", "f1"], ["raw1"], axis=1),
        helper.make_node("Mod", ["raw1", "buckets"], ["ids1"]),
        helper.make_node("Gather", ["cat", "f2"], ["raw2"], axis=1),
        helper.make_node("Sub", ["raw2", "offset"], ["ids2"]),
        helper.make_node("Gather", ["emb0.weight", "ids0"], ["e0"], axis=0),
        helper.make_node("Gather", ["emb1.weight", "ids1"], ["e1"], axis=0),
        helper.make_node("Gather", ["emb2.weight", "ids2"], ["e2"], axis=0),
        helper.make_node("MatMul", ["dense", "dense.weight"], ["d"]),
        helper.make_node("Sum", ["d", "e0", "e1", "e2"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "out.weight"], ["o"]),
        helper.make_node("Add", ["o", "out.bias"], ["logit"]),
    ]
    graph = helper.make_graph(nodes, "tabular",
                              [helper.make_tensor_value_info("dense", TensorProto.FLOAT, ["batch", DENSE]),
                               helper.make_tensor_value_info("cat", TensorProto.INT64, ["batch", 3])],
                              [helper.make_tensor_value_info("logit", TensorProto.FLOAT, ["batch", 1])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path))
    return path


def make_rows(n: int, *, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dense, cat, label) of n examples; the label from a fixed true logit (the same for every seed)."""
    truth = np.random.default_rng(12345)
    w_dense = truth.normal(0, 1, DENSE)
    effect = [truth.normal(0, 1.0, SMALL), truth.normal(0, 1.0, 1000), truth.normal(0, 1.0, OFFSET_ROWS)]
    rng = np.random.default_rng(seed)
    dense = rng.normal(0, 1, (n, DENSE)).astype(np.float32)
    k0 = rng.integers(0, SMALL, n)
    k1 = rng.integers(0, 1000, n)
    k2 = rng.integers(0, OFFSET_ROWS, n)
    cat = np.stack([k0, k1 * 7919 + 10**9, k2 + 100], axis=1).astype(np.int64)   # field 1: large raw ids
    logit = dense @ w_dense * 0.5 + effect[0][k0] + effect[1][k1] + effect[2][k2]
    label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    return dense, cat, label


def write_npz(path: Path, *, train: int = 4000, test: int = 1000, seed: int = 0) -> Path:
    d0, c0, y0 = make_rows(train, seed=seed)
    d1, c1, y1 = make_rows(test, seed=seed + 1)
    np.savez(path, dense_train=d0, dense_test=d1, cat_train=c0, cat_test=c1, y_train=y0, y_test=y1)
    return path


def write_parquet(folder: Path, *, train: int = 4000, test: int = 1000, files: int = 3, row_group: int = 500,
                  seed: int = 0, label: str = "label") -> Path:
    """train/part-i.parquet (files of train/files rows) and test/part-0.parquet: dense, cat (fixed-size lists), label."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def table(dense, cat, y):
        return pa.table({
            "dense": pa.FixedSizeListArray.from_arrays(pa.array(dense.reshape(-1)), DENSE),
            "cat": pa.FixedSizeListArray.from_arrays(pa.array(cat.reshape(-1)), 3),
            label: pa.array(y.astype(np.int8)),
        })

    d, c, y = make_rows(train, seed=seed)
    (folder / "train").mkdir(parents=True, exist_ok=True)
    (folder / "test").mkdir(parents=True, exist_ok=True)
    for i, rows in enumerate(np.array_split(np.arange(train), files)):
        pq.write_table(table(d[rows], c[rows], y[rows]), folder / "train" / f"part-{i}.parquet", row_group_size=row_group)
    d, c, y = make_rows(test, seed=seed + 1)
    pq.write_table(table(d, c, y), folder / "test" / "part-0.parquet", row_group_size=row_group)
    return folder
