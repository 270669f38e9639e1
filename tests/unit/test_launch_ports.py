"""ps-launch's port picking for replicated jobs: below the kernel's ephemeral range, distinct, free, a fallback."""

from __future__ import annotations

import socket

from ps_tools.launch import supervise


def bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_ports_are_picked_below_the_ephemeral_range_distinct_and_free(tmp_path, monkeypatch) -> None:
    path = tmp_path / "range"
    path.write_text("40000\t60999\n")
    monkeypatch.setattr(supervise, "EPHEMERAL_RANGE_FILE", str(path))
    assert supervise.ephemeral_range() == (40000, 60999)
    ports = supervise.free_ports(12)
    assert len(set(ports)) == 12, ports
    assert all(supervise.LOWEST_PICKED_PORT <= p < 40000 for p in ports), ports
    assert all(bindable(p) for p in ports), ports


def test_a_port_in_use_is_never_picked(tmp_path, monkeypatch) -> None:
    # a span of a few ports, one of them held by a listener: every pick must avoid it
    path = tmp_path / "range"
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        port = held.getsockname()[1]
        monkeypatch.setattr(supervise, "LOWEST_PICKED_PORT", port - 10)
        path.write_text(f"{port + 10} 60999\n")   # picks from [port - 10, port + 9], 4 x 2 < 20
        monkeypatch.setattr(supervise, "EPHEMERAL_RANGE_FILE", str(path))
        for _ in range(20):
            assert port not in supervise.free_ports(2)
    finally:
        held.close()


def test_without_a_readable_range_the_kernel_picks(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(supervise, "EPHEMERAL_RANGE_FILE", str(tmp_path / "missing"))
    assert supervise.ephemeral_range() is None
    ports = supervise.free_ports(3)
    assert len(set(ports)) == 3 and all(bindable(p) for p in ports), ports


def test_a_range_with_no_room_below_falls_back_to_the_kernel(tmp_path, monkeypatch) -> None:
    path = tmp_path / "range"
    path.write_text(f"{supervise.LOWEST_PICKED_PORT + 5} 60999\n")
    monkeypatch.setattr(supervise, "EPHEMERAL_RANGE_FILE", str(path))
    ports = supervise.free_ports(4)
    assert len(set(ports)) == 4 and all(p > supervise.LOWEST_PICKED_PORT + 5 for p in ports), ports


def test_a_range_file_that_is_not_two_numbers_reads_as_none(tmp_path, monkeypatch) -> None:
    path = tmp_path / "range"
    path.write_text("not a range\n")
    monkeypatch.setattr(supervise, "EPHEMERAL_RANGE_FILE", str(path))
    assert supervise.ephemeral_range() is None
