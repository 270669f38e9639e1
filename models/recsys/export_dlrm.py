"""Export a DLRM from PyTorch to ONNX, with torch autograd's outputs and gradients on one batch; or train it.

Run from the repository root with an environment that has torch, onnx, numpy (and pyarrow for
``--train``); torch is not a project dependency and nothing in the package imports this script:

    python models/recsys/export_dlrm.py          (torch 2.13 made the committed dlrm.onnx / dlrm.npz)
    python models/recsys/export_dlrm.py --train DATA_DIR --steps 6000 --batch-size 256 --lr 0.002

The model (Naumov et al. 2019, "Deep Learning Recommendation Model") reads ``dense``
(batch, 13) float32 and ``cat`` (batch, 26) int64, the columns ps_models.recsys.criteo_synthetic
writes, and outputs ``logit`` (batch, 1), one logit per example (train it with ``--loss bce``):

* a bottom MLP on ``dense``: 13 -> 64 -> 16, ReLU after each layer (``bottom.0``, ``bottom.2``);
* one table of 16-wide rows per categorical field, in three kinds (column ranges as the
  generator's ``SMALL``, ``HASHED`` and ``DYNAMIC``):

  - ``emb.small.<i>.weight``, i = 0..12 (cat column i): ``vocab`` rows (3 to 1000), read at
    ``cat[:, i]`` -- a Gather on axis 1 of the input, then the table's Gather;
  - ``emb.hashed.<i>.weight``, i = 0..7 (cat column 13 + i): 16384 x 16 float32 = 1 MiB, read
    at ``cat[:, 13 + i] % 16384`` (a Mod in the graph); at 1 MiB a table trains sparsely by default;
  - ``emb.dynamic.<i>.weight``, i = 0..4 (cat column 21 + i): a placeholder of one row, read at
    ``cat[:, 21 + i]`` itself -- any int64 key; the model's metadata declares these tables
    (``onnx_ps.dynamic_tables``), so the shards hold them as dynamic tables, a row per key;

* the DLRM interaction: the dot products of every pair of the 27 vectors (the bottom MLP's
  output and the 26 rows), 351 numbers, concatenated with the bottom output (367);
* a top MLP: 367 -> 64 -> 1, ReLU between (``top.0``, ``top.2``), giving the logit.

Torch cannot look a key up in a one-row table, so the dynamic tables are exported read at
``cat[:, c] * 0`` and the exported graph is then edited: each such Gather reads the column
itself and the Mul goes. The script checks the graph it writes: every torch parameter is the
initializer of the same name and value, the small tables read a column of ``cat``, the hashed
ones its Mod 16384, the dynamic ones the column; onnxruntime (when installed) reproduces
torch's logits on the reference batch.

It exports with the legacy exporter (``dynamo=False``) in training mode without constant
folding at opset 18, with a dynamic batch axis, and writes beside the .onnx a .npz: a batch
of 16 rows of the generator (seed 0): ``input:dense``, ``input:cat`` (the dynamic columns
set to 0, the one row torch's placeholder has), ``input:cat_keys`` (the same rows with their
dynamic keys), ``labels`` (float), ``output:logit``, ``loss`` (the mean over the batch of
binary cross-entropy with logits) and ``grad:<parameter>``: torch autograd in float64 on the
float32 parameters (tests/unit/test_dlrm_example.py compares the engine with them). With
every key's row set to the placeholder's row, the model on ``input:cat_keys`` is the model on
``input:cat``. The export is deterministic (``--seed``).

``--train DATA_DIR`` trains the same module in torch on a dataset the generator wrote instead
of exporting (a reference for what the model reaches): Adam on batches drawn at random from
the training split, each dynamic table given a row per key of the dataset (keys mapped to rows
here, as the shards do; sparse gradients, SparseAdam on the tables), then prints the test
split's AUC next to the dataset's Bayes AUC.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import nn

HERE = Path(__file__).resolve().parent
try:
    from ps_models.recsys import criteo_synthetic as data
except ImportError:   # run as a script from an environment without the project installed
    sys.path.insert(0, str(HERE))
    import criteo_synthetic as data

OPSET = 18
#: The reference batch's size.
REFERENCE_BATCH = 16
#: Width of every table's rows and of the bottom MLP's output.
DIM = 16
BOTTOM = (data.DENSE_FEATURES, 64, DIM)
TOP_HIDDEN = 64
#: The metadata key declaring dynamic tables (worker_client/engine/sparse.py, DYNAMIC_TABLES_KEY).
DYNAMIC_TABLES_KEY = "onnx_ps.dynamic_tables"
INPUTS, OUTPUT = ["dense", "cat"], "logit"


class DLRM(nn.Module):
    """A DLRM over the generator's 13 dense features and 26 fields (see the module docstring).

    `dynamic_rows`: rows of each dynamic table (one number for all, or one per table); 1 is the exported
    placeholder, read at key * 0 (the export edits that away); more (--train) reads rows at the ids given, keys
    already mapped to rows by the caller. `sparse`: the tables' gradients are sparse (--train; not exported).
    """

    def __init__(self, *, dynamic_rows: int | list[int] = 1, init_std: float = 0.1, sparse: bool = False) -> None:
        super().__init__()
        dynamic_rows = [dynamic_rows] * len(data.DYNAMIC) if isinstance(dynamic_rows, int) else list(dynamic_rows)
        self.bottom = nn.Sequential(nn.Linear(BOTTOM[0], BOTTOM[1]), nn.ReLU(), nn.Linear(BOTTOM[1], BOTTOM[2]),
                                    nn.ReLU())
        self.emb = nn.ModuleDict({
            "small": nn.ModuleList(nn.Embedding(v, DIM, sparse=sparse) for v in data.SMALL_VOCABS),
            "hashed": nn.ModuleList(nn.Embedding(data.HASH_BUCKETS, DIM, sparse=sparse) for _ in data.HASHED),
            "dynamic": nn.ModuleList(nn.Embedding(rows, DIM, sparse=sparse) for rows in dynamic_rows),
        })
        vectors = 1 + data.CAT_FIELDS
        rows, cols = np.triu_indices(vectors, k=1)
        self.register_buffer("pairs", torch.from_numpy((rows * vectors + cols).astype(np.int64)), persistent=False)
        self.top = nn.Sequential(nn.Linear(DIM + len(rows), TOP_HIDDEN), nn.ReLU(), nn.Linear(TOP_HIDDEN, 1))
        self.placeholder = dynamic_rows == [1] * len(data.DYNAMIC)
        with torch.no_grad():
            for table in self.emb.values():
                for e in table:
                    e.weight.normal_(0.0, init_std)

    def forward(self, dense: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)                                                       # (B, 16)
        vectors = [x]
        vectors += [e(cat[:, c]) for c, e in zip(data.SMALL, self.emb["small"])]
        vectors += [e(cat[:, c] % data.HASH_BUCKETS) for c, e in zip(data.HASHED, self.emb["hashed"])]
        vectors += [e(cat[:, c] * 0 if self.placeholder else cat[:, c])
                    for c, e in zip(data.DYNAMIC, self.emb["dynamic"])]
        t = torch.stack(vectors, dim=1)                                              # (B, 27, 16)
        dots = torch.bmm(t, t.transpose(1, 2)).flatten(1)                            # (B, 729)
        return self.top(torch.cat([x, dots.index_select(1, self.pairs)], dim=1))    # (B, 1)


def table_names(kind: str) -> list[str]:
    count = {"small": len(data.SMALL), "hashed": len(data.HASHED), "dynamic": len(data.DYNAMIC)}[kind]
    return [f"emb.{kind}.{i}.weight" for i in range(count)]


def export(module: nn.Module, dense: torch.Tensor, cat: torch.Tensor) -> onnx.ModelProto:
    """The training-mode, unfolded legacy export with a dynamic batch axis, before the dynamic tables' edit."""
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)     # the legacy-exporter notice
        path = Path(folder) / "model.onnx"
        torch.onnx.export(module, (dense, cat), path, dynamo=False, opset_version=OPSET,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=INPUTS, output_names=[OUTPUT],
                          dynamic_axes={"dense": {0: "batch"}, "cat": {0: "batch"}, OUTPUT: {0: "batch"}})
        return onnx.load(path)


def _constant_value(graph: onnx.GraphProto, name: str) -> np.ndarray | None:
    """The value of a Constant node's output or an initializer, else None."""
    for tensor in graph.initializer:
        if tensor.name == name:
            return numpy_helper.to_array(tensor)
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            return numpy_helper.to_array(next(a.t for a in node.attribute if a.name == "value"))
    return None


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in graph.node for o in n.output}


def _table_gather(graph: onnx.GraphProto, table: str) -> onnx.NodeProto:
    uses = [n for n in graph.node if table in n.input]
    if len(uses) != 1 or uses[0].op_type != "Gather" or list(uses[0].input[:1]) != [table]:
        raise SystemExit(f"table {table!r} is not read by exactly one Gather: {[n.op_type for n in uses]}")
    return uses[0]


def _column_of_cat(graph: onnx.GraphProto, name: str) -> int | None:
    """c when `name` is cat[:, c] (a Gather on axis 1 of the input with a constant index), else None."""
    node = _producers(graph).get(name)
    if node is None or node.op_type != "Gather" or node.input[0] != "cat":
        return None
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    index = _constant_value(graph, node.input[1])
    return int(index) if axis == 1 and index is not None and index.ndim == 0 else None


def read_dynamic_keys(model: onnx.ModelProto) -> None:
    """Make each dynamic table's Gather read cat[:, c] instead of cat[:, c] * 0, and declare the tables."""
    graph = model.graph
    producers = _producers(graph)
    for c, table in zip(data.DYNAMIC, table_names("dynamic")):
        gather = _table_gather(graph, table)
        mul = producers.get(gather.input[1])
        if mul is None or mul.op_type != "Mul":
            raise SystemExit(f"{table}: expected its Gather to read a Mul (the key times 0), got {mul}")
        column = [i for i in mul.input if _constant_value(graph, i) is None]
        zero = [i for i in mul.input if _constant_value(graph, i) is not None]
        if len(column) != 1 or len(zero) != 1 or np.any(_constant_value(graph, zero[0]) != 0) \
                or _column_of_cat(graph, column[0]) != c:
            raise SystemExit(f"{table}: its Gather's Mul is not cat[:, {c}] * 0")
        gather.input[1] = column[0]
        if sum(mul.output[0] in n.input for n in graph.node) == 0:
            graph.node.remove(mul)
            if sum(zero[0] in n.input for n in graph.node) == 0:
                if zero[0] in producers:
                    graph.node.remove(producers[zero[0]])
                else:
                    graph.initializer.remove(next(t for t in graph.initializer if t.name == zero[0]))
    entry = model.metadata_props.add()
    entry.key, entry.value = DYNAMIC_TABLES_KEY, ",".join(table_names("dynamic"))


def check_graph(module: nn.Module, model: onnx.ModelProto) -> None:
    """The parameters are the float initializers by name and value; each table is read at what the docstring says."""
    parameters = dict(module.named_parameters())
    initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
                    if t.data_type == onnx.TensorProto.FLOAT}
    if set(parameters) != set(initializers):
        raise SystemExit(f"torch parameters {sorted(parameters)} do not map one-to-one onto the float "
                         f"initializers {sorted(initializers)}")
    for key, parameter in parameters.items():
        if not np.array_equal(parameter.detach().numpy(), initializers[key]):
            raise SystemExit(f"initializer {key!r} differs from the torch parameter")
    graph = model.graph
    producers = _producers(graph)
    for c, table in zip(data.SMALL, table_names("small")):
        if _column_of_cat(graph, _table_gather(graph, table).input[1]) != c:
            raise SystemExit(f"{table} is not read at cat[:, {c}]")
    for c, table in zip(data.HASHED, table_names("hashed")):
        mod = producers.get(_table_gather(graph, table).input[1])
        if mod is None or mod.op_type != "Mod" or _column_of_cat(graph, mod.input[0]) != c \
                or _constant_value(graph, mod.input[1]) != data.HASH_BUCKETS:
            raise SystemExit(f"{table} is not read at cat[:, {c}] % {data.HASH_BUCKETS}")
    for c, table in zip(data.DYNAMIC, table_names("dynamic")):
        if _column_of_cat(graph, _table_gather(graph, table).input[1]) != c:
            raise SystemExit(f"{table} is not read at cat[:, {c}]")
    if [v.name for v in graph.input] != INPUTS or [v.name for v in graph.output] != [OUTPUT]:
        raise SystemExit(f"inputs {[v.name for v in graph.input]}, outputs {[v.name for v in graph.output]}")
    onnx.checker.check_model(model, full_check=True)


def reference_batch(seed: int) -> dict[str, np.ndarray]:
    """REFERENCE_BATCH rows of the generator (popular ids repeat across rows), labels as float."""
    tables = data.Generator(seed=seed).tables()
    dense, keys, labels, _ = tables.chunk(np.random.default_rng([seed, 17]), REFERENCE_BATCH)
    cat = keys.copy()
    cat[:, data.DYNAMIC.start:data.DYNAMIC.stop] = 0
    return {"input:dense": dense, "input:cat": cat, "input:cat_keys": keys, "labels": labels.astype(np.float32)}


def reference(module: nn.Module, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The logits, the mean binary cross-entropy with logits and its gradients by torch autograd, in float64."""
    exact = {k: v.detach().to(torch.float64).requires_grad_(True) for k, v in module.named_parameters()}
    dense = torch.from_numpy(batch["input:dense"]).to(torch.float64)
    cat = torch.from_numpy(batch["input:cat"])
    labels = torch.from_numpy(batch["labels"]).to(torch.float64)
    with torch.enable_grad():
        logit = torch.func.functional_call(module.to(torch.float64), exact, (dense, cat))
        loss = F.binary_cross_entropy_with_logits(logit.reshape(-1), labels)
        grads = torch.autograd.grad(loss, list(exact.values()))
    module.to(torch.float32)
    return {"output:logit": logit.detach().numpy(), "loss": np.array(float(loss.detach()), np.float64),
            **{f"grad:{k}": g.numpy() for k, g in zip(exact, grads)}}


def check_onnxruntime(model: onnx.ModelProto, batch: dict[str, np.ndarray], logits: np.ndarray) -> None:
    """onnxruntime's logits on the batch, keys and all, equal torch's (skipped without onnxruntime)."""
    try:
        import onnxruntime as ort
    except ImportError:
        print("onnxruntime is not installed: the exported graph was not run")
        return
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got, = session.run(None, {"dense": batch["input:dense"], "cat": batch["input:cat"]})
    if not np.allclose(got, logits, rtol=1e-4, atol=1e-5):
        raise SystemExit(f"onnxruntime's logits differ from torch's by {np.abs(got - logits).max()}")


def export_main(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    module = DLRM(init_std=args.init_std).train()
    batch = reference_batch(args.seed)
    model = export(module, torch.from_numpy(batch["input:dense"]), torch.from_numpy(batch["input:cat"]))
    read_dynamic_keys(model)
    check_graph(module, model)
    arrays = {**batch, **reference(module, batch)}
    check_onnxruntime(model, batch, arrays["output:logit"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, args.out)
    npz = args.out.with_suffix(".npz")
    np.savez_compressed(npz, allow_pickle=False, **arrays)
    for path in (args.out, npz):
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


# --- --train: the reference training in torch ---------------------------------------------------------------


def read_split(folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """dense, cat and label of every file of a split (held whole: this is for a reference run, not the product)."""
    import pyarrow.parquet as pq

    parts = [pq.read_table(path) for path in sorted(folder.glob("*.parquet"))]
    dense = np.concatenate([p.column("dense").combine_chunks().flatten().to_numpy() for p in parts])
    cat = np.concatenate([p.column("cat").combine_chunks().flatten().to_numpy() for p in parts])
    label = np.concatenate([p.column("label").to_numpy() for p in parts])
    return (dense.reshape(-1, data.DENSE_FEATURES).astype(np.float32), cat.reshape(-1, data.CAT_FIELDS),
            label.astype(np.float32))


def train_main(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    x_train, c_train, y_train = read_split(args.train / "train")
    x_test, c_test, y_test = read_split(args.train / "test")
    # each dynamic table gets a row per key of its column in train and test, as the shards create a row per key
    # (a test key never seen in training keeps its initial row)
    rows = []
    for c in data.DYNAMIC:
        keys, index = np.unique(np.concatenate([c_train[:, c], c_test[:, c]]), return_inverse=True)
        c_train[:, c], c_test[:, c] = index[:len(c_train)], index[len(c_train):]
        rows.append(len(keys))
    module = DLRM(dynamic_rows=rows, init_std=args.init_std, sparse=True).train()
    tables = [p for name, p in module.named_parameters() if name.startswith("emb.")]
    dense = [p for name, p in module.named_parameters() if not name.startswith("emb.")]
    optimizers = [torch.optim.SparseAdam(tables, lr=args.lr), torch.optim.Adam(dense, lr=args.lr)]
    print(f"read {len(y_train)} train and {len(y_test)} test rows in {time.perf_counter() - started:.1f} s; "
          f"dynamic tables of {rows} rows", flush=True)
    rng = np.random.default_rng(args.seed)
    tensors = [torch.from_numpy(a) for a in (x_train, c_train, y_train)]
    probe = slice(0, min(len(y_test), 20000))
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        index = torch.from_numpy(rng.integers(0, len(y_train), args.batch_size))
        dense_x, cat, labels = (t[index] for t in tensors)
        loss = F.binary_cross_entropy_with_logits(module(dense_x, cat).reshape(-1), labels)
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        if step % max(1, args.steps // 10) == 0:
            print(f"step {step}: loss {loss.item():.4f}, AUC on {probe.stop} test rows "
                  f"{evaluate(module, x_test[probe], c_test[probe], y_test[probe]):.4f}, "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
    seconds = time.perf_counter() - started
    test_auc = evaluate(module, x_test, c_test, y_test)
    meta_path = args.train / "meta.json"
    bayes = json.loads(meta_path.read_text())["bayes_auc_test"] if meta_path.exists() else None
    print(json.dumps({"steps": args.steps, "batch_size": args.batch_size, "optimizer": "adam (SparseAdam on tables)",
                      "lr": args.lr, "init_std": args.init_std, "train_rows": len(y_train),
                      "test_auc": round(test_auc, 4), "bayes_auc_test": bayes, "seconds": round(seconds, 1)}))
    return 0


def evaluate(module: nn.Module, dense: np.ndarray, cat: np.ndarray, labels: np.ndarray) -> float:
    with torch.no_grad():
        logits = torch.cat([module(torch.from_numpy(dense[i:i + 8192]), torch.from_numpy(cat[i:i + 8192]))
                            for i in range(0, len(labels), 8192)]).reshape(-1).numpy()
    return data.auc(logits, labels)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init-std", type=float, default=0.1, help="standard deviation of the tables' initial rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=HERE / "dlrm.onnx", help="the .onnx to write (the .npz goes beside it)")
    p.add_argument("--train", type=Path, metavar="DATA_DIR",
                   help="train in torch on a dataset folder (criteo_synthetic's) instead of exporting")
    p.add_argument("--steps", type=int, default=6000, help="--train: steps")
    p.add_argument("--batch-size", type=int, default=256, help="--train: examples per step")
    p.add_argument("--lr", type=float, default=2e-3, help="--train: Adam's learning rate")
    p.add_argument("--threads", type=int, default=1, help="--train: torch's threads")
    args = p.parse_args(argv)
    return train_main(args) if args.train is not None else export_main(args)


if __name__ == "__main__":
    sys.exit(main())
