"""Shard checkpoints without sockets: full-state round trips, dedup across a restore, atomic writes, corrupt files, retention."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_common.errors import CheckpointMismatchError, CorruptCheckpointError
from ps_server.checkpoints import CheckpointDirectory, Checkpointer, checkpoint_name
from ps_server.checkpoints import directory as ckpt_directory
from ps_server.checkpoints import fileformat as ckpt
from ps_server.config import ServerConfig
from ps_server.membership import DEDUP_WINDOW
from tests.helpers.domain import FakeClock, clocks, init_shard, make_shard, push, values

RNG = np.random.default_rng(7)
# "emb" is split over the two shards (partition_min_bytes is small); names hold the key separators on purpose.
MODEL = {
    "emb": RNG.standard_normal((64, 8)).astype(np.float32),
    "dense/w@0": RNG.standard_normal((8, 4)).astype(np.float32),
    "dense/b": np.zeros(4, np.float32),
    "scale": np.array(1.5, np.float64),
}
TWO_SHARDS = dict(num_shards=2, partition_min_bytes=256)


def grads(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in MODEL.items()}


def adam_shard(index: int = 1, mode: str = "async", now: FakeClock | None = None, **overrides):
    settings = dict(shard_index=index, optimizer="adam", optimizer_params={"lr": 0.01}, **TWO_SHARDS)
    settings.update(overrides)
    return make_shard(mode, now=now, **settings)


def trained_shard(mode: str = "async", **overrides):
    """Shard 1 of 2 with Adam after a few pushes from two workers, one of them dropped as stale."""
    shard = adam_shard(mode=mode, max_staleness=1, **overrides)
    init_shard(shard, MODEL)
    shard.register("a")
    shard.register("b")
    for i in range(4):
        assert push(shard, "a", i, shard.step, grads(i)).accepted
    dropped = push(shard, "b", 0, 0, grads(99))      # read at step 0, shard at 4: over max_staleness 1
    assert not dropped.accepted and dropped.drop_reason == pb.DROP_STALE
    assert push(shard, "b", 1, shard.step, grads(100)).accepted
    return shard


def slots(shard) -> dict:
    return {key: {k: v.copy() for k, v in s.slots.items()} for key, s in shard.store.parts.items()}


def save_and_restore(shard, tmp_path: Path, *, now: FakeClock | None = None, **config_overrides):
    """Writes the shard's checkpoint, reads it back and restores it into a fresh shard with the same settings."""
    directory = CheckpointDirectory(tmp_path)
    path = directory.write(shard.snapshot())
    fresh = make_shard(shard.config.mode, now=now, **{**_settings(shard.config), **config_overrides})
    fresh.restore(directory.read(path))
    return fresh


def _settings(config: ServerConfig) -> dict:
    return {k: getattr(config, k) for k in ("shard_index", "num_shards", "partition_min_bytes", "optimizer",
                                            "optimizer_params", "replicas_to_aggregate", "total_replicas",
                                            "max_staleness", "lease_seconds", "checkpoint_dir")}


def assert_same_state(a, b) -> None:
    assert (a.step, a.dropped, a.applied_gradients) == (b.step, b.dropped, b.applied_gradients)
    assert clocks(a) == clocks(b)
    va, vb = values(a), values(b)
    assert va.keys() == vb.keys()
    for key in va:
        np.testing.assert_array_equal(va[key], vb[key])
        assert va[key].dtype == vb[key].dtype
    sa, sb = slots(a), slots(b)
    for key in sa:
        assert sa[key].keys() == sb[key].keys()
        for slot in sa[key]:
            np.testing.assert_array_equal(sa[key][slot], sb[key][slot])
    for worker, record in a.membership.workers.items():
        assert dict(record.outcomes) == dict(b.membership.workers[worker].outcomes)
    assert a.store.shard_map == b.store.shard_map


# ---------------------------------------------------------------------- round trips


def test_a_restored_shard_holds_the_same_values_optimizer_slots_step_clocks_and_outcomes(tmp_path):
    shard = trained_shard()
    assert any(not p.whole for p in shard.store.shard_map.parts_of("emb")), "emb should be split over the shards"
    assert set(next(iter(shard.store.parts.values())).slots) == {"step", "exp_avg", "exp_avg_sq"}
    restored = save_and_restore(shard, tmp_path)
    assert_same_state(shard, restored)
    assert restored.step == 5 and restored.dropped == 1 and clocks(restored) == {"a": 4, "b": 2}


def test_a_restored_shard_continues_exactly_like_the_original(tmp_path):
    shard = trained_shard()
    restored = save_and_restore(shard, tmp_path)
    for i in range(3):
        first = push(shard, "a", 4 + i, shard.step, grads(200 + i))
        second = push(restored, "a", 4 + i, restored.step, grads(200 + i))
        assert first == second
    assert_same_state(shard, restored)


def test_a_retried_push_of_a_checkpointed_clock_is_a_duplicate_with_its_first_outcome_and_is_not_applied(tmp_path):
    shard = trained_shard()
    restored = save_and_restore(shard, tmp_path)
    before = values(restored)
    accepted = push(restored, "a", 3, 0, grads(3))            # its first outcome: accepted
    dropped = push(restored, "b", 0, 0, grads(99))            # its first outcome: dropped as stale
    assert accepted.duplicate and accepted.accepted
    assert dropped.duplicate and not dropped.accepted and dropped.drop_reason == pb.DROP_STALE
    assert (restored.step, restored.dropped, clocks(restored)) == (5, 1, {"a": 4, "b": 2})
    for key, value in before.items():
        np.testing.assert_array_equal(values(restored)[key], value)


def test_a_push_older_than_the_dedup_window_is_still_not_applied_after_a_restore(tmp_path):
    shard = adam_shard()
    init_shard(shard, MODEL)
    shard.register("a")
    for i in range(DEDUP_WINDOW + 3):
        push(shard, "a", i, shard.step, grads(i))
    restored = save_and_restore(shard, tmp_path)
    assert len(restored.membership.workers["a"].outcomes) == DEDUP_WINDOW
    old = push(restored, "a", 0, 0, grads(0))
    assert old.duplicate and restored.step == DEDUP_WINDOW + 3


def test_a_sync_step_partly_in_survives_a_restore_and_completes_with_the_same_mean(tmp_path):
    def sync_shard():
        shard = adam_shard(mode="sync", replicas_to_aggregate=2, total_replicas=2)
        init_shard(shard, MODEL)
        shard.register("a")
        shard.register("b")
        return shard

    shard = sync_shard()
    assert push(shard, "a", 0, 0, grads(1)).aggregated == 1
    restored = save_and_restore(shard, tmp_path)
    assert restored.policy.contributors == ["a"] and restored.step == 0
    retry = push(restored, "a", 0, 0, grads(1))
    assert retry.duplicate and retry.aggregated == 1 and restored.policy.contributors == ["a"]
    done_original = push(shard, "b", 0, 0, grads(2))
    done_restored = push(restored, "b", 0, 0, grads(2))
    assert done_original == done_restored and done_restored.step == 1
    assert_same_state(shard, restored)


def test_an_uninitialized_shard_with_workers_round_trips(tmp_path):
    shard = adam_shard()
    shard.register("a")
    restored = save_and_restore(shard, tmp_path)
    assert not restored.store.initialized and clocks(restored) == {"a": 0}


def test_workers_live_at_the_checkpoint_get_a_fresh_lease_and_workers_that_left_stay_gone(tmp_path):
    now = FakeClock()
    shard = adam_shard(now=now)
    init_shard(shard, MODEL)
    shard.register("a")
    shard.register("gone")
    shard.deregister("gone")
    later = FakeClock(start=5.0)       # another process: its own monotonic clock
    restored = save_and_restore(shard, tmp_path, now=later)
    assert restored.membership.live_clocks() == {"a": 0}
    later.advance(restored.config.lease_seconds + 1)
    assert restored.membership.live_clocks() == {}


# ---------------------------------------------------------------------- atomic writes and the directory


def test_a_directory_is_claimed_once_and_another_shard_is_refused_naming_both(tmp_path):
    directory = CheckpointDirectory(tmp_path / "shard0")
    assert directory.mismatch(0, 1) is None and not directory.path.exists()   # asking makes nothing
    directory.claim(0, 1)
    assert json.loads((directory.path / ckpt_directory.OWNER_FILE).read_text()) == {"shard_index": 0, "num_shards": 1}
    directory.claim(0, 1)                                                     # the same shard again: fine
    assert directory.mismatch(0, 1) is None
    why = directory.mismatch(0, 2)
    assert why == (f"checkpoint directory {directory.path} belongs to shard_index=0 of num_shards=1; this shard "
                   "is shard_index=0 of num_shards=2")
    with pytest.raises(CheckpointMismatchError, match="shard_index=1 of num_shards=2: give every shard a directory"):
        CheckpointDirectory(directory.path).claim(1, 2)
    assert directory.owner() == {"shard_index": 0, "num_shards": 1}           # the refused claim changed nothing


def test_an_unreadable_owner_file_is_rewritten_by_the_claim(tmp_path, caplog):
    directory = CheckpointDirectory(tmp_path)
    (tmp_path / ckpt_directory.OWNER_FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert directory.mismatch(1, 3) is None
        directory.claim(1, 3)
    assert directory.owner() == {"shard_index": 1, "num_shards": 3}
    assert "rewriting unreadable" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == [ckpt_directory.OWNER_FILE]   # no temporary left


def test_a_crash_mid_write_leaves_no_file_under_the_final_name(tmp_path, monkeypatch):
    shard = trained_shard()
    directory = CheckpointDirectory(tmp_path)
    first = directory.write(shard.snapshot())
    push(shard, "a", 4, shard.step, grads(4))

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":")   # a few bytes, then the crash
        raise OSError("disk on fire")

    monkeypatch.setattr(ckpt_directory, "save_file", crash)
    with pytest.raises(OSError, match="disk on fire"):
        directory.write(shard.snapshot())
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]
    assert not (tmp_path / checkpoint_name(6)).exists()
    path, state = directory.latest()
    assert path == first and state.step == 5


def test_a_temporary_file_left_by_a_killed_writer_is_ignored_and_removed_at_restore(tmp_path):
    shard = trained_shard(checkpoint_dir=str(tmp_path))
    CheckpointDirectory(tmp_path).write(shard.snapshot())
    leftover = tmp_path / f".{checkpoint_name(9)}.tmp-123-1"
    leftover.write_bytes(b"half a checkpoint")
    fresh = adam_shard(max_staleness=1, checkpoint_dir=str(tmp_path))
    state = Checkpointer(fresh, fresh.config).restore()
    assert state is not None and fresh.step == 5
    assert not leftover.exists()


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def _bad_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:8] = b"\xff" * 8
    path.write_bytes(bytes(data))


def _flip_a_data_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-50] ^= 0x5A
    path.write_bytes(bytes(data))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("damage, reason", [
    (_truncate, "unreadable"), (_bad_header, "unreadable"), (_flip_a_data_byte, "checksum mismatch"), (_empty, "unreadable"),
], ids=["truncated", "bad-header", "checksum-mismatch", "empty"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning_and_the_previous_one_is_used(tmp_path, caplog, damage, reason):
    shard = trained_shard(checkpoint_dir=str(tmp_path))
    directory = CheckpointDirectory(tmp_path)
    directory.write(shard.snapshot())                                 # step 5
    push(shard, "a", 4, shard.step, grads(4))
    newest = directory.write(shard.snapshot())                        # step 6
    damage(newest)
    fresh = adam_shard(max_staleness=1, checkpoint_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="ps_server.checkpoints"):
        state = Checkpointer(fresh, fresh.config).restore()
    assert state is not None and state.step == 5 and fresh.step == 5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(newest.name in w and reason in w for w in warnings), warnings
    assert not newest.exists() and newest.with_name(newest.name + ".corrupt").exists()


def test_reading_a_damaged_checkpoint_raises_corrupt_checkpoint_error_naming_the_file(tmp_path):
    path = CheckpointDirectory(tmp_path).write(trained_shard().snapshot())
    _flip_a_data_byte(path)
    with pytest.raises(CorruptCheckpointError, match=path.name):
        CheckpointDirectory(tmp_path).read(path)


def test_only_damaged_checkpoints_means_a_fresh_start(tmp_path):
    path = CheckpointDirectory(tmp_path).write(trained_shard().snapshot())
    _truncate(path)
    fresh = adam_shard(max_staleness=1, checkpoint_dir=str(tmp_path))
    assert Checkpointer(fresh, fresh.config).restore() is None
    assert not fresh.store.initialized and fresh.step == 0


def test_retention_keeps_the_newest_k_checkpoints(tmp_path):
    shard = trained_shard()
    directory = CheckpointDirectory(tmp_path, keep=2)
    for i in range(4):
        directory.write(shard.snapshot())
        push(shard, "a", 4 + i, shard.step, grads(i))
    assert [step for step, _ in directory.checkpoints()] == [8, 7]
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_name(7), checkpoint_name(8)]


# ---------------------------------------------------------------------- refusing a checkpoint that does not fit


@pytest.mark.parametrize("change, field", [
    (dict(shard_index=0), "shard_index"),
    (dict(num_shards=3), "num_shards"),
    (dict(mode="ssp"), "mode"),
    (dict(partition_min_bytes=1 << 20), "partition_min_bytes"),
    (dict(optimizer="sgd", optimizer_params={"lr": 0.1}), "optimizer"),
])
def test_a_checkpoint_written_under_another_configuration_is_refused(tmp_path, change, field):
    shard = trained_shard(checkpoint_dir=str(tmp_path))
    CheckpointDirectory(tmp_path).write(shard.snapshot())
    settings = {**_settings(shard.config), **change}
    mode = settings.pop("mode", None) or "async"
    if settings["shard_index"] >= settings["num_shards"]:
        settings["shard_index"] = 0
    fresh = make_shard(mode, **settings)
    with pytest.raises(CheckpointMismatchError, match=field) as info:
        Checkpointer(fresh, fresh.config).restore()
    assert "step 5" in str(info.value)
    assert isinstance(info.value, ValueError)          # the CLI reports ValueError and exits 2
    assert not fresh.store.initialized and fresh.step == 0 and not fresh.membership.workers


def test_two_shards_pointed_at_one_directory_are_refused_before_either_writes(tmp_path):
    first = adam_shard(index=0, checkpoint_dir=str(tmp_path))
    assert Checkpointer(first, first.config).restore() is None
    second = adam_shard(index=1, checkpoint_dir=str(tmp_path))
    with pytest.raises(CheckpointMismatchError, match="shard_index=0 of num_shards=2.*shard_index=1 of num_shards=2"):
        Checkpointer(second, second.config).restore()
    again = adam_shard(index=0, checkpoint_dir=str(tmp_path))
    assert Checkpointer(again, again.config).restore() is None          # its owner may come back


def test_changed_hyperparameters_are_taken_from_the_configuration_with_a_warning(tmp_path, caplog):
    shard = trained_shard(checkpoint_dir=str(tmp_path))
    CheckpointDirectory(tmp_path).write(shard.snapshot())
    fresh = make_shard("async", **{**_settings(shard.config), "optimizer_params": {"lr": 0.5}})
    with caplog.at_level(logging.WARNING, logger="ps_server.checkpoints"):
        Checkpointer(fresh, fresh.config).restore()
    assert fresh.step == 5 and fresh.optimizer.hyperparameters["lr"] == 0.5
    assert any("hyperparameters" in r.getMessage() for r in caplog.records)


def test_a_checkpoint_whose_parts_do_not_fit_the_shard_map_changes_nothing(tmp_path):
    shard = trained_shard()
    state = shard.snapshot()
    state.parts = state.parts[1:]
    fresh = adam_shard(max_staleness=1)
    with pytest.raises(CheckpointMismatchError, match="parts do not match"):
        fresh.restore(state)
    assert not fresh.store.initialized and not fresh.membership.workers


def test_a_newer_format_version_is_refused_not_skipped(tmp_path):
    tensors, metadata = ckpt.encode(trained_shard().snapshot())
    metadata["format_version"] = str(ckpt.FORMAT_VERSION + 1)
    with pytest.raises(CheckpointMismatchError, match="newer"):
        ckpt.decode(tensors, metadata)


def test_server_config_rejects_a_bad_checkpoint_keep_or_an_empty_directory():
    with pytest.raises(ValueError, match="checkpoint_keep: 0"):
        ServerConfig(checkpoint_keep=0)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        ServerConfig(checkpoint_dir=" ")


# ---------------------------------------------------------------------- when checkpoints are written


def _wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.01)
    raise AssertionError(f"not true within {timeout} s: {predicate}")


def test_the_checkpointer_writes_once_n_steps_passed(tmp_path):
    shard = adam_shard(checkpoint_dir=str(tmp_path), checkpoint_every_steps=2)
    init_shard(shard, MODEL)
    shard.register("a")
    checkpointer = Checkpointer(shard, shard.config).start()
    try:
        push(shard, "a", 0, 0, grads(0))
        time.sleep(0.3)
        assert not CheckpointDirectory(tmp_path).checkpoints()          # 1 step: not yet
        push(shard, "a", 1, 1, grads(1))
        _wait_for(lambda: CheckpointDirectory(tmp_path).checkpoints())
        assert CheckpointDirectory(tmp_path).checkpoints()[0][0] == 2
    finally:
        checkpointer.stop(timeout=10)


def test_stopping_the_checkpointer_writes_the_final_state_once(tmp_path):
    shard = adam_shard(checkpoint_dir=str(tmp_path))                 # no interval: only on stop
    init_shard(shard, MODEL)
    shard.register("a")
    checkpointer = Checkpointer(shard, shard.config).start()
    for i in range(3):
        push(shard, "a", i, shard.step, grads(i))
    assert not CheckpointDirectory(tmp_path).checkpoints()
    shard.stop()
    final = checkpointer.stop(timeout=10)
    assert final == tmp_path / checkpoint_name(3)
    assert CheckpointDirectory(tmp_path).read(final).workers[0].clock == 3
    assert checkpointer.stop(timeout=10) is None          # nothing changed since: nothing written


def test_the_checkpointer_writes_by_time_only_when_the_state_changed(tmp_path):
    shard = adam_shard(checkpoint_dir=str(tmp_path), checkpoint_every_seconds=0.05)
    init_shard(shard, MODEL)
    shard.register("a")
    checkpointer = Checkpointer(shard, shard.config).start()
    try:
        push(shard, "a", 0, 0, grads(0))
        _wait_for(lambda: checkpointer.last_path)
        written = checkpointer.last_path.stat().st_mtime_ns
        time.sleep(0.3)
        assert checkpointer.last_path.stat().st_mtime_ns == written     # unchanged state: no rewrite
        push(shard, "a", 1, 1, grads(1))
        _wait_for(lambda: checkpointer.last_path.name == checkpoint_name(2))
    finally:
        checkpointer.stop(timeout=10)


def test_a_failed_write_is_logged_and_retried_while_the_shard_keeps_working(tmp_path, monkeypatch, caplog):
    shard = adam_shard(checkpoint_dir=str(tmp_path))
    init_shard(shard, MODEL)
    shard.register("a")
    checkpointer = Checkpointer(shard, shard.config)
    push(shard, "a", 0, 0, grads(0))
    real = ckpt_directory.save_file
    monkeypatch.setattr(ckpt_directory, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError("No space left on device")))
    with caplog.at_level(logging.ERROR, logger="ps_server.checkpoints"):
        assert checkpointer.checkpoint_now() is None
    assert any("failed" in r.getMessage() for r in caplog.records)
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(ckpt_directory, "save_file", real)
    assert checkpointer.checkpoint_now() == tmp_path / checkpoint_name(1)


def test_a_reset_replaces_every_checkpoint_so_a_restart_does_not_bring_the_old_parameters_back(tmp_path):
    shard = adam_shard(checkpoint_dir=str(tmp_path))
    init_shard(shard, MODEL)
    shard.register("a")
    checkpointer = Checkpointer(shard, shard.config)
    for i in range(3):
        push(shard, "a", i, shard.step, grads(i))
        checkpointer.checkpoint_now()
    assert [s for s, _ in CheckpointDirectory(tmp_path).checkpoints()] == [3, 2, 1]
    shard.reset()
    assert [s for s, _ in CheckpointDirectory(tmp_path).checkpoints()] == [0]
    fresh = adam_shard(checkpoint_dir=str(tmp_path))
    assert Checkpointer(fresh, fresh.config).restore().step == 0
    assert not fresh.store.initialized and not fresh.membership.workers


def test_checkpoint_files_are_plain_safetensors_with_the_documented_keys_and_metadata(tmp_path):
    shard = trained_shard()
    path = CheckpointDirectory(tmp_path).write(shard.snapshot())
    with safe_open(str(path), framework="np") as f:
        keys, metadata = set(f.keys()), f.metadata()
    expected = set()
    for name, row_start in shard.store.parts:
        expected |= {f"param/{name}@{row_start}", *(f"slot/{name}@{row_start}/{slot}" for slot in ("step", "exp_avg", "exp_avg_sq"))}
    assert keys == expected
    assert metadata["format"] == ckpt.FORMAT and metadata["checksum"].startswith("crc32:")
    state = json.loads(metadata["state"])
    assert state["shard_index"] == 1 and state["num_shards"] == 2 and state["mode"] == "async"
    assert state["optimizer"]["name"] == "adam" and state["step"] == 5
    assert {p["name"] for p in state["parameters"]} == set(MODEL)
    assert {w["worker_id"]: w["clock"] for w in state["workers"]} == {"a": 4, "b": 2}
    assert os.path.getsize(path) > sum(v.nbytes for v in MODEL.values()) // 2


def test_a_job_bringing_another_model_to_a_checkpoint_is_told_which_checkpoint_holds_what(tmp_path):
    """The refusal named only a tensor ('already initialized with tensor B...'), not the checkpoint that put it
    there: the user had reused a --checkpoint-dir of another job."""
    from ps_common.errors import InitMismatchError
    from tests.helpers.domain import specs_of

    shard = trained_shard(checkpoint_dir=str(tmp_path))
    path = CheckpointDirectory(tmp_path).write(shard.snapshot())
    fresh = adam_shard(max_staleness=1, checkpoint_dir=str(tmp_path))
    assert Checkpointer(fresh, fresh.config).restore() is not None
    with pytest.raises(InitMismatchError, match=rf"shard 1 restored the checkpoint {path} \(step 5\), which holds "
                                                 r"another model's parameters"):
        fresh.init_layout(specs_of({"w_other": np.zeros((3, 2), np.float32)}))
