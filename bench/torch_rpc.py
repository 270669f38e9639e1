"""The baseline: a PyTorch RPC parameter server of the same shape as ours (needs torch; benchmark only).

``python -P -m ps_bench.torch_rpc ROLE ...``, one process per role, all on 127.0.0.1:

- ``train-ps``: rank 0, named "ps". Holds the MLP's parameters (the ONNX model's initial
  values) and applies SGD, under one lock, with our consistency rules: async applies on
  arrival; sync sums the gradients of a step until N = min(aggregate, live workers) arrived
  and applies their mean (a gradient read before the current step is dropped as stale);
  ssp applies on arrival and holds a pull by a worker at clock c until every live worker's
  clock is >= c - b. A pull waits for `min_step` (sync) and returns copies taken under the lock.
- ``train-worker``: rank i + 1. The loop of `worker_client.training.Trainer`: pull (per
  the mode), torch autograd gradients of the same MLP on the same synthetic batches,
  push with the step it read, then the next pull (sync: the step after the one read when
  the push was accepted). Times the same window as `ps_bench.train_worker` and prints
  ``BENCH_RESULT {json}``.
- ``store``: rank 0 of the push-then-pull benchmark: holds one tensor; ``push`` adds
  -lr x the pushed tensor to it in place, ``pull`` returns it.
- ``store-client``: rank 1: reads commands on stdin (``run ROWS COLS ROUNDS``, ``quit``),
  answers each run with ``TORCH_PP {"seconds": ...}`` after one untimed round.

The agent is TensorPipe over TCP: transport "uv" (libuv sockets) and channel "basic"
only, so neither shared memory nor cross-memory attach (the defaults on one host) is used.
The parent picks the rendezvous port (`ps_bench.harness.free_port`); every rpc and the
shutdown have timeouts.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F

from ps_bench import mlp
from ps_models.datasets import iterate_batches, worker_shard

RESULT_PREFIX = "BENCH_RESULT "
PP_PREFIX = "TORCH_PP "
RPC_TIMEOUT = 300.0
WAIT_TIMEOUT = 120.0


def options(port: int) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=16,
                                           rpc_timeout=RPC_TIMEOUT, _transports=["uv"], _channels=["basic"])


# ---------------------------------------------------------------------------------- training

class TrainPS:
    """The parameters, the SGD update and the consistency rules of one parameter server."""

    def __init__(self, values: list[np.ndarray], *, mode: str, lr: float, workers: int, aggregate: int,
                 staleness: int) -> None:
        self.params = [torch.from_numpy(np.array(v, dtype=np.float32)) for v in values]
        self.mode, self.lr, self.aggregate, self.staleness = mode, lr, aggregate, staleness
        self.cond = threading.Condition()
        self.step = 0
        self.live = set(range(workers))
        self.clocks = dict.fromkeys(range(workers), 0)
        self.sums: list[torch.Tensor] | None = None
        self.contributed: set[int] = set()

    def _apply(self, grads: list[torch.Tensor], scale: float = 1.0) -> None:
        for p, g in zip(self.params, grads):
            p.add_(g, alpha=-self.lr * scale)
        self.step += 1

    def _maybe_complete(self) -> None:
        quorum = max(1, min(self.aggregate, len(self.live)))
        if self.sums is not None and len(self.contributed) >= quorum:
            self._apply(self.sums, 1.0 / len(self.contributed))
            self.sums, self.contributed = None, set()

    def push(self, worker: int, read_step: int, grads: list[torch.Tensor]) -> tuple[bool, int]:
        with self.cond:
            self.clocks[worker] += 1
            accepted = True
            if self.mode == "sync":
                if read_step < self.step or worker in self.contributed:
                    accepted = False   # stale, or already contributed to this step
                else:
                    if self.sums is None:
                        self.sums = [g.clone() for g in grads]
                    else:
                        for s, g in zip(self.sums, grads):
                            s.add_(g)
                    self.contributed.add(worker)
                    self._maybe_complete()
            else:
                self._apply(grads)
            self.cond.notify_all()
            return accepted, self.step

    def pull(self, worker: int, min_step: int, clock: int | None) -> tuple[int, list[torch.Tensor]]:
        def ready() -> bool:
            if self.step < min_step:
                return False
            return clock is None or all(self.clocks[w] >= clock - self.staleness for w in self.live)

        with self.cond:
            if not self.cond.wait_for(ready, timeout=WAIT_TIMEOUT):
                raise TimeoutError(f"pull by worker {worker} waited {WAIT_TIMEOUT} s (step {self.step}, "
                                   f"min_step {min_step}, clocks {self.clocks})")
            return self.step, [p.clone() for p in self.params]

    def leave(self, worker: int) -> None:
        with self.cond:
            self.live.discard(worker)
            if self.mode == "sync":
                self._maybe_complete()
            self.cond.notify_all()


_PS: TrainPS | None = None


def train_push(worker: int, read_step: int, grads: list[torch.Tensor]) -> tuple[bool, int]:
    assert _PS is not None
    return _PS.push(worker, read_step, grads)


def train_pull(worker: int, min_step: int, clock: int | None) -> tuple[int, list[torch.Tensor]]:
    assert _PS is not None
    return _PS.pull(worker, min_step, clock)


def train_leave(worker: int) -> None:
    assert _PS is not None
    _PS.leave(worker)


def run_train_ps(args: argparse.Namespace) -> int:
    global _PS
    torch.set_num_threads(1)
    values = mlp.initial_values(args.model)
    _PS = TrainPS([values[name] for name in mlp.PARAMETERS], mode=args.mode, lr=args.lr, workers=args.workers,
                  aggregate=args.aggregate or args.workers, staleness=args.staleness)
    rpc.init_rpc("ps", rank=0, world_size=args.workers + 1, rpc_backend_options=options(args.port))
    rpc.shutdown(graceful=True, timeout=RPC_TIMEOUT)
    return 0


def forward_loss(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of relu(x @ W1 + b1) @ W2 + b2: the ONNX MLP's Gemm, Relu, Gemm."""
    w1, b1, w2, b2 = params
    return F.cross_entropy(torch.relu(x @ w1 + b1) @ w2 + b2, y)


def run_train_worker(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    total = args.warmup + args.steps
    data = worker_shard(mlp.synthetic_dataset(workers=args.workers, steps_per_worker=total, batch=args.batch,
                                              seed=args.seed), args.index, args.workers)
    batches = []
    for epoch in range(mlp.epochs_for(total)):
        batches += [(torch.from_numpy(x), torch.from_numpy(y))
                    for x, y in iterate_batches(data.x_train, data.y_train, args.batch, seed=args.seed, epoch=epoch)]
    rpc.init_rpc(f"worker{args.index}", rank=args.index + 1, world_size=args.workers + 1,
                 rpc_backend_options=options(args.port))
    ssp = args.mode == "ssp"
    clock = 0
    spent = {"compute": 0.0, "push": 0.0, "pull": 0.0}
    try:
        read_step, params = rpc.rpc_sync("ps", train_pull, args=(args.index, 0, clock if ssp else None))
        opened = time.monotonic()
        for i in range(total):
            if i == args.warmup:
                opened = time.monotonic()
                spent = dict.fromkeys(spent, 0.0)
            x, y = batches[i]
            t0 = time.monotonic()
            for p in params:
                p.requires_grad_(True)
            loss = forward_loss(params, x, y)
            grads = torch.autograd.grad(loss, params)
            t1 = time.monotonic()
            accepted, _ = rpc.rpc_sync("ps", train_push, args=(args.index, read_step, list(grads)))
            clock += 1
            t2 = time.monotonic()
            min_step = read_step + 1 if args.mode == "sync" and accepted else 0
            read_step, params = rpc.rpc_sync("ps", train_pull, args=(args.index, min_step, clock if ssp else None))
            t3 = time.monotonic()
            spent["compute"] += t1 - t0
            spent["push"] += t2 - t1
            spent["pull"] += t3 - t2
        closed = time.monotonic()
        rpc.rpc_sync("ps", train_leave, args=(args.index,))
    finally:
        rpc.shutdown(graceful=True, timeout=RPC_TIMEOUT)
    result = {"worker": args.index, "mode": args.mode, "iterations": total, "timed_steps": args.steps,
              "seconds": closed - opened, "steps_per_s": args.steps / (closed - opened), "loss": float(loss),
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


def run_store(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    _STORE["lr"] = args.lr
    rpc.init_rpc("ps", rank=0, world_size=2, rpc_backend_options=options(args.port))
    rpc.shutdown(graceful=True, timeout=RPC_TIMEOUT)
    return 0


def run_store_client(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    rpc.init_rpc("client", rank=1, world_size=2, rpc_backend_options=options(args.port))
    try:
        print(PP_PREFIX + json.dumps({"ready": True}), flush=True)
        shape: tuple[int, int] | None = None
        grad = torch.empty(0)
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
            rpc.rpc_sync("ps", store_push, args=(grad,))   # one untimed round
            pulled = rpc.rpc_sync("ps", store_pull)
            start = time.perf_counter()
            for _ in range(rounds):
                rpc.rpc_sync("ps", store_push, args=(grad,))
                pulled = rpc.rpc_sync("ps", store_pull)
            seconds = time.perf_counter() - start
            assert tuple(pulled.shape) == shape
            print(PP_PREFIX + json.dumps({"seconds": seconds, "rounds": rounds}), flush=True)
    finally:
        rpc.shutdown(graceful=True, timeout=RPC_TIMEOUT)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ps_bench.torch_rpc", description=__doc__.splitlines()[0])
    p.add_argument("role", choices=["train-ps", "train-worker", "store", "store-client"])
    p.add_argument("--port", type=int, required=True, help="the rendezvous port on 127.0.0.1 (rank 0 listens)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--mode", choices=["sync", "ssp", "async"], default="async")
    p.add_argument("--aggregate", type=int, default=0, help="sync: N (default: workers)")
    p.add_argument("--staleness", type=int, default=1, help="ssp: b")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--model", type=Path, default=None, help="the MLP's .onnx (train-ps)")
    p.add_argument("--batch", type=int, default=mlp.BATCH)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    runner = {"train-ps": run_train_ps, "train-worker": run_train_worker, "store": run_store,
              "store-client": run_store_client}[args.role]
    return runner(args)


if __name__ == "__main__":
    sys.exit(main())
