"""What ps-launch shows: one live bar on a terminal, only JSON with --log-json, metrics where it says, TensorBoard scalars.

Real jobs of the bundled MLP on digits (2 shards, 2 workers, sync), as `make demo` runs
them: one under a pseudo-terminal (Python's pty module), read back as a terminal would
show it; one with --log-json --verbose --metrics-port 0 whose every line must parse and
whose shards' metrics are fetched while it trains.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import struct
import subprocess
import termios
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from ps_common.process import child_env, python_module_argv
from tests.helpers.tensorboard import read_scalars

#: The demo's job (Makefile, `make demo`), without its paths.
DEMO_FLAGS = ("--mode", "sync", "--shards", "2", "--workers", "2", "--optimizer", "momentum", "--lr", "0.05",
              "--model", "mlp", "--data", "digits", "--batch-size", "32", "--steps", "500", "--eval-every", "25",
              "--min-accuracy", "0.95")
#: Longest run of one job here, in seconds.
JOB_TIMEOUT = 180
#: The terminal the pty pretends to be.
COLUMNS, ROWS = 120, 40
#: A line of the live bar as it is left on the screen, e.g.
#: " 100%|█████| 500/500 steps | ETA 00:00 | loss 0.0211 | 9,870 samples/s | stale drops 0 | test acc 0.9694".
BAR = re.compile(r"^\s*(\d+)%\|.*\| (\d+)/(\d+) steps \| ETA (\S+) \| loss \S+ \| [\d,]+ samples/s \| "
                 r"stale drops \d+")


def run_in_terminal(argv: list[str], timeout: float) -> tuple[int, str]:
    """Runs argv with a pseudo-terminal as stdin, stdout and stderr; (exit status, everything it wrote)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=child_env({"TERM": "xterm"}),
                            close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:   # EIO: every writer closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            proc.kill()
            pytest.fail(f"ps-launch ran past {timeout} s under a terminal; it wrote:\n"
                        + b"".join(chunks).decode(errors="replace")[-3000:])
        status = proc.wait(timeout=30)
    finally:
        os.close(master)
    return status, b"".join(chunks).decode("utf-8", errors="replace")


def screen_lines(raw: str) -> list[str]:
    """The lines a terminal leaves on the screen: each line as its last carriage return redrew it."""
    lines = []
    for line in raw.replace("\r\n", "\n").split("\n"):
        shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line.split("\r")[-1]).rstrip()
        if shown:
            lines.append(shown)
    return lines


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_the_demo_in_a_terminal_shows_one_live_bar_with_an_eta_and_a_handful_of_lines(tmp_path: Path) -> None:
    tensorboard = tmp_path / "tensorboard"
    argv = python_module_argv("ps_tools.launch", *DEMO_FLAGS, "--record", str(tmp_path / "run"),
                              "--tensorboard", str(tensorboard))
    status, raw = run_in_terminal(argv, JOB_TIMEOUT)
    lines = screen_lines(raw)
    shown = "\n".join(lines)
    assert status == 0, shown

    bars = [line for line in lines if BAR.match(line)]
    assert len(bars) == 1, f"expected one bar on the screen:\n{shown}"
    percent, done, total, eta = BAR.match(bars[0]).groups()   # type: ignore[union-attr]
    assert (percent, done, total) == ("100", "500", "500") and re.fullmatch(r"\d\d:\d\d", eta), bars[0]
    redraws = {m.group(2) for m in (BAR.match(part.strip("\n")) for part in raw.split("\r")) if m}
    assert len(redraws) >= 3, f"the bar was drawn at steps {sorted(redraws)} only: not live"
    assert len(lines) <= 5, f"more than the header, the bar, the result and the summary:\n{shown}"
    assert lines[0].startswith("[launch] sync job: 2 shard(s), 2 worker(s); model mlp, data digits"), shown
    assert re.match(r"\[launch\] done: test accuracy 0\.9\d+ after 500 steps", lines[-2]), shown
    assert json.loads(lines[-1])["steps"] == 500
    assert not [line for line in lines if line.startswith(("[shard", "[worker"))], shown

    summary = json.loads(lines[-1])
    scalars = read_scalars(tensorboard)
    assert {"train/loss", "train/samples_per_second", "train/stale_drops", "test/accuracy", "test/loss"} <= set(scalars)
    assert max(step for step, _ in scalars["train/loss"]) == 500
    final_step, final_accuracy = max(scalars["test/accuracy"])
    assert final_step == 500 and final_accuracy == pytest.approx(summary["test_accuracy"], abs=1e-6)
    assert len(scalars["test/accuracy"]) >= 10   # one evaluation every 25 steps


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_log_json_gives_only_json_lines_with_fields_and_the_metrics_are_served_where_it_says(tmp_path) -> None:
    argv = python_module_argv("ps_tools.launch", *DEMO_FLAGS[:-2], "--steps", "1500", "--log-json", "--verbose",
                              "--metrics-port", "0", "--print-every", "0.5")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    stdout: list[str] = []
    reader = threading.Thread(target=lambda: stdout.extend(proc.stdout), daemon=True)   # type: ignore[arg-type]
    reader.start()
    stderr: list[str] = []
    scraped: dict[str, str] = {}
    try:
        for line in proc.stderr:   # type: ignore[union-attr]
            stderr.append(line)
            record = json.loads(line)
            if record.get("metrics") and not scraped:   # fetched while the job trains
                for url in record["metrics"]:
                    with urllib.request.urlopen(url, timeout=10) as answer:
                        scraped[url] = answer.read().decode()
        status = proc.wait(timeout=JOB_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    assert status == 0, "".join(stderr[-20:])

    records = [json.loads(line) for line in stderr]   # every line parses, or json.loads raised above
    summary = [json.loads(line) for line in stdout]
    assert len(summary) == 1 and summary[0]["steps"] == 1500
    for record in records:
        assert {"ts", "level", "msg", "process"} <= set(record), record
    processes = {r["process"] for r in records}
    assert {"launch", "shard0", "shard1", "worker0", "worker1"} <= processes, processes
    # the children's fields are keys, not only text in the message
    assert any(r["process"] == "shard1" and r.get("shard") == 1 for r in records)
    assert any(r["process"] == "worker1" and r.get("worker") == 1 and len(r.get("servers", [])) == 2
               for r in records)
    assert any(r["process"] == "worker0" and r.get("shards") == 2 and r.get("already_initialized") is False
               for r in records)
    evals = [r for r in records if r["process"] == "worker0" and r.get("event") == "eval"]
    assert evals and all(isinstance(r["step"], int) and "test_accuracy" in r for r in evals)
    progress = [r for r in records if r["process"] == "launch" and r.get("event") == "progress"]
    assert progress and {"percent", "eta_seconds", "loss", "samples_per_second", "stale_drops"} <= set(progress[-1])
    assert progress[-1]["percent"] == 100.0

    assert len(scraped) == 2, records[:5]
    for url, text in scraped.items():
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url)
        assert "ps_step{" in text and "ps_pushes_total{" in text, text[:500]
        assert "_created" not in text


@pytest.mark.timeout(2 * JOB_TIMEOUT + 60)
def test_a_job_resumed_from_checkpoints_at_its_steps_says_it_trained_nothing(tmp_path) -> None:
    """A second run of a finished job over its checkpoints has nothing left to do: it says so, rather than a
    "done after 20 steps" that reads as if it trained them."""
    flags = ("--shards", "1", "--workers", "1", "--model", "mlp", "--data", "digits", "--steps", "20",
             "--checkpoint-dir", str(tmp_path / "checkpoints"), "--timeout", str(JOB_TIMEOUT))
    runs = [subprocess.run(python_module_argv("ps_tools.launch", *flags), capture_output=True, text=True,
                           env=child_env(), timeout=JOB_TIMEOUT + 30) for _ in range(2)]
    for done in runs:
        assert done.returncode == 0, done.stderr[-3000:]
    first, second = (json.loads(done.stdout.strip().splitlines()[-1]) for done in runs)
    assert first["samples"] == 640 and first["steps"] == 20
    assert second["samples"] == 0 and second["steps"] == 20
    assert "nothing trained" not in runs[0].stderr
    assert ("WARNING: the shards are already at step 20, at or past --steps 20: nothing to train (raise --steps to "
            "train further)") in runs[1].stderr
    assert "done: nothing trained (the job was already at step 20, at or past --steps 20); test accuracy" \
        in runs[1].stderr
