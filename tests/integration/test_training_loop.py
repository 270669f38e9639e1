"""The worker's training loop against real in-process shards: modes, stop conditions, restarts and bounded waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ps_models.builders import write_model
from ps_models.datasets import Dataset, load_dataset, num_batches
from ps_server.config import ServerConfig
from ps_server.server import ShardServer, create_server
from worker_client.client import PSClient
from worker_client.engine import GradientEngine
from worker_client.training import JsonLinesSink, Trainer, TrainingError, TrainingPlan


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model("mlp", tmp_path_factory.mktemp("model") / "mlp.onnx", seed=0)


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset("digits", model="mlp")


@pytest.fixture
def start() -> Iterator[Any]:
    servers: list[ShardServer] = []
    clients: list[PSClient] = []

    def shard(**settings: Any) -> ShardServer:
        settings.setdefault("optimizer", "momentum")
        settings.setdefault("optimizer_params", {"lr": 0.05})
        server, _ = create_server(ServerConfig(**settings))
        servers.append(server)
        return server

    def client(server: ShardServer, worker_id: str) -> PSClient:
        c = PSClient([server.address], worker_id=worker_id, wait_timeout=30)
        clients.append(c)
        return c

    yield shard, client
    for c in clients:
        c.close()
    for s in servers:
        s.stop()


def trainer(client: PSClient, model: Path, data: Dataset, **plan: Any) -> Trainer:
    options = {"worker_index": 0, "num_workers": 1, "batch_size": 32, "eval_every": 0, "start_timeout": 10.0,
               "wait_timeout": 30.0, **plan}
    engine = GradientEngine(model, batch_size=options["batch_size"], intra_op_threads=1)
    return Trainer(client, engine, data, plan=TrainingPlan(**options))


def test_a_worker_stops_after_its_epochs_over_its_share(start: Any, model: Path, digits: Dataset) -> None:
    shard, client = start
    server = shard(mode="async")
    result = trainer(client(server, "w0"), model, digits, epochs=2).run()
    per_epoch = num_batches(digits.num_train, 32)
    assert result["iterations"] == 2 * per_epoch and result["steps"] == 2 * per_epoch
    assert result["epochs_done"] == 2 and result["test_accuracy"] is not None


def test_sync_workers_move_in_lockstep_and_drop_nothing(start: Any, model: Path, digits: Dataset) -> None:
    shard, client = start
    server = shard(mode="sync", replicas_to_aggregate=2, total_replicas=2)
    results: dict[int, dict[str, Any]] = {}

    def run(index: int) -> None:
        results[index] = trainer(client(server, f"w{index}"), model, digits, worker_index=index, num_workers=2,
                                 steps=20).run()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == [0, 1]
    for r in results.values():
        assert (r["steps"], r["iterations"], r["dropped"], r["mode"]) == (20, 20, 0, "sync")
    assert results[0]["test_accuracy"] is not None and results[1]["test_accuracy"] is None


def test_the_start_barrier_waits_only_until_the_start_timeout(start: Any, model: Path, digits: Dataset) -> None:
    shard, client = start
    server = shard(mode="async")
    worker = trainer(client(server, "w0"), model, digits, num_workers=2, steps=10, start_timeout=0.5)
    with pytest.raises(TrainingError, match=r"start barrier: not all 2 workers arrived within .* s"):
        worker.run()
    assert [w.live for w in server.shard.view().workers] == [False], "a worker that gave up leaves"


def test_a_worker_that_comes_back_resumes_from_the_shards_state(start: Any, model: Path, digits: Dataset) -> None:
    shard, client = start
    server = shard(mode="async")
    before = trainer(client(server, "w0"), model, digits, steps=10).run()
    assert (before["resumed"], before["clock"]) == (False, 10)
    after = trainer(client(server, "w0"), model, digits, steps=25).run()
    assert after["resumed"] and after["iterations"] == 15 and after["clock"] == 25 and after["steps"] == 25


def test_a_worker_refuses_a_mode_other_than_the_shards(start: Any, model: Path, digits: Dataset) -> None:
    shard, client = start
    server = shard(mode="async")
    engine = GradientEngine(model, batch_size=32, intra_op_threads=1)
    worker = Trainer(client(server, "w0"), engine, digits, expected_mode="sync",
                     plan=TrainingPlan(worker_index=0, num_workers=1, batch_size=32, steps=5, start_timeout=5))
    with pytest.raises(TrainingError, match="configured for mode 'sync', but the shards .* run mode 'async'"):
        worker.run()


def test_a_worker_waits_for_initialization_only_until_its_start_timeout(start: Any, model: Path,
                                                                        digits: Dataset) -> None:
    shard, client = start
    server = shard(mode="async")
    worker = trainer(client(server, "w1"), model, digits, worker_index=1, num_workers=2, steps=5, start_timeout=0.6)
    with pytest.raises(TrainingError, match=r"waited .* s for worker 0 to initialize the parameters"):
        worker.run()


def test_events_are_json_lines_with_the_fields_the_launcher_reads(start: Any, model: Path, digits: Dataset,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import sys

    shard, client = start
    server = shard(mode="async")
    engine = GradientEngine(model, batch_size=32, intra_op_threads=1)
    plan = TrainingPlan(worker_index=0, num_workers=1, batch_size=32, steps=30, eval_every=10, progress_every=0.001)
    Trainer(client(server, "w0"), engine, digits, plan=plan, report=JsonLinesSink(sys.stdout)).run()
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "done" and "progress" in kinds
    assert [e["step"] for e in events if e["event"] == "eval"] == [0, 10, 20, 30]
    progress = next(e for e in events if e["event"] == "progress")
    assert {"step", "loss", "samples_per_second", "stale_drops", "worker"} <= set(progress)



class _Recorder:
    """Wraps a client's push_pull and an engine's step, noting each call's interval and the steps a push read."""

    def __init__(self, client: PSClient, engine: GradientEngine, *, await_gradient: float = 0.0,
                 gradients: int = 0) -> None:
        """With `await_gradient` s, push t of a run of `gradients` (t < `gradients`) holds its answer until
        gradient t + 1 has begun, or that long (`met` notes which). Only a push that runs beside the next gradient
        sees it begin, so the count does not hang on how a loaded machine schedules two short intervals."""
        self.pushes: list[tuple[float, float, list[int]]] = []
        self.steps: list[tuple[float, float]] = []
        self.met: list[bool] = []
        begun = threading.Condition()
        count, called = [0], [0]   # gradients begun, pushes called
        push_pull, step = client.push_pull, engine.step

        def recorded_push_pull(*args: Any, **kwargs: Any):
            began = time.monotonic()
            reads = list(kwargs.get("read_steps") or client.steps)
            try:
                return push_pull(*args, **kwargs)
            finally:
                with begun:
                    called[0] += 1
                    following = called[0] + 1   # push t (1-based) is gradient t's; gradient t + 1 follows it
                    if await_gradient and following <= gradients:
                        self.met.append(begun.wait_for(lambda: count[0] >= following, timeout=await_gradient))
                self.pushes.append((began, time.monotonic(), reads))

        def recorded_step(*args: Any, **kwargs: Any):
            began = time.monotonic()
            with begun:
                count[0] += 1
                begun.notify_all()
            try:
                return step(*args, **kwargs)
            finally:
                self.steps.append((began, time.monotonic()))

        client.push_pull = recorded_push_pull   # type: ignore[method-assign]
        engine.step = recorded_step             # type: ignore[method-assign]

    def overlapped(self) -> int:
        """How many pushes ran while a gradient was being computed."""
        return sum(any(a < d and c < b for c, d in self.steps) for a, b, _ in self.pushes)


@pytest.mark.parametrize("overlap", [True, False])
def test_async_overlaps_each_push_with_the_next_gradient_adding_exactly_one_step_of_staleness(
        start: Any, model: Path, digits: Dataset, overlap: bool) -> None:
    shard, client = start
    server = shard(mode="async")
    worker = trainer(client(server, "w0"), model, digits, steps=12, overlap=overlap)
    # with overlap, every push but the last is still in flight when the next gradient begins; without, none is
    # (the push would hold the gradient back, so it is not made to wait for it)
    recorder = _Recorder(worker.client, worker.engine, await_gradient=10.0 if overlap else 0.0, gradients=12)
    result = worker.run()
    assert (result["steps"], result["iterations"], result["dropped"]) == (12, 12, 0)
    # one worker: push t (1-based) read the step its gradient was computed at
    reads = [r[0] for _, _, r in sorted(recorder.pushes)]
    if overlap:
        assert reads == [0, 0, *range(1, 11)]   # t - 2 (the first two on the initial values)
        assert recorder.met == [True] * 11       # pushes 1-11 each ran beside the next gradient
    else:
        assert reads == list(range(12))          # t - 1
        assert recorder.met == []
        assert recorder.overlapped() == 0


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_sync_and_ssp_never_overlap(start: Any, model: Path, digits: Dataset, mode: str) -> None:
    shard, client = start
    server = shard(mode=mode, **({"staleness": 1} if mode == "ssp" else {"replicas_to_aggregate": 1,
                                                                         "total_replicas": 1}))
    worker = trainer(client(server, "w0"), model, digits, steps=8, overlap=True)
    recorder = _Recorder(worker.client, worker.engine)
    assert worker.run()["iterations"] == 8
    assert recorder.overlapped() == 0


def test_a_model_that_outputs_its_own_loss_trains_without_a_labels_input(start: Any, digits: Dataset,
                                                                         tmp_path: Path) -> None:
    """loss="output:NAME" adds no labels input: the data's labels were fed all the same, and the engine refused
    them as an unknown input once the job had started."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(0).standard_normal((64, 10)).astype(np.float32) * 0.1
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["logits"], name="dense"),
         helper.make_node("Mul", ["logits", "logits"], ["squared"], name="square"),
         helper.make_node("ReduceMean", ["squared"], ["penalty"], name="mean", keepdims=0)],
        "own_loss", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10]),
         helper.make_tensor_value_info("penalty", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(weight, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    path = tmp_path / "own_loss.onnx"
    onnx.save(model, path)
    shard, client = start
    server = shard(mode="async", optimizer="sgd", optimizer_params={"lr": 0.5})
    engine = GradientEngine(path, batch_size=32, loss="output:penalty", intra_op_threads=1)
    worker = Trainer(client(server, "w0"), engine, digits,
                     plan=TrainingPlan(worker_index=0, num_workers=1, batch_size=32, steps=20, eval_every=0,
                                       start_timeout=10.0, wait_timeout=30.0))
    losses = []
    recorded = engine.step

    def step(*args: Any, **kwargs: Any):
        assert "labels" not in args[1]
        result = recorded(*args, **kwargs)
        losses.append(result.loss)
        return result

    engine.step = step   # type: ignore[method-assign]
    assert worker.run()["steps"] == 20
    assert losses[-1] < 0.5 * losses[0]   # the penalty, the model's own loss, went down
