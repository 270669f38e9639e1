"""End to end: exported models train through ps-launch as their framework's own loop does.

The fixture scripts recorded each framework's digits accuracy with one recipe
(training.json beside them); ps-launch runs the same recipe on one worker, which sees the
examples in the same order, and must land within a point of it. The riskiest two run here:
training-mode BatchNorm + Dropout (state on the shards) and a Keras CNN at tf2onnx's
default opset (upgraded, markers instead of folded biases).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ps_server.checkpoints import CheckpointDirectory

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
#: The launcher, as a user runs it (the console script, wherever its module lives).
PS_LAUNCH = Path(sys.executable).parent / "ps-launch"
#: How far below the framework's own accuracy ps-launch may land (the issue's one point).
ONE_POINT = 0.01
#: Longest run of one launched job, in seconds.
JOB_TIMEOUT = 240


def _digits_file(layout: str, input_name: str, folder: Path) -> Path:
    spec = importlib.util.spec_from_file_location("digits_layouts",
                                                  FIXTURES / "digits_layouts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write(layout, folder / f"digits_{layout}.npz", input_name)


def _launch(fixture: str, tmp_path: Path, *extra: str) -> tuple[dict, dict]:
    folder, name = fixture.split("/")
    record = json.loads((FIXTURES / folder / "training.json").read_text())[name]
    recipe = record["recipe"]
    data = _digits_file(record["layout"], record["input_name"], tmp_path)
    argv = [str(PS_LAUNCH), "--mode", "sync", "--workers", "1", "--shards", "2",
            "--optimizer", recipe["optimizer"], "--lr", str(recipe["lr"]),
            "--batch-size", str(recipe["batch_size"]), "--steps", str(recipe["steps"]),
            "--seed", str(recipe["seed"]), "--model", str(FIXTURES / folder / f"{name}.onnx"),
            "--data", str(data), "--eval-every", "0", "--log-level", "WARNING",
            "--timeout", str(JOB_TIMEOUT), *extra]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT + 30)
    assert done.returncode == 0, f"ps-launch exited {done.returncode}:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1]), record


def test_training_mode_batch_norm_and_dropout_train_like_torch_with_state_on_the_shards(
        tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    summary, record = _launch("torch/bn_dropout_train", tmp_path,
                              "--checkpoint-dir", str(checkpoints))
    assert summary["steps"] == record["recipe"]["steps"]
    assert summary["test_accuracy"] >= record["framework_test_accuracy"] - ONE_POINT, \
        (summary, record)
    found = {}
    for shard in sorted(checkpoints.iterdir()):
        latest = CheckpointDirectory(shard).latest()
        assert latest is not None, shard
        _, state = latest
        flags = {s.name: s.state for s in state.parameters}
        assert flags["bn.running_mean"] and flags["bn.running_var"] and not flags["bn.weight"]
        found.update({part.name: part.value for part in state.parts})
    # 600 steps of momentum 0.9 moved the running statistics far from their start (0 and 1)
    assert np.abs(found["bn.running_mean"]).max() > 0.01
    assert np.abs(found["bn.running_var"] - 1.0).max() > 0.01


def test_a_keras_cnn_at_tf2onnxs_default_opset_trains_like_keras(tmp_path: Path) -> None:
    summary, record = _launch("keras/keras_cnn", tmp_path)
    assert summary["test_accuracy"] >= record["framework_test_accuracy"] - ONE_POINT, \
        (summary, record)
