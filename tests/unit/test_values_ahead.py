"""A read whose values are told as they land (Read.written, for the data channel's values first): each part's
bytes told in order up to its size, the same values as a plain read, told while the update writes them only where
the read follows the push without waiting, and never where the answer must wait (a replicated shard)."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.shard_map import ParamSpec
from ps_server.operations import Push, Read
from ps_server.optimizers import _BLOCK_BYTES
from ps_server.optimizers import make_optimizer
from tests.helpers.domain import LR, decode, initialize, make_shard, own_chunks, values

# w spans several of the optimizer's cache blocks; b and s are small; s is a state part (running statistics)
W_ROWS = 3 * (_BLOCK_BYTES // 32) + 100
MODEL = {"w": (np.arange(W_ROWS * 8, dtype=np.float32) % 7).reshape(W_ROWS, 8),
         "b": np.ones(5, np.float32), "s": np.zeros(3, np.float32)}
G = 0.25


class Told:
    """Read.written's calls: (part key, bytes, the shard's step at the time)."""

    def __init__(self, shard) -> None:
        self.shard = shard
        self.calls: list[tuple[tuple[str, int], int, int]] = []

    def __call__(self, key, nbytes: int) -> None:
        self.calls.append((key, nbytes, self.shard.step))

    def of(self, key) -> list[tuple[int, int]]:
        return [(nbytes, step) for k, nbytes, step in self.calls if k == key]


def ready(mode: str = "async", workers=("a",), dynamic=(), **overrides):
    shard = make_shard(mode, **overrides)
    specs = [ParamSpec("w", "float32", MODEL["w"].shape), ParamSpec("b", "float32", (5,)),
             ParamSpec("s", "float32", (3,), state=True), *dynamic]
    initialize(shard, specs, own_chunks(shard, MODEL, specs=specs))
    for worker in workers:
        shard.register(worker)
    return shard, specs


def a_push(shard, specs, worker: str, clock: int, read_step: int) -> Push:
    grads = {"w": np.full_like(MODEL["w"], G), "b": np.full(5, G, np.float32), "s": np.full(3, 2.0, np.float32)}
    return Push(worker, clock, read_step, decode(own_chunks(shard, grads, specs=specs), shard.push_layout()))


def into(shard) -> dict:
    return {key: np.full_like(state.value, np.nan) for key, state in shard.store.parts.items()}


def check_told_in_order(told: Told, targets: dict) -> None:
    for key, target in targets.items():
        sizes = [nbytes for nbytes, _ in told.of(key)]
        assert sizes, f"{key} never told"
        assert sizes == sorted(sizes) and sizes[-1] == target.nbytes, (key, sizes, target.nbytes)


def test_a_read_that_follows_its_push_is_told_block_by_block_while_the_update_writes_it() -> None:
    shard, specs = ready()
    targets = into(shard)
    told = Told(shard)
    result = shard.push_pull(a_push(shard, specs, "a", 0, 0), Read(into=targets, written=told))
    assert result.push.accepted and result.values is not None and shard.step == 1
    check_told_in_order(told, targets)
    w = told.of(("w", 0))
    # one call a block of the update, at step 0: before the push's step was counted, i.e. during the update
    assert len(w) == -(-MODEL["w"].size * 4 // _BLOCK_BYTES) and {step for _, step in w} == {0}
    assert {step for _, step in told.of(("s", 0))} == {0}   # a state part takes its pushed value whole
    for key, value in values(shard).items():
        np.testing.assert_array_equal(targets[key], value)
    np.testing.assert_array_equal(targets[("w", 0)], MODEL["w"] - LR * G)
    np.testing.assert_array_equal(targets[("s", 0)], np.full(3, 2.0, np.float32))


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_read_that_waits_after_its_push_is_told_only_after_the_wait(mode: str) -> None:
    shard, specs = ready(mode, workers=("a",))
    targets = into(shard)
    told = Told(shard)
    read = Read(into=targets, written=told, wait_for_step=mode == "sync", ssp=mode == "ssp", timeout=5.0)
    result = shard.push_pull(a_push(shard, specs, "a", 0, 0), read)
    assert result.values is not None and shard.step == 1
    check_told_in_order(told, targets)
    assert {step for _, _, step in told.calls} == {1}   # copied by the read, after the step, never during the update
    for key, value in values(shard).items():
        np.testing.assert_array_equal(targets[key], value)


def test_a_dropped_push_still_tells_its_read() -> None:
    shard, specs = ready(max_staleness=1)
    for clock in range(3):   # the shard is at step 3
        shard.push_pull(a_push(shard, specs, "a", clock, clock), Read(into=into(shard)))
    before = values(shard)
    targets = into(shard)
    told = Told(shard)
    result = shard.push_pull(a_push(shard, specs, "a", 3, 0), Read(into=targets, written=told))
    assert not result.push.accepted and result.values is not None
    check_told_in_order(told, targets)
    for key, value in before.items():
        np.testing.assert_array_equal(targets[key], value)


class Log:
    """A replication log that takes everything at once."""

    seq = 0

    def record(self, op) -> int:
        self.seq += 1
        return self.seq

    def wait(self, seq: int) -> None:
        pass


def test_a_replicated_shard_never_tells_what_its_backups_may_not_hold_yet() -> None:
    shard, specs = ready()
    shard.replication = Log()
    targets = into(shard)
    told = Told(shard)
    result = shard.push_pull(a_push(shard, specs, "a", 0, 0), Read(into=targets, written=told))
    assert result.values is not None and told.calls == []
    np.testing.assert_array_equal(targets[("w", 0)], MODEL["w"] - LR * G)


def test_a_read_without_a_place_for_its_values_tells_nothing() -> None:
    shard, specs = ready()
    told = Told(shard)
    result = shard.push_pull(a_push(shard, specs, "a", 0, 0), Read(written=told))
    assert result.values is not None and told.calls == []
    np.testing.assert_array_equal(result.values.parts[("w", 0)], MODEL["w"] - LR * G)


def test_the_optimizer_tells_its_blocks_in_order_and_an_unblocked_update_whole() -> None:
    for name in ("sgd", "adam", "adagrad", "rmsprop"):
        optimizer = make_optimizer(name, lr=0.1)
        param = np.arange(2 * (_BLOCK_BYTES // 4) + 5, dtype=np.float32)
        state = optimizer.init_state(param)
        blocks: list[tuple[int, int]] = []
        optimizer.apply(param, np.ones_like(param), state, updated=lambda a, b: blocks.append((a, b)))
        assert blocks[0][0] == 0 and blocks[-1][1] == param.size, name
        assert all(x[1] == y[0] for x, y in zip(blocks, blocks[1:])), name
        strided = np.arange(20, dtype=np.float32)[::2]   # not contiguous: one pass over the whole array
        blocks.clear()
        optimizer.apply(strided, np.ones_like(strided), optimizer.init_state(strided),
                        updated=lambda a, b: blocks.append((a, b)))
        assert blocks == [(0, 10)], name


def test_a_read_into_arrays_without_telling_is_still_copied_while_the_update_writes_it(monkeypatch) -> None:
    # (a shared-memory segment's read: the copy reads each block from the cache instead of memory)
    from ps_server import shard as shard_module

    seen: list[tuple] = []
    updated = shard_module._CopyOut.updated
    monkeypatch.setattr(shard_module._CopyOut, "updated",
                        lambda self, key, value, start, stop: (seen.append((key, start, stop)),
                                                               updated(self, key, value, start, stop)))
    shard, specs = ready()
    targets = into(shard)
    result = shard.push_pull(a_push(shard, specs, "a", 0, 0), Read(into=targets))
    assert result.values is not None
    assert [stop for key, _, stop in seen if key == ("w", 0)][-1] == MODEL["w"].size
    for key, value in values(shard).items():
        np.testing.assert_array_equal(targets[key], value)


def test_rows_of_a_fixed_tensor_asked_beside_are_no_reason_to_stop_telling_but_a_dynamic_tables_are() -> None:
    # a fixed tensor's rows are read after the dense parts and cannot fail; a dynamic table's new rows may pass
    # max_shard_bytes after them, and the answer then goes without its values
    from ps_common.dynamic_ids import DynamicTable

    table = ParamSpec("emb", "float32", (4,), dynamic=DynamicTable("normal:0.01", 0, 3))
    for rows, tells in (([("w", np.array([2, 0]))], True), ([("emb", np.array([5, 9]))], False)):
        shard, specs = ready(dynamic=[table])
        targets = into(shard)
        told = Told(shard)
        result = shard.push_pull(a_push(shard, specs, "a", 0, 0), Read(into=targets, written=told, rows=rows))
        assert result.values is not None and len(result.values.rows) == 1
        assert bool(told.calls) == tells, rows
        if tells:
            check_told_in_order(told, targets)
            np.testing.assert_array_equal(result.values.rows[0][1], (MODEL["w"] - LR * G)[[2, 0]])
        np.testing.assert_array_equal(targets[("w", 0)], MODEL["w"] - LR * G)
