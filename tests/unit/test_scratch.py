"""Scratch folders and temporary files go with their process: a killed process's are removed by the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from ps_common import scratch
from ps_common.scratch import ScratchDir, process_tag, sweep_temporaries, temporary_name

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="process start times come from Linux's /proc")

MAKE_AND_HANG = textwrap.dedent("""
    import sys, time
    from ps_common.scratch import ScratchDir
    folder = ScratchDir("ps-worker")
    (folder.path / "model.onnx").write_bytes(b"x" * 1000)
    print(folder.path, flush=True)
    time.sleep(60)
""")


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(scratch.tempfile, "tempdir", None)   # re-read TMPDIR
    yield tmp_path
    scratch.tempfile.tempdir = None


def killed_process_folder(tmp_path) -> str:
    child = subprocess.Popen([sys.executable, "-c", MAKE_AND_HANG], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        path = child.stdout.readline().strip()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert path and os.path.isdir(path)
    return path


def test_a_killed_processs_scratch_folder_is_removed_when_the_next_one_is_made(tmpdir_env):
    left = []
    for _ in range(3):
        left.append(killed_process_folder(tmpdir_env))
        # SIGKILL ran no cleanup; each successor removed its predecessor's folder
        assert [os.path.isdir(p) for p in left] == [False] * (len(left) - 1) + [True]
    with ScratchDir("ps-worker") as mine:
        assert not any(os.path.exists(p) for p in left)
        assert sorted(os.listdir(mine.parent)) == [mine.name]
    assert os.listdir(mine.parent) == []


def test_a_running_processs_folder_is_kept(tmpdir_env):
    child = subprocess.Popen([sys.executable, "-c", MAKE_AND_HANG], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "TMPDIR": str(tmpdir_env)})
    try:
        theirs = child.stdout.readline().strip()
        with ScratchDir("ps-launch"):
            assert os.path.isdir(theirs)
    finally:
        child.kill()
        child.wait(10)


def test_a_folder_whose_pid_now_belongs_to_another_process_is_removed(tmpdir_env):
    root = scratch.scratch_root()
    pid, start = process_tag().split("-")
    stale = root / f"ps-worker-{pid}-{int(start) + 1}-abc123"   # this pid, but started at another time
    stale.mkdir()
    with ScratchDir("ps-worker"):
        assert not stale.exists()


def test_the_scratch_root_is_private_and_a_planted_one_is_not_used(tmpdir_env):
    root = scratch.scratch_root()
    assert oct(os.stat(root).st_mode & 0o777) == oct(0o700)
    root.rmdir()
    elsewhere = tmpdir_env / "elsewhere"
    elsewhere.mkdir()
    root.symlink_to(elsewhere)                           # planted: a link to somewhere else
    assert scratch.scratch_root() is None
    with ScratchDir("ps-worker") as made:
        assert made.parent == tmpdir_env and os.listdir(elsewhere) == []


def test_a_killed_writers_temporary_file_is_removed_by_the_next_writer(tmp_path):
    final = tmp_path / "entry.onnx"
    child = subprocess.run([sys.executable, "-c", "import os; from pathlib import Path; "
                            "from ps_common.scratch import temporary_name; "
                            f"print(temporary_name(Path({str(final)!r})))"], capture_output=True, text=True, check=True)
    theirs = tmp_path / os.path.basename(child.stdout.strip())   # a process now gone
    theirs.write_bytes(b"partial")
    mine = temporary_name(final)
    mine.write_bytes(b"mine")
    assert sweep_temporaries(tmp_path) == [theirs]
    assert mine.exists() and not theirs.exists()


@pytest.mark.parametrize("kind", ["", "Ps", "ps_worker", "../x", "ps-1"])
def test_a_kind_that_is_not_lowercase_words_is_refused(kind):
    with pytest.raises(ValueError, match="Invalid scratch kind"):
        ScratchDir(kind)
