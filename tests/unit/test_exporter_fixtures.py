"""Models from the common exporters train: each fixture's gradients against its framework's.

The fixtures (tests/fixtures/torch, tests/fixtures/keras) were made by the scripts beside
them; neither torch nor tensorflow is needed here. Every fixture is checked at 1e-5
relative against torch autograd or GradientTape.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from worker_client import GradientEngine

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
#: fixture -> its folder; every one is exported with the default trainable selection.
MODELS = {"gru_reader": "torch", "lstm_reader": "torch", "depthwise_separable": "torch",
          "scalar_temperature": "torch", "keras_cnn": "keras", "keras_layernorm_mlp": "keras"}
#: The agreement the issue asks for, relative to the gradient's norm.
TOLERANCE = 1e-5


def load_fixture(name: str, folder: str):
    """(model path, inputs incl. labels, loss kind, loss, gradients, arrays by prefix)."""
    data = np.load(FIXTURES / folder / f"{name}.npz")

    def prefixed(prefix: str) -> dict[str, np.ndarray]:
        return {k[len(prefix):]: data[k] for k in data.files if k.startswith(prefix)}

    inputs = prefixed("input:")
    inputs["labels"] = data["labels"]
    return (FIXTURES / folder / f"{name}.onnx", inputs, str(data["loss_kind"]),
            float(data["loss"]), prefixed("grad:"), prefixed)


def relative_error(value: np.ndarray, reference: np.ndarray) -> float:
    scale = max(float(np.linalg.norm(reference)), 1e-30)
    return float(np.linalg.norm(value.astype(np.float64) - reference)) / scale


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_fixture_trains_exactly_the_frameworks_variables_with_its_gradients(
        name: str, tmp_path: Path) -> None:
    path, inputs, kind, reference_loss, reference, _ = load_fixture(name, MODELS[name])
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no tie, no folded variable, no failed upgrade
        engine = GradientEngine(path, batch_size=len(inputs["labels"]), loss=kind,
                                cache_dir=tmp_path)
    assert sorted(engine.trainable_names) == sorted(reference)
    loss, grads = engine.gradients(engine.parameters(), inputs)
    assert abs(loss - reference_loss) <= TOLERANCE * abs(reference_loss)
    for key, expected in reference.items():
        assert grads[key].shape == expected.shape, key
        assert relative_error(grads[key], expected) <= TOLERANCE, key


def test_a_plain_tf2onnx_export_warns_that_its_biases_were_folded_away(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"2 weight layer\(s\) of this tf2onnx model have no "
                                         r"bias: .*dense.*MatMul"):
        engine = GradientEngine(FIXTURES / "keras" / "keras_layernorm_mlp_plain.onnx",
                                batch_size=4, cache_dir=tmp_path)
    assert len(engine.trainable_names) == 3   # of the six Keras variables
