"""`ps-bench`: push and pull throughput of the parameter server against a raw-bytes gRPC baseline.

For each tensor size and shard count, it starts the shards (and, beside them, the same
number of baseline servers) as separate processes on 127.0.0.1, then times push and pull
of one float32 tensor through both, alternating between the two so that machine noise
hits both alike. It prints one JSON line per measurement (docs/benchmarks.md):
`{"system", "metric", "size_mb", "value", "unit"}` (plus `shards`), and a ratio line
`system: "onnx-ps/grpc-raw"` per pair. Compare ratios, never absolute figures: the
machines are shared and noisy.

The shards run in async mode with SGD at a tiny learning rate, so every push is really
applied (the optimizer's cost is part of the product's push); pulls of an unchanged
version are served from the shard's encoded-chunk cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from ps_bench import raw_grpc
from ps_bench.raw_grpc import RawClient
from ps_common.process import python_module_argv, start_and_wait_ready, stop_all
from ps_server.cli import READY_PREFIX
from worker_client.client import PSClient

SYSTEM = "onnx-ps"
BASELINE = "grpc-raw"
#: Longest wait for a started shard's or baseline server's READY line, in seconds.
READY_TIMEOUT = 60.0
#: Columns of the benchmark tensor (float32); its rows follow from the size.
COLUMNS = 256
#: Bytes per float32 value.
FLOAT32_BYTES = 4
#: The shards' SGD learning rate: every push is applied, yet the values barely move.
TINY_LR = "1e-9"
#: The gradient pushed: a constant this size.
GRADIENT_VALUE = 1e-3


def emit(system: str, metric: str, size_mb: float, value: float, unit: str, **extra) -> None:
    print(json.dumps({"system": system, "metric": metric, "size_mb": size_mb, "value": round(value, 4), "unit": unit, **extra}),
          flush=True)


def time_median(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_case(size_mb: float, shards: int, *, rounds: int, repeats: int) -> None:
    nbytes = int(size_mb * 1e6)
    rows = max(1, nbytes // (FLOAT32_BYTES * COLUMNS))
    tensor = np.random.default_rng(0).standard_normal((rows, COLUMNS), dtype=np.float32)
    grad = np.full_like(tensor, GRADIENT_VALUE)
    gb = tensor.nbytes / 1e9
    children = []
    try:
        for i in range(shards):
            children.append(start_and_wait_ready(
                f"shard{i}", python_module_argv("ps_server", "--shard-index", str(i), "--num-shards", str(shards),
                                                "--mode", "async", "--optimizer", "sgd", "--lr", TINY_LR,
                                                "--log-level", "WARNING"),
                READY_PREFIX, timeout=READY_TIMEOUT))
            children.append(start_and_wait_ready(f"raw{i}", python_module_argv("ps_bench.raw_grpc"),
                                                 raw_grpc.READY_PREFIX, timeout=READY_TIMEOUT))
        ps_addresses = [c.ready["address"] for c in children if c.name.startswith("shard")]
        raw_addresses = [f"127.0.0.1:{c.ready['port']}" for c in children if c.name.startswith("raw")]
        client = PSClient(ps_addresses, worker_id="bench")
        client.initialize({"t": tensor})
        client.register(heartbeat=False)
        raw = RawClient(raw_addresses)
        raw.push(tensor)

        ours = {"push": [], "pull": []}
        base = {"push": [], "pull": []}
        # Push timing excludes the pull above: time the push alone.
        for _ in range(rounds):
            client.pull()
            ours["push"].append(time_median(lambda: client.push({"t": grad}), repeats))
            base["push"].append(time_median(lambda: raw.push(grad), repeats))
            ours["pull"].append(time_median(lambda: client.pull(), repeats))
            base["pull"].append(time_median(lambda: raw.pull(np.float32), repeats))
        for op in ("push", "pull"):
            mine, theirs = statistics.median(ours[op]), statistics.median(base[op])
            emit(SYSTEM, f"{op}_gbps", size_mb, gb / mine, "GB/s", shards=shards)
            emit(BASELINE, f"{op}_gbps", size_mb, gb / theirs, "GB/s", shards=shards)
            emit(f"{SYSTEM}/{BASELINE}", f"{op}_ratio", size_mb, theirs / mine, "x", shards=shards)
        client.close()
        raw.close()
    finally:
        stop_all(children)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ps-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="1,16,100", help="tensor sizes in MB (default 1,16,100)")
    parser.add_argument("--shards", default="1,2", help="shard counts (default 1,2)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per case (default 5)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per round; the median counts (default 5)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)

    def log(text: str) -> None:
        if not args.quiet:
            print(text, file=sys.stderr, flush=True)

    for shards in [int(s) for s in args.shards.split(",")]:
        for size in [float(s) for s in args.sizes_mb.split(",")]:
            log(f"ps-bench: {size:g} MB over {shards} shard(s), {args.rounds} rounds x {args.repeats} calls ...")
            t0 = time.monotonic()
            run_case(size, shards, rounds=args.rounds, repeats=args.repeats)
            log(f"ps-bench: done in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
