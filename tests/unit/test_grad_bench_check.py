"""grad_bench's gradient check: the largest difference over the largest gradient, and, where the engine and torch
disagree, both measured against torch in float64 so the record says which side is off. The benchmark needs torch,
which `make test` never installs: these run in a benchmark environment and skip elsewhere."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="ps_bench.grad_bench compares against torch, not installed here")
grad_bench = pytest.importorskip("ps_bench.grad_bench")


def test_the_largest_error_is_over_the_largest_expected_gradient() -> None:
    expected = {"a": np.array([1.0, -4.0]), "b": np.array([0.5])}
    got = {"a": np.array([1.0, -4.0]), "b": np.array([0.7]), "unrelated": np.array([9.0])}
    assert grad_bench._largest_error(got, expected) == pytest.approx(0.2 / 4.0)
    assert grad_bench._largest_error(expected, expected) == 0.0


def _case(loss: str) -> grad_bench.Case:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.ReLU(),
                                 torch.nn.Linear(5, 3)).train()
    example = torch.randn(16, 6)
    labels = torch.randn(16, 3) if loss == "mse" else torch.randint(0, 3, (16,))
    return grad_bench.Case(Path("unused.onnx"), module, {}, example, labels, loss)


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_the_float64_arbiter_names_the_side_that_is_off(loss: str) -> None:
    case = _case(loss)
    loss_fn = torch.nn.functional.cross_entropy if loss == "cross_entropy" else torch.nn.functional.mse_loss
    loss_fn(case.module(case.torch_input), case.torch_labels).backward()
    float32 = {name: p.grad.numpy().copy() for name, p in case.module.named_parameters()}
    # one side as torch's float32 gradients; the other those with one entry moved by a tenth of the largest
    moved = {name: value.copy() for name, value in float32.items()}
    largest = max(float(np.abs(value).max()) for value in float32.values())
    moved["3.weight"][0, 0] += 0.1 * largest
    engine_error, torch_error = grad_bench._float64_errors(float32, moved, case.module, case, loss_fn)
    assert engine_error < 1e-5                      # float32 against float64: rounding
    assert torch_error == pytest.approx(0.1, rel=1e-3)
    engine_error, torch_error = grad_bench._float64_errors(moved, float32, case.module, case, loss_fn)
    assert engine_error == pytest.approx(0.1, rel=1e-3) and torch_error < 1e-5
    # the module itself is left in float32, its gradients as they were
    assert all(p.dtype == torch.float32 for p in case.module.parameters())
    assert all(np.array_equal(p.grad.numpy(), float32[name]) for name, p in case.module.named_parameters())
