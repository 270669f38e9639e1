"""The torch LSTM fixture (tests/fixtures/torch/lstm_reader.onnx and its .npz) as the engine's tests use it: its batch, torch's
reference gradients, and the engine built with and without one of the rewrite passes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from worker_client import GradientEngine
from worker_client.engine import rewrites

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "torch"


def lstm_batch() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the engine's inputs with the labels, torch's gradient of each parameter)."""
    data = np.load(FIXTURES / "lstm_reader.npz")
    inputs = {k[len("input:"):]: data[k] for k in data.files if k.startswith("input:")}
    inputs["labels"] = data["labels"]
    reference = {k[len("grad:"):]: data[k] for k in data.files if k.startswith("grad:")}
    return inputs, reference


def lstm_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, without: str
                 ) -> tuple[GradientEngine, GradientEngine]:
    """(the engine as built, the engine built with the pass `rewrites.<without>` doing nothing), each with a
    cache of its own."""
    batch = len(lstm_batch()[0]["labels"])

    def build(folder: str) -> GradientEngine:
        return GradientEngine(FIXTURES / "lstm_reader.onnx", batch_size=batch, loss="cross_entropy",
                              cache_dir=tmp_path / folder)

    engine = build("with")
    with monkeypatch.context() as patched:
        patched.setattr(rewrites, without, lambda *args, **kwargs: 0)
        plain = build("without")
    return engine, plain


def assert_lstm_gradients_hold(engine: GradientEngine, plain: GradientEngine, *, exact: bool = True) -> None:
    """The two engines' losses equal and their gradients bit for bit equal (`exact`; else to float32 rounding: a
    pass that regroups a sum), and torch's to float32 rounding."""
    inputs, reference = lstm_batch()
    loss, gradients = engine.gradients(engine.parameters(), inputs)
    plain_loss, plain_gradients = plain.gradients(plain.parameters(), inputs)
    assert loss == plain_loss
    assert reference
    for name, expected in reference.items():
        scale = np.abs(expected).max()
        if exact:
            np.testing.assert_array_equal(gradients[name], plain_gradients[name])
        else:
            np.testing.assert_allclose(gradients[name], plain_gradients[name], rtol=1e-5, atol=1e-6 * scale)
        np.testing.assert_allclose(gradients[name], expected, rtol=1e-4, atol=1e-6 * scale)

