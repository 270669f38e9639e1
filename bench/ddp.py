"""The DDP peer for sync mode: torch.distributed with gloo, DistributedDataParallel's all-reduce (needs torch).

``python -P -m ps_bench.ddp --rank R --world N --port P --model-name NAME --model FILE.onnx --data FILE.npz``,
one process per worker, run by `ps_bench.train_bench`. Every rank builds the same torch
module with the ONNX file's initial values (`ps_bench.torch_rpc.load_module`), wraps it in
``DistributedDataParallel`` over a gloo process group (rendezvous ``tcp://HOST:PORT``, rank
0 listening), and trains on the same batches as our worker of the same index
(`ps_bench.torch_rpc.worker_batches`): forward, cross-entropy, backward (DDP all-reduces
the gradients, averaged over the N ranks, in buckets overlapping the backward pass), then
``torch.optim.SGD`` at the same learning rate. That is sync training with N = the world
size: what our sync mode computes, without a parameter server.

At its best: ``gradient_as_bucket_view=True`` (no copy between the gradients and the
buckets), ``broadcast_buffers=False`` (BatchNorm's running statistics are not trained and
not needed by a training-mode forward), and the tables our engine trains by rows
(``--tables``) as ``nn.Embedding(sparse=True)``: their gradients are the touched rows, which
gloo all-gathers instead of all-reducing the whole table.

Timing is the same window as our workers': from the start of iteration `warmup` to the end
of the last optimizer step. Prints ``BENCH_RESULT {json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ps_bench import mlp
from ps_bench.torch_rpc import RESULT_PREFIX, load_module, split_names, worker_batches

TIMEOUT_S = 300.0


def sparse_tables(module: nn.Module, tables: list[str]) -> list[str]:
    """Makes the embeddings whose weight is in `tables` produce sparse gradients; the names it changed."""
    changed = []
    for name, sub in module.named_modules():
        key = f"{name}.weight" if name else "weight"
        if isinstance(sub, nn.Embedding) and key in tables:
            sub.sparse = True
            changed.append(key)
    return changed


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    total = args.warmup + args.steps
    module = load_module(args.model_name, args.model)
    sparse = sparse_tables(module, split_names(args.tables))
    batches = worker_batches(args.data, args.rank, args.world, args.batch, total, args.seed)
    dist.init_process_group("gloo", init_method=f"tcp://{args.host}:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        model = DistributedDataParallel(module, broadcast_buffers=False, gradient_as_bucket_view=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        opened = time.monotonic()
        for i in range(total):
            if i == args.warmup:
                opened = time.monotonic()
            x, y = batches[i]
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        closed = time.monotonic()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"worker": args.rank, "mode": "sync", "iterations": total, "timed_steps": args.steps,
            "seconds": closed - opened, "steps_per_s": args.steps / (closed - opened), "loss": float(loss),
            "sparse_tables": sparse}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ps_bench.ddp", description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True, help="the number of workers (processes)")
    p.add_argument("--host", default="127.0.0.1", help="rank 0's address (the rendezvous)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model-name", default="mlp", help="mlp, fm, or a ps_bench.torch_models name")
    p.add_argument("--model", type=Path, required=True, help="the model's .onnx: the initial values")
    p.add_argument("--data", required=True, help="the dataset (a .npz or a spec ps_models.datasets loads)")
    p.add_argument("--tables", default="", help="embedding weights with sparse gradients (comma-separated)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--batch", type=int, default=mlp.BATCH)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(RESULT_PREFIX + json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
