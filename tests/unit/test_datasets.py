"""Unit tests of the dataset readers, generators, shards and batch iterator."""

from __future__ import annotations

import pickle
import socket
import warnings
from pathlib import Path

import numpy as np
import pytest

import ps_models
import ps_models.datasets as datasets_module
from ps_models.data.make_digits import stratified_split
from ps_models.datasets import (DIGITS_PATH, Dataset, DatasetError, click_logits, hash_ids, iterate_batches,
                             load_dataset, load_npz, num_batches, reshape_for, worker_shard)
from worker_client.training import binary_auc


def _rows(x: np.ndarray) -> set[bytes]:
    return {row.tobytes() for row in x.reshape(len(x), -1)}


def _write(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


def _valid_arrays(n_train: int = 20, n_test: int = 6) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x_train": rng.random((n_train, 5)), "y_train": np.arange(n_train) % 3,
            "x_test": rng.random((n_test, 5)), "y_test": np.arange(n_test) % 3}


# --- digits -------------------------------------------------------------------------------

def test_digits_ship_inside_the_package_and_load_without_any_network(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("load_dataset tried to open a socket")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    assert DIGITS_PATH.is_file()
    assert DIGITS_PATH.parent.parent == Path(ps_models.__file__).resolve().parent
    ds = load_dataset("digits")
    assert ds.num_train + ds.num_test == 1797


def test_digits_have_the_documented_shapes_dtypes_range_and_labels() -> None:
    ds = load_dataset("digits")
    assert ds.x_train.shape == (1438, 64) and ds.x_test.shape == (359, 64)
    assert ds.x_train.dtype == ds.x_test.dtype == np.float32
    assert ds.y_train.dtype == ds.y_test.dtype == np.int64
    assert 0.0 <= min(ds.x_train.min(), ds.x_test.min())
    assert max(ds.x_train.max(), ds.x_test.max()) == 1.0
    assert ds.num_classes == 10 and ds.input_name == "x" and ds.image_shape == (1, 8, 8)
    assert set(ds.y_train.tolist()) == set(ds.y_test.tolist()) == set(range(10))


def test_digits_split_is_disjoint_and_stratified() -> None:
    ds = load_dataset("digits")
    assert not _rows(ds.x_train) & _rows(ds.x_test)  # the 1797 images are all distinct
    test_share = np.bincount(ds.y_test) / (np.bincount(ds.y_test) + np.bincount(ds.y_train))
    assert np.all(np.abs(test_share - 0.2) < 0.02)


def test_the_digits_split_helper_gives_disjoint_covering_per_class_indices() -> None:
    labels = np.repeat(np.arange(4), [10, 11, 12, 13])
    train, test = stratified_split(labels, test_fraction=0.2, seed=3)
    assert not set(train) & set(test)
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(len(labels)))
    assert np.bincount(labels[test]).tolist() == [2, 2, 2, 3]


def test_digits_are_laid_out_per_model() -> None:
    assert load_dataset("digits", model="lenet").x_train.shape == (1438, 1, 8, 8)
    assert load_dataset("digits", model="mlp").x_test.shape == (359, 64)
    flat_again = reshape_for(load_dataset("digits", model="lenet"), "mlp")
    assert np.array_equal(flat_again.x_train, load_dataset("digits").x_train)


def test_loading_is_deterministic_and_seed_does_not_move_the_digits_split() -> None:
    first, second = load_dataset("digits", seed=0), load_dataset("digits", seed=9)
    assert np.array_equal(first.x_train, second.x_train)
    assert np.array_equal(first.y_test, second.y_test)


def test_a_dataset_describes_itself_with_its_sizes() -> None:
    text = repr(load_dataset("digits"))
    assert "1438" in text and "359" in text and "10 classes" in text and "(64,)" in text


# --- synthetic ----------------------------------------------------------------------------

def test_synthetic_classification_honours_its_parameters() -> None:
    ds = load_dataset("synthetic:classification?n=500&features=12&classes=4&test=0.3")
    assert ds.x_train.shape == (350, 12) and ds.x_test.shape == (150, 12)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert ds.num_classes == 4 and set(ds.y_train.tolist()) == {0, 1, 2, 3}
    assert not _rows(ds.x_train) & _rows(ds.x_test)


def test_synthetic_classification_defaults_match_the_documentation() -> None:
    ds = load_dataset("synthetic:classification")
    assert (ds.num_train, ds.num_test, ds.feature_shape, ds.num_classes) == (1600, 400, (64,), 10)


def test_synthetic_regression_gives_float_targets_and_no_classes() -> None:
    ds = load_dataset("synthetic:regression?n=100&features=3&outputs=2")
    assert ds.x_train.shape == (80, 3) and ds.y_train.shape == (80, 2)
    assert ds.y_train.dtype == np.float32 and ds.num_classes == 0 and not ds.is_classification


def test_synthetic_ids_give_int64_bags_within_the_vocabulary_for_the_id_models() -> None:
    ds = load_dataset("synthetic:ids?n=300&vocab=50&bag=6&classes=3", model="transformer")
    assert ds.x_train.shape == (240, 6) and ds.x_train.dtype == np.int64
    assert ds.input_name == "ids" and ds.num_classes == 3
    assert 0 <= min(ds.x_train.min(), ds.x_test.min())
    assert max(ds.x_train.max(), ds.x_test.max()) < 50


def test_synthetic_ids_carry_a_learnable_signal() -> None:
    ds = load_dataset("synthetic:ids?n=2000&vocab=100&classes=2&signal=0.5")
    # a token's class is its majority label in training; voting with it should beat chance
    votes = np.zeros((100, 2))
    np.add.at(votes, (ds.x_train, np.repeat(ds.y_train[:, None], ds.x_train.shape[1], 1)), 1)
    predicted = (votes.argmax(1)[ds.x_test] == 1).mean(1) > 0.5
    assert (predicted == (ds.y_test == 1)).mean() > 0.9


def test_synthetic_clicks_give_each_field_its_own_range_of_global_ids() -> None:
    ds = load_dataset("synthetic:clicks?n=2000&fields=5&vocab=30")
    assert ds.x_train.shape == (1600, 5) and ds.x_train.dtype == np.int64
    assert ds.input_name == "ids" and ds.num_classes == 2
    x = np.concatenate([ds.x_train, ds.x_test])
    for f in range(5):
        assert x[:, f].min() >= f * 30 and x[:, f].max() < (f + 1) * 30


def test_hashed_synthetic_clicks_are_the_same_examples_with_each_id_a_fixed_int64_key() -> None:
    plain = load_dataset("synthetic:clicks?n=2000&fields=5&vocab=30")
    hashed = load_dataset("synthetic:clicks?n=2000&fields=5&vocab=30&hashed=1")
    np.testing.assert_array_equal(hashed.x_train, hash_ids(plain.x_train))
    np.testing.assert_array_equal(hashed.x_test, hash_ids(plain.x_test))
    np.testing.assert_array_equal(hashed.y_train, plain.y_train)
    assert hashed.x_train.dtype == np.int64 and np.abs(hashed.x_train).min() > 1 << 40
    assert (hashed.x_train < 0).any() and (hashed.x_train > 1 << 62).any()     # spread over the int64 range
    assert len(np.unique(hashed.x_train)) == len(np.unique(plain.x_train))     # distinct ids stay distinct
    np.testing.assert_array_equal(click_logits("synthetic:clicks?n=2000&fields=5&vocab=30&hashed=1"),
                                  click_logits("synthetic:clicks?n=2000&fields=5&vocab=30"))


def test_synthetic_click_ids_follow_the_zipf_popularity() -> None:
    ds = load_dataset("synthetic:clicks?n=20000&fields=2&vocab=1000&skew=1.3")
    counts = np.sort(np.bincount(ds.x_train[:, 0], minlength=1000))[::-1]
    top = 1 / (np.arange(1, 1001) ** -1.3).sum()      # the most popular id's probability
    assert counts[0] / len(ds.x_train) == pytest.approx(top, rel=0.05)
    assert counts[0] > 20 * counts[100]                   # rank 101 is (101)^1.3 ~ 400x rarer


def test_synthetic_click_labels_follow_their_true_logits_whose_auc_is_the_bayes_auc() -> None:
    """The documented defaults: the true factorization machine ranks the test split at AUC 0.875."""
    ds = load_dataset("synthetic:clicks")
    logits = click_logits("synthetic:clicks")
    assert logits.shape == (ds.num_train + ds.num_test,)
    y = np.concatenate([ds.y_train, ds.y_test])
    # calibrated: the click rate in each decile of the true logit is the mean sigmoid there
    order = np.argsort(logits)
    for chunk in np.array_split(order, 10):
        assert y[chunk].mean() == pytest.approx((1 / (1 + np.exp(-logits[chunk]))).mean(), abs=0.03)
    bayes = binary_auc(logits[ds.num_train:], ds.y_test)
    assert bayes == pytest.approx(0.875, abs=0.001)


def test_synthetic_clicks_have_a_pairwise_signal_that_first_order_rates_miss() -> None:
    """Per-id click rates (the best a first-order model learns) rank the test split well below the true logits."""
    spec = "synthetic:clicks?n=40000&fields=4&vocab=20&skew=0"
    ds = load_dataset(spec)
    logits = click_logits(spec)
    rates = np.zeros(80)
    np.add.at(rates, ds.x_train, ds.y_train[:, None])
    rates /= np.maximum(np.bincount(ds.x_train.ravel(), minlength=80), 1)
    first_order = binary_auc(np.log(rates / (1 - rates))[ds.x_test].sum(1), ds.y_test)
    bayes = binary_auc(logits[ds.num_train:], ds.y_test)
    assert bayes > first_order + 0.05, (bayes, first_order)


@pytest.mark.parametrize("spec", ["synthetic:classification?n=300", "synthetic:regression",
                                  "synthetic:ids?n=200", "synthetic:clicks?n=500"])
def test_synthetic_data_is_a_function_of_the_seed(spec: str) -> None:
    same = load_dataset(spec, seed=4), load_dataset(spec, seed=4)
    other = load_dataset(spec, seed=5)
    assert np.array_equal(same[0].x_train, same[1].x_train)
    assert np.array_equal(same[0].y_test, same[1].y_test)
    assert not np.array_equal(same[0].x_train, other.x_train)


@pytest.mark.parametrize("spec, words", [
    ("synthetic:blobs", ["unknown synthetic kind 'blobs'"]),
    ("synthetic:classification?depth=3", ["unknown parameter 'depth'"]),
    ("synthetic:classification?n=ten", ["n='ten'", "integer"]),
    ("synthetic:classification?n", ["'n' is not key=value"]),
    ("synthetic:classification?n=5&n=6", ["given twice"]),
    ("synthetic:classification?classes=1", ["classes=1"]),
    ("synthetic:classification?test=1.5", ["test=1.5"]),
    ("synthetic:classification?n=1", ["n=1"]),
    ("synthetic:ids?vocab=2&classes=3", ["vocab=2", "classes=3"]),
    ("synthetic:ids?signal=2", ["signal=2.0"]),
    ("synthetic:regression?noise=nan", ["noise='nan'"]),
    ("synthetic:clicks?fields=1", ["fields=1", "pairwise"]),
    ("synthetic:clicks?skew=-1", ["skew=-1.0"]),
    ("synthetic:clicks?hashed=2", ["hashed=2", "0 (row ids) or 1"]),
    ("mnist", ["unknown dataset spec 'mnist'", "digits", "synthetic:"]),
    ("missing/file.npz", ["'missing/file.npz'", "no file at", "the path of an existing .npz file",
                          "or a Parquet folder holding train/ and test/"]),
    ("synthetic:classification?n=100000000000", ["n=100000000000", "features=64", "would take about",
                                                 "118,400,000,000,000 bytes", "to generate, more than"]),
    ("synthetic:ids?n=100&vocab=100000000000", ["vocab=100000000000", "bytes", "to generate, more than"]),
    ("synthetic:clicks?n=100000000000", ["n=100000000000", "fields=10", "bytes", "to generate, more than"]),
])
def test_bad_specs_raise_a_value_error_naming_the_spec_and_the_problem(
        spec: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        load_dataset(spec)
    message = str(caught.value)
    assert repr(spec) in message
    assert all(word in message for word in words), message


def test_an_empty_spec_is_refused() -> None:
    with pytest.raises(DatasetError, match="non-empty"):
        load_dataset("  ")


def test_a_folder_given_to_load_dataset_is_named_as_a_folder(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as caught:
        load_dataset(str(tmp_path))
    assert f"{tmp_path} is a folder" in str(caught.value) and "ParquetDataset" in str(caught.value)


def test_synthetic_sizes_beyond_the_memory_bound_are_refused_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets_module, "_memory_limit", lambda: (1 << 20, "the test's limit"))
    spec = "synthetic:classification?n=100000"    # 100000 x (64 x 18 + 32) bytes = 118 MB > 1 MiB
    with pytest.raises(DatasetError) as caught:
        load_dataset(spec)
    message = str(caught.value)
    for word in (repr(spec), "n=100000, features=64", "about 112.9 MiB (118,400,000 bytes)",
                 "more than the test's limit (1.0 MiB)"):
        assert word in message, message
    with pytest.raises(DatasetError, match="n=100000, fields=10"):
        click_logits("synthetic:clicks?n=100000")
    assert load_dataset("synthetic:classification?n=100&features=4").num_train == 80   # 1,000 x ... bytes: fits


@pytest.mark.parametrize("spec", ["synthetic:classification?n=20000", "synthetic:regression?n=50000&outputs=3",
                                  "synthetic:ids?n=50000&vocab=1000000",
                                  "synthetic:ids?n=50000&vocab=1000000&hot=100000",
                                  "synthetic:ids?n=50000&vocab=1000000&hot=20",
                                  "synthetic:clicks?n=20000&vocab=100000"])
def test_the_synthetic_memory_estimate_covers_what_generation_takes(spec: str) -> None:
    import tracemalloc   # numpy reports its allocations to tracemalloc

    tracemalloc.start()
    try:
        load_dataset(spec)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    estimate = datasets_module._synthetic_bytes(*datasets_module._parse_synthetic(spec))
    assert peak <= estimate + (1 << 20) and estimate <= 3 * peak, (peak, estimate)   # 1 MiB: Python's own


# --- user .npz files ----------------------------------------------------------------------

def test_a_valid_npz_loads_with_cast_dtypes_and_inferred_classes(tmp_path: Path) -> None:
    path = _write(tmp_path / "mine.npz", **_valid_arrays())
    ds = load_dataset(str(path))
    assert ds.name == "mine" and ds.num_classes == 3 and ds.input_name == "x"
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert ds.x_train.shape == (20, 5) and ds.y_test.shape == (6,)


def test_an_npz_may_name_its_input_and_declare_more_classes(tmp_path: Path) -> None:
    path = _write(tmp_path / "named.npz", **_valid_arrays(), input_name=np.array("features"),
                  num_classes=np.array(7))
    ds = load_npz(path)
    assert ds.input_name == "features" and ds.num_classes == 7


def test_an_npz_with_integer_features_is_read_as_ids(tmp_path: Path) -> None:
    arrays = _valid_arrays()
    arrays["x_train"] = np.arange(40, dtype=np.int32).reshape(20, 2)
    arrays["x_test"] = np.arange(12, dtype=np.int32).reshape(6, 2)
    ds = load_npz(_write(tmp_path / "ids.npz", **arrays))
    assert ds.x_train.dtype == np.int64 and ds.input_name == "ids"
    assert reshape_for(ds, "embedding").x_train.shape == (20, 2)


def test_an_npz_with_float_targets_is_regression(tmp_path: Path) -> None:
    arrays = _valid_arrays()
    arrays["y_train"] = np.linspace(0, 1, 20)
    arrays["y_test"] = np.linspace(0, 1, 6)
    ds = load_npz(_write(tmp_path / "reg.npz", **arrays))
    assert ds.num_classes == 0 and ds.y_train.shape == (20, 1) and ds.y_train.dtype == np.float32


def test_an_npz_of_images_feeds_lenet_and_flattens_for_the_mlp(tmp_path: Path) -> None:
    arrays = _valid_arrays()
    arrays["x_train"] = np.zeros((20, 6, 6), np.float32)
    arrays["x_test"] = np.zeros((6, 6, 6), np.float32)
    ds = load_npz(_write(tmp_path / "img.npz", **arrays))
    assert reshape_for(ds, "lenet").x_train.shape == (20, 1, 6, 6)
    assert reshape_for(ds, "mlp").x_train.shape == (20, 36)


@pytest.mark.parametrize("change, words", [
    ({"y_test": None}, ["missing array 'y_test'", "found: x_test, x_train, y_train"]),
    ({"x_train": None, "y_train": None}, ["missing arrays 'x_train', 'y_train'"]),
    ({"y_train": np.zeros(19, np.int64)},
     ["x_train has shape (20, 5)", "y_train has shape (19,)"]),
    ({"x_test": np.zeros((6, 4))}, ["x_train has shape (20, 5)", "x_test (6, 4)"]),
    ({"x_train": np.zeros(20)}, ["x_train has shape (20,)", "ndim >= 2"]),
    ({"x_test": np.zeros((0, 5)), "y_test": np.zeros(0, np.int64)}, ["x_test has no rows"]),
    ({"y_train": -(np.arange(20) % 3)}, ["y_train has a negative label -2"]),
    ({"y_train": np.zeros((20, 2), np.int64)}, ["integer labels y_train have shape (20, 2) and y_test (6,)",
                                                "must agree after the first axis"]),
    ({"x_train": np.full((20, 5), np.nan)}, ["x_train holds NaN"]),
    ({"y_train": np.where(np.arange(20) == 4, np.nan, 0.5), "y_test": np.full(6, 0.5)},
     ["y_train holds NaN or infinite values (row 4)"]),
    ({"y_train": np.full(20, 0.5), "y_test": np.where(np.arange(6) == 2, -np.inf, 0.5)},
     ["y_test holds NaN or infinite values (row 2)"]),
    ({"y_train": np.full((20, 2), 0.5), "y_test": np.where(np.arange(12).reshape(6, 2) == 9, np.inf, 0.5)},
     ["y_test holds NaN or infinite values (row 4)"]),
    ({"x_train": np.where(np.arange(100).reshape(20, 5) == 17, 1e300, 0.5)},
     ["x_train row 3 has values beyond float32's range (largest magnitude 1e+300)", "3.40282e+38"]),
    ({"x_test": np.where(np.arange(30).reshape(6, 5) >= 20, -2e39, 0.5)},
     ["x_test row 4 has values beyond float32's range (largest magnitude 2e+39)"]),
    ({"y_train": np.where(np.arange(20) == 7, 1e300, 0.5), "y_test": np.full(6, 0.5)},
     ["y_train row 7 has values beyond float32's range (largest magnitude 1e+300)"]),
    ({"x_train": np.zeros((20, 5), bool)}, ["x_train is bool"]),
    ({"y_train": np.array(["a"] * 20)}, ["y_train is <U1"]),
    ({"input_name": np.array(["x", "y"])}, ["input_name must be a 0-d string array"]),
    ({"num_classes": np.array(2)}, ["num_classes is 2", "label is 2"]),
    ({"y_train": np.zeros(20, np.int64), "y_test": np.zeros(6, np.int64)}, ["single class"]),
])
def test_npz_format_errors_name_the_file_the_array_and_the_shapes(
        tmp_path: Path, change: dict[str, np.ndarray | None], words: list[str]) -> None:
    arrays = _valid_arrays()
    for key, value in change.items():
        if value is None:
            arrays.pop(key)
        else:
            arrays[key] = value
    path = _write(tmp_path / "broken.npz", **arrays)
    with pytest.raises(DatasetError) as caught:
        load_dataset(str(path))
    message = str(caught.value)
    assert str(path) in message
    assert all(word in message for word in words), message


def test_values_beyond_float32_are_refused_without_leaking_numpy_overflow_warnings(tmp_path: Path) -> None:
    arrays = _valid_arrays()
    arrays["x_train"] = np.full((20, 5), 1e300)
    path = _write(tmp_path / "huge.npz", **arrays)
    with warnings.catch_warnings():
        warnings.simplefilter("error")    # a RuntimeWarning from the cast would fail here
        with pytest.raises(DatasetError) as caught:
            load_npz(path)
    assert "holds NaN" not in str(caught.value)
    assert f"{path}: x_train row 0 has values beyond float32's range (largest magnitude 1e+300)" in str(caught.value)
    arrays["x_train"] = np.full((20, 5), 3e38)   # float64, large, but a float32 holds it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_npz(_write(tmp_path / "large.npz", **arrays)).x_train.max() == np.float32(3e38)


def test_an_empty_file_is_refused_as_not_an_npz(tmp_path: Path) -> None:
    empty = tmp_path / "empty0.npz"
    empty.write_bytes(b"")
    for load in (load_npz, lambda path: load_dataset(str(path))):
        with pytest.raises(DatasetError) as caught:
            load(empty)
        assert str(caught.value) == f"{empty}: empty file (0 bytes), not a .npz archive"


def test_a_file_that_is_not_an_npz_archive_is_refused_by_name(tmp_path: Path) -> None:
    text = tmp_path / "notes.npz"
    text.write_text("hello")
    pickled = tmp_path / "pickled.npz"
    pickled.write_bytes(pickle.dumps({"x_train": [1.0]}))
    for path, start in ((text, "b'hello'"), (pickled, repr(pickle.dumps({"x_train": [1.0]})[:8]))):
        with pytest.raises(DatasetError) as caught:
            load_npz(path)
        message = str(caught.value)
        assert f"{path} is not a .npz (zip) archive (it starts with {start}" in message, message
        assert "allow_pickle" not in message and "Parquet" not in message, message
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3))
    with pytest.raises(DatasetError, match="single.npy: holds a single array"):
        load_npz(single)


def test_an_npz_needing_pickle_is_refused(tmp_path: Path) -> None:
    arrays = _valid_arrays()
    arrays["y_train"] = np.array([object()] * 20, dtype=object)
    path = _write(tmp_path / "pickled.npz", **arrays)
    with pytest.raises(DatasetError, match="pickled.npz: an array could not be read"):
        load_npz(path)


def test_reshape_for_refuses_data_the_model_cannot_take() -> None:
    ids = load_dataset("synthetic:ids?n=100")
    with pytest.raises(DatasetError, match="'mlp' needs float features"):
        reshape_for(ids, "mlp")
    flat = load_dataset("synthetic:classification?n=100")
    with pytest.raises(DatasetError, match="no image shape"):
        reshape_for(flat, "lenet")
    with pytest.raises(DatasetError, match="'embedding' needs"):
        reshape_for(flat, "embedding")
    with pytest.raises(DatasetError, match="unknown model 'resnet'"):
        reshape_for(flat, "resnet")


def test_a_dataset_with_mismatched_rows_cannot_be_built() -> None:
    with pytest.raises(DatasetError, match="input 'x' has 3 train rows but y_train has 2"):
        Dataset.of("bad", np.zeros((3, 2)), np.zeros(2), np.zeros((1, 2)), np.zeros(1))


# --- shards -------------------------------------------------------------------------------

@pytest.mark.parametrize("num_workers", [1, 2, 3, 7, 1438])
def test_worker_shards_are_disjoint_cover_the_training_split_and_are_balanced(
        num_workers: int) -> None:
    ds = load_dataset("digits")
    shards = [worker_shard(ds, i, num_workers) for i in range(num_workers)]
    seen = [_rows(s.x_train) for s in shards]
    assert sum(len(s) for s in seen) == ds.num_train
    assert set().union(*seen) == _rows(ds.x_train)
    sizes = [s.num_train for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert all(np.array_equal(s.x_test, ds.x_test) for s in shards)


def test_worker_shards_keep_examples_and_labels_paired_and_are_deterministic() -> None:
    ds = load_dataset("digits")
    shard = worker_shard(ds, 1, 4)
    assert np.array_equal(shard.x_train, ds.x_train[1::4])
    assert np.array_equal(shard.y_train, ds.y_train[1::4])
    assert np.array_equal(worker_shard(ds, 1, 4).x_train, shard.x_train)
    assert "worker 1 of 4" in shard.name


@pytest.mark.parametrize("index, count, words", [
    (3, 3, ["worker_index 3", "num_workers 3"]),
    (-1, 3, ["worker_index", "-1"]),
    (0, 0, ["num_workers", "0"]),
    (0, 2000, ["num_workers 2000", "1438"]),
    (True, 2, ["worker_index", "True"]),
])
def test_worker_shard_rejects_bad_indices_naming_the_values(
        index: int, count: int, words: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        worker_shard(load_dataset("digits"), index, count)
    assert all(word in str(caught.value) for word in words), str(caught.value)


# --- batches ------------------------------------------------------------------------------

def test_batches_have_a_fixed_size_and_wrap_the_remainder_so_every_example_is_seen() -> None:
    x = np.arange(10, dtype=np.float32)[:, None]
    y = np.arange(10)
    batches = list(iterate_batches(x, y, 4, seed=0, epoch=0))
    assert len(batches) == 3 == num_batches(10, 4)
    assert all(bx.shape == (4, 1) and by.shape == (4,) for bx, by in batches)
    assert set(np.concatenate([by for _, by in batches]).tolist()) == set(range(10))
    assert all(np.array_equal(bx[:, 0], by) for bx, by in batches)  # pairs stay together


def test_batches_can_drop_the_remainder_instead() -> None:
    x, y = np.zeros((10, 2)), np.arange(10)
    batches = list(iterate_batches(x, y, 4, seed=0, epoch=0, remainder="drop"))
    assert len(batches) == 2 == num_batches(10, 4, remainder="drop")
    assert len(set(np.concatenate([by for _, by in batches]).tolist())) == 8


def test_a_shard_smaller_than_the_batch_still_yields_one_full_batch() -> None:
    batches = list(iterate_batches(np.zeros((3, 1)), np.arange(3), 8, seed=1, epoch=2))
    assert len(batches) == 1 and batches[0][1].shape == (8,)
    assert set(batches[0][1].tolist()) == {0, 1, 2}


def test_batch_order_is_fixed_by_seed_and_epoch_and_changes_between_epochs() -> None:
    x, y = np.zeros((64, 1)), np.arange(64)

    def order(seed: int, epoch: int) -> list[int]:
        return np.concatenate([by for _, by in iterate_batches(x, y, 8, seed=seed,
                                                               epoch=epoch)]).tolist()

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != order(1, 0)
    assert sorted(order(3, 5)) == list(range(64))


@pytest.mark.parametrize("kwargs, words", [
    ({"batch_size": 0}, ["batch_size", "0"]),
    ({"seed": -1}, ["seed", "-1"]),
    ({"epoch": 1.5}, ["epoch", "1.5"]),
    ({"remainder": "pad"}, ["remainder", "'pad'"]),
    ({"batch_size": 20, "remainder": "drop"}, ["batch_size 20", "10 examples"]),
])
def test_iterate_batches_rejects_bad_arguments_when_called(kwargs: dict[str, object],
                                                           words: list[str]) -> None:
    arguments: dict[str, object] = {"batch_size": 4, "seed": 0, "epoch": 0, **kwargs}
    with pytest.raises(ValueError) as caught:
        iterate_batches(np.zeros((10, 1)), np.arange(10), **arguments)  # type: ignore[arg-type]
    assert all(word in str(caught.value) for word in words), str(caught.value)


def test_iterate_batches_rejects_unpaired_arrays() -> None:
    with pytest.raises(ValueError, match="x has 5 rows but y has 4"):
        iterate_batches(np.zeros((5, 1)), np.arange(4), 2, seed=0, epoch=0)


def test_synthetic_ids_with_hot_draw_from_that_many_ids_spread_over_the_vocab():
    from ps_models.datasets import load_dataset as load

    data = load("synthetic:ids?n=400&vocab=1000000&bag=4&hot=50", seed=0)
    used = np.unique(np.concatenate([data.x_train.ravel(), data.x_test.ravel()]))
    assert len(used) <= 50 and used.max() > 1000    # few ids, from all over the vocabulary
    with pytest.raises(Exception, match="hot=5000000"):
        load("synthetic:ids?n=400&vocab=1000000&hot=5000000", seed=0)
