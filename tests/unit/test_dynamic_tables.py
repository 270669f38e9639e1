"""Dynamic tables (rows keyed by any int64 id) in one shard's domain and the shared id rules: creation from the
initializer, hash routing, eviction, lazy optimizer state, every mode, bad input and checkpoints
(docs/protocol.md, "Dynamic tables")."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common import codec
from ps_common.dynamic_ids import MAX_IDS_PER_REQUEST, DynamicTable, initial_rows, shard_of_ids, splitmix64
from ps_common.errors import (CheckpointMismatchError, InitMismatchError, InvalidRequestError, InvalidTensorError, ResourceExhaustedError,
                              UnknownTensorError)
from ps_common.shard_map import ParamSpec, build_shard_map
from ps_server.checkpoints.directory import CheckpointDirectory
from ps_server.operations import Push
from tests.helpers.domain import LR, make_shard, specs_of, pull_rows
from worker_client.client import rows as sparse
from worker_client.client.rows import dynamic_table

DIM = 3
HUGE = 9_123_456_789_012
MODEL = {"b": np.zeros(2, np.float32)}


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def specs(**table) -> list[ParamSpec]:
    return specs_of(MODEL) + [dynamic_table("emb", (DIM,), **table)]


def ready(mode: str = "async", *, table: dict | None = None, **overrides):
    shard = make_shard(mode, **overrides)
    shard.initialize(specs(**(table or {})), {("b", 0): MODEL["b"]})
    shard.register("a")
    shard.register("b")
    return shard


def rows_of(shard, wanted: np.ndarray) -> np.ndarray:
    return pull_rows(shard, [("emb", wanted)], min_step=0, worker_id="", clock=0, timeout=1.0)[1][0][1]


def grad(n: int, value: float = 1.0) -> np.ndarray:
    return np.full((n, DIM), value, np.float32)


def live_rows(shard) -> int:
    return shard.view().dynamic[0].rows


# ------------------------------------------------------------------ the shared rules


def test_splitmix64_matches_the_reference_values():
    # the first outputs of the reference splitmix64 generator seeded with 0 (state advanced by the golden ratio)
    golden = 0x9E3779B97F4A7C15
    assert int(splitmix64(np.array([0], np.uint64))[0]) == 0xE220A8397B1DCDAF
    assert int(splitmix64(np.array([golden], np.uint64))[0]) == 0x6E789E6AA1B965F4


def test_an_id_goes_to_splitmix64_of_it_modulo_the_shard_count_for_any_int64():
    values = ids(0, 1, -1, HUGE, -(1 << 63), (1 << 63) - 1)
    expected = [int(splitmix64(np.array([v], np.int64).view(np.uint64))[0]) % 3 for v in values]
    assert shard_of_ids(values, 3).tolist() == expected
    spread = np.bincount(shard_of_ids(np.arange(30_000, dtype=np.int64) * 7919, 3), minlength=3)
    assert spread.min() > 9_000                    # about a third each


@pytest.mark.parametrize("initializer", ["normal:0.5", "uniform:0.1"])
def test_initial_rows_are_a_function_of_table_seed_and_id_alone(initializer):
    table = DynamicTable(initializer, seed=7)
    a = initial_rows("emb", table, ids(HUGE, 5, -3), (2, 2), "float32")
    b = initial_rows("emb", table, ids(-3, HUGE), (2, 2), "float32")
    np.testing.assert_array_equal(a[0], b[1])
    np.testing.assert_array_equal(a[2], b[0])
    assert not np.array_equal(a[0], a[1])
    other_seed = initial_rows("emb", DynamicTable(initializer, seed=8), ids(HUGE), (2, 2), "float32")
    other_name = initial_rows("emb2", table, ids(HUGE), (2, 2), "float32")
    assert not np.array_equal(a[0], other_seed[0]) and not np.array_equal(a[0], other_name[0])


def test_the_initializers_have_the_documented_distributions():
    many = np.arange(20_000, dtype=np.int64)
    normal = initial_rows("t", DynamicTable("normal:0.5"), many, (4,), "float64")
    assert abs(normal.mean()) < 0.01 and abs(normal.std() - 0.5) < 0.01
    uniform = initial_rows("t", DynamicTable("uniform:0.1"), many, (4,), "float64")
    assert -0.1 <= uniform.min() and uniform.max() < 0.1 and abs(uniform.std() - 0.1 / np.sqrt(3)) < 0.002
    assert not initial_rows("t", DynamicTable("zeros"), many[:5], (4,), "float32").any()


@pytest.mark.parametrize("bad", [dict(initializer="normal"), dict(initializer="normal:-1"), dict(initializer="ones"),
                                 dict(evict_after_steps=-1)])
def test_a_bad_table_setting_is_refused_naming_the_table(bad):
    with pytest.raises(ValueError, match="emb"):
        dynamic_table("emb", (DIM,), **bad)


def test_a_dynamic_table_has_no_parts_and_must_be_floating_point():
    shard_map = build_shard_map(specs(), 3)
    assert shard_map.parts_of("emb") == [] and shard_map.specs["emb"].row_shape == (DIM,)
    with pytest.raises(ValueError, match="floating point"):
        build_shard_map([dynamic_table("emb", (DIM,), dtype="int64")], 1)


def test_the_spec_survives_the_wire():
    spec = dynamic_table("emb", (DIM, 2), initializer="uniform:0.2", evict_after_steps=9, seed=-4)
    assert codec.spec_from_wire(codec.param_spec_to_wire(spec)) == spec


def test_client_and_shards_agree_on_where_each_id_goes():
    shard_map = build_shard_map(specs(), 3)
    wanted = ids(HUGE, -1, 0, 17, 1 << 40, HUGE + 1)
    plan = sparse.route_rows(shard_map, {"emb": wanted})
    shards = [make_shard(num_shards=3, shard_index=i) for i in range(3)]
    seen = []
    for i, s in enumerate(shards):
        s.initialize(specs(), {("b", 0): MODEL["b"]} if shard_map.part("b", 0).shard == i else {})
        for name, pos, routed in plan.get(i, []):
            seen.extend(pos.tolist())
            assert rows_of(s, routed).shape == (len(routed), DIM)    # the shard takes them all
    assert sorted(seen) == list(range(len(wanted)))
    grads = sparse.row_gradients_by_shard(shard_map, {"emb": (wanted, grad(len(wanted)))}, np.dtype(np.float32))
    assert sorted(grads) == [0, 1, 2]                # every shard gets one (maybe empty): a sync step needs it
    wrong = next(i for i in range(3) if i not in plan or len(plan[i][0][2]) < len(wanted))
    other = next(v for v in wanted.tolist() if shard_of_ids(ids(v), 3)[0] != wrong)
    with pytest.raises(InvalidTensorError, match=f"id {other} .* hashes to shard"):
        rows_of(shards[wrong], ids(other))


# ------------------------------------------------------------------ rows: creation, updates, eviction


def test_a_row_is_created_on_first_use_from_the_initializer_the_same_on_another_shard():
    table = dict(initializer="normal:0.5", seed=3)
    first, restarted = ready(table=table), ready(table=table)
    expected = initial_rows("emb", DynamicTable("normal:0.5", seed=3), ids(HUGE), (DIM,), "float32")
    np.testing.assert_array_equal(rows_of(first, ids(HUGE, HUGE))[1], expected[0])
    np.testing.assert_array_equal(rows_of(restarted, ids(HUGE))[0], expected[0])
    assert live_rows(first) == 1 and first.view().dynamic[0].created == 1


def test_an_async_push_creates_and_updates_rows_summing_repeated_ids():
    shard = ready()
    result = shard.push(Push("a", 0, 0, {}, [("emb", ids(HUGE, -7, HUGE), grad(3))]))
    assert result.accepted and shard.step == 1
    np.testing.assert_array_equal(rows_of(shard, ids(HUGE, -7)), [[-2 * LR] * DIM, [-LR] * DIM])


def test_rows_untouched_for_evict_after_steps_are_evicted_with_their_state_and_come_back_fresh():
    shard = ready(table=dict(initializer="uniform:0.1", evict_after_steps=2), optimizer="adam",
                  optimizer_params={"lr": 0.1})
    fresh = rows_of(shard, ids(1, 2))                    # created at step 0
    shard.push(Push("a", 0, 0, {}, [("emb", ids(1, 2), grad(2))]))        # step 0 -> 1, both touched at 0
    keep_touching = 1
    for clock in range(1, 5):                            # steps 2..5; row 1 pulled at every step
        rows_of(shard, ids(keep_touching))
        shard.push(Push("a", clock, shard.step, {("b", 0): np.zeros(2, np.float32)}))
        table = shard.store.dynamic["emb"]
        assert (2 in table.index) == (shard.step - 0 <= 2)   # touched at step 0: gone once t - 0 > 2
    assert 1 in shard.store.dynamic["emb"].index and shard.view().dynamic[0].evicted == 1
    np.testing.assert_array_equal(rows_of(shard, ids(2))[0], fresh[1])          # re-created from the initializer
    assert shard.store.dynamic["emb"].slots["row_step"][shard.store.dynamic["emb"].index[2]] == 0


def test_rows_are_never_evicted_when_evict_after_steps_is_zero():
    shard = ready()
    rows_of(shard, ids(4))
    for clock in range(5):
        shard.push(Push("a", clock, shard.step, {("b", 0): np.zeros(2, np.float32)}))
    assert live_rows(shard) == 1


@pytest.mark.parametrize("name,params", [("sgd", {"lr": 0.1}), ("adagrad", {"lr": 0.1}), ("adam", {"lr": 0.1})])
def test_lazy_updates_of_dynamic_rows_match_those_of_a_dense_table_trained_by_rows(name, params):
    dense = make_shard(optimizer=name, optimizer_params=params)
    dynamic = make_shard(optimizer=name, optimizer_params=params)
    dense.initialize(specs_of({"emb": np.zeros((4, DIM), np.float32)}), {("emb", 0): np.zeros((4, DIM), np.float32)})
    dynamic.initialize([dynamic_table("emb", (DIM,))], {})
    mapping = {0: HUGE, 1: -HUGE, 2: 5, 3: 1 << 62}
    rng = np.random.default_rng(1)
    dense.register("w")
    dynamic.register("w")
    for clock, touched in enumerate(([0], [0, 2], [0], [3, 0])):
        g = rng.standard_normal((len(touched), DIM)).astype(np.float32)
        dense.push(Push("w", clock, dense.step, {}, [("emb", ids(*touched), g)]))
        dynamic.push(Push("w", clock, dynamic.step, {}, [("emb", ids(*(mapping[t] for t in touched)), g)]))
    got = rows_of(dynamic, ids(*mapping.values()))
    want = pull_rows(dense, [("emb", ids(0, 1, 2, 3))], min_step=0, worker_id="", clock=0, timeout=1)[1][0][1]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    table = dynamic.store.dynamic["emb"]
    assert [int(table.slots["row_step"][table.index[mapping[i]]]) for i in range(4)] == [4, 0, 1, 1]


def test_a_sync_step_sums_each_rows_gradients_over_contributors_and_divides_by_their_count():
    shard = ready("sync", replicas_to_aggregate=2, total_replicas=2)
    bias = np.zeros(2, np.float32)
    shard.push(Push("a", 0, 0, {("b", 0): bias}, [("emb", ids(HUGE, 3), grad(2, 4.0))]))
    assert shard.step == 0 and live_rows(shard) == 0          # accumulated, not applied
    shard.push(Push("b", 0, 0, {("b", 0): bias}, [("emb", ids(HUGE), grad(1, 2.0))]))
    assert shard.step == 1
    np.testing.assert_array_equal(rows_of(shard, ids(HUGE, 3)), [[-LR * 3.0] * DIM, [-LR * 2.0] * DIM])


def test_a_sync_push_without_the_dynamic_table_is_refused():
    shard = ready("sync", replicas_to_aggregate=1, total_replicas=1)
    with pytest.raises(InvalidTensorError, match="'emb'"):
        shard.push(Push("a", 0, 0, {("b", 0): np.zeros(2, np.float32)}))


def test_a_retried_push_of_dynamic_rows_is_applied_once():
    shard = ready()
    shard.push(Push("a", 0, 0, {}, [("emb", ids(HUGE), grad(1))]))
    again = shard.push(Push("a", 0, 0, {}, [("emb", ids(HUGE), grad(1))]))
    assert again.duplicate and shard.step == 1
    np.testing.assert_array_equal(rows_of(shard, ids(HUGE))[0], [-LR] * DIM)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("what,rows,error,match", [
    ("wrong dtype", lambda: np.ones((1, DIM), np.float64), InvalidTensorError, "float64"),
    ("wrong shape", lambda: np.ones((1, DIM + 1), np.float32), InvalidTensorError, r"expected float32\[1, 3\]"),
    ("NaN", lambda: np.full((1, DIM), np.nan, np.float32), InvalidTensorError, "NaN"),
])
def test_a_bad_dynamic_row_gradient_is_refused_and_changes_nothing(what, rows, error, match):
    shard = ready()
    with pytest.raises(error, match=match):
        shard.push(Push("a", 0, 0, {}, [("emb", ids(HUGE), rows())]))
    assert shard.step == 0 and live_rows(shard) == 0 and shard.membership.workers["a"].clock == 0


def test_bad_ids_are_refused_naming_the_table():
    shard = ready()
    with pytest.raises(InvalidTensorError, match="int64"):
        pull_rows(shard, [("emb", np.array([1, 2], np.int32))], min_step=0, worker_id="", clock=0, timeout=1)
    with pytest.raises(InvalidTensorError, match="over the limit"):
        pull_rows(shard, [("emb", np.zeros(MAX_IDS_PER_REQUEST + 1, np.int64))], min_step=0, worker_id="", clock=0,
                        timeout=1)
    with pytest.raises(UnknownTensorError):
        pull_rows(shard, [("nope", ids(1))], min_step=0, worker_id="", clock=0, timeout=1)
    with pytest.raises(InvalidRequestError, match="empty"):
        pull_rows(shard, [("", ids(1))], min_step=0, worker_id="", clock=0, timeout=1)
    with pytest.raises(InvalidRequestError, match="empty"):
        shard.push(Push("a", 0, 0, {}, [("", ids(1), grad(1))]))
    assert live_rows(shard) == 0


def test_a_dynamic_table_in_chunks_is_refused():
    shard = ready()
    with pytest.raises(InvalidTensorError, match="dynamic table"):
        shard.push_layout()("emb", 0)


def test_creating_rows_past_the_shard_byte_limit_is_resource_exhausted_and_changes_nothing():
    shard = ready(max_shard_bytes=8 + 1000)
    with pytest.raises(ResourceExhaustedError, match="max_shard_bytes"):
        rows_of(shard, np.arange(100, dtype=np.int64))
    with pytest.raises(ResourceExhaustedError):
        shard.push(Push("a", 0, 0, {}, [("emb", np.arange(100, dtype=np.int64), grad(100))]))
    assert live_rows(shard) == 0 and shard.step == 0
    rows_of(shard, ids(1, 2))                            # a few fit


def test_a_reinit_with_other_table_settings_is_an_init_mismatch():
    shard = ready()
    with pytest.raises(InitMismatchError, match="dynamic"):
        shard.init_layout(specs(evict_after_steps=5)) and shard.initialize(specs(evict_after_steps=5), {})


# ------------------------------------------------------------------ checkpoints


def test_rows_optimizer_state_touch_steps_and_a_sync_accumulator_survive_a_checkpoint(tmp_path):
    settings = dict(optimizer="adam", optimizer_params={"lr": 0.01}, replicas_to_aggregate=2, total_replicas=2)
    table = dict(initializer="normal:0.1", evict_after_steps=3)
    shard = ready("sync", table=table, **settings)
    bias = np.zeros(2, np.float32)
    shard.push(Push("a", 0, 0, {("b", 0): bias}, [("emb", ids(HUGE, 5), grad(2))]))
    shard.push(Push("b", 0, 0, {("b", 0): bias}, [("emb", ids(HUGE), grad(1))]))     # step 1
    shard.push(Push("a", 1, 1, {("b", 0): bias}, [("emb", ids(-HUGE), grad(1))]))    # step 2 half in
    directory = CheckpointDirectory(tmp_path)
    fresh = make_shard("sync", **settings)
    fresh.restore(directory.read(directory.write(shard.snapshot())))
    before, after = shard.store.dynamic["emb"], fresh.store.dynamic["emb"]
    assert after.index.keys() == before.index.keys() == {HUGE, 5}
    for i in (HUGE, 5):
        a, b = before.index[i], after.index[i]
        assert after.touched[b] == before.touched[a]
        assert all(np.array_equal(after.slots[k][b], before.slots[k][a]) for k in before.slots)
    for s in (shard, fresh):
        s.push(Push("b", 1, 1, {("b", 0): bias}, [("emb", ids(5), grad(1))]))
    assert fresh.step == shard.step == 2
    np.testing.assert_array_equal(rows_of(fresh, ids(HUGE, 5, -HUGE)), rows_of(shard, ids(HUGE, 5, -HUGE)))


def test_a_checkpoint_holding_ids_that_hash_to_another_shard_is_refused():
    shard = ready(table=dict(initializer="zeros"))
    rows_of(shard, np.arange(20, dtype=np.int64))
    state = shard.snapshot()
    state.num_shards = 2                                 # as if shard 0 of 2 had written it
    other = make_shard(num_shards=2)
    with pytest.raises(CheckpointMismatchError, match="hashes to shard 1"):
        other.restore(state)
    assert other.store.shard_map is None
