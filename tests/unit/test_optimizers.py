"""The server-side optimizers against torch.optim reference trajectories, plus their contracts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ps_server import optimizers
from ps_server.optimizers import OPTIMIZERS, Optimizer, make_optimizer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "optimizer_reference.npz"

with np.load(FIXTURE) as _npz:
    REFERENCE: dict[str, np.ndarray] = {key: _npz[key] for key in _npz.files}
CASES: list[dict[str, Any]] = json.loads(str(REFERENCE["cases"]))
META: dict[str, Any] = json.loads(str(REFERENCE["meta"]))
TENSORS: list[str] = META["tensors"]
STEPS: int = META["steps"]


def cases_for(optimizer: str) -> list[Any]:
    """pytest params for the fixture cases of one optimizer, named by case."""
    return [pytest.param(case, id=case["name"]) for case in CASES if case["optimizer"] == optimizer]


def run_case(case: dict[str, Any], dtype: type[np.floating[Any]]) -> dict[str, list[np.ndarray]]:
    """Run one fixture case with our optimizer in ``dtype``; return each tensor's params per step."""
    opt = make_optimizer(case["optimizer"], **case["hyperparameters"])
    params = {t: REFERENCE[f"init/{t}"].astype(dtype) for t in TENSORS}
    states = {t: opt.init_state(params[t]) for t in TENSORS}
    history: dict[str, list[np.ndarray]] = {t: [] for t in TENSORS}
    for step in range(STEPS):
        for t in TENSORS:
            grad = REFERENCE[f"grads/{t}"][step].astype(dtype)
            opt.apply(params[t], grad, states[t])
            history[t].append(params[t].copy())
    return history


def assert_matches_reference(case: dict[str, Any], dtype: type[np.floating[Any]], rtol: float, atol: float) -> None:
    """Every tensor after every step equals torch's to the given tolerances."""
    history = run_case(case, dtype)
    for t in TENSORS:
        expected = REFERENCE[f"expected/{case['name']}/{t}"]
        for step in range(STEPS):
            np.testing.assert_allclose(
                history[t][step], expected[step], rtol=rtol, atol=atol, err_msg=f"{case['name']} {t} step {step + 1}"
            )


def test_fixture_has_cases_for_every_optimizer() -> None:
    assert {case["optimizer"] for case in CASES} == set(OPTIMIZERS)
    assert STEPS >= 5


@pytest.mark.parametrize("case", cases_for("sgd"))
def test_sgd_matches_torch_reference_to_1e6_relative(case: dict[str, Any]) -> None:
    assert_matches_reference(case, np.float64, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("case", cases_for("momentum"))
def test_momentum_matches_torch_reference_to_1e6_relative(case: dict[str, Any]) -> None:
    assert_matches_reference(case, np.float64, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("case", cases_for("adam"))
def test_adam_matches_torch_reference_to_1e6_relative(case: dict[str, Any]) -> None:
    assert_matches_reference(case, np.float64, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("case", cases_for("adamw"))
def test_adamw_matches_torch_reference_to_1e6_relative(case: dict[str, Any]) -> None:
    assert_matches_reference(case, np.float64, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("case", cases_for("adagrad"))
def test_adagrad_matches_torch_reference_to_1e6_relative(case: dict[str, Any]) -> None:
    assert_matches_reference(case, np.float64, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("case", cases_for("rmsprop"))
def test_rmsprop_matches_torch_reference_to_1e6_relative(case: dict[str, Any]) -> None:
    assert_matches_reference(case, np.float64, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("case", [pytest.param(case, id=case["name"]) for case in CASES])
def test_float32_params_stay_within_1e5_of_the_float64_reference(case: dict[str, Any]) -> None:
    assert_matches_reference(case, np.float32, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", [pytest.param(case, id=case["name"]) for case in CASES])
def test_float32_updates_keep_param_and_state_in_float32(case: dict[str, Any]) -> None:
    opt = make_optimizer(case["optimizer"], **case["hyperparameters"])
    param = REFERENCE["init/matrix"].astype(np.float32)
    state = opt.init_state(param)
    opt.apply(param, REFERENCE["grads/matrix"][0].astype(np.float32), state)
    assert param.dtype == np.float32
    assert all(value.dtype == np.float32 for key, value in state.items() if key != "step")


@pytest.mark.parametrize("case", [pytest.param(case, id=case["name"]) for case in CASES])
def test_state_has_an_int64_step_and_slots_shaped_like_the_param(case: dict[str, Any]) -> None:
    opt = make_optimizer(case["optimizer"], **case["hyperparameters"])
    for dtype in (np.float32, np.float64):
        param = np.zeros((4, 5), dtype=dtype)
        state = opt.init_state(param)
        assert state["step"].shape == () and state["step"].dtype == np.int64 and int(state["step"]) == 0
        for key, value in state.items():
            if key != "step":
                assert value.shape == param.shape and value.dtype == param.dtype, key
        for expected_step in (1, 2):
            opt.apply(param, np.ones_like(param), state)
            assert int(state["step"]) == expected_step


def test_state_slots_follow_the_enabled_features() -> None:
    param = np.zeros(3)
    assert set(make_optimizer("sgd").init_state(param)) == {"step"}
    assert set(make_optimizer("momentum").init_state(param)) == {"step", "momentum_buffer"}
    assert set(make_optimizer("adam").init_state(param)) == {"step", "exp_avg", "exp_avg_sq"}
    assert "max_exp_avg_sq" in make_optimizer("adamw", amsgrad=True).init_state(param)
    assert set(make_optimizer("rmsprop", momentum=0.9, centered=True).init_state(param)) == {
        "step",
        "square_avg",
        "momentum_buffer",
        "grad_avg",
    }
    np.testing.assert_array_equal(
        make_optimizer("adagrad", initial_accumulator_value=0.25).init_state(param)["sum"], np.full(3, 0.25)
    )


@pytest.mark.parametrize("case", [pytest.param(case, id=case["name"]) for case in CASES])
def test_read_only_grad_from_bytes_is_accepted_and_left_unmodified(case: dict[str, Any]) -> None:
    opt = make_optimizer(case["optimizer"], **case["hyperparameters"])
    param = REFERENCE["init/matrix"].copy()
    raw = REFERENCE["grads/matrix"][0].tobytes()
    grad = np.frombuffer(raw, dtype=np.float64)  # 1-D and read-only, as it arrives off the wire
    assert not grad.flags.writeable
    state = opt.init_state(param)
    for _ in range(3):
        opt.apply(param, grad, state)
    assert grad.tobytes() == raw

    writable = REFERENCE["grads/matrix"][0].copy()
    before = writable.copy()
    opt.apply(param, writable, state)
    np.testing.assert_array_equal(writable, before)


@pytest.mark.parametrize("case", [pytest.param(case, id=case["name"]) for case in CASES])
def test_updating_row_ranges_separately_equals_updating_the_whole_tensor(case: dict[str, Any]) -> None:
    opt = make_optimizer(case["optimizer"], **case["hyperparameters"])
    whole = REFERENCE["init/tall"].copy()
    whole_state = opt.init_state(whole)
    shards = [whole[:3].copy(), whole[3:].copy()]
    shard_states = [opt.init_state(shard) for shard in shards]
    for step in range(STEPS):
        grad = REFERENCE["grads/tall"][step]
        opt.apply(whole, grad, whole_state)
        opt.apply(shards[0], grad[:3], shard_states[0])
        opt.apply(shards[1], grad[3:], shard_states[1])
    np.testing.assert_array_equal(np.concatenate(shards), whole)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", [pytest.param(case, id=case["name"]) for case in CASES])
def test_blocked_contiguous_and_unblocked_strided_tensors_get_identical_updates(
    case: dict[str, Any], dtype: type[np.floating[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(optimizers, "_BLOCK_BYTES", 4096)  # several blocks plus a partial one
    opt = make_optimizer(case["optimizer"], **case["hyperparameters"])
    rng = np.random.default_rng(7)
    shape = (61, 53)
    contiguous = rng.standard_normal(shape).astype(dtype)
    strided = np.asfortranarray(contiguous)  # not C-contiguous: updated in one whole-array pass
    state_c, state_f = opt.init_state(contiguous), opt.init_state(strided)
    for _ in range(3):
        grad = rng.standard_normal(shape).astype(dtype)
        opt.apply(contiguous, grad, state_c)
        opt.apply(strided, grad, state_f)
    np.testing.assert_array_equal(contiguous, strided)
    for key in state_c:
        np.testing.assert_array_equal(state_c[key], state_f[key], err_msg=key)


@pytest.mark.parametrize("size", [5, 300_000])  # whole-array and blocked paths
def test_grad_of_another_float_dtype_is_cast_to_the_param_dtype(size: int) -> None:
    opt = make_optimizer("adam", lr=0.01)
    param = np.ones(size)
    state = opt.init_state(param)
    grad = np.frombuffer(np.ones(size, dtype=np.float32).tobytes(), dtype=np.float32)
    opt.apply(param, grad, state)
    assert param.dtype == np.float64 and state["exp_avg"].dtype == np.float64
    np.testing.assert_allclose(param, 0.99)
    small = np.ones(size, dtype=np.float32)
    small_state = opt.init_state(small)
    opt.apply(small, np.ones(size, dtype=np.float64), small_state)
    np.testing.assert_allclose(small, 0.99, rtol=1e-6)


def test_grad_with_the_wrong_element_count_raises_value_error() -> None:
    opt = make_optimizer("sgd")
    param = np.zeros((2, 3))
    with pytest.raises(ValueError, match="5 elements"):
        opt.apply(param, np.zeros(5), opt.init_state(param))


def test_unknown_optimizer_name_raises_value_error_listing_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown optimizer 'adamm'; choose one of sgd, momentum"):
        make_optimizer("adamm")


def test_optimizers_tuple_names_every_optimizer_and_make_optimizer_sets_the_name() -> None:
    assert OPTIMIZERS == ("sgd", "momentum", "adam", "adamw", "adagrad", "rmsprop")
    for name in OPTIMIZERS:
        opt = make_optimizer(name)
        assert isinstance(opt, Optimizer)
        assert opt.name == name


def test_unknown_hyperparameter_raises_value_error_naming_it_and_its_value() -> None:
    with pytest.raises(ValueError, match=r"'betas'=\(0.9, 0.99\)"):
        make_optimizer("adam", betas=(0.9, 0.99))
    with pytest.raises(ValueError, match="'nesterov'"):
        make_optimizer("adam", nesterov=True)


@pytest.mark.parametrize(
    ("name", "hyperparameters", "message"),
    [
        ("sgd", {"lr": -0.1}, "Invalid learning rate: -0.1 (must be >= 0)"),
        ("adam", {"lr": float("nan")}, "Invalid lr value: nan"),
        ("sgd", {"lr": float("inf")}, "Invalid lr value: inf"),
        ("sgd", {"lr": "0.1"}, "Invalid lr value: '0.1'"),
        ("sgd", {"lr": True}, "Invalid lr value: True"),
        ("momentum", {"momentum": -0.5}, "Invalid momentum value: -0.5"),
        ("sgd", {"dampening": 1.5}, "Invalid dampening value: 1.5"),
        ("sgd", {"weight_decay": -1.0}, "Invalid weight_decay value: -1.0"),
        ("sgd", {"nesterov": 1}, "Invalid nesterov value: 1"),
        ("adam", {"beta1": 1.0}, "Invalid beta1 value: 1.0 (must be in [0, 1))"),
        ("adamw", {"beta2": -0.1}, "Invalid beta2 value: -0.1"),
        ("adam", {"eps": -1e-8}, "Invalid eps value: -1e-08"),
        ("adam", {"amsgrad": "yes"}, "Invalid amsgrad value: 'yes'"),
        ("adagrad", {"lr_decay": -0.01}, "Invalid lr_decay value: -0.01"),
        ("adagrad", {"initial_accumulator_value": -2.0}, "Invalid initial_accumulator_value value: -2.0"),
        ("rmsprop", {"alpha": 1.5}, "Invalid alpha value: 1.5"),
        ("rmsprop", {"momentum": -0.9}, "Invalid momentum value: -0.9"),
        ("rmsprop", {"centered": None}, "Invalid centered value: None"),
    ],
)
def test_invalid_hyperparameter_raises_value_error_naming_the_value(
    name: str, hyperparameters: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        make_optimizer(name, **hyperparameters)


@pytest.mark.parametrize(
    ("name", "hyperparameters"),
    [("sgd", {"nesterov": True}), ("momentum", {"nesterov": True, "momentum": 0.0}), ("momentum", {"nesterov": True, "dampening": 0.1})],
)
def test_nesterov_without_momentum_or_with_dampening_is_refused(name: str, hyperparameters: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="Nesterov momentum requires"):
        make_optimizer(name, **hyperparameters)


def test_hyperparameters_are_resolved_with_torch_defaults() -> None:
    assert make_optimizer("sgd").hyperparameters == {
        "lr": 1e-3,
        "momentum": 0.0,
        "dampening": 0.0,
        "weight_decay": 0.0,
        "nesterov": False,
    }
    assert make_optimizer("momentum", lr=0.1).hyperparameters["momentum"] == 0.9
    adam = make_optimizer("adam", lr=1, amsgrad=np.bool_(True)).hyperparameters
    assert adam == {"lr": 1.0, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "amsgrad": True}
    assert type(adam["lr"]) is float and type(adam["amsgrad"]) is bool
    assert make_optimizer("adamw").hyperparameters["weight_decay"] == 0.01
    assert make_optimizer("adagrad").hyperparameters == {
        "lr": 1e-2,
        "lr_decay": 0.0,
        "weight_decay": 0.0,
        "initial_accumulator_value": 0.0,
        "eps": 1e-10,
    }
    assert make_optimizer("rmsprop").hyperparameters == {
        "lr": 1e-2,
        "alpha": 0.99,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "momentum": 0.0,
        "centered": False,
    }
    json.dumps(make_optimizer("rmsprop", centered=True).hyperparameters)  # plain JSON-able values
