"""Serving while training: ps-serve --follow's update latency and its inference requests/s.

    python -m ps_bench.serve_bench [--models mlp,fm] [--seconds 20] [--interval 0.25] [--clients 2]

For each model a real job runs on 127.0.0.1: two shards (sync, N = 2) and two training
workers (`python -m worker_client`, the real training loop), and ps-serve follows it
(`--follow`, `--follow-interval`). The models: the bundled MLP on digits, and the bundled
recommendation example (models/recsys/fm.onnx on hashed synthetic clicks, both tables held as
dynamic tables: the follower reads only the changed rows and re-keys the tables every swap).

Measured over --seconds while the job trains:

* **update latency**: for every step s the job takes, from the moment the shards accepted
  the push that made it (a probe long-polls the shard for step s with a one-tensor Pull and
  notes when it returns) to the first answer of ps-serve that reports a step >= s (a probe
  asks ps-serve without pause); median and p99 over the steps, in milliseconds;
* **requests/s** of --clients client threads (tritonclient.http, batch 1) that ask
  without pause, and their failures (any answer but 200);

then the same clients for --seconds with the workers stopped (nothing to follow), for the
ratio of requests/s while following to requests/s without training. Everything shares this
machine's cores (shards, workers, ps-serve, the clients): the figures are for one host.

One JSON line per figure (harness.emit): ``update_latency_ms`` (value: the median; p99,
steps, swaps in the line), ``requests_per_second`` (following: true/false, failures), and
``requests_ratio``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ps_bench import harness
from ps_bench.harness import Proc

#: The jobs followed: worker flags (model, data, loss, tables) and the shards' optimizer.
JOBS = {
    "mlp": {"worker": ["--model", "mlp", "--data", "digits", "--batch-size", "32"],
            "optimizer": ["--optimizer", "sgd", "--lr", "0.01"]},
    "fm": {"worker": ["--model", "FM", "--data", "synthetic:clicks?hashed=1", "--batch-size", "64",
                      "--dynamic-tables", "factors.weight,linear.weight"],
           "optimizer": ["--optimizer", "adagrad", "--lr", "0.05"]},
}
SHARDS, WORKERS = 2, 2
READY_TIMEOUT = 120.0


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


class _Asker:
    """A client thread asking ps-serve without pause: (time, step) of every answer, and failures."""

    def __init__(self, address: str, model: str, inputs: dict[str, np.ndarray]) -> None:
        import tritonclient.http as tritonhttp

        self.client = tritonhttp.InferenceServerClient(address)
        self.model = model
        self.tensors = []
        for name, value in inputs.items():
            tensor = tritonhttp.InferInput(name, list(value.shape), "FP32" if value.dtype == np.float32 else "INT64")
            tensor.set_data_from_numpy(value)
            self.tensors.append(tensor)
        self.answers: list[tuple[float, int]] = []
        self.failures = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from tritonclient.utils import InferenceServerException

        while not self.stop.is_set():
            try:
                answer = self.client.infer(self.model, self.tensors).get_response()
                self.answers.append((time.monotonic(), int(answer["parameters"]["step"])))
            except InferenceServerException:
                self.failures += 1

    def __enter__(self) -> "_Asker":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)
        self.client.close()


def _step_times(addresses: list[str], stop: threading.Event, seen: dict[int, float]) -> None:
    """Notes when the shards reach each step: a Pull of the smallest tensor with min_step one past the last."""
    from worker_client.client import PSClient

    with PSClient(addresses, worker_id="serve-bench-probe", shared_memory=False) as client:
        shard_map = client.fetch_shard_map()
        smallest = min((s for s in shard_map.specs.values() if s.dynamic is None), key=lambda s: np.prod(s.shape))
        owner = shard_map.parts_of(smallest.name)[0].shard
        step = client.cluster_info(owner).step
        while not stop.is_set():
            mins = [0] * len(addresses)
            mins[owner] = step + 1
            try:
                client.pull([smallest.name], min_steps=mins, timeout=1.0)
            except Exception:  # noqa: BLE001 -- no new step within the wait
                continue
            now = time.monotonic()
            reached = client.steps[owner]
            for s in range(step + 1, reached + 1):
                seen[s] = now
            step = reached


def bench_model(name: str, args: argparse.Namespace, work: Path) -> None:
    from ps_models.recsys import FM_PATH
    from ps_serve.cli import READY_PREFIX
    from ps_tools import export

    job = JOBS[name]
    worker_flags = [str(FM_PATH) if f == "FM" else f for f in job["worker"]]
    children: list = []
    try:
        shards = [harness.start_shard(["--mode", "sync", "--shard-index", str(i), "--num-shards", str(SHARDS),
                                       "--workers", str(WORKERS), "--replicas-to-aggregate", str(WORKERS),
                                       *job["optimizer"]]) for i in range(SHARDS)]
        children += shards
        addresses = [s.ready["address"] for s in shards]
        servers = ",".join(addresses)
        workers = [Proc(f"worker{i}", "worker_client", ["--servers", servers, "--mode", "sync", "--workers",
                                                          str(WORKERS), "--worker-index", str(i), "--steps", "10000000",
                                                          "--eval-every", "0", "--log-level", "WARNING",
                                                          *worker_flags]) for i in range(WORKERS)]
        children += workers
        state = None
        deadline = time.monotonic() + READY_TIMEOUT
        while state is None or state.step < 3:   # the job is initialized and training
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the job did not reach step 3 in {READY_TIMEOUT:.0f} s")
            try:
                state = export.read_servers(addresses, timeout=10)
            except export.ExportError:
                time.sleep(0.5)
        model_path = work / f"{name}.onnx"
        export.export(_model_file(name, work), state, model_path)
        serve = Proc("ps-serve", "ps_serve", ["--model", str(model_path), "--follow", servers, "--follow-interval",
                                              str(args.interval), "--log-level", "WARNING"])
        children.append(serve)
        ready = serve.wait_for(READY_PREFIX, READY_TIMEOUT)
        inputs = _request(name)

        stop = threading.Event()
        reached: dict[int, float] = {}
        probe = threading.Thread(target=_step_times, args=(addresses, stop, reached), daemon=True)
        probe.start()
        askers = [_Asker(ready["http"], ready["model"], inputs) for _ in range(args.clients)]
        watcher = _Asker(ready["http"], ready["model"], inputs)
        with watcher:
            for asker in askers:
                asker.__enter__()
            started = time.monotonic()
            time.sleep(args.seconds)
            elapsed = time.monotonic() - started
            for asker in askers:
                asker.__exit__()
        stop.set()
        probe.join(10)
        latencies = []
        answers = sorted(watcher.answers)
        for step, at in sorted(reached.items()):
            served = next((t for t, s in answers if t >= at and s >= step), None)
            if served is not None:
                latencies.append((served - at) * 1000)
        following = sum(len(a.answers) for a in askers) / elapsed
        failures = sum(a.failures for a in askers) + watcher.failures
        harness.emit("onnx-ps", "update_latency_ms", 0.0, _percentile(latencies, 50), "ms", model=name,
                     p99=round(_percentile(latencies, 99), 1), steps=len(latencies), interval=args.interval,
                     **harness.machine())
        harness.emit("onnx-ps", "requests_per_second", 0.0, following, "requests/s", model=name, following=True,
                     clients=args.clients, failures=failures)
        for worker in workers:
            worker.stop()
        askers = [_Asker(ready["http"], ready["model"], inputs) for _ in range(args.clients)]
        for asker in askers:
            asker.__enter__()
        started = time.monotonic()
        time.sleep(args.seconds)
        elapsed = time.monotonic() - started
        for asker in askers:
            asker.__exit__()
        idle = sum(len(a.answers) for a in askers) / elapsed
        harness.emit("onnx-ps", "requests_per_second", 0.0, idle, "requests/s", model=name, following=False,
                     clients=args.clients, failures=sum(a.failures for a in askers))
        harness.emit("onnx-ps", "requests_ratio", 0.0, following / idle if idle else float("nan"), "x", model=name,
                     what="requests/s while following a training job over requests/s without training")
    finally:
        harness.stop_all(children)


def _model_file(name: str, work: Path) -> Path:
    from ps_models.builders import write_model
    from ps_models.recsys import FM_PATH

    if name == "fm":
        return FM_PATH
    return write_model("mlp", work / "mlp-given.onnx")


def _request(name: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    if name == "mlp":
        return {"x": rng.random((1, 64), dtype=np.float32)}
    return {"ids": rng.integers(-2**62, 2**62, size=(1, 10), dtype=np.int64)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="serve_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,fm", help=f"comma-separated, of {', '.join(JOBS)}")
    p.add_argument("--seconds", type=float, default=20.0, help="each measurement's length")
    p.add_argument("--interval", type=float, default=0.25, help="ps-serve --follow-interval")
    p.add_argument("--clients", type=int, default=2, help="client threads asking without pause")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in JOBS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {', '.join(JOBS)}")
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as scratch:
        for name in names:
            bench_model(name, args, Path(scratch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
