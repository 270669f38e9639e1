"""ps-serve --follow against real shard processes: the served step advances as pushes land, every answer equals the
model at the step it reports (never a mix of two), new and evicted rows of a dynamic table are followed, and a job
that cannot be followed ends ps-serve with one line and exit 2."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.http as tritonhttp
from onnx import TensorProto, helper, numpy_helper

from ps_common.process import PIPE, ChildProcess, child_env, python_module_argv
from ps_models.builders import build_mlp
from ps_serve.cli import READY_PREFIX
from ps_tools import ctl
from tests.helpers.launch import REPO_ROOT
from worker_client.client import PSClient, RetryPolicy
from worker_client.client.rows import dynamic_table

LR = 0.5
READY_TIMEOUT = 60.0
#: The longest a pushed step may take to be served here (the benchmark measures the real figure).
SERVED_WITHIN = 10.0


def start_serve(model: Path, *flags: str) -> tuple[ChildProcess, dict]:
    child = ChildProcess("ps-serve", python_module_argv("ps_serve.cli", "--model", str(model), *flags),
                         env=child_env(None, drop=["PS_AUTH_TOKEN", "PS_READER_TOKEN"]), cwd=REPO_ROOT,
                         ready_prefix=READY_PREFIX, stderr=PIPE, new_session=False)
    return child, child.wait_ready(READY_TIMEOUT)


@pytest.fixture
def serve():
    started: list[ChildProcess] = []

    def start(model: Path, *flags: str) -> tuple[ChildProcess, dict]:
        child, ready = start_serve(model, *flags)
        started.append(child)
        return child, ready

    yield start
    for child in started:
        child.stop(10.0)


def client(cluster, worker_id: str) -> PSClient:
    c = PSClient(cluster.addresses, worker_id=worker_id, rpc_timeout=30, wait_timeout=30,
                 retry=RetryPolicy(attempts=3, initial_backoff=0.05))
    c.wait_ready(30)
    return c


def infer(address: str, model: str, inputs: dict[str, np.ndarray]) -> tuple[int, np.ndarray]:
    """(step, first output) of one inference over HTTP with tritonclient."""
    triton = tritonhttp.InferenceServerClient(address)
    try:
        tensors = []
        for name, value in inputs.items():
            tensor = tritonhttp.InferInput(name, list(value.shape), "FP32" if value.dtype == np.float32 else "INT64")
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        result = triton.infer(model, tensors)
        answer = result.get_response()
        return int(answer["parameters"]["step"]), result.as_numpy(answer["outputs"][0]["name"])
    finally:
        triton.close()


def mlp_forward(values: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    hidden = np.maximum(x @ values["fc1.weight"] + values["fc1.bias"], 0)
    return hidden @ values["fc2.weight"] + values["fc2.bias"]


def test_the_served_step_follows_a_sync_job_and_no_answer_mixes_two_steps(start_cluster, serve, tmp_path,
                                                                          capsys) -> None:
    cluster = start_cluster(2, mode="sync", flags=["--optimizer", "sgd", "--lr", str(LR), "--replicas-to-aggregate",
                                                   "1", "--total-replicas", "1", "--partition-min-bytes", "64"])
    model = tmp_path / "mlp.onnx"
    onnx.save(build_mlp(input_dim=8, hidden=(6,), num_classes=3), model)
    initial = {t.name: numpy_helper.to_array(t) for t in onnx.load(model).graph.initializer}
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    with client(cluster, "w0") as w0:
        w0.initialize(initial)
        w0.register(heartbeat=False)
        exported = tmp_path / "served.onnx"
        assert ctl.main(["export", "--model", str(model), "--out", str(exported), "--servers",
                         cluster.address_option]) == 0
        capsys.readouterr()
        _, ready = serve(exported, "--follow", cluster.address_option, "--follow-interval", "0.05")
        assert ready["step"] == 0
        values_at = {0: {n: np.array(v) for n, v in w0.pull().items()}}

        answers: list[tuple[int, np.ndarray]] = []
        stop = threading.Event()

        def ask() -> None:   # requests all along, each checked against the values of the step it reports
            while not stop.is_set():
                answers.append(infer(ready["http"], "served", {"x": x}))

        asker = threading.Thread(target=ask)
        asker.start()
        try:
            for step in range(1, 7):
                w0.pull(min_steps=step - 1)
                grads = {n: np.full_like(v, 0.05 * step) for n, v in initial.items()}
                assert w0.push(grads).accepted
                values_at[step] = {n: np.array(v) for n, v in w0.pull(min_steps=step).items()}
                deadline = time.monotonic() + SERVED_WITHIN
                while True:
                    served_step, output = infer(ready["http"], "served", {"x": x})
                    if served_step >= step:
                        break
                    assert time.monotonic() < deadline, f"step {step} not served within {SERVED_WITHIN} s"
                    time.sleep(0.02)
                np.testing.assert_allclose(output, mlp_forward(values_at[step], x), rtol=1e-5, atol=1e-5)
        finally:
            stop.set()
            asker.join(30)
        assert len(answers) > 10
        for served_step, output in answers:
            np.testing.assert_allclose(output, mlp_forward(values_at[served_step], x), rtol=1e-5, atol=1e-5)
        assert 6 in {s for s, _ in answers} and len({s for s, _ in answers}) >= 3   # answered across steps


def dynamic_model(path: Path) -> Path:
    """out = Gather(emb, ids) summed over its row: one dynamic table of rows of 4, keyed by any int64 id."""
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["rows"]),
             helper.make_node("ReduceSum", ["rows", "axes"], ["out"], keepdims=0)]
    graph = helper.make_graph(nodes, "dyn", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b"])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b"])],
                              [numpy_helper.from_array(np.zeros((1, 4), np.float32), "emb"),
                               numpy_helper.from_array(np.array([1], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.save(model, path)
    return path


def test_new_and_evicted_rows_of_a_dynamic_table_are_followed(start_cluster, serve, tmp_path, capsys) -> None:
    cluster = start_cluster(2, mode="async", flags=["--optimizer", "sgd", "--lr", str(LR)])
    model = dynamic_model(tmp_path / "dyn.onnx")
    keys = np.array([7, 10**15 + 3, -42], np.int64)
    with client(cluster, "w0") as w0:
        w0.initialize({}, dynamic=[dynamic_table("emb", (4,), evict_after_steps=3)])
        w0.register(heartbeat=False)
        assert w0.push({}, row_gradients={"emb": (keys[:1], np.ones((1, 4), np.float32))}).accepted
        exported = tmp_path / "served.onnx"
        assert ctl.main(["export", "--model", str(model), "--out", str(exported), "--servers",
                         cluster.address_option]) == 0
        assert json.loads(capsys.readouterr().out)["dynamic_tables"] == {"emb": 1}
        _, ready = serve(exported, "--follow", cluster.address_option, "--follow-interval", "0.05")

        def served(step: int) -> np.ndarray:
            deadline = time.monotonic() + SERVED_WITHIN
            while True:
                served_step, output = infer(ready["http"], "served", {"ids": keys})
                if served_step >= step:
                    return output
                assert time.monotonic() < deadline, f"step {step} not served within {SERVED_WITHIN} s"
                time.sleep(0.02)

        np.testing.assert_allclose(served(1), [-4 * LR, 0, 0])   # unseen keys read the zero row
        # two new keys: their rows are followed
        assert w0.push({}, row_gradients={"emb": (keys[1:], np.ones((2, 4), np.float32))}).accepted
        np.testing.assert_allclose(served(2), [-4 * LR, -4 * LR, -4 * LR])
        # key 7 untouched for more than 3 steps is evicted on its shard: it reads the zero row again
        for _ in range(4):
            assert w0.push({}, row_gradients={"emb": (keys[1:], np.ones((2, 4), np.float32))}).accepted
        np.testing.assert_allclose(served(6), [0, -5 * 4 * LR, -5 * 4 * LR])


def test_a_job_that_cannot_be_followed_ends_ps_serve_with_one_line_and_exit_2(start_cluster, tmp_path) -> None:
    cluster = start_cluster(1, mode="async")
    model = tmp_path / "mlp.onnx"
    onnx.save(build_mlp(input_dim=8, hidden=(6,), num_classes=3), model)
    other = {"w": np.zeros((3, 3), np.float32)}
    with client(cluster, "w0") as w0:
        w0.initialize(other)
    for flags, expected in ((["--follow", cluster.address_option], "does not match the shards"),
                            (["--follow", ","], "names no shard address"),
                            # was retried for 30 s (and 127.0.0.1:99999 would have reached port 34463)
                            (["--follow", "notanaddr"], "address 'notanaddr' is not host:port"),
                            (["--follow", "127.0.0.1:99999"], "with a port in 1..65535")):
        child = ChildProcess("ps-serve", python_module_argv("ps_serve.cli", "--model", str(model), *flags),
                             env=child_env(None, drop=["PS_AUTH_TOKEN", "PS_READER_TOKEN"]), cwd=REPO_ROOT,
                             ready_prefix=READY_PREFIX, stderr=PIPE, new_session=False)
        code = child.wait(60)
        child.wait_drained(10)
        lines = [line for line in child.last_lines("stderr") if line.strip()]
        assert code == 2 and len(lines) == 1 and expected in lines[0], (code, lines)
