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
    return {"model": model, "truncated": truncated, "labels15": root / "labels15.npz",
            "float_labels": root / "float_labels.npz"}


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
