"""Model state on the shards (ParameterSpec.state): pushes replace it, sync averages it, checkpoints keep it."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.errors import InitMismatchError
from ps_common.shard_map import ParamSpec
from ps_server.checkpoints import fileformat as ckpt
from tests.helpers.domain import LR, decode, make_shard, own_chunks, push

VALUES = {"w": np.array([1.0, 2.0], np.float32), "running_mean": np.zeros(2, np.float32)}
SPECS = [ParamSpec("w", "float32", (2,)), ParamSpec("running_mean", "float32", (2,), state=True)]


def _initialized(mode: str, **overrides):
    shard = make_shard(mode, **overrides)
    shard.initialize(SPECS, decode(own_chunks(shard, VALUES, specs=SPECS), shard.init_layout(SPECS)))
    return shard


def _values(shard) -> dict[str, np.ndarray]:
    return {key[0]: part.value.copy() for key, part in shard.store.parts.items()}


def test_an_async_push_replaces_state_and_optimizes_parameters() -> None:
    shard = _initialized("async")
    shard.register("a")
    assert push(shard, "a", 0, 0, {"w": np.array([1.0, 1.0], np.float32),
                                   "running_mean": np.array([5.0, 6.0], np.float32)}).accepted
    values = _values(shard)
    np.testing.assert_array_equal(values["w"], [1.0 - LR, 2.0 - LR])
    np.testing.assert_array_equal(values["running_mean"], [5.0, 6.0])


def test_a_sync_step_sets_state_to_the_mean_of_its_contributors_values() -> None:
    shard = _initialized("sync", replicas_to_aggregate=2, total_replicas=2)
    shard.register("a")
    shard.register("b")
    for worker, mean in (("a", [2.0, 4.0]), ("b", [4.0, 8.0])):
        assert push(shard, worker, 0, 0, {"w": np.array([1.0, 3.0], np.float32),
                                          "running_mean": np.array(mean, np.float32)}).accepted
    assert shard.step == 1
    values = _values(shard)
    np.testing.assert_array_equal(values["running_mean"], [3.0, 6.0])
    np.testing.assert_array_equal(values["w"], [1.0 - LR * 1.0, 2.0 - LR * 3.0])


def test_a_checkpoint_keeps_which_tensors_are_state() -> None:
    shard = _initialized("async")
    tensors, metadata = ckpt.encode(shard.snapshot())
    restored = ckpt.decode(tensors, metadata)
    assert {s.name: s.state for s in restored.parameters} == {"w": False, "running_mean": True}


def test_re_initializing_a_state_tensor_as_a_parameter_is_a_mismatch() -> None:
    shard = _initialized("async")
    as_parameters = [ParamSpec("w", "float32", (2,)), ParamSpec("running_mean", "float32", (2,))]
    with pytest.raises(InitMismatchError, match=r"'running_mean' is initialized as state"):
        shard.initialize(as_parameters, decode(own_chunks(shard, VALUES, specs=as_parameters),
                                               shard.init_layout(as_parameters)))
