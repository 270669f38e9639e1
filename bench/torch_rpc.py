"""The PyTorch RPC peer: a parameter server of the same shape as ours, at its best (needs torch; benchmark only).

``python -P -m ps_bench.torch_rpc ROLE ...``, one process per role:

- ``train-ps``: rank s (s < shards), named ``ps<s>``. Holds the parts of the model's
  parameters the placement gives shard s (`ps_common.shard_map.build_shard_map`, the rule
  our shards follow: whole tensors, or row ranges of large ones) at the ONNX model's
  initial values, and applies SGD under one lock with our consistency rules: async applies
  on arrival; sync sums the gradients of a step until N = min(aggregate, live workers)
  arrived and applies their mean (a gradient read before the current step is dropped as
  stale); ssp applies on arrival and holds a pull by a worker at clock c until every live
  worker's clock is >= c - b. A pull waits for `min_step` (sync) and returns copies taken
  under the lock. Tables trained sparsely (``--tables``) take row gradients
  (``index_add_``) and answer the rows asked for, never the whole table.
- ``train-worker``: rank shards + i. The loop of `worker_client.training.Trainer` on the
  same torch module as the ONNX file (`load_module`), the same batches (the same dataset
  file, `Dataset.part(i, N).batches`), torch autograd through
  ``torch.func.functional_call`` at the pulled parameters, then, per ``--variant``:

  * ``two-call``: ``rpc_async`` push to every shard, wait, then ``rpc_async`` pull from every
    shard (sync: the step after the one read when the push was accepted), wait;
  * ``fused``: one ``rpc_async`` per shard, ``update_and_fetch``, that applies the gradient
    and returns the parameters the next step needs (after the mode's wait), as our PushPull.

  With tables, a step gathers the rows its batch touches (``torch.unique``) and feeds the
  module those rows with the batch's ids renumbered into them, so autograd's gradient of
  a table is the touched rows' (what ``nn.Embedding(sparse=True)`` would give, without
  the whole table in the worker); the push carries them as row gradients and the pull (the
  fused call too) reads the next batch's rows. BatchNorm's running statistics stay in each
  worker's module (they are not trained; our workers push them).
  It times the same window as `ps_bench.train_worker` and prints ``BENCH_RESULT {json}``.
- ``store``: rank 0 of the push-then-pull benchmark: holds one tensor; ``push`` adds
  -lr x the pushed tensor to it in place, ``pull`` returns it.
- ``store-client``: rank 1: reads commands on stdin (``run ROWS COLS ROUNDS``, ``quit``),
  answers each run with ``TORCH_PP {"seconds": ...}`` after one untimed round. A round is
  ``push`` then ``pull`` (``--variant two-call``) or one ``push_pull`` rpc that adds and
  returns the tensor (``--variant fused``).

``--transport``: ``tcp`` restricts TensorPipe to its TCP transport "uv" (libuv sockets) and
channel "basic", as between hosts; ``shm`` leaves TensorPipe its defaults, which on one host
are the shared-memory transport and cross-memory-attach channel: PyTorch RPC at its best on
one host. The rendezvous is ``tcp://HOST:PORT`` (``--host``, 127.0.0.1 by default; the
parent picks the port); every rpc and the shutdown have timeouts.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from onnx import numpy_helper
from torch import nn
from torch.func import functional_call

from ps_bench import mlp
from ps_common.shard_map import ParamSpec, Part, ShardMap, build_shard_map
from ps_models.datasets import load_dataset

RESULT_PREFIX = "BENCH_RESULT "
PP_PREFIX = "TORCH_PP "
RPC_TIMEOUT = 300.0
WAIT_TIMEOUT = 120.0
#: PyTorch RPC's variants of a training step, and TensorPipe's transports (see the module docstring).
VARIANTS = ("two-call", "fused")
TRANSPORTS = ("tcp", "shm")

Key = tuple[str, int]   # a part's key: (tensor name, first row)


def options(port: int, *, host: str = "127.0.0.1", transport: str = "tcp") -> rpc.TensorPipeRpcBackendOptions:
    """The agent's options: the rendezvous at HOST:PORT; "tcp": the uv transport and basic channel only."""
    extra: dict[str, Any] = {"_transports": ["uv"], "_channels": ["basic"]} if transport == "tcp" else {}
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{host}:{port}", num_worker_threads=16,
                                           rpc_timeout=RPC_TIMEOUT, **extra)


# ---------------------------------------------------------------------------------- the models

class _Affine(nn.Module):
    """x @ weight + bias, the weight laid out (fan_in, fan_out) as in the ONNX MLP's Gemm."""

    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(fan_in, fan_out))
        self.bias = nn.Parameter(torch.zeros(fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class OnnxMLP(nn.Module):
    """relu(x @ W1 + b1) @ W2 + b2: the ONNX MLP's Gemm, Relu, Gemm, parameters named as its initializers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = _Affine(mlp.INPUT_DIM, mlp.HIDDEN)
        self.fc2 = _Affine(mlp.HIDDEN, mlp.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def initializers(path: str | Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path), load_external_data=False).graph.initializer}


def load_module(name: str, onnx_path: str | Path) -> nn.Module:
    """The torch module `name` ("mlp", "fm", or a `ps_bench.torch_models` name) holding the ONNX file's initial
    values, in training mode; every parameter must be an initializer of the same name and shape."""
    values = initializers(onnx_path)
    if name == "mlp":
        module: nn.Module = OnnxMLP()
    elif name == "fm":
        from ps_models.recsys.export_fm import FactorizationMachine
        rows, dim = values["factors.weight"].shape
        module = FactorizationMachine(rows, dim, init_std=0.0)
    else:
        from ps_bench import torch_models
        module = torch_models.build(name)
    with torch.no_grad():
        for key, parameter in module.named_parameters():
            if key not in values or tuple(values[key].shape) != tuple(parameter.shape):
                raise SystemExit(f"torch_rpc: parameter {key} {tuple(parameter.shape)} of {name} is not an "
                                 f"initializer of that shape in {onnx_path}")
            parameter.copy_(torch.from_numpy(np.array(values[key], dtype=np.float32)))
    return module.train()


def placement(module: nn.Module, shards: int) -> ShardMap:
    """Where each parameter (or row range) lives: the rule our shards follow, on the trainable parameters."""
    return build_shard_map([ParamSpec(k, "float32", tuple(p.shape)) for k, p in module.named_parameters()], shards)


# ---------------------------------------------------------------------------------- the server

class TrainPS:
    """One shard's parts, the SGD update and the consistency rules of one parameter server."""

    def __init__(self, parts: Mapping[Key, torch.Tensor], *, mode: str, lr: float, workers: int, aggregate: int,
                 staleness: int, tables: Sequence[str] = ()) -> None:
        self.parts = {k: v.detach().clone().contiguous() for k, v in parts.items()}
        self.dense_keys = [k for k in self.parts if k[0] not in set(tables)]
        self.mode, self.lr, self.aggregate, self.staleness = mode, lr, aggregate, staleness
        self.cond = threading.Condition()
        self.step = 0
        self.live = set(range(workers))
        self.clocks = dict.fromkeys(range(workers), 0)
        self.sums: dict[Key, torch.Tensor] | None = None
        self.row_sums: list[dict[Key, tuple[torch.Tensor, torch.Tensor]]] = []
        self.contributed: set[int] = set()

    def _apply(self, dense: Mapping[Key, torch.Tensor], rows: Sequence[Mapping[Key, tuple[torch.Tensor, torch.Tensor]]],
               scale: float = 1.0) -> None:
        alpha = -self.lr * scale
        for key, g in dense.items():
            self.parts[key].add_(g, alpha=alpha)
        for one in rows:
            for key, (ids, values) in one.items():
                self.parts[key].index_add_(0, ids, values, alpha=alpha)
        self.step += 1

    def _maybe_complete(self) -> None:
        quorum = max(1, min(self.aggregate, len(self.live)))
        if self.contributed and len(self.contributed) >= quorum:
            self._apply(self.sums or {}, self.row_sums, 1.0 / len(self.contributed))
            self.sums, self.row_sums, self.contributed = None, [], set()

    def push(self, worker: int, read_step: int, dense: Mapping[Key, torch.Tensor],
             rows: Mapping[Key, tuple[torch.Tensor, torch.Tensor]]) -> tuple[bool, int]:
        with self.cond:
            self.clocks[worker] += 1
            accepted = True
            if self.mode == "sync":
                if read_step < self.step or worker in self.contributed:
                    accepted = False   # stale, or already contributed to this step
                else:
                    if self.sums is None:
                        self.sums = {k: g.clone() for k, g in dense.items()}
                    else:
                        for k, g in dense.items():
                            self.sums[k].add_(g)
                    if rows:
                        self.row_sums.append(dict(rows))
                    self.contributed.add(worker)
                    self._maybe_complete()
            else:
                self._apply(dense, [rows])
            self.cond.notify_all()
            return accepted, self.step

    def pull(self, worker: int, min_step: int, clock: int | None, want: Mapping[Key, torch.Tensor]
             ) -> tuple[int, dict[Key, torch.Tensor], dict[Key, torch.Tensor]]:
        def ready() -> bool:
            if self.step < min_step:
                return False
            return clock is None or all(self.clocks[w] >= clock - self.staleness for w in self.live)

        with self.cond:
            if not self.cond.wait_for(ready, timeout=WAIT_TIMEOUT):
                raise TimeoutError(f"pull by worker {worker} waited {WAIT_TIMEOUT} s (step {self.step}, "
                                   f"min_step {min_step}, clocks {self.clocks})")
            return (self.step, {k: self.parts[k].clone() for k in self.dense_keys},
                    {k: self.parts[k].index_select(0, ids) for k, ids in want.items()})

    def update_and_fetch(self, worker: int, read_step: int, dense: Mapping[Key, torch.Tensor],
                         rows: Mapping[Key, tuple[torch.Tensor, torch.Tensor]], clock: int | None,
                         want: Mapping[Key, torch.Tensor]
                         ) -> tuple[bool, int, dict[Key, torch.Tensor], dict[Key, torch.Tensor]]:
        accepted, _ = self.push(worker, read_step, dense, rows)
        min_step = read_step + 1 if self.mode == "sync" and accepted else 0
        return (accepted, *self.pull(worker, min_step, clock, want))

    def leave(self, worker: int) -> None:
        with self.cond:
            self.live.discard(worker)
            if self.mode == "sync":
                self._maybe_complete()
            self.cond.notify_all()


_PS: TrainPS | None = None


def train_push(worker: int, read_step: int, dense: dict, rows: dict) -> tuple[bool, int]:
    assert _PS is not None
    return _PS.push(worker, read_step, dense, rows)


def train_pull(worker: int, min_step: int, clock: int | None, want: dict) -> tuple[int, dict, dict]:
    assert _PS is not None
    return _PS.pull(worker, min_step, clock, want)


def update_and_fetch(worker: int, read_step: int, dense: dict, rows: dict, clock: int | None, want: dict
                     ) -> tuple[bool, int, dict, dict]:
    """The fused variant's one rpc: apply the gradient, then return what the next step needs."""
    assert _PS is not None
    return _PS.update_and_fetch(worker, read_step, dense, rows, clock, want)


def train_leave(worker: int) -> None:
    assert _PS is not None
    _PS.leave(worker)


def run_train_ps(args: argparse.Namespace) -> int:
    global _PS
    torch.set_num_threads(1)
    module = load_module(args.model_name, args.model)
    values = dict(module.named_parameters())
    shard_map = placement(module, args.shards)
    parts = {p.key: values[p.name].detach()[p.row_start:p.row_end] if not p.whole else values[p.name].detach()
             for p in shard_map.parts_on(args.index)}
    _PS = TrainPS(parts, mode=args.mode, lr=args.lr, workers=args.workers, aggregate=args.aggregate or args.workers,
                  staleness=args.staleness, tables=split_names(args.tables))
    del module, values
    rpc.init_rpc(f"ps{args.index}", rank=args.index, world_size=args.shards + args.workers,
                 rpc_backend_options=options(args.port, host=args.host, transport=args.transport))
    rpc.shutdown(graceful=True, timeout=RPC_TIMEOUT)
    return 0


# ---------------------------------------------------------------------------------- the worker

class Layout:
    """The worker's view of the placement: how gradients split into shards' messages and answers join up."""

    def __init__(self, shard_map: ShardMap, tables: Sequence[str]) -> None:
        self.shard_map = shard_map
        self.shards = shard_map.num_shards
        self.tables = list(tables)
        self.dense_names = [n for n in shard_map.specs if n not in self.tables]
        self.dense_on = [[p for p in shard_map.parts_on(s) if p.name not in self.tables] for s in range(self.shards)]
        self.table_parts = {t: shard_map.parts_of(t) for t in self.tables}

    def split_dense(self, grads: Mapping[str, torch.Tensor]) -> list[dict[Key, torch.Tensor]]:
        # a row range is cloned: a view would send its whole storage over RPC
        return [{p.key: grads[p.name] if p.whole else grads[p.name][p.row_start:p.row_end].clone()
                 for p in parts} for parts in self.dense_on]

    def route(self, table: str, ids: torch.Tensor) -> list[tuple[Part, int, int]]:
        """(part, start, end) of the sorted unique global `ids` each part of `table` holds, in row order."""
        out = []
        for part in self.table_parts[table]:
            lo = int(torch.searchsorted(ids, part.row_start))
            hi = int(torch.searchsorted(ids, part.row_end))
            if hi > lo:
                out.append((part, lo, hi))
        return out

    def split_rows(self, ids: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor] | None
                   ) -> list[dict[Key, Any]]:
        """Per shard, {part: local row ids} (grads None: what to read) or {part: (local ids, row gradients)}."""
        out: list[dict[Key, Any]] = [{} for _ in range(self.shards)]
        for table, table_ids in ids.items():
            for part, lo, hi in self.route(table, table_ids):
                local = table_ids[lo:hi] - part.row_start
                if grads is None:
                    out[part.shard][part.key] = local
                else:   # a slice is cloned: a view would send its whole storage over RPC
                    rows = grads[table]
                    out[part.shard][part.key] = (local, rows if hi - lo == len(rows) else rows[lo:hi].clone())
        return out

    def join_dense(self, answers: Sequence[Mapping[Key, torch.Tensor]]) -> dict[str, torch.Tensor]:
        found: dict[Key, torch.Tensor] = {k: v for a in answers for k, v in a.items()}
        out = {}
        for name in self.dense_names:
            parts = self.shard_map.parts_of(name)
            out[name] = found[parts[0].key] if len(parts) == 1 else torch.cat([found[p.key] for p in parts])
        return out

    def join_rows(self, ids: Mapping[str, torch.Tensor], answers: Sequence[Mapping[Key, torch.Tensor]]
                  ) -> dict[str, torch.Tensor]:
        found: dict[Key, torch.Tensor] = {k: v for a in answers for k, v in a.items()}
        return {t: torch.cat([found[part.key] for part, _, _ in self.route(t, table_ids)])
                for t, table_ids in ids.items()}


def split_names(text: str | None) -> list[str]:
    return [n for n in (text or "").split(",") if n]


def worker_batches(data: str, index: int, workers: int, batch: int, total: int, seed: int
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This worker's first `total` batches, as our Trainer reads them (its share, shuffled by seed and epoch)."""
    dataset = load_dataset(data, seed=seed)
    name = dataset.input_name
    out = []
    for _, inputs, labels in dataset.part(index, workers).batches(batch, start=0, seed=seed):
        out.append((torch.from_numpy(np.ascontiguousarray(inputs[name])), torch.from_numpy(labels.astype(np.int64))))
        if len(out) == total:
            return out
    raise AssertionError("unreachable: batches() repeats epochs forever")


def run_train_worker(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    total = args.warmup + args.steps
    tables = split_names(args.tables)
    module = load_module(args.model_name, args.model)
    layout = Layout(placement(module, args.shards), tables)
    batches = worker_batches(args.data, args.index, args.workers, args.batch, total, args.seed)
    names = [f"ps{s}" for s in range(args.shards)]
    rpc.init_rpc(f"worker{args.index}", rank=args.shards + args.index, world_size=args.shards + args.workers,
                 rpc_backend_options=options(args.port, host=args.host, transport=args.transport))
    ssp = args.mode == "ssp"
    fused = args.variant == "fused"
    clock = 0
    spent = {"compute": 0.0, "push": 0.0, "pull": 0.0}

    def unique(x: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        ids, inverse = torch.unique(x, sorted=True, return_inverse=True)
        return {t: ids for t in tables}, inverse

    def pull(min_steps: Sequence[int], want_ids: Mapping[str, torch.Tensor]) -> tuple[list[int], dict, dict]:
        want = layout.split_rows(want_ids, None)
        futures = [rpc.rpc_async(names[s], train_pull, args=(args.index, min_steps[s], clock if ssp else None, want[s]))
                   for s in range(args.shards)]
        answers = [f.wait() for f in futures]
        return ([a[0] for a in answers], layout.join_dense([a[1] for a in answers]),
                layout.join_rows(want_ids, [a[2] for a in answers]))

    try:
        ids, inverse = unique(batches[0][0]) if tables else ({}, None)
        read_steps, params, rows = pull([0] * args.shards, ids)
        opened = time.monotonic()
        for i in range(total):
            if i == args.warmup:
                opened = time.monotonic()
                spent = dict.fromkeys(spent, 0.0)
            x, y = batches[i]
            t0 = time.monotonic()
            feed = {**params, **rows}
            for p in feed.values():
                p.requires_grad_(True)
            loss = F.cross_entropy(functional_call(module, feed, (inverse if tables else x,)), y)
            grads = dict(zip(feed, torch.autograd.grad(loss, list(feed.values()))))
            dense = layout.split_dense(grads)
            row_grads = layout.split_rows(ids, grads)
            next_ids, next_inverse = unique(batches[i + 1][0]) if tables and i + 1 < total else ({}, None)
            t1 = time.monotonic()
            clock += 1
            if fused:
                want = layout.split_rows(next_ids, None)
                futures = [rpc.rpc_async(names[s], update_and_fetch,
                                         args=(args.index, read_steps[s], dense[s], row_grads[s],
                                               clock if ssp else None, want[s])) for s in range(args.shards)]
                answers = [f.wait() for f in futures]
                read_steps = [a[1] for a in answers]
                params = layout.join_dense([a[2] for a in answers])
                rows = layout.join_rows(next_ids, [a[3] for a in answers])
                t2 = t3 = time.monotonic()
            else:
                futures = [rpc.rpc_async(names[s], train_push, args=(args.index, read_steps[s], dense[s], row_grads[s]))
                           for s in range(args.shards)]
                accepted = [f.wait()[0] for f in futures]
                t2 = time.monotonic()
                min_steps = [r + 1 if args.mode == "sync" and a else 0 for r, a in zip(read_steps, accepted)]
                read_steps, params, rows = pull(min_steps, next_ids)
                t3 = time.monotonic()
            ids, inverse = next_ids, next_inverse
            spent["compute"] += t1 - t0
            spent["push"] += t2 - t1
            spent["pull"] += t3 - t2
        closed = time.monotonic()
        for f in [rpc.rpc_async(n, train_leave, args=(args.index,)) for n in names]:
            f.wait()
    finally:
        rpc.shutdown(graceful=True, timeout=RPC_TIMEOUT)
    result = {"worker": args.index, "mode": args.mode, "variant": args.variant, "transport": args.transport,
              "iterations": total, "timed_steps": args.steps, "seconds": closed - opened,
              "steps_per_s": args.steps / (closed - opened), "loss": float(loss),
              "per_step_ms": {k: 1e3 * v / args.steps for k, v in spent.items()}}
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------------- push, pull

_STORE: dict[str, object] = {"tensor": None, "lr": 1e-9}


def store_set(tensor: torch.Tensor) -> None:
    _STORE["tensor"] = tensor


def store_push(grad: torch.Tensor) -> None:
    tensor = _STORE["tensor"]
    assert isinstance(tensor, torch.Tensor)
    tensor.add_(grad, alpha=-float(_STORE["lr"]))   # type: ignore[arg-type]


def store_pull() -> torch.Tensor:
    return _STORE["tensor"]   # type: ignore[return-value]


def store_push_pull(grad: torch.Tensor) -> torch.Tensor:
    """The fused variant: the push and the pull after it in one rpc, as our PushPull."""
    store_push(grad)
    return store_pull()


def run_store(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    _STORE["lr"] = args.lr
    rpc.init_rpc("ps", rank=0, world_size=2, rpc_backend_options=options(args.port, host=args.host,
                                                                         transport=args.transport))
    rpc.shutdown(graceful=True, timeout=RPC_TIMEOUT)
    return 0


def run_store_client(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    rpc.init_rpc("client", rank=1, world_size=2, rpc_backend_options=options(args.port, host=args.host,
                                                                             transport=args.transport))
    try:
        print(PP_PREFIX + json.dumps({"ready": True}), flush=True)
        shape: tuple[int, int] | None = None
        grad = torch.empty(0)

        def one_round() -> torch.Tensor:
            if args.variant == "fused":
                return rpc.rpc_sync("ps", store_push_pull, args=(grad,))
            rpc.rpc_sync("ps", store_push, args=(grad,))
            return rpc.rpc_sync("ps", store_pull)

        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                break
            rows, cols, rounds = (int(w) for w in words[1:4])
            if shape != (rows, cols):
                shape = (rows, cols)
                rng = np.random.default_rng(0)
                rpc.rpc_sync("ps", store_set, args=(torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)),))
                grad = torch.full(shape, 1e-3)
            pulled = one_round()   # untimed
            start = time.perf_counter()
            for _ in range(rounds):
                pulled = one_round()
            seconds = time.perf_counter() - start
            assert tuple(pulled.shape) == shape
            print(PP_PREFIX + json.dumps({"seconds": seconds, "rounds": rounds}), flush=True)
    finally:
        rpc.shutdown(graceful=True, timeout=RPC_TIMEOUT)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ps_bench.torch_rpc", description=__doc__.splitlines()[0])
    p.add_argument("role", choices=["train-ps", "train-worker", "store", "store-client"])
    p.add_argument("--port", type=int, required=True, help="the rendezvous port (rank 0 listens)")
    p.add_argument("--host", default="127.0.0.1", help="the rendezvous address: rank 0's (default 127.0.0.1)")
    p.add_argument("--transport", choices=TRANSPORTS, default="tcp",
                   help="tcp: TensorPipe's uv transport and basic channel only; shm: its defaults (shared memory "
                        "and cross-memory attach on one host) (default tcp)")
    p.add_argument("--variant", choices=VARIANTS, default="two-call",
                   help="two-call: push, then pull; fused: one update_and_fetch rpc per shard (default two-call)")
    p.add_argument("--shards", type=int, default=1, help="parameter-server processes (ranks 0..shards-1)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--index", type=int, default=0, help="this shard's or worker's index")
    p.add_argument("--mode", choices=["sync", "ssp", "async"], default="async")
    p.add_argument("--aggregate", type=int, default=0, help="sync: N (default: workers)")
    p.add_argument("--staleness", type=int, default=1, help="ssp: b")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--model-name", default="mlp", help="mlp, fm, or a ps_bench.torch_models name (default mlp)")
    p.add_argument("--model", type=Path, default=None, help="the model's .onnx: the initial values")
    p.add_argument("--data", default=None, help="the dataset (a .npz or a spec ps_models.datasets loads)")
    p.add_argument("--tables", default="", help="parameters trained by rows (comma-separated)")
    p.add_argument("--batch", type=int, default=mlp.BATCH)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.role in ("train-ps", "train-worker") and args.model is None:
        p.error(f"{args.role} needs --model")
    if args.role == "train-worker" and args.data is None:
        p.error("train-worker needs --data")
    runner = {"train-ps": run_train_ps, "train-worker": run_train_worker, "store": run_store,
              "store-client": run_store_client}[args.role]
    return runner(args)


if __name__ == "__main__":
    sys.exit(main())
