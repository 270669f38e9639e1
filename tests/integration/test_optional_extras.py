"""A missing optional extra (pyproject.toml, [project.optional-dependencies]) breaks its feature, never the run.

`pip install onnx-ps` without an extra must still run every job that does not ask for what
the extra brings, and one that does gets a clear outcome:

* ``demo`` (matplotlib): ``ps-launch --record DIR`` writes run.json and the summary, says in
  one line there is no plot and how to get one, and exits 0 -- the plot is a nicety;
* ``tensorboard`` (tensorboardX): ``--tensorboard DIR`` is refused before anything starts,
  in one line naming the extra, exit 2;
* ``gpu`` (onnxruntime-gpu): ``--device cuda`` without onnxruntime's CUDA provider is
  refused before anything starts, in one line naming the extra, exit 2.

A package is made missing for the real commands by a folder on PYTHONPATH holding a package
of that name whose import raises ImportError (the children run with ``python -P``, which
keeps PYTHONPATH); the CUDA provider by hiding it from onnxruntime's provider list.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ps_common.process import child_env, python_module_argv

#: Longest run of one command here: a job of 20 steps, or one refused before it starts.
COMMAND_TIMEOUT = 120
#: The smallest real job: the bundled MLP on digits, one shard, one worker.
TINY_JOB = ("--shards", "1", "--workers", "1", "--model", "mlp", "--data", "digits", "--batch-size", "32",
            "--steps", "20", "--eval-every", "10")


def without(package: str, root: Path) -> dict[str, str]:
    """An environment in which ``import package`` raises ImportError, as where it is not installed."""
    stub = root / "without" / package
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(f"raise ImportError(\"No module named '{package}'\")\n", encoding="utf-8")
    path = [str(root / "without"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return child_env({"PYTHONPATH": os.pathsep.join(path)})


def launch(*flags: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(python_module_argv("ps_tools.launch", "--timeout", "90", *flags), capture_output=True,
                          text=True, env=env, timeout=COMMAND_TIMEOUT)


@pytest.mark.timeout(COMMAND_TIMEOUT + 30)
def test_record_without_matplotlib_writes_run_json_says_there_is_no_plot_and_exits_0(tmp_path: Path) -> None:
    record = tmp_path / "run"
    done = launch(*TINY_JOB, "--record", str(record), env=without("matplotlib", tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]

    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout should hold only the summary line, got {lines}"
    summary = json.loads(lines[-1])
    assert summary["steps"] == 20 and summary["record"] == str(record.resolve())
    run = json.loads((record / "run.json").read_text(encoding="utf-8"))
    assert run["summary"] == summary
    assert not (record / "plot.png").exists()

    said = [line for line in done.stderr.splitlines() if "no plot" in line]
    assert len(said) == 1, done.stderr[-4000:]
    assert "install matplotlib" in said[0] and "pip install 'onnx-ps[demo]'" in said[0], said[0]


@pytest.mark.timeout(COMMAND_TIMEOUT + 30)
def test_tensorboard_without_tensorboardx_is_refused_in_one_line_naming_the_extra_before_anything_starts(
        tmp_path: Path) -> None:
    board = tmp_path / "board"
    done = launch(*TINY_JOB, "--tensorboard", str(board), env=without("tensorboardX", tmp_path))
    assert done.returncode == 2, done.stderr[-4000:]
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-4000:]
    assert lines[0].startswith("ps-launch: --tensorboard needs the tensorboardX package"), lines[0]
    assert "pip install 'onnx-ps[tensorboard]'" in lines[0], lines[0]
    assert not board.exists()


@pytest.mark.timeout(COMMAND_TIMEOUT + 30)
def test_ps_worker_tensorboard_without_tensorboardx_is_refused_in_one_line_naming_the_extra(tmp_path: Path) -> None:
    # No shard runs: the worker must refuse before it calls one.
    done = subprocess.run(
        python_module_argv("worker_client", "--servers", "127.0.0.1:9", "--model", "mlp", "--data", "digits",
                           "--steps", "5", "--tensorboard", str(tmp_path / "board")),
        capture_output=True, text=True, env=without("tensorboardX", tmp_path), timeout=COMMAND_TIMEOUT)
    assert done.returncode == 2, done.stderr[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "--tensorboard needs the tensorboardX package" in last and "pip install 'onnx-ps[tensorboard]'" in last, last


def test_device_cuda_without_the_cuda_provider_is_refused_in_one_line_naming_the_gpu_extra(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # onnxruntime without onnxruntime-gpu offers no CUDAExecutionProvider; hidden here so that the
    # outcome is the same on a machine that has it (tests/integration/test_user_mistakes.py runs the
    # same mistake only where it is really missing).
    import onnxruntime

    from ps_tools import launch as launch_module
    from ps_tools.launch import supervise   # where the launcher starts its processes

    offered = [p for p in onnxruntime.get_available_providers() if p != "CUDAExecutionProvider"]
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: list(offered))

    def no_process(*args, **kwargs):
        raise AssertionError(f"ps-launch started a process for a job that cannot run: {args[:1]}")

    monkeypatch.setattr(supervise, "ChildProcess", no_process)
    status = launch_module.main([*TINY_JOB, "--device", "cuda"])
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ps-launch: "), err
    assert "device='cuda' needs onnxruntime's CUDAExecutionProvider" in lines[0], lines[0]
    assert "pip install 'onnx-ps[gpu]'" in lines[0], lines[0]
