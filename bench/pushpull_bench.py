"""Push-then-pull throughput of one float32 tensor (1, 16, 100 MB): onnx-ps against PyTorch RPC.

One shard process (`python -P -m ps_server`, async, SGD with lr 1e-9) and one client
(`PSClient`, in this process) alternate a push of a gradient and a pull of the tensor, so
every push is really applied and every pull must encode a new version (no cache serves
an unchanged one). Beside it, the same in PyTorch RPC (`ps_bench.torch_rpc`): a PS
process holding the tensor, ``rpc_sync`` push that adds -lr x the gradient in place,
``rpc_sync`` pull that returns it, TensorPipe over TCP; its client is a child process
driven over stdin. Each timed repeat is `--rounds` push+pull pairs after one untimed
pair, the two systems alternating (the order flips every repeat).

GB/s = (bytes pushed + bytes pulled) / seconds = 2 x size x rounds / seconds. Prints one
JSON line per system and size, ``{"system", "metric": "pushpull_gbps", "size_mb", "value",
"unit", "runs"}`` (the median over repeats), and a ratio line ``{"system":
"onnx-ps/torch-rpc", "metric": "pushpull_ratio", ...}``: the median of the repeats' ratios,
ours over theirs (above 1: we are faster). Without torch here it runs our side only and
says so on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from ps_bench import harness
from ps_bench.harness import TORCH, Proc, log
from worker_client.client import PSClient

COLS = 256
LR = 1e-9


def shape_for(size_mb: float) -> tuple[int, int]:
    """A (rows, 256) float32 shape of about size_mb megabytes (10^6 bytes)."""
    return max(1, int(size_mb * 1e6) // (4 * COLS)), COLS


class Ours:
    """One shard and one client of ours, kept for every size and repeat.

    `data_path` "push-pull" is what the training loop uses (PSClient.push_pull: one round trip,
    through shared memory when the shard shares the host); "streams" is Push then Pull over gRPC.
    """

    def __init__(self, data_path: str = "push-pull") -> None:
        self.data_path = data_path
        self.shard = harness.start_shard(["--mode", "async", "--optimizer", "sgd", "--lr", str(LR)])
        self.client: PSClient | None = None
        self.shape: tuple[int, int] | None = None

    def timed(self, shape: tuple[int, int], rounds: int) -> float:
        if self.shape != shape:
            # A tensor of another size: a fresh job on the same shard (initialization is once per shard).
            if self.client is not None:
                self.client.close()
                self.restart()
            self.client = PSClient([self.shard.ready["address"]], worker_id="pushpull-bench",
                                   shared_memory=self.data_path == "push-pull")
            self.client.wait_ready(timeout=30)
            tensor = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
            self.client.initialize({"t": tensor})
            self.client.register(heartbeat=True)
            self.grad = np.full(shape, 1e-3, dtype=np.float32)
            self.shape = shape
        client = self.client
        assert client is not None
        client.pull()
        step = self._round if self.data_path == "push-pull" else self._streams
        step(client)   # one untimed round (and the shared-memory segment opened)
        start = time.perf_counter()
        for _ in range(rounds):
            pulled = step(client)
        seconds = time.perf_counter() - start
        assert pulled["t"].shape == shape
        return seconds

    def _round(self, client: PSClient) -> dict:
        _, pulled = client.push_pull({"t": self.grad})
        return pulled if pulled is not None else client.pull()   # too large for one message without shm

    def _streams(self, client: PSClient) -> dict:
        client.push({"t": self.grad})
        return client.pull()

    def restart(self) -> None:
        harness.stop_all([self.shard])
        self.shard = harness.start_shard(["--mode", "async", "--optimizer", "sgd", "--lr", str(LR)])

    def close(self) -> None:
        if self.client is not None:
            self.client.deregister()
            self.client.close()
        harness.stop_all([self.shard])


class Theirs:
    """The PyTorch RPC store and its client (child processes)."""

    def __init__(self) -> None:
        port = harness.free_port()
        self.procs = [Proc(f"{TORCH} store", "ps_bench.torch_rpc", ["store", "--port", port, "--lr", LR])]
        self.procs.append(Proc(f"{TORCH} client", "ps_bench.torch_rpc", ["store-client", "--port", port], stdin=True))
        self.procs[1].wait_for("TORCH_PP ", 120)

    def timed(self, shape: tuple[int, int], rounds: int, timeout: float) -> float:
        self.procs[1].send(f"run {shape[0]} {shape[1]} {rounds}")
        return float(self.procs[1].wait_for("TORCH_PP ", timeout)["seconds"])

    def close(self) -> None:
        try:
            self.procs[1].send("quit")
        except OSError:
            pass
        deadline = time.monotonic() + 15
        for proc in reversed(self.procs):   # a clean rpc shutdown first, then by PID
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                pass
        harness.stop_all(self.procs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ps_bench.pushpull_bench", description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", default="1,16,100", help="tensor sizes in MB (default 1,16,100)")
    p.add_argument("--rounds", type=int, default=0,
                   help="push+pull pairs per timed repeat (default: about 400 MB moved per repeat, 3 to 50)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per system and size; medians (default 5)")
    p.add_argument("--no-torch", action="store_true", help="our side only, even when torch is importable")
    p.add_argument("--data-path", choices=("push-pull", "streams"), default="push-pull",
                   help="ours: push-pull (the training loop's PushPull, shared memory on one host; default) "
                        "or streams (Push then Pull over gRPC)")
    args = p.parse_args(argv)
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    if args.repeats < 1 or args.rounds < 0 or any(s <= 0 for s in sizes):
        p.error("--repeats >= 1, --rounds >= 0, sizes > 0")
    with_torch = not args.no_torch and harness.torch_available()
    if not with_torch:
        log("pushpull_bench: " + ("--no-torch: " if args.no_torch else "torch is not importable in this environment "
            f"({sys.executable}): ") + "running onnx-ps only (docs/benchmarks.md: the torch environment)")
    log(f"pushpull_bench: machine {json.dumps(harness.machine())}")
    ours: Ours | None = None
    theirs: Theirs | None = None
    try:
        ours = Ours(args.data_path)
        theirs = Theirs() if with_torch else None
        for size in sizes:
            shape = shape_for(size)
            nbytes = shape[0] * shape[1] * 4
            rounds = args.rounds or min(50, max(3, round(200e6 / nbytes)))
            moved = 2 * nbytes * rounds
            timeout = 120 + moved / 10e6   # at least 10 MB/s, or something is wrong
            def report(repeat: int, runs: dict[str, list[float]]) -> None:
                log(f"pushpull_bench: {size:g} MB, repeat {repeat + 1}/{args.repeats}: "
                    + ", ".join(f"{s} {v[-1]:.3f} GB/s" for s, v in runs.items() if v))

            runs, ratios = harness.side_by_side(
                args.repeats, lambda: moved / ours.timed(shape, rounds) / 1e9,
                (lambda: moved / theirs.timed(shape, rounds, timeout) / 1e9) if theirs is not None else None,
                report=report)
            harness.emit_medians(runs, ratios, metric="pushpull_gbps", ratio_metric="pushpull_ratio", size_mb=size,
                                 unit="GB/s", digits=4, rounds=rounds, repeats=args.repeats, shape=list(shape),
                                 data_path=args.data_path)
    finally:
        if theirs is not None:
            theirs.close()
        if ours is not None:
            ours.close()
    log(f"pushpull_bench: loadavg at the end {harness.machine()['loadavg']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
