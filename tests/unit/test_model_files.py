"""Model files crafted by someone else: external data is read by onnx's rules or stricter, tensors hold what they
declare, and every refusal names the model file and the tensor.

The one door is worker_client/engine/external_data.py; these tests go through the paths that read
a model's tensors (read_model with and without external data, the sparse tables' mapping in the
GradientEngine, the pipeline cut's load_model, ps-check) and assert each refuses the same files.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from ps_common.errors import ModelLoadError
from ps_models.large_table import TABLE, write_large_embedding
from worker_client.check import check_model
from worker_client.engine import GradientEngine
from worker_client.engine.external_data import map_external
from worker_client.engine.load import load_model, read_model

ROWS, DIM = 64, 4


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file outside the model's folder whose bytes must never become parameters."""
    path = tmp_path / "outside" / "secret.bin"
    path.parent.mkdir()
    path.write_bytes(np.full(ROWS * DIM, 7.0, dtype="<f4").tobytes())
    return path


def table_model(folder: Path, **entries: str) -> Path:
    """The bundled embedding model with its table in external data, its entries then replaced by `entries`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = write_large_embedding(folder / "model.onnx", rows=ROWS, dim=DIM, bag=2)
    if entries:
        model = onnx.load(path, load_external_data=False)
        tensor = next(t for t in model.graph.initializer if t.name == TABLE)
        info = {e.key: e.value for e in tensor.external_data} | entries
        del tensor.external_data[:]
        for key, value in info.items():
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        onnx.save_model(model, str(path))
    return path


def every_reader(path: Path):
    """Each path of the project that reads a model's tensors, as a callable that raises ModelLoadError."""
    return {
        "read_model (checked, not read)": lambda: read_model(path, external_data=False),
        "read_model (read)": lambda: read_model(path),
        "load_model (pipeline cuts, ps-launch)": lambda: load_model(path),
        "GradientEngine, dense": lambda: GradientEngine(path, batch_size=2, cache_dir=path.parent / "cache"),
        "GradientEngine, sparse table mapped": lambda: GradientEngine(
            path, batch_size=2, cache_dir=path.parent / "cache", sparse_tables=[TABLE]),
        "GradientEngine, dynamic table": lambda: GradientEngine(
            path, batch_size=2, cache_dir=path.parent / "cache", dynamic_tables=[TABLE]),
    }


def assert_refused_everywhere(path: Path, *expected: str) -> None:
    for what, read in every_reader(path).items():
        with pytest.raises(ModelLoadError) as caught:
            read()
        message = str(caught.value)
        assert str(path) in message, f"{what}: {message}"
        assert repr(TABLE) in message, f"{what}: {message}"
        for text in expected:
            assert text in message, f"{what}: {text!r} not in {message!r}"
    report = check_model(path)
    assert not report.ok and str(path) in (report.error or "") and TABLE in report.error


def test_a_table_in_a_regular_file_inside_the_folder_is_read_by_every_path(tmp_path):
    path = table_model(tmp_path / "m")
    engine = GradientEngine(path, batch_size=2, cache_dir=tmp_path / "cache", sparse_tables=[TABLE])
    mapped = engine.server_parameters()[TABLE]
    raw = np.fromfile(tmp_path / "m" / "model.onnx.data", dtype="<f4").reshape(ROWS, DIM)
    np.testing.assert_array_equal(mapped, raw)
    dense = read_model(path)
    loaded = next(t for t in dense.graph.initializer if t.name == TABLE)
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(loaded), raw)


def test_a_table_file_that_is_a_symbolic_link_to_a_file_outside_is_refused(tmp_path, secret):
    path = table_model(tmp_path / "m")
    data = tmp_path / "m" / "model.onnx.data"
    data.unlink()
    data.symlink_to(secret)
    assert_refused_everywhere(path, "symbolic link")


def test_a_table_file_behind_a_linked_folder_is_refused(tmp_path, secret):
    path = table_model(tmp_path / "m", location="sub/secret.bin")
    (tmp_path / "m" / "sub").symlink_to(secret.parent, target_is_directory=True)
    assert_refused_everywhere(path, "symbolic link", "sub")


def test_a_link_inside_the_folder_to_a_file_inside_is_refused_too(tmp_path):
    # onnx refuses any link: the rule is about links, not only where they point
    path = table_model(tmp_path / "m")
    data = tmp_path / "m" / "model.onnx.data"
    data.rename(tmp_path / "m" / "real.data")
    data.symlink_to("real.data")
    assert_refused_everywhere(path, "symbolic link")


@pytest.mark.parametrize("location, says", [
    ("../outside/secret.bin", "outside the model's folder"),
    ("sub/../../outside/secret.bin", "outside the model's folder"),
    ("{secret}", "absolute path"),
    ("", "names no location"),
    ("missing.data", "is missing"),
    (".", "names the model's folder, not a file"),
    ("sub", "is not a regular file"),
])
def test_a_location_outside_missing_or_not_a_file_is_refused(tmp_path, secret, location, says):
    (tmp_path / "m" / "sub").mkdir(parents=True)
    path = table_model(tmp_path / "m", location=location.format(secret=secret))
    assert_refused_everywhere(path, says)


@pytest.mark.parametrize("entries, says", [
    ({"offset": "4096"}, "past the end"),
    ({"offset": "-4"}, "not a non-negative integer"),
    ({"length": "12"}, "needs 1024 bytes"),
    ({"length": "9999"}, "passes the end"),
    ({"offset": "4", "length": "1024"}, "passes the end"),
    ({"length": "x"}, "not a non-negative integer"),
])
def test_offsets_and_lengths_outside_the_file_or_the_tensor_are_refused(tmp_path, entries, says):
    path = table_model(tmp_path / "m", **entries)
    assert_refused_everywhere(path, says)


def test_a_fifo_in_place_of_the_data_file_is_refused_without_blocking(tmp_path):
    path = table_model(tmp_path / "m")
    data = tmp_path / "m" / "model.onnx.data"
    data.unlink()
    os.mkfifo(data)
    assert_refused_everywhere(path, "not a regular file")


def test_a_mapped_table_is_read_only(tmp_path):
    path = table_model(tmp_path / "m")
    tensor = next(t for t in onnx.load(path, load_external_data=False).graph.initializer if t.name == TABLE)
    array = map_external(tensor, tmp_path / "m", where=str(path))
    with pytest.raises(ValueError):
        array[0, 0] = 1.0


def _model_with_initializer(path: Path, tensor: onnx.TensorProto) -> Path:
    graph = helper.make_graph([helper.make_node("Add", ["x", tensor.name], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])], [tensor])
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.parametrize("dims, data, says", [
    ([1 << 40, 1 << 40], None, "declares shape [1099511627776, 1099511627776]"),
    ([3, 2], b"\0" * 8, "holds 8 bytes"),
    ([-1, 2], None, "negative dimension"),
])
def test_a_tensor_that_does_not_hold_what_its_dims_declare_is_named_with_its_file(tmp_path, dims, data, says):
    tensor = TensorProto(name="w.huge", data_type=TensorProto.FLOAT, dims=dims)
    if data is not None:
        tensor.raw_data = data
    path = _model_with_initializer(tmp_path / "crafted.onnx", tensor)
    for read in (lambda: read_model(path, external_data=False), lambda: load_model(path),
                 lambda: GradientEngine(path, batch_size=2, cache_dir=tmp_path / "cache")):
        with pytest.raises(ModelLoadError) as caught:
            read()
        assert str(path) in str(caught.value) and "'w.huge'" in str(caught.value) and says in str(caught.value)
    report = check_model(path)
    assert not report.ok and "'w.huge'" in report.error and str(path) in report.error


def test_typed_and_raw_tensors_that_hold_their_values_load(tmp_path):
    typed = helper.make_tensor("w", TensorProto.FLOAT, [1, 2], [1.0, 2.0])
    path = _model_with_initializer(tmp_path / "typed.onnx", typed)
    assert read_model(path).graph.initializer[0].float_data == [1.0, 2.0]
    raw = helper.make_tensor("w", TensorProto.FLOAT16, [1, 2], np.array([1, 2], np.float16).tobytes(), raw=True)
    assert read_model(_model_with_initializer(tmp_path / "raw.onnx", raw)).graph.initializer[0].raw_data
