"""ReceiveBuffers: a pull's large arrays are reused only once nobody holds them."""

from __future__ import annotations

import threading

import numpy as np

from worker_client.client.buffers import KEEP, MIN_BYTES, ReceiveBuffers

LARGE = (MIN_BYTES // 4,)   # float32 elements of exactly MIN_BYTES


def test_an_array_nobody_holds_is_handed_out_again_for_the_same_tensor_shape_and_dtype() -> None:
    buffers = ReceiveBuffers()
    first = buffers.empty("w", LARGE, np.float32)
    address = first.ctypes.data
    del first
    again = buffers.empty("w", LARGE, np.float32)
    assert again.ctypes.data == address
    # another tensor, shape or dtype never gets it
    assert buffers.empty("b", LARGE, np.float32).ctypes.data != address
    assert buffers.empty("w", (LARGE[0] + 1,), np.float32).ctypes.data != address
    assert buffers.empty("w", LARGE, np.int32).ctypes.data != address


def test_an_array_still_held_directly_or_through_a_view_or_memoryview_is_never_rewritten() -> None:
    buffers = ReceiveBuffers()
    held = buffers.empty("w", LARGE, np.float32)
    held[:] = 1.0
    other = buffers.empty("w", LARGE, np.float32)
    assert other.ctypes.data != held.ctypes.data
    view = held[10:20]
    del held
    assert buffers.empty("w", LARGE, np.float32).ctypes.data != view.ctypes.data - 40
    np.testing.assert_array_equal(view, 1.0)
    exported = memoryview(other)
    other_address = np.frombuffer(exported, np.float32).ctypes.data
    del other
    fresh = buffers.empty("w", LARGE, np.float32)
    assert fresh.ctypes.data != other_address      # the memoryview still holds it
    assert fresh.ctypes.data != view.ctypes.data - 40


def test_at_most_keep_arrays_are_kept_per_tensor_and_small_ones_never() -> None:
    buffers = ReceiveBuffers()
    held = [buffers.empty("w", LARGE, np.float32) for _ in range(KEEP + 2)]
    addresses = [a.ctypes.data for a in held]
    del held
    reused = {buffers.empty("w", LARGE, np.float32).ctypes.data for _ in range(KEEP + 2)}
    assert reused <= set(addresses[:KEEP]) and len(reused) == 1   # one at a time, each dropped at once
    small = buffers.empty("b", (MIN_BYTES // 4 - 1,), np.float32)
    address = small.ctypes.data
    del small
    assert not any(key[0] == "b" for key in buffers._kept)
    buffers.clear()
    assert not buffers._kept and address


def test_threads_asking_at_once_never_get_the_same_array() -> None:
    buffers = ReceiveBuffers()
    got: list[np.ndarray] = []
    lock = threading.Lock()
    start = threading.Barrier(4)

    def take() -> None:
        start.wait(timeout=10)
        array = buffers.empty("w", LARGE, np.float32)
        with lock:
            got.append(array)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len({a.ctypes.data for a in got}) == 4
