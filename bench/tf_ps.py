"""The TensorFlow peer: ``tf.distribute.ParameterServerStrategy`` (TF2), async (needs tensorflow).

TensorFlow 2's parameter-server training is asynchronous: a coordinator process (the
"chief") holds the program, places every variable on a ``ps`` task and hands functions to
``worker`` tasks as they become free (``ClusterCoordinator.schedule``); each function reads
the variables it needs from the ps tasks, computes a gradient and applies it there at once.
It has no synchronous mode (TF1's SyncReplicasOptimizer exists only in graph mode), so
`ps_bench.train_bench` runs this peer in async mode only.

Processes, one each, all started by `ps_bench.train_bench`:

``python -P -m ps_bench.tf_ps server --job ps|worker --index I --cluster JSON --threads T``
    a ``tf.distribute.Server`` for one task of the cluster; prints ``TF_SERVER_READY {...}``.
``python -P -m ps_bench.tf_ps coordinator --cluster JSON --model-name NAME --model FILE.onnx --data FILE.npz ...``
    the chief: builds the Keras model (`build_model`) under the strategy, checks that it
    has as many trainable values as the ONNX model our engine trains, trains ``--workers x
    (--warmup + --steps)`` steps in functions of ``--steps-per-function`` steps each, and
    prints ``BENCH_RESULT {"steps_per_s", "steps", "seconds", "loss", ...}`` for the timed part.

At its best, as a TensorFlow user runs it: several steps per scheduled function (ten by
default; the dispatch of a function costs the coordinator a round trip), unrolled in the
function's graph (faster than a graph loop, see `run_coordinator`), a ``tf.data``
pipeline on each worker that shuffles, batches and prefetches, images channels-last (the
layout TensorFlow's CPU kernels, oneDNN, prefer), the embedding tables updated by rows (a
gradient of a Gather is an ``IndexedSlices``, applied as a scatter on the ps task), SGD at
the learning rate the other systems use. One compute thread per process (TensorFlow's
intra-op pool) as everywhere in the benchmark; the servers keep two inter-op threads,
because with one (ps and worker tasks alike) the coordinator finished no function in 60 s here.

What differs from the other systems, and why it does not favour us: the Keras models are
the same architectures with the same number of trainable values (checked), but their
initial values are Keras's own, so losses are not compared; the coordinator hands a
function to whichever worker is free, so the batches are not split between workers as our
Trainer splits them (each worker reads the whole training set, reshuffled every epoch);
``"same"`` padding in strided convolutions pads one side where torch pads both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np

from ps_bench.train_worker import RESULT_PREFIX

READY_PREFIX = "TF_SERVER_READY "
#: inter-op threads of a server task: with one, the coordinator finished no function in 60 s here
SERVER_INTER_OP_THREADS = 2
#: steps in one scheduled function unless told otherwise
STEPS_PER_FUNCTION = 10


def cluster_spec(ps: list[str], workers: list[str], chief: str) -> dict[str, list[str]]:
    """The cluster as TF_CONFIG spells it: ps and worker tasks, and the coordinator as the chief."""
    return {"ps": list(ps), "worker": list(workers), "chief": [chief]}


def function_counts(workers: int, warmup: int, steps: int, per_function: int) -> tuple[int, int]:
    """(warm-up functions, timed functions): at least one warm-up function per worker (each traces and
    registers the function once), and the timed steps of every worker rounded up to whole functions."""
    if per_function < 1 or workers < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"need workers >= 1, steps >= 1, warmup >= 0 and steps per function >= 1, "
                         f"got {workers}, {steps}, {warmup}, {per_function}")
    return max(workers, math.ceil(workers * warmup / per_function)), math.ceil(workers * steps / per_function)


def _tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # TensorFlow's start-up notices go to stderr otherwise
    try:
        import tensorflow as tf
    except ImportError as exc:
        raise SystemExit("ps_bench.tf_ps needs tensorflow (tensorflow-cpu), which is not installed here; "
                         "docs/benchmarks.md, \"The torch environment\", says how to add it") from exc
    return tf


def run_server(args: argparse.Namespace) -> int:
    tf = _tf()
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=args.threads,
                                      inter_op_parallelism_threads=SERVER_INTER_OP_THREADS)
    cluster = json.loads(args.cluster)
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=args.job, task_index=args.index,
                                  protocol="grpc", config=config, start=True)
    print(READY_PREFIX + json.dumps({"job": args.job, "index": args.index, "address": cluster[args.job][args.index],
                                     "target": server.target}), flush=True)
    server.join()   # until train_bench stops it (SIGTERM)
    return 0


# ---------------------------------------------------------------------------------- the models in Keras

def build_model(tf, name: str, onnx_shapes: dict[str, tuple[int, ...]]):
    """The benchmark model `name` in Keras (functional), the same architecture as its ONNX file."""
    from ps_bench import model_sizes as sizes
    keras = tf.keras
    layers = keras.layers
    if name == "mlp":
        from ps_bench import mlp
        x = keras.Input((mlp.INPUT_DIM,), name="x")
        out = layers.Dense(mlp.CLASSES)(layers.Dense(mlp.HIDDEN, activation="relu")(x))
        return keras.Model(x, out)
    if name == "fm":
        rows, dim = onnx_shapes["factors.weight"]
        ids = keras.Input((None,), dtype="int64", name="ids")
        return keras.Model(ids, FactorizationMachine(tf, rows, dim)(ids))
    if name == "transformer":
        ids = keras.Input((sizes.SEQ_LEN,), dtype="int64", name="ids")
        x = PositionalEmbedding(tf, sizes.VOCAB, sizes.SEQ_LEN, sizes.D_MODEL)(ids)
        for _ in range(sizes.LAYERS):   # torch's post-norm TransformerEncoderLayer
            attention = layers.MultiHeadAttention(sizes.HEADS, sizes.D_MODEL // sizes.HEADS, dropout=sizes.DROPOUT)
            x = layers.LayerNormalization(epsilon=1e-5)(x + layers.Dropout(sizes.DROPOUT)(attention(x, x)))
            hidden = layers.Dropout(sizes.DROPOUT)(layers.Dense(sizes.FEED_FORWARD, activation="relu")(x))
            out = layers.Dropout(sizes.DROPOUT)(layers.Dense(sizes.D_MODEL)(hidden))
            x = layers.LayerNormalization(epsilon=1e-5)(x + out)
        return keras.Model(ids, layers.Dense(sizes.TEXT_CLASSES)(layers.GlobalAveragePooling1D()(x)))
    if name == "resnet18":
        def conv_bn(x, filters, size, stride, relu=True):
            x = layers.Conv2D(filters, size, stride, padding="same", use_bias=False)(x)
            x = layers.BatchNormalization(momentum=0.9, epsilon=1e-5)(x)
            return layers.ReLU()(x) if relu else x

        channels, height, width = sizes.IMAGE_SHAPE
        image = keras.Input((height, width, channels), name="image")   # channels-last
        inputs = sizes.STAGES[0][0]
        x = conv_bn(image, inputs, 3, 1)
        for outputs, stride in sizes.STAGES:
            for block_stride in (stride, 1):
                shortcut = x
                if block_stride != 1 or inputs != outputs:
                    shortcut = conv_bn(x, outputs, 1, block_stride, relu=False)
                y = conv_bn(conv_bn(x, outputs, 3, block_stride), outputs, 3, 1, relu=False)
                x = layers.ReLU()(y + shortcut)
                inputs = outputs
        return keras.Model(image, layers.Dense(sizes.IMAGE_CLASSES)(layers.GlobalAveragePooling2D()(x)))
    raise ValueError(f"no Keras definition of model {name!r}; there are mlp, fm, transformer and resnet18")


def FactorizationMachine(tf, rows: int, dim: int):
    """models/recsys/export_fm.py's FactorizationMachine as a Keras layer: logits (-z/2, z/2) of a
    second-order FM over one table of global ids."""

    class FM(tf.keras.layers.Layer):
        def build(self, input_shape):
            self.factors = self.add_weight(shape=(rows, dim), initializer="uniform", name="factors")
            self.linear = self.add_weight(shape=(rows, 1), initializer="zeros", name="linear")
            self.bias = self.add_weight(shape=(1,), initializer="zeros", name="bias")

        def call(self, ids):
            v = table_rows(tf, self.factors, ids)
            summed = tf.reduce_sum(v, axis=1)
            pairwise = 0.5 * tf.reduce_sum(summed * summed - tf.reduce_sum(v * v, axis=1), axis=1, keepdims=True)
            z = self.bias + tf.reduce_sum(table_rows(tf, self.linear, ids), axis=1) + pairwise
            return tf.concat([-0.5 * z, 0.5 * z], axis=1)

    return FM()


def PositionalEmbedding(tf, vocab: int, seq_len: int, d_model: int):
    """A token embedding plus a learned position embedding (the torch model's ``embed`` and ``position``)."""

    class Embed(tf.keras.layers.Layer):
        def build(self, input_shape):
            self.embed = self.add_weight(shape=(vocab, d_model), initializer="uniform", name="embed")
            self.position = self.add_weight(shape=(1, seq_len, d_model), name="position",
                                            initializer=tf.keras.initializers.RandomNormal(stddev=0.02))

        def call(self, ids):
            return table_rows(tf, self.embed, ids) + self.position

    return Embed()


def table_rows(tf, table, ids):
    """The rows `ids` of an embedding table, gathered where the table lives: `tf.nn.embedding_lookup` on the
    variable is a ResourceGather, placed on the ps task, so only the rows cross the wire. Keras's Embedding
    layer gathers from the table's value instead, which read the whole table into the worker every step (the
    FM moved 785 MB a run across the namespaces that way, against 29 MB for ours). The gradient is
    IndexedSlices either way, which Keras's optimizer applies as a scatter on the ps task."""
    return tf.nn.embedding_lookup(getattr(table, "value", table), ids)


# ---------------------------------------------------------------------------------- the coordinator

def onnx_trainables(model: str, cache_dir: str | None, tables: list[str]) -> dict[str, tuple[int, ...]]:
    """The shapes of the values our engine trains in `model` (the ONNX file both systems are measured on)."""
    from worker_client.engine import GradientEngine
    engine = GradientEngine(model, batch_size=1, loss="cross_entropy", cache_dir=cache_dir, sparse_tables=tables)
    return {name: tuple(value.shape) for name, value in engine.server_parameters().items()}


def training_arrays(path: str, model_name: str) -> tuple[np.ndarray, np.ndarray]:
    """The data file's training inputs (images channels-last) and int64 labels."""
    from ps_models.datasets import load_dataset
    data = load_dataset(path)
    x = np.ascontiguousarray(data.x_train)
    if model_name == "resnet18":
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    return x, data.y_train.astype(np.int64)


def run_coordinator(args: argparse.Namespace) -> dict[str, Any]:
    tf = _tf()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    warmup_functions, timed_functions = function_counts(args.workers, args.warmup, args.steps,
                                                        args.steps_per_function)
    cluster = json.loads(args.cluster)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    expected = onnx_trainables(args.model, args.cache_dir, [t for t in args.tables.split(",") if t])
    with strategy.scope():
        model = build_model(tf, args.model_name, expected)
        optimizer = tf.keras.optimizers.SGD(args.lr)
    ours = sum(math.prod(s) for s in expected.values())
    theirs = sum(math.prod(v.shape) for v in model.trainable_variables)
    if ours != theirs:
        raise SystemExit(f"the Keras {args.model_name} has {theirs} trainable values, the ONNX model "
                         f"{args.model} {ours}: not the same model")
    x, y = training_arrays(args.data, args.model_name)
    batch, per_function = args.batch, args.steps_per_function

    def dataset_fn():
        rows = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), reshuffle_each_iteration=True)
        return rows.batch(batch, drop_remainder=True).repeat().prefetch(tf.data.AUTOTUNE)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def train(iterator):
        def step(inputs, labels):
            with tf.GradientTape() as tape:
                logits = model(inputs, training=True)
                loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(labels, logits,
                                                                                      from_logits=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        loss = tf.constant(0.0)
        # unrolled in Python, not tf.range: a graph loop whose body reads and writes variables on the ps
        # tasks ran the MLP at 7,700 samples/s here, the unrolled steps at 11,600 (2 ps, 2 workers, 10 a call)
        for _ in range(per_function):
            inputs, labels = next(iterator)
            loss = strategy.run(step, args=(inputs, labels))
        return loss

    def run(functions: int):
        results = [coordinator.schedule(train, args=(iterator,)) for _ in range(functions)]
        coordinator.join()
        return results

    run(warmup_functions)
    start = time.monotonic()
    results = run(timed_functions)
    seconds = time.monotonic() - start
    steps = timed_functions * per_function
    return {"steps_per_s": steps / seconds, "steps": steps, "seconds": round(seconds, 4),
            "loss": float(results[-1].fetch()), "steps_per_function": per_function,
            "tensorflow": tf.__version__}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ps_bench.tf_ps", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("server", help="one ps or worker task")
    s.add_argument("--job", choices=("ps", "worker"), required=True)
    s.add_argument("--index", type=int, required=True)
    s.add_argument("--cluster", required=True, help="the cluster as JSON: {\"ps\": [...], \"worker\": [...], ...}")
    s.add_argument("--threads", type=int, default=1)
    c = sub.add_parser("coordinator", help="the chief: builds the model and schedules the training functions")
    c.add_argument("--cluster", required=True)
    c.add_argument("--model-name", required=True)
    c.add_argument("--model", required=True, help="the ONNX file of the same model (its trainable values are counted)")
    c.add_argument("--data", required=True)
    c.add_argument("--tables", default="", help="the tables our engine trains by rows (for the count)")
    c.add_argument("--cache-dir", default=None)
    c.add_argument("--workers", type=int, required=True)
    c.add_argument("--batch", type=int, required=True)
    c.add_argument("--warmup", type=int, required=True, help="untimed steps per worker")
    c.add_argument("--steps", type=int, required=True, help="timed steps per worker")
    c.add_argument("--steps-per-function", type=int, default=STEPS_PER_FUNCTION)
    c.add_argument("--lr", type=float, required=True)
    c.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "server":
        return run_server(args)
    print(RESULT_PREFIX + json.dumps(run_coordinator(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
