"""The process helper (ps_common.process) on tiny Python children: READY lines, events, errors, stopping by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ps_common import process
from ps_common.errors import ProcessStartError
from ps_common.process import ChildProcess

#: Longest wait for anything in these tests; the children are tiny scripts.
TIMEOUT = 20.0


def script(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_the_ready_line_then_events_then_plain_lines_are_told_apart(tmp_path: Path) -> None:
    outputs: list[process.Output] = []
    child = ChildProcess("echo", script("""
        import json, sys, time
        print("starting up")
        print('{"event": "early"}')               # before READY: an ordinary line
        print("ECHO_READY " + json.dumps({"port": 7}), flush=True)
        print(json.dumps({"event": "progress", "step": 1}))
        print(json.dumps({"no_event_key": 1}))
        print("to stderr", file=sys.stderr)
        sys.stdout.flush(); sys.stderr.flush()
        time.sleep(60)
    """), ready_prefix="ECHO_READY ", events=True, sink=lambda c, out: outputs.append(out))
    try:
        assert child.wait_ready(TIMEOUT) == {"port": 7}
        event = child.wait_event(lambda e: e["event"] == "progress", TIMEOUT)
        assert event == {"event": "progress", "step": 1}
        assert child.events == [event]
        deadline = time.monotonic() + TIMEOUT
        while "to stderr" not in child.last_lines("stderr") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.last_lines("stderr") == ["to stderr"]
        assert child.last_lines("stdout")[:2] == ["starting up", '{"event": "early"}']
    finally:
        code = child.stop(grace=5)
    assert code == -signal.SIGTERM
    assert not child.alive() and child not in process.running_children()
    kinds = {(o.stream, o.kind, o.text) for o in outputs}
    assert ("stdout", process.READY, 'ECHO_READY {"port": 7}') in kinds
    assert ("stdout", process.LINE, '{"event": "early"}') in kinds
    assert ("stdout", process.LINE, '{"no_event_key": 1}') in kinds
    assert ("stdout", process.EVENT, '{"event": "progress", "step": 1}') in kinds
    assert child.wait_drained(TIMEOUT)
    assert {(o.stream, o.kind) for o in outputs if o.kind == process.CLOSED} == {("stdout", "closed"),
                                                                                  ("stderr", "closed")}


def test_a_child_that_exits_before_ready_is_named_with_its_argv_exit_code_and_last_lines() -> None:
    argv = script("""
        import sys
        print("loading the model")
        print("no such model: bogus", file=sys.stderr)
        sys.exit(3)
    """)
    child = ChildProcess("shard7", argv, ready_prefix="READY ")
    with pytest.raises(ProcessStartError) as info:
        child.wait_ready(TIMEOUT)
    message = str(info.value)
    assert message.startswith(f"shard7 (pid {child.pid}; argv: {sys.executable} -c ")
    assert "exited with code 3 before its READY line ('READY')" in message
    assert "[shard7] loading the model" in message and "[shard7] no such model: bogus" in message


def test_a_silent_child_fails_at_the_timeout_and_is_stopped() -> None:
    child = ChildProcess("mute", script("import time; time.sleep(60)"), ready_prefix="READY ")
    started = time.monotonic()
    with pytest.raises(ProcessStartError, match=r"mute .* printed no READY line \('READY'\) within 0\.5 s; "
                                                r"its last lines:\n  \(no output\)"):
        child.wait_ready(0.5)
    assert time.monotonic() - started < 0.5 + TIMEOUT / 2
    assert child.returncode == -signal.SIGTERM


def test_a_malformed_ready_line_is_an_error_naming_the_line() -> None:
    child = ChildProcess("odd", script("import time; print('READY not-json', flush=True); time.sleep(60)"),
                         ready_prefix="READY ")
    with pytest.raises(ProcessStartError, match=r"odd .* printed a malformed READY line 'READY not-json'"):
        child.wait_ready(TIMEOUT)
    assert not child.alive()


def test_a_chatty_child_never_blocks_on_its_pipes_and_its_log_file_is_quoted(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = ChildProcess("chatty", script("""
        import sys, time
        for i in range(20000):
            print("x" * 100, i)
            print("log line", i, file=sys.stderr)
        print("READY {}", flush=True)
        time.sleep(60)
    """), ready_prefix="READY ", stderr=log)
    try:
        assert child.wait_ready(TIMEOUT) == {}
        assert child.last_lines("stderr")[-1] == "log line 19999"
        assert len(child.last_lines("stdout")) == process.TAIL_LINES
    finally:
        child.stop(grace=5)


def test_stop_all_kills_a_child_that_ignores_sigterm_after_the_grace() -> None:
    stubborn = ChildProcess("stubborn", script("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("READY {}", flush=True)
        time.sleep(60)
    """), ready_prefix="READY ")
    polite = ChildProcess("polite", script("import time; print('READY {}', flush=True); time.sleep(60)"),
                          ready_prefix="READY ")
    stubborn.wait_ready(TIMEOUT)
    polite.wait_ready(TIMEOUT)
    killed: list[str] = []
    started = time.monotonic()
    survivors = process.stop_all([stubborn, polite], grace=1.0, on_kill=lambda p: killed.append(p.name))
    assert survivors == [] and killed == ["stubborn"]
    assert (stubborn.returncode, polite.returncode) == (-signal.SIGKILL, -signal.SIGTERM)
    assert time.monotonic() - started < 2 * 1.0 + 1.0


def test_a_child_that_cannot_start_is_named_with_its_argv(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-program"
    with pytest.raises(ProcessStartError, match=rf"ghost could not start \(argv: {missing} --flag\)"):
        ChildProcess("ghost", [missing, "--flag"])


@pytest.mark.parametrize("safe_path_flag", [True, False], ids=["-P", "3.10-bootstrap"])
def test_python_module_argv_keeps_the_working_directory_off_sys_path(tmp_path: Path, safe_path_flag: bool) -> None:
    (tmp_path / "ps_common").mkdir()
    (tmp_path / "ps_common" / "__init__.py").write_text("raise ImportError('the user directory shadowed ps_common')\n")
    (tmp_path / "decoy_module_in_cwd.py").write_text("print('SHADOWED')\n")
    env = process.child_env()
    if not safe_path_flag or process.HAS_SAFE_PATH_FLAG:
        ours = subprocess.run(process.python_module_argv("ps_common.settings_doc", "--markdown",
                                                         safe_path_flag=safe_path_flag),
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT)
        assert ours.returncode == 0, ours.stderr
        assert "| `mode` |" in ours.stdout
        theirs = subprocess.run(process.python_module_argv("decoy_module_in_cwd", safe_path_flag=safe_path_flag),
                                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT)
        assert theirs.returncode != 0 and "SHADOWED" not in theirs.stdout
        assert "No module named decoy_module_in_cwd" in theirs.stderr
    else:
        pytest.skip(f"-P needs Python 3.11+, this is {sys.version.split()[0]}")


def test_child_env_drops_adds_and_unbuffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CONFIG", "{}")
    monkeypatch.setenv("PS_KEEP_ME", "1")
    env = process.child_env({"PS_EXTRA": "2"}, drop=["TF_CONFIG"])
    assert "TF_CONFIG" not in env
    assert (env["PS_KEEP_ME"], env["PS_EXTRA"], env["PYTHONUNBUFFERED"]) == ("1", "2", "1")
    assert os.environ["TF_CONFIG"] == "{}"


def test_the_session_sweep_stops_every_descendant_by_pid_and_says_how() -> None:
    from tests.helpers.processes import descendants, reap_descendants

    # A parent with a polite child and a stubborn one (ignores SIGTERM), which has a child of its own.
    parent = subprocess.Popen(script("""
        import subprocess, sys, time
        polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        stubborn = subprocess.Popen([sys.executable, "-c", (
            "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)")])
        print(polite.pid, stubborn.pid, flush=True)
        time.sleep(60)
    """), stdout=subprocess.PIPE, text=True)
    try:
        polite, stubborn = map(int, parent.stdout.readline().split())
        deadline = time.monotonic() + TIMEOUT
        while len(descendants(parent.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        found = descendants(parent.pid)
        assert {polite, stubborn} <= set(found) and len(found) == 3, found
        report = reap_descendants(parent.pid, grace=1.0)
        assert descendants(parent.pid) == {}
        assert parent.poll() is None, "the root itself is not stopped"
        assert any(line.startswith(f"pid {polite} (") and line.endswith("stopped by SIGTERM") for line in report)
        assert any(line.startswith(f"pid {stubborn} (") and line.endswith("stopped by SIGKILL") for line in report)
        assert len(report) == 3, report
    finally:
        process.stop(parent, grace=5)
        parent.stdout.close()
