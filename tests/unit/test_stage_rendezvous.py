"""The rendezvous of a local pipeline job's stage workers: publish and lookup in a shared folder."""

from __future__ import annotations

import threading
import time

import pytest

from ps_common.errors import StageTimeoutError, StoppedError
from worker_client.pipeline.rendezvous import lookup, path_of, publish


def test_a_published_address_is_found_and_a_republished_one_replaces_it(tmp_path):
    path = publish(tmp_path, 1, 2, "127.0.0.1:4000")
    assert path == tmp_path / "replica1-stage2.json"
    assert lookup(tmp_path, 1, 2, timeout=1) == "127.0.0.1:4000"
    publish(tmp_path, 1, 2, "127.0.0.1:4001")
    assert lookup(tmp_path, 1, 2, timeout=1) == "127.0.0.1:4001"
    assert [p.name for p in tmp_path.iterdir()] == ["replica1-stage2.json"]   # no temporary file left


def test_lookup_waits_for_an_address_published_later(tmp_path):
    threading.Timer(0.3, publish, (tmp_path, 0, 0, "127.0.0.1:5000")).start()
    assert lookup(tmp_path, 0, 0, timeout=5) == "127.0.0.1:5000"


def test_a_lookup_that_runs_out_names_the_file_and_the_seconds(tmp_path):
    started = time.monotonic()
    with pytest.raises(StageTimeoutError) as err:
        lookup(tmp_path, 3, 1, timeout=0.3)
    assert time.monotonic() - started < 1.5
    assert str(path_of(tmp_path, 3, 1)) in str(err.value) and "0.3 s" in str(err.value)


def test_a_half_written_file_is_not_an_address(tmp_path):
    path_of(tmp_path, 0, 0).write_text('{"address": ')
    with pytest.raises(StageTimeoutError):
        lookup(tmp_path, 0, 0, timeout=0.2)


def test_a_stop_event_ends_a_lookup_promptly(tmp_path):
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with pytest.raises(StoppedError):
        lookup(tmp_path, 0, 0, timeout=60, stop=stop)
    assert time.monotonic() - started < 1.0
