"""Unit tests for ps_common.shard_map: coverage, balance, determinism, validation and lookups."""

from __future__ import annotations

import math
import random

import pytest

from ps_common.shard_map import (
    DEFAULT_PARTITION_MIN_BYTES,
    ParamSpec,
    Part,
    ShardMap,
    build_shard_map,
)

MIB = 1 << 20


def small_tensors(count: int = 50, seed: int = 0) -> list[ParamSpec]:
    """count tensors, each well below the default threshold, of assorted shapes and dtypes."""
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        dtype = rng.choice(["float32", "float16", "int64", "float64"])
        shape = rng.choice([(rng.randint(1, 256), rng.randint(1, 256)), (rng.randint(1, 4096),), ()])
        specs.append(ParamSpec(f"layer{i:02d}.param", dtype, shape))
    assert all(s.nbytes <= DEFAULT_PARTITION_MIN_BYTES for s in specs)
    return specs


def embedding_model() -> list[ParamSpec]:
    """One ~100 MB embedding (never allocated) plus 50 small tensors."""
    return [ParamSpec("embedding", "float32", (200000, 128)), *small_tensors()]


def random_model(rng: random.Random) -> list[ParamSpec]:
    specs = []
    for i in range(rng.randint(0, 30)):
        rank = rng.randint(0, 3)
        shape = tuple(rng.choice([0, 1, 2, 3, 17, 100, 1000, 5000]) for _ in range(rank))
        specs.append(ParamSpec(f"t{i}", rng.choice(["float32", "int8", "float64", "bool"]), shape))
    return specs


def assert_covers_every_row_once(smap: ShardMap) -> None:
    assert [(p.name, p.row_start) for p in smap.parts] == sorted((p.name, p.row_start) for p in smap.parts)
    assert {p.name for p in smap.parts} == set(smap.specs)
    for name, spec in smap.specs.items():
        parts = smap.parts_of(name)
        assert parts, name
        rows = spec.shape[0] if spec.shape else 1
        assert parts[0].row_start == 0
        assert parts[-1].row_end == rows
        for before, after in zip(parts, parts[1:]):
            assert before.row_end == after.row_start  # contiguous, no overlap, no gap
        for p in parts:
            assert 0 <= p.shard < smap.num_shards
            assert p.dtype == spec.dtype
            assert p.row_start <= p.row_end
            if p.whole:
                assert len(parts) == 1 and p.shape == spec.shape and p.label == name
            else:
                assert p.row_start < p.row_end
                assert p.shape == (p.row_end - p.row_start, *spec.shape[1:])
                assert p.label == f"{name}[{p.row_start}:{p.row_end}]"
        assert sum(p.nbytes for p in parts) == spec.nbytes
        assert len({p.shard for p in parts}) == len(parts)  # one range per shard at most
    assert sum(smap.bytes_per_shard()) == sum(s.nbytes for s in smap.specs.values())


def test_param_spec_reports_bytes_and_row_bytes() -> None:
    spec = ParamSpec("w", "float32", (10, 3, 2))
    assert spec.nbytes == 240
    assert spec.row_bytes == 24
    scalar = ParamSpec("s", "float64", ())
    assert scalar.nbytes == 8 and scalar.row_bytes == 8


def test_the_same_specs_give_the_same_map_twice() -> None:
    first = build_shard_map(embedding_model(), 4)
    second = build_shard_map(embedding_model(), 4)
    assert first.parts == second.parts
    assert first == second


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5, 8])
def test_the_map_does_not_depend_on_the_order_of_the_specs(num_shards: int) -> None:
    specs = embedding_model() + [ParamSpec("dense.big", "float32", (1000, 1000))]
    reference = build_shard_map(specs, num_shards)
    rng = random.Random(7)
    for _ in range(5):
        shuffled = specs[:]
        rng.shuffle(shuffled)
        assert build_shard_map(shuffled, num_shards).parts == reference.parts
    assert build_shard_map(reversed(specs), num_shards).parts == reference.parts
    assert build_shard_map(iter(specs), num_shards).parts == reference.parts


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 7, 8, 16])
def test_every_row_of_every_tensor_is_covered_exactly_once(num_shards: int) -> None:
    assert_covers_every_row_once(build_shard_map(embedding_model(), num_shards))
    rng = random.Random(num_shards)
    for _ in range(40):
        smap = build_shard_map(random_model(rng), num_shards, partition_min_bytes=rng.choice([1, 100, 4096]))
        assert_covers_every_row_once(smap)


@pytest.mark.parametrize("num_shards", [2, 3, 4, 8])
def test_a_huge_embedding_plus_fifty_small_tensors_is_balanced_within_ten_percent(num_shards: int) -> None:
    smap = build_shard_map(embedding_model(), num_shards)
    assert smap.imbalance() <= 0.10
    totals = smap.bytes_per_shard()
    mean = sum(totals) / num_shards
    assert max(totals) <= 1.10 * mean
    assert len(smap.parts_of("embedding")) == num_shards
    assert_covers_every_row_once(smap)
    # each shard's total, as the client asks it every step, is its parts' bytes
    assert [smap.shard_bytes(i) for i in range(num_shards)] == totals == \
        [sum(p.nbytes for p in smap.parts_on(i)) for i in range(num_shards)]
    totals[0] += 1   # a copy: the map's own totals stay
    assert smap.bytes_per_shard()[0] == smap.shard_bytes(0) != totals[0]


@pytest.mark.parametrize("num_shards", [2, 3, 4, 8])
def test_several_big_tensors_and_a_few_small_ones_are_balanced_within_ten_percent(num_shards: int) -> None:
    specs = [
        ParamSpec("emb.user", "float32", (50000, 64)),
        ParamSpec("emb.item", "float16", (300000, 32)),
        ParamSpec("fc1.w", "float32", (2048, 1024)),
        ParamSpec("fc2.w", "float32", (1024, 512)),
        *small_tensors(10, seed=3),
    ]
    smap = build_shard_map(specs, num_shards)
    assert smap.imbalance() <= 0.10
    assert_covers_every_row_once(smap)


def test_the_split_tensor_fills_around_an_unsplittable_big_tensor() -> None:
    specs = [
        ParamSpec("one_row", "float32", (1, 4 * MIB)),  # 16 MiB, fewer than 2 rows: never split
        ParamSpec("table", "float32", (48 * 1024, 256)),  # 48 MiB, splittable
    ]
    smap = build_shard_map(specs, 4)
    assert smap.parts_of("one_row")[0].whole
    assert smap.bytes_per_shard() == [16 * MIB] * 4
    assert smap.imbalance() == 0.0
    # the shard with the unsplittable tensor gets none of the table
    one_row_shard = smap.parts_of("one_row")[0].shard
    assert all(p.shard != one_row_shard for p in smap.parts_of("table"))


def test_a_small_model_is_spread_over_all_shards_without_splitting() -> None:
    specs = [ParamSpec(f"w{i}", "float32", (64, 64)) for i in range(12)]
    smap = build_shard_map(specs, 4)
    assert all(p.whole for p in smap.parts)
    assert [len(smap.parts_on(s)) for s in range(4)] == [3, 3, 3, 3]
    assert smap.imbalance() == 0.0

    mixed = build_shard_map(small_tensors(), 8)
    assert all(p.whole for p in mixed.parts)
    assert all(mixed.parts_on(s) for s in range(8))


def test_tensors_at_or_below_the_threshold_or_with_one_row_are_never_split() -> None:
    specs = [
        ParamSpec("exactly_threshold", "float32", (1024, 256)),  # 1 MiB == threshold
        ParamSpec("one_row", "float32", (1, 10 * MIB)),
        ParamSpec("scalar", "float64", ()),
    ]
    smap = build_shard_map(specs, 8)
    assert all(p.whole for p in smap.parts)
    assert len(smap.parts) == 3


def test_split_parts_are_never_smaller_than_half_the_threshold() -> None:
    rng = random.Random(11)
    for _ in range(60):
        threshold = rng.choice([64, 1000, 4096])
        specs = random_model(rng)
        smap = build_shard_map(specs, rng.randint(1, 9), partition_min_bytes=threshold)
        for p in smap.parts:
            if not p.whole:
                assert p.nbytes >= math.ceil(threshold / 2), p


def test_a_tensor_just_above_the_threshold_may_be_split_to_balance() -> None:
    specs = [ParamSpec("a", "float32", (1024, 257))]  # a bit over 1 MiB, nothing else
    smap = build_shard_map(specs, 2)
    parts = smap.parts_of("a")
    assert [p.shard for p in parts] == [0, 1]
    assert smap.imbalance() < 0.01


def test_parts_per_tensor_never_exceed_the_number_of_shards() -> None:
    specs = [ParamSpec("huge", "int8", (10_000_000,)), *small_tensors(20)]
    for num_shards in (2, 5, 16, 64):
        smap = build_shard_map(specs, num_shards, partition_min_bytes=1)
        assert len(smap.parts_of("huge")) <= num_shards
        assert smap.imbalance() <= 0.10


def test_one_shard_holds_everything_whole() -> None:
    specs = embedding_model()
    smap = build_shard_map(specs, 1)
    assert all(p.shard == 0 and p.whole for p in smap.parts)
    assert len(smap.parts) == len(specs)
    assert smap.bytes_per_shard() == [sum(s.nbytes for s in specs)]
    assert smap.imbalance() == 0.0


def test_a_rank_zero_tensor_is_one_whole_part_with_rows_zero_to_one() -> None:
    smap = build_shard_map([ParamSpec("step", "int64", ())], 3, partition_min_bytes=1)
    (part,) = smap.parts_of("step")
    assert (part.row_start, part.row_end, part.shape, part.whole) == (0, 1, (), True)
    assert part.nbytes == 8
    assert part.label == "step"
    assert smap.part("step", 0) is part


def test_zero_size_tensors_are_assigned_with_zero_bytes() -> None:
    specs = [
        ParamSpec("empty_rows", "float32", (0, 16)),
        ParamSpec("empty_cols", "float32", (5, 0)),
        ParamSpec("big", "float32", (4096, 1024)),
    ]
    smap = build_shard_map(specs, 3, partition_min_bytes=1024)
    (rows0,) = smap.parts_of("empty_rows")
    (cols0,) = smap.parts_of("empty_cols")
    assert (rows0.row_start, rows0.row_end, rows0.nbytes, rows0.whole) == (0, 0, 0, True)
    assert (cols0.row_start, cols0.row_end, cols0.nbytes, cols0.whole) == (0, 5, 0, True)
    assert_covers_every_row_once(smap)
    assert smap.imbalance() < 0.01

    only_empty = build_shard_map([ParamSpec("e", "float32", (0,))], 2)
    assert only_empty.bytes_per_shard() == [0, 0]
    assert only_empty.imbalance() == 0.0


def test_an_empty_model_gives_an_empty_map() -> None:
    smap = build_shard_map([], 3)
    assert smap.parts == ()
    assert smap.bytes_per_shard() == [0, 0, 0]
    assert smap.imbalance() == 0.0


@pytest.mark.parametrize(
    ("specs", "kwargs", "shown"),
    [
        ([ParamSpec("w", "float32", (2,))], {"num_shards": 0}, "0"),
        ([ParamSpec("w", "float32", (2,))], {"num_shards": -3}, "-3"),
        ([ParamSpec("w", "float32", (2,))], {"num_shards": 2, "partition_min_bytes": 0}, "0"),
        ([ParamSpec("w", "float32", (2,))], {"num_shards": 2, "partition_min_bytes": -5}, "-5"),
        ([ParamSpec("dup", "float32", (2,)), ParamSpec("dup", "int8", (3,))], {"num_shards": 2}, "dup"),
        ([ParamSpec("neg", "float32", (4, -7))], {"num_shards": 2}, "-7"),
        ([ParamSpec("half", "float32", (2.5,))], {"num_shards": 2}, "2.5"),
        ([ParamSpec("w", "float33", (2,))], {"num_shards": 2}, "float33"),
        ([ParamSpec("w", "object", (2,))], {"num_shards": 2}, "object"),
        ([ParamSpec("", "float32", (2,))], {"num_shards": 2}, "''"),
    ],
)
def test_invalid_inputs_raise_value_error_naming_the_bad_value(
    specs: list[ParamSpec], kwargs: dict[str, int], shown: str
) -> None:
    with pytest.raises(ValueError) as info:
        build_shard_map(specs, **kwargs)
    assert shown in str(info.value)


def test_part_finds_a_part_by_name_and_first_row() -> None:
    smap = build_shard_map(embedding_model(), 4)
    for p in smap.parts_of("embedding"):
        assert smap.part("embedding", p.row_start) == p
    small = smap.parts_of("layer00.param")[0]
    assert smap.part("layer00.param", 0) == small
    on_shards = [p for s in range(4) for p in smap.parts_on(s)]
    assert sorted(on_shards, key=lambda p: (p.name, p.row_start)) == list(smap.parts)
    assert all(isinstance(p, Part) for p in on_shards)


def test_parts_of_an_unknown_tensor_raises_key_error_with_the_name() -> None:
    smap = build_shard_map(embedding_model(), 2)
    with pytest.raises(KeyError) as info:
        smap.parts_of("no_such_tensor")
    assert info.value.args == ("no_such_tensor",)


def test_part_with_no_such_row_start_raises_key_error_naming_both() -> None:
    smap = build_shard_map(embedding_model(), 2)
    with pytest.raises(KeyError) as info:
        smap.part("embedding", 12345)
    assert "embedding" in str(info.value) and "12345" in str(info.value)
    with pytest.raises(KeyError) as info:
        smap.part("missing", 0)
    assert "missing" in str(info.value) and "0" in str(info.value)


def test_parts_on_a_shard_out_of_range_raises_value_error() -> None:
    smap = build_shard_map(embedding_model(), 2)
    with pytest.raises(ValueError, match="5"):
        smap.parts_on(5)
