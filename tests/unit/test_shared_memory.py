"""Anonymous shared-memory segments and the fd door that hands them out: nothing named, nothing plantable,
tickets good once, sizes sealed."""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import time

import numpy as np
import pytest

from ps_common import shared_memory
from ps_common.shared_memory import FdDoor, Layout, Segment, collect

pytestmark = pytest.mark.skipif(not shared_memory.available(), reason="needs Linux memfd and SCM_RIGHTS")


@pytest.fixture
def door():
    made = FdDoor()
    yield made
    made.close()


def test_a_segment_has_no_name_on_disk_and_its_size_is_sealed():
    before = set(os.listdir("/dev/shm"))
    segment = Segment.create(4096)
    try:
        assert set(os.listdir("/dev/shm")) == before
        assert os.readlink(f"/proc/self/fd/{segment.fd}").startswith("/memfd:" + shared_memory.MEMFD_NAME)
        seals = fcntl.fcntl(segment.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.ftruncate(segment.fd, 0)   # a peer cannot pull the memory from under the other's mapping
    finally:
        segment.close()


def test_a_collected_segment_is_the_same_memory_on_both_sides(door):
    layout = Layout.of([(("w", 0), np.float32, (4, 3)), (("b", 0), np.float32, (3,))])
    made: list[Segment] = []
    ticket = door.issue(lambda: made.append(Segment.create(layout.size)) or made[0])
    worker = collect(door.name, ticket)
    try:
        assert worker.size == layout.size
        grads = np.arange(12, dtype=np.float32).reshape(4, 3)
        worker.write(layout.gradients[:1], [grads])
        np.testing.assert_array_equal(made[0].view(layout.gradients[0]), grads)
        np.copyto(made[0].view(layout.values[1]), np.full(3, 2.5, np.float32))
        np.testing.assert_array_equal(worker.view(layout.values[1]), [2.5, 2.5, 2.5])
    finally:
        worker.close()
        made[0].close()


def test_a_regions_views_are_made_once_each_call_a_new_dict_and_dropped_at_close():
    layout = Layout.of([(("w", 0), np.float32, (4, 3)), (("ids", 0), np.int64, (2,)), (("b", 0), np.float32, (3,))])
    segment = Segment.create(layout.size)
    first, second = segment.views(layout.values), segment.views(layout.values)
    assert list(first) == [("w", 0), ("ids", 0), ("b", 0)] and first is not second
    assert all(first[key] is second[key] for key in first)          # the same arrays, kept
    first.pop(("w", 0))                                             # a caller's dict is its own
    assert ("w", 0) in segment.views(layout.values)
    grads = segment.views(layout.gradients)
    assert list(grads) == [("w", 0), ("b", 0)] and grads[("w", 0)].shape == (4, 3)
    for _ in range(10):   # sequences made for one call are not all kept: at most KEPT_SEQUENCES
        segment.views(layout.values[:2])
    assert len(segment._made) <= Segment.KEPT_SEQUENCES
    assert all(first[key] is segment.views(layout.values)[key] for key in first)
    np.copyto(second[("b", 0)], [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(segment.view(layout.values[2]), [1.0, 2.0, 3.0])
    del first, second, grads
    segment.close()   # the kept views are dropped first, so the mapping is unmapped here, not when collected
    assert segment._map.closed


def test_a_ticket_is_good_once(door):
    ticket = door.issue(lambda: Segment.create(64))
    collect(door.name, ticket).close()
    with pytest.raises(ValueError, match="refused the ticket"):
        collect(door.name, ticket)


def test_a_wrong_or_truncated_ticket_gets_nothing_and_makes_no_segment(door):
    made = []
    ticket = door.issue(lambda: made.append(1) or Segment.create(64))
    with pytest.raises(ValueError, match="refused the ticket"):
        collect(door.name, bytes(b ^ 1 for b in ticket))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:   # sends half a ticket, then hangs up
        sock.connect("\0" + door.name)
        sock.sendall(ticket[:5])
    time.sleep(0.1)
    assert made == []
    collect(door.name, ticket).close()   # the real ticket still works
    assert made == [1]


def test_an_expired_ticket_is_refused(door, monkeypatch):
    ticket = door.issue(lambda: Segment.create(64))
    later = time.monotonic() + shared_memory.TICKET_SECONDS + 1
    monkeypatch.setattr(shared_memory.time, "monotonic", lambda: later)
    with pytest.raises(ValueError, match="refused the ticket"):
        collect(door.name, ticket)


def test_a_stalled_caller_does_not_block_the_door_for_others(door, monkeypatch):
    monkeypatch.setattr(shared_memory, "DOOR_TIMEOUT_SECONDS", 0.5)
    ticket = door.issue(lambda: Segment.create(64))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stalled:
        stalled.connect("\0" + door.name)   # sends nothing
        started = time.monotonic()
        collect(door.name, ticket, timeout=5).close()
        assert time.monotonic() - started < 3


@pytest.mark.parametrize("name", ["../etc/passwd", "onnx-ps-segment", "other-door", "onnx-ps-door-\0x"])
def test_collecting_from_a_name_that_is_not_a_door_of_ours_is_refused(name):
    with pytest.raises(ValueError, match="is not a shared-memory door name"):
        collect(name, b"x" * 32)


def test_a_descriptor_that_is_not_a_sealed_segment_is_not_mapped(tmp_path):
    regular = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(regular, 64)
    with pytest.raises(ValueError, match="not a sealable segment"):
        Segment.adopt(regular, 64)
    unsealed = os.memfd_create("x", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, 64)
    with pytest.raises(ValueError, match="size is not sealed"):
        Segment.adopt(unsealed, 64)
    sealed = Segment.create(64)
    try:
        with pytest.raises(ValueError, match="holds 64 bytes, 128 were announced"):
            Segment.adopt(os.dup(sealed.fd), 128)
    finally:
        sealed.close()


def test_a_door_in_another_network_namespace_cannot_be_reached():
    # abstract sockets belong to one network namespace: a name nobody bound here is refused at once
    with pytest.raises(OSError):
        collect(shared_memory.DOOR_PREFIX + "0" * 24, b"x" * 32, timeout=1)


def test_closing_the_door_ends_its_thread_and_frees_its_name():
    made = FdDoor()
    name = made.name
    made.close()
    assert not any(t.name == "fd-door" and t.is_alive() for t in threading.enumerate() if t is made._thread)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind("\0" + name)   # free again
