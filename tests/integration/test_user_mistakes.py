"""A new user's mistakes end with one or two lines naming the file, the value and the fix, and the promised exit code.

Each test runs the real command (ps-server, ps-worker, ps-launch as `python -P -m ...`)
the way a user would and asserts the last lines of stderr and the exit status: 2 for a
mistake found before anything started (docs/tools.md, "Exit codes"). For ps-launch it
also asserts that no shard or worker was started: a job that cannot run starts nothing.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ps_common.process import child_env, python_module_argv
from ps_models.builders import write_model
from ps_models.datasets import DIGITS_PATH
from ps_server.checkpoints import CheckpointDirectory

#: Longest run of one command here: each fails before it starts anything.
COMMAND_TIMEOUT = 60


def run(module: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(python_module_argv(module, *args), capture_output=True, text=True, env=child_env(),
                          timeout=COMMAND_TIMEOUT, cwd=cwd)


def last_lines(text: str, count: int = 2) -> str:
    return "\n".join(text.strip().splitlines()[-count:])


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 that a listening socket holds for the test."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The bundled MLP, a truncated copy of it, and digits with labels out of range and with float labels."""
    root = tmp_path_factory.mktemp("mistakes")
    model = write_model("mlp", root / "mlp.onnx")
    truncated = root / "truncated.onnx"
    truncated.write_bytes(model.read_bytes()[:3000])
    with np.load(DIGITS_PATH) as d:
        arrays = {k: d[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    np.savez(root / "labels15.npz", **{**arrays, "y_train": arrays["y_train"] + 5, "y_test": arrays["y_test"] + 5})
    np.savez(root / "float_labels.npz", **{**arrays, "y_train": arrays["y_train"].astype(np.float32),
                                           "y_test": arrays["y_test"].astype(np.float32)})
    one_shard = root / "one-shard-checkpoints"   # what a 1-shard job's shard leaves in --checkpoint-dir
    CheckpointDirectory(one_shard / "shard0").claim(0, 1)
    return {"model": model, "truncated": truncated, "labels15": root / "labels15.npz",
            "float_labels": root / "float_labels.npz", "one_shard": one_shard}


# ---------------------------------------------------------------------- ps-server


def test_ps_server_on_a_port_in_use_says_so_and_exits_2(taken_port: int) -> None:
    done = run("ps_server", "--port", str(taken_port))
    assert done.returncode == 2, done.stderr
    last = last_lines(done.stderr, 1)
    assert last.startswith(f"ps-server: shard 0: cannot bind 127.0.0.1:{taken_port}: the port is in use"), last
    assert "choose another --port (0 picks a free one)" in last
    assert "Traceback" not in done.stderr


def test_ps_server_with_its_metrics_port_in_use_says_so_and_exits_2(taken_port: int) -> None:
    done = run("ps_server", "--port", "0", "--metrics-port", str(taken_port))
    assert done.returncode == 2, done.stderr
    last = last_lines(done.stderr, 1)
    assert f"cannot bind the metrics endpoint 127.0.0.1:{taken_port}" in last, last
    assert "choose another --metrics-port" in last
    assert "Traceback" not in done.stderr


# ---------------------------------------------------------------------- ps-launch: checked before anything starts

LAUNCH_MISTAKES = {
    # id: (flags, what the one line must say)
    "missing-model": (["--model", "{root}/no-such-model.onnx"],
                      ["Invalid [worker] model (--model)", "no-such-model.onnx", "no such file",
                       "not a bundled model (deep_mlp, embedding, lenet, mlp, transformer)"]),
    "truncated-model": (["--model", "{truncated}"],
                        ["the model file {truncated} (3000 bytes) does not parse as an ONNX model",
                         "truncated, corrupt or not an ONNX file"]),
    "labels-out-of-range": (["--model", "{model}", "--data", "{labels15}"],
                            ["data {labels15} has labels up to 14 (y_train), but model {model} outputs 10 classes",
                             "labels must lie in 0..9; relabel the data, or use a model with 15 outputs"]),
    "float-labels-cross-entropy": (["--model", "{model}", "--data", "{float_labels}"],
                                   ["data {float_labels} holds floating-point targets (y_train is float32",
                                    "--loss cross_entropy needs integer class labels", "or use --loss mse"]),
    "batch-larger-than-a-share": (["--model", "{model}", "--batch-size", "2000"],
                                  ["Invalid [worker] batch_size (--batch-size): 2000: larger than a worker's share",
                                   "digits has 1438 training examples, 719 per worker with 2 worker(s)",
                                   "use --batch-size 719 or less"]),
    "missing-data": (["--model", "{model}", "--data", "{root}/no-such-data.npz"],
                     ["unknown dataset spec", "no-such-data.npz", "no file at"]),
    # written only at the job's end (the record) or inside the shards (checkpoints): found after the whole run
    "record-is-a-file": (["--model", "{model}", "--record", "{truncated}"],
                         ["Invalid --record '{truncated}': it is a file, not a folder"]),
    "checkpoint-dir-is-a-file": (["--model", "{model}", "--checkpoint-dir", "{truncated}"],
                                 ["Invalid --checkpoint-dir '{truncated}': it is a file, not a folder"]),
    # settings that would change nothing in this job: a user who set one expects it to hold
    "staleness-in-sync": (["--model", "{model}", "--mode", "sync", "--staleness", "2"],
                          ["Invalid [job] staleness (--staleness): 2.0 (from --staleness): applies only in mode ssp, "
                           "and this job's mode is sync (from --mode): drop it, or use --mode ssp"]),
    "label-column-with-npz": (["--model", "{model}", "--data", "{labels15}", "--label-column", "y"],
                              ["Invalid --label-column 'y': it applies only to a folder of Parquet files, and --data "
                               "'{labels15}' is not one"]),
    "shuffle-rows-with-digits": (["--model", "{model}", "--shuffle-rows", "64"],
                                 ["Invalid --shuffle-rows 64: it applies only to a folder of Parquet files"]),
    # each shard refuses a folder another job's shard owns, but only once the others have started (and made folders)
    "checkpoint-dir-of-another-shard-count": (["--model", "{model}", "--checkpoint-dir", "{one_shard}"],
                                              ["{one_shard}/shard0 belongs to shard 0 of a 1-shard job (SHARD.json, "
                                               "no checkpoint yet), and this job has --shards 2",
                                               "resume with --shards 1, or point --checkpoint-dir at another folder"]),
}
try:
    import onnxruntime
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():   # this machine has no GPU stack
        LAUNCH_MISTAKES["cuda-without-onnxruntime-gpu"] = (
            ["--model", "{model}", "--device", "cuda"],
            ["device='cuda' needs onnxruntime's CUDAExecutionProvider", "pip install 'onnx-ps[gpu]'"])
except ImportError:   # pragma: no cover - onnxruntime is a dependency
    pass


def _fill(items: list[str], files: dict[str, Path]) -> list[str]:
    names = {k: str(v) for k, v in files.items()} | {"root": str(files["model"].parent)}
    return [item.format(**names) for item in items]


@pytest.mark.parametrize("mistake", list(LAUNCH_MISTAKES))
def test_ps_launch_names_the_mistake_in_one_line_exits_2_and_starts_no_process(mistake, files, monkeypatch,
                                                                               capsys) -> None:
    from ps_tools import launch
    from ps_tools.launch import supervise   # where the launcher starts its processes

    def no_process(*args, **kwargs):
        raise AssertionError(f"ps-launch started a process for a job that cannot run: {args[:1]}")

    monkeypatch.setattr(supervise, "ChildProcess", no_process)
    flags, expected = LAUNCH_MISTAKES[mistake]
    status = launch.main(["--shards", "2", "--workers", "2", "--steps", "20", *_fill(flags, files)])
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ps-launch: "), err
    for text in _fill(expected, files):
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"


def test_ps_launch_from_the_command_line_prints_no_traceback_for_a_corrupt_model(files) -> None:
    done = run("ps_tools.launch", "--shards", "2", "--workers", "2", "--model", str(files["truncated"]))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr   # one line
    assert done.stderr.startswith(f"ps-launch: the model file {files['truncated']} (3000 bytes) does not parse")
    assert done.stdout == ""


@pytest.fixture
def free_port_below_a_taken_one() -> Iterator[tuple[socket.socket, int]]:
    """(holder, P): a listening socket holds P, and `holder` holds P-1 until the test closes it.

    Holding both until the call matters: a P-1 that some other process owns would make the launcher
    report shard 0's port instead of shard 1's (seen once in CI).
    """
    for _ in range(50):
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        holder = socket.socket()
        try:
            holder.bind(("127.0.0.1", port - 1))
        except OSError:
            holder.close()
            taken.close()
            continue
        try:
            yield holder, port
        finally:
            holder.close()
            taken.close()
        return
    pytest.fail("found no pair of adjacent ports on 127.0.0.1 in 50 tries")


def test_ps_launch_refuses_a_metrics_port_in_use_before_starting_a_shard(free_port_below_a_taken_one, files,
                                                                          monkeypatch, capsys) -> None:
    from ps_tools import launch
    from ps_tools.launch import supervise   # where the launcher starts its processes

    holder, taken_port = free_port_below_a_taken_one
    monkeypatch.setattr(supervise, "ChildProcess", lambda *a, **k: pytest.fail("a process was started"))
    holder.close()   # frees shard 0's port only now
    status = launch.main(["--shards", "2", "--model", str(files["model"]), "--metrics-port", str(taken_port - 1)])
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"shard 1's metrics endpoint (--metrics-port {taken_port - 1} + 1) needs port {taken_port}" in err
    assert "choose another --metrics-port" in err


# ---------------------------------------------------------------------- ps-worker by hand


@pytest.mark.parametrize("mistake", ["labels-out-of-range", "float-labels-cross-entropy", "batch-larger-than-a-share"])
def test_ps_worker_names_the_same_mistakes_before_it_calls_a_shard_and_exits_2(mistake, files) -> None:
    flags, expected = LAUNCH_MISTAKES[mistake]
    # worker 1 of 2, as on a second host: the same message as worker 0 and the launcher, not an IndexError
    done = run("worker_client", "--servers", "127.0.0.1:9", "--workers", "2", "--worker-index", "1",
               *_fill(flags, files))
    assert done.returncode == 2, done.stderr
    last = last_lines(done.stderr, 1)
    assert last.startswith("ps-worker: "), done.stderr
    for text in _fill(expected, files):
        assert text in last, f"{text!r} not in {last!r}"
    assert "waiting for shard" not in done.stderr and "Traceback" not in done.stderr


def test_ps_worker_with_a_wrong_servers_address_says_what_it_tried_and_what_to_check(files) -> None:
    with socket.socket() as sock:     # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = run("worker_client", "--servers", f"127.0.0.1:{port}", "--model", str(files["model"]),
               "--start-timeout", "2")
    assert done.returncode == 1, done.stderr
    last = last_lines(done.stderr, 1)
    assert f"shard 0 at 127.0.0.1:{port} not reachable after 2.0 s" in last, last
    assert f"Tried --servers 127.0.0.1:{port} (shard order)" in last
    assert "READY line" in last and "ps-ctl status HOST:PORT" in last


# ---------------------------------------------------------------------- model files crafted by someone else


@pytest.fixture(scope="module")
def crafted(tmp_path_factory) -> dict[str, Path]:
    """An embedding model whose table file links to a file outside its folder, and one with a 2^40 x 2^40 tensor
    that holds no data."""
    from onnx import TensorProto, helper
    import onnx

    from ps_models.large_table import write_large_embedding

    root = tmp_path_factory.mktemp("crafted")
    secret = root / "secret.bin"
    secret.write_bytes(np.full(64 * 4, 7.0, dtype="<f4").tobytes())
    linked = write_large_embedding(root / "m" / "linked.onnx", rows=64, dim=4, bag=2)
    data = linked.with_name(linked.name + ".data")
    data.unlink()
    data.symlink_to(secret)
    model = onnx.load(write_model("mlp", root / "huge.onnx"))
    model.graph.initializer.append(TensorProto(name="w.huge", data_type=TensorProto.FLOAT, dims=[1 << 40, 1 << 40]))
    model.graph.node.append(helper.make_node("Identity", ["w.huge"], ["huge.out"]))
    onnx.save_model(model, str(root / "huge.onnx"))
    return {"linked": linked, "huge": root / "huge.onnx"}


CRAFTED = {
    # id: (model, extra flags, what the one line must say)
    "table-linked-outside": ("linked", ["--data", "synthetic:ids?vocab=64&bag=2&n=400", "--sparse-tables",
                                        "embedding.weight"],
                             ["tensor 'embedding.weight'", "symbolic link"]),
    "huge-tensor-without-data": ("huge", [], ["tensor 'w.huge'", "declares shape [1099511627776, 1099511627776]"]),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_ps_launch_refuses_a_crafted_model_file_naming_it_and_the_tensor_and_starts_nothing(case, crafted,
                                                                                             monkeypatch, capsys):
    from ps_tools import launch
    from ps_tools.launch import supervise   # where the launcher starts its processes

    monkeypatch.setattr(supervise, "ChildProcess", lambda *a, **k: pytest.fail("a process was started"))
    model, flags, expected = CRAFTED[case]
    status = launch.main(["--shards", "2", "--workers", "2", "--steps", "5", "--batch-size", "8",
                          "--model", str(crafted[model]), *flags])
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ps-launch: "), err
    for text in [str(crafted[model]), *expected]:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"


@pytest.mark.parametrize("case", list(CRAFTED))
def test_ps_worker_refuses_a_crafted_model_file_before_it_calls_a_shard(case, crafted):
    model, flags, expected = CRAFTED[case]
    done = run("worker_client", "--servers", "127.0.0.1:9", "--model", str(crafted[model]), "--batch-size", "8",
               *flags)
    assert done.returncode == 2, done.stderr
    last = last_lines(done.stderr, 1)
    for text in ["ps-worker: ", str(crafted[model]), *expected]:
        assert text in last, f"{text!r} not in {last!r}"
    assert "waiting for shard" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("case", list(CRAFTED))
def test_ps_check_names_the_file_and_the_tensor_of_a_crafted_model(case, crafted):
    model, _, expected = CRAFTED[case]
    done = run("worker_client.check", str(crafted[model]))
    assert done.returncode == 1, done.stdout + done.stderr
    for text in [str(crafted[model]), *expected]:
        assert text in done.stdout, f"{text!r} not in {done.stdout!r}"
    assert "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def two_inputs(tmp_path_factory) -> Path:
    """A classifier of digits that takes two data inputs, x and x2 (their sum goes through one layer)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.random.default_rng(0).normal(0, 0.1, (64, 10)).astype(np.float32), "fc.weight")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x2"], ["sum"]), helper.make_node("MatMul", ["sum", "fc.weight"], ["logits"])],
        "two_inputs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64]),
                       helper.make_tensor_value_info("x2", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 10])], [weight])
    path = tmp_path_factory.mktemp("two") / "two_inputs.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_a_model_with_an_input_the_data_does_not_feed_is_refused_before_anything_starts(two_inputs, monkeypatch,
                                                                                         capsys):
    from ps_tools import launch
    from ps_tools.launch import supervise   # where the launcher starts its processes

    monkeypatch.setattr(supervise, "ChildProcess", lambda *a, **k: pytest.fail("a process was started"))
    status = launch.main(["--shards", "1", "--workers", "1", "--steps", "5", "--model", str(two_inputs)])
    err = capsys.readouterr().err
    assert status == 2, err
    line = err.strip()
    assert "\n" not in line and line.startswith("ps-launch: "), err
    for text in [str(two_inputs), "takes 2 data inputs ('x', 'x2')", "provides only 'x'", "'x2' would be missing"]:
        assert text in line, f"{text!r} not in {line!r}"
    done = run("worker_client", "--servers", "127.0.0.1:9", "--model", str(two_inputs))
    assert done.returncode == 2 and "'x2' would be missing" in last_lines(done.stderr, 1), done.stderr
    assert "waiting for shard" not in done.stderr
