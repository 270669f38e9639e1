"""NumPy optimizers matching torch.optim; all elementwise, so each row range of a sharded tensor updates alone."""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from typing import ClassVar

import numpy as np

__all__ = [
    "OPTIMIZERS",
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "Optimizer",
    "RMSprop",
    "make_optimizer",
]

HyperValue = float | bool

# Bytes per array per cache block: the several passes of one update run over a block while
# it is still in the CPU cache, and the scratch arrays stay small (see Optimizer.apply).
# 512 KiB measured best on a 16M-element float32 Adam update (2 MiB L2): about 2x faster
# than whole-array passes, and the per-call overhead of small blocks stays negligible.
_BLOCK_BYTES = 1 << 19


def _as_float(name: str, value: object) -> float:
    """Return a numeric hyperparameter as a finite float, or raise ValueError naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"Invalid {name} value: {value!r} (expected a number)")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"Invalid {name} value: {value!r} (must be finite)")
    return result


def _as_bool(name: str, value: object) -> bool:
    """Return a flag hyperparameter as a bool, or raise ValueError naming it."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"Invalid {name} value: {value!r} (expected True or False)")
    return bool(value)


def _check_range(name: str, value: float, low: float, high: float | None = None, *, high_open: bool = False) -> None:
    """Raise ValueError unless low <= value <= high (or < high when high_open)."""
    label = "learning rate" if name == "lr" else f"{name} value"
    if value < low or (high is not None and (value >= high if high_open else value > high)):
        allowed = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"Invalid {label}: {value} (must be {allowed})")


class Optimizer(abc.ABC):
    """One optimizer with fixed hyperparameters; per-tensor state lives outside, in a dict of arrays.

    Instances hold no mutable state, so threads may apply updates to different tensors at once.
    """

    name: str
    hyperparameters: dict[str, HyperValue]

    _DEFAULTS: ClassVar[dict[str, HyperValue]] = {}
    _SCRATCH: ClassVar[int] = 1  # scratch arrays _update needs

    def __init__(self, name: str, **hyperparameters: object) -> None:
        """Resolve hyperparameters against the defaults and validate them (ValueError)."""
        unknown = [key for key in hyperparameters if key not in self._DEFAULTS]
        if unknown:
            key = unknown[0]
            raise ValueError(
                f"unknown hyperparameter {key!r}={hyperparameters[key]!r} for optimizer {name!r}; "
                f"choose from {', '.join(self._DEFAULTS)}"
            )
        resolved: dict[str, HyperValue] = {}
        for key, default in self._DEFAULTS.items():
            value = hyperparameters.get(key, default)
            resolved[key] = _as_bool(key, value) if isinstance(default, bool) else _as_float(key, value)
        self.name = name
        self.hyperparameters = resolved
        self._validate()

    def __repr__(self) -> str:
        settings = ", ".join(f"{key}={value!r}" for key, value in self.hyperparameters.items())
        return f"{type(self).__name__}({self.name!r}, {settings})"

    @abc.abstractmethod
    def _validate(self) -> None:
        """Raise ValueError for an out-of-range hyperparameter."""

    @abc.abstractmethod
    def _slots(self) -> dict[str, float]:
        """State slot names (besides "step") and their initial fill values."""

    @abc.abstractmethod
    def _coefficients(self, step: int) -> tuple[float, ...]:
        """Scalars for update number ``step`` (1-based), computed once per apply."""

    @abc.abstractmethod
    def _update(
        self,
        p: np.ndarray,
        g: np.ndarray,
        slots: list[np.ndarray],
        scratch: list[np.ndarray],
        coefficients: tuple[float, ...],
    ) -> None:
        """Update one block in place; all arrays share one shape; never write ``g``."""

    def init_state(self, param: np.ndarray) -> dict[str, np.ndarray]:
        """Fresh state for ``param``: "step" (int64 scalar) plus slots of its shape and dtype."""
        state: dict[str, np.ndarray] = {"step": np.zeros((), np.int64)}
        for slot, fill in self._slots().items():
            state[slot] = np.full(param.shape, fill, dtype=param.dtype)
        return state

    def apply(self, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray],
              updated: Callable[[int, int], None] | None = None) -> None:
        """Apply one update to ``param`` and ``state`` in place and increment ``state["step"]``.

        ``grad`` may be read-only and is never written; it may be 1-D over a param of any
        shape as long as the element counts agree. Arithmetic runs in ``param.dtype``.
        ``updated(start, stop)``, when given, is called as each block of ``param``'s flat
        elements [start, stop) takes its final value, in order, while the block is still in
        the cache (a shard copies it out for a data channel to send at once).
        """
        if param.dtype.kind != "f":
            raise ValueError(f"param dtype must be floating point, got {param.dtype}")
        if not param.flags.writeable:
            raise ValueError("param must be a writeable array")
        if grad.size != param.size:
            raise ValueError(f"grad has {grad.size} elements, param {param.shape} has {param.size}")
        if grad.shape != param.shape:
            grad = grad.reshape(param.shape)
        slots: list[np.ndarray] = []
        for slot in self._slots():
            array = state.get(slot)
            if array is None:
                raise ValueError(f"optimizer {self.name!r} state lacks slot {slot!r}")
            if array.shape != param.shape:
                raise ValueError(f"state slot {slot!r} has shape {array.shape}, param has {param.shape}")
            slots.append(array)
        step_array = state.get("step")
        if not isinstance(step_array, np.ndarray) or step_array.dtype != np.int64 or step_array.shape != ():
            step_array = state["step"] = np.array(0 if step_array is None else step_array, dtype=np.int64).reshape(())
        np.add(step_array, 1, out=step_array)
        if "row_step" in state:   # a table also updated sparsely: every row took this update
            np.add(state["row_step"], 1, out=state["row_step"])
        coefficients = self._coefficients(int(step_array))

        arrays = [param, grad, *slots]
        cast = grad.dtype != param.dtype
        size = param.size
        block = max(1, _BLOCK_BYTES // param.dtype.itemsize)
        if size > block and all(array.flags.c_contiguous for array in arrays):
            # Blocked: every pass over a block hits the cache, memory is streamed about once.
            flat = [array.reshape(-1) for array in arrays]
            scratch = [np.empty(block, dtype=param.dtype) for _ in range(self._SCRATCH)]
            update = self._update
            for start in range(0, size, block):
                stop = min(start + block, size)
                p, g, *rest = (array[start:stop] for array in flat)
                if cast:
                    g = g.astype(param.dtype)
                if stop - start == block:
                    update(p, g, rest, scratch, coefficients)
                else:
                    update(p, g, rest, [s[: stop - start] for s in scratch], coefficients)
                if updated is not None:
                    updated(start, stop)
        else:
            scratch = [np.empty(param.shape, dtype=param.dtype) for _ in range(self._SCRATCH)]
            self._update(param, grad.astype(param.dtype) if cast else grad, slots, scratch, coefficients)
            if updated is not None:
                updated(0, size)

    def apply_rows(self, param: np.ndarray, rows: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray]) -> None:
        """Lazy sparse update: only ``param[rows]`` and their slot rows change (``rows`` unique).

        Each row keeps its own update count in the slot "row_step" (int64, one per row, made
        on the first sparse update from the part's "step"), and a row's update uses the
        coefficients of its own count: Adam's bias correction of a row updated 3 times is
        that of step 3, however many steps the table saw. Untouched rows, and their
        momentum and moments, stay as they are (dense Adam would decay them every step).
        """
        if param.dtype.kind != "f":
            raise ValueError(f"param dtype must be floating point, got {param.dtype}")
        if grad.shape != (len(rows),) + param.shape[1:]:
            raise ValueError(f"row grad has shape {grad.shape}, {len(rows)} rows of param {param.shape} need "
                             f"{(len(rows),) + param.shape[1:]}")
        if not len(rows):
            return
        row_step = state.get("row_step")
        if row_step is None:
            row_step = state["row_step"] = np.full(param.shape[0], int(state.get("step", 0)), np.int64)
        row_step[rows] += 1
        unique_steps, which = np.unique(row_step[rows], return_inverse=True)
        # Rows whose counts give the same coefficients are updated together: one group for
        # SGD (two: a momentum buffer's first step), Adagrad without lr_decay and RMSprop,
        # one per count for Adam. Grouping by count alone cost a fancy-indexed pass per
        # distinct count: 1 ms a push for 300 rows of a 10^4-row table under Adagrad.
        groups: dict[tuple[float, ...], list[int]] = {}
        for k, step in enumerate(unique_steps):
            groups.setdefault(self._coefficients(int(step)), []).append(k)
        names = list(self._slots())
        for coefficients, members in groups.items():
            pick = None if len(groups) == 1 else np.isin(which, members)
            sel = rows if pick is None else rows[pick]
            p = param[sel]
            slots = [state[name][sel] for name in names]
            g = grad if pick is None else grad[pick]
            if g.dtype != param.dtype:
                g = g.astype(param.dtype)
            scratch = [np.empty(p.shape, dtype=param.dtype) for _ in range(self._SCRATCH)]
            self._update(p, g, slots, scratch, coefficients)
            param[sel] = p
            for name, array in zip(names, slots):
                state[name][sel] = array


def _decayed(p: np.ndarray, g: np.ndarray, weight_decay: float, out: np.ndarray) -> np.ndarray:
    """Return g + weight_decay * p (L2 penalty) written into ``out``, or ``g`` itself when 0."""
    if weight_decay == 0.0:
        return g
    np.multiply(p, weight_decay, out=out)
    np.add(out, g, out=out)
    return out


class SGD(Optimizer):
    """torch.optim.SGD: optional (Nesterov) momentum with dampening and L2 weight decay."""

    _DEFAULTS: ClassVar[dict[str, HyperValue]] = {
        "lr": 1e-3,
        "momentum": 0.0,
        "dampening": 0.0,
        "weight_decay": 0.0,
        "nesterov": False,
    }
    _SCRATCH: ClassVar[int] = 2

    def __init__(self, name: str = "sgd", **hyperparameters: object) -> None:
        """SGD; ``name`` "momentum" defaults momentum to 0.9."""
        if name == "momentum":
            hyperparameters.setdefault("momentum", 0.9)
        super().__init__(name, **hyperparameters)

    def _validate(self) -> None:
        h = self.hyperparameters
        _check_range("lr", h["lr"], 0.0)
        _check_range("momentum", h["momentum"], 0.0)
        _check_range("dampening", h["dampening"], 0.0, 1.0)
        _check_range("weight_decay", h["weight_decay"], 0.0)
        if h["nesterov"] and (h["momentum"] <= 0.0 or h["dampening"] != 0.0):
            raise ValueError(
                "Nesterov momentum requires a momentum and zero dampening, "
                f"got momentum={h['momentum']}, dampening={h['dampening']}"
            )

    def _slots(self) -> dict[str, float]:
        return {"momentum_buffer": 0.0} if self.hyperparameters["momentum"] != 0.0 else {}

    def _coefficients(self, step: int) -> tuple[float, ...]:
        return (1.0 if step == 1 else 0.0,)

    def _update(
        self,
        p: np.ndarray,
        g: np.ndarray,
        slots: list[np.ndarray],
        scratch: list[np.ndarray],
        coefficients: tuple[float, ...],
    ) -> None:
        h = self.hyperparameters
        lr, momentum = h["lr"], h["momentum"]
        first = coefficients[0] != 0.0
        d = _decayed(p, g, h["weight_decay"], scratch[0])
        tmp = scratch[1]
        if momentum != 0.0:
            buf = slots[0]
            if first:  # torch starts the buffer at the (undampened) gradient
                np.copyto(buf, d, casting="same_kind")
            else:
                np.multiply(buf, momentum, out=buf)
                if h["dampening"] != 0.0:
                    np.multiply(d, 1.0 - h["dampening"], out=tmp)
                    np.add(buf, tmp, out=buf)
                else:
                    np.add(buf, d, out=buf)
            if h["nesterov"]:
                np.multiply(buf, momentum, out=tmp)
                np.add(tmp, d, out=tmp)
            else:
                np.copyto(tmp, buf)
            np.multiply(tmp, lr, out=tmp)
        else:
            np.multiply(d, lr, out=tmp)
        np.subtract(p, tmp, out=p)


class Adam(Optimizer):
    """torch.optim.Adam: L2 weight decay added to the gradient, optional AMSGrad."""

    _DEFAULTS: ClassVar[dict[str, HyperValue]] = {
        "lr": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "amsgrad": False,
    }
    _SCRATCH: ClassVar[int] = 2
    _DECOUPLED: ClassVar[bool] = False

    def __init__(self, name: str = "adam", **hyperparameters: object) -> None:
        """Adam with torch defaults."""
        super().__init__(name, **hyperparameters)

    def _validate(self) -> None:
        h = self.hyperparameters
        _check_range("lr", h["lr"], 0.0)
        _check_range("eps", h["eps"], 0.0)
        _check_range("beta1", h["beta1"], 0.0, 1.0, high_open=True)
        _check_range("beta2", h["beta2"], 0.0, 1.0, high_open=True)
        _check_range("weight_decay", h["weight_decay"], 0.0)

    def _slots(self) -> dict[str, float]:
        slots = {"exp_avg": 0.0, "exp_avg_sq": 0.0}
        if self.hyperparameters["amsgrad"]:
            slots["max_exp_avg_sq"] = 0.0
        return slots

    def _coefficients(self, step: int) -> tuple[float, ...]:
        h = self.hyperparameters
        bias_correction1 = 1.0 - h["beta1"] ** step
        sqrt_bias_correction2 = math.sqrt(1.0 - h["beta2"] ** step)
        # torch: p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps); both sides scaled by sqrt(bc2).
        return h["lr"] / bias_correction1 * sqrt_bias_correction2, h["eps"] * sqrt_bias_correction2

    def _update(
        self,
        p: np.ndarray,
        g: np.ndarray,
        slots: list[np.ndarray],
        scratch: list[np.ndarray],
        coefficients: tuple[float, ...],
    ) -> None:
        h = self.hyperparameters
        step_size, eps = coefficients
        weight_decay = h["weight_decay"]
        tmp = scratch[0]
        if self._DECOUPLED:
            if weight_decay != 0.0:
                np.multiply(p, 1.0 - h["lr"] * weight_decay, out=p)
            d = g
        else:
            d = _decayed(p, g, weight_decay, scratch[1])
        exp_avg, exp_avg_sq = slots[0], slots[1]
        # exp_avg.lerp_(d, 1 - beta1)
        np.subtract(d, exp_avg, out=tmp)
        np.multiply(tmp, 1.0 - h["beta1"], out=tmp)
        np.add(exp_avg, tmp, out=exp_avg)
        # exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d * d
        np.multiply(exp_avg_sq, h["beta2"], out=exp_avg_sq)
        np.multiply(d, 1.0 - h["beta2"], out=tmp)
        np.multiply(tmp, d, out=tmp)
        np.add(exp_avg_sq, tmp, out=exp_avg_sq)
        if h["amsgrad"]:
            np.maximum(slots[2], exp_avg_sq, out=slots[2])
            np.sqrt(slots[2], out=tmp)
        else:
            np.sqrt(exp_avg_sq, out=tmp)
        np.add(tmp, eps, out=tmp)
        np.divide(exp_avg, tmp, out=tmp)
        np.multiply(tmp, step_size, out=tmp)
        np.subtract(p, tmp, out=p)


class AdamW(Adam):
    """torch.optim.AdamW: Adam with decoupled weight decay (p *= 1 - lr * weight_decay)."""

    _DEFAULTS: ClassVar[dict[str, HyperValue]] = {**Adam._DEFAULTS, "weight_decay": 1e-2}
    _SCRATCH: ClassVar[int] = 1
    _DECOUPLED: ClassVar[bool] = True

    def __init__(self, name: str = "adamw", **hyperparameters: object) -> None:
        """AdamW with torch defaults (weight_decay 0.01)."""
        super().__init__(name, **hyperparameters)


class Adagrad(Optimizer):
    """torch.optim.Adagrad: accumulated squared gradients, learning-rate decay, L2 weight decay."""

    _DEFAULTS: ClassVar[dict[str, HyperValue]] = {
        "lr": 1e-2,
        "lr_decay": 0.0,
        "weight_decay": 0.0,
        "initial_accumulator_value": 0.0,
        "eps": 1e-10,
    }
    _SCRATCH: ClassVar[int] = 2

    def __init__(self, name: str = "adagrad", **hyperparameters: object) -> None:
        """Adagrad with torch defaults."""
        super().__init__(name, **hyperparameters)

    def _validate(self) -> None:
        h = self.hyperparameters
        _check_range("lr", h["lr"], 0.0)
        _check_range("lr_decay", h["lr_decay"], 0.0)
        _check_range("weight_decay", h["weight_decay"], 0.0)
        _check_range("initial_accumulator_value", h["initial_accumulator_value"], 0.0)
        _check_range("eps", h["eps"], 0.0)

    def _slots(self) -> dict[str, float]:
        return {"sum": self.hyperparameters["initial_accumulator_value"]}

    def _coefficients(self, step: int) -> tuple[float, ...]:
        h = self.hyperparameters
        return (h["lr"] / (1.0 + (step - 1) * h["lr_decay"]),)

    def _update(
        self,
        p: np.ndarray,
        g: np.ndarray,
        slots: list[np.ndarray],
        scratch: list[np.ndarray],
        coefficients: tuple[float, ...],
    ) -> None:
        h = self.hyperparameters
        (clr,) = coefficients
        tmp = scratch[0]
        d = _decayed(p, g, h["weight_decay"], scratch[1])
        accumulator = slots[0]
        np.multiply(d, d, out=tmp)
        np.add(accumulator, tmp, out=accumulator)
        np.sqrt(accumulator, out=tmp)
        np.add(tmp, h["eps"], out=tmp)
        np.divide(d, tmp, out=tmp)
        np.multiply(tmp, clr, out=tmp)
        np.subtract(p, tmp, out=p)


class RMSprop(Optimizer):
    """torch.optim.RMSprop: optional centering, momentum and L2 weight decay."""

    _DEFAULTS: ClassVar[dict[str, HyperValue]] = {
        "lr": 1e-2,
        "alpha": 0.99,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "momentum": 0.0,
        "centered": False,
    }
    _SCRATCH: ClassVar[int] = 2

    def __init__(self, name: str = "rmsprop", **hyperparameters: object) -> None:
        """RMSprop with torch defaults."""
        super().__init__(name, **hyperparameters)

    def _validate(self) -> None:
        h = self.hyperparameters
        _check_range("lr", h["lr"], 0.0)
        _check_range("eps", h["eps"], 0.0)
        _check_range("momentum", h["momentum"], 0.0)
        _check_range("weight_decay", h["weight_decay"], 0.0)
        _check_range("alpha", h["alpha"], 0.0, 1.0)

    def _slots(self) -> dict[str, float]:
        slots = {"square_avg": 0.0}
        if self.hyperparameters["momentum"] > 0.0:
            slots["momentum_buffer"] = 0.0
        if self.hyperparameters["centered"]:
            slots["grad_avg"] = 0.0
        return slots

    def _coefficients(self, step: int) -> tuple[float, ...]:
        return ()

    def _update(
        self,
        p: np.ndarray,
        g: np.ndarray,
        slots: list[np.ndarray],
        scratch: list[np.ndarray],
        coefficients: tuple[float, ...],
    ) -> None:
        h = self.hyperparameters
        alpha, momentum = h["alpha"], h["momentum"]
        tmp = scratch[0]
        d = _decayed(p, g, h["weight_decay"], scratch[1])
        square_avg = slots[0]
        # square_avg = alpha * square_avg + (1 - alpha) * d * d
        np.multiply(square_avg, alpha, out=square_avg)
        np.multiply(d, 1.0 - alpha, out=tmp)
        np.multiply(tmp, d, out=tmp)
        np.add(square_avg, tmp, out=square_avg)
        if h["centered"]:
            grad_avg = slots[-1]
            # grad_avg.lerp_(d, 1 - alpha); avg = sqrt(square_avg - grad_avg**2)
            np.subtract(d, grad_avg, out=tmp)
            np.multiply(tmp, 1.0 - alpha, out=tmp)
            np.add(grad_avg, tmp, out=grad_avg)
            np.multiply(grad_avg, grad_avg, out=tmp)
            np.subtract(square_avg, tmp, out=tmp)
            np.sqrt(tmp, out=tmp)
        else:
            np.sqrt(square_avg, out=tmp)
        np.add(tmp, h["eps"], out=tmp)
        np.divide(d, tmp, out=tmp)
        if momentum > 0.0:
            buf = slots[1]
            np.multiply(buf, momentum, out=buf)
            np.add(buf, tmp, out=buf)
            np.multiply(buf, h["lr"], out=tmp)
        else:
            np.multiply(tmp, h["lr"], out=tmp)
        np.subtract(p, tmp, out=p)


_FACTORIES: dict[str, Callable[..., Optimizer]] = {
    "sgd": lambda **kw: SGD("sgd", **kw),
    "momentum": lambda **kw: SGD("momentum", **kw),
    "adam": lambda **kw: Adam("adam", **kw),
    "adamw": lambda **kw: AdamW("adamw", **kw),
    "adagrad": lambda **kw: Adagrad("adagrad", **kw),
    "rmsprop": lambda **kw: RMSprop("rmsprop", **kw),
}

OPTIMIZERS: tuple[str, ...] = tuple(_FACTORIES)


def make_optimizer(name: str, **hyperparameters: float | bool) -> Optimizer:
    """Build the optimizer ``name`` (one of OPTIMIZERS); ValueError for a bad name or setting."""
    factory = _FACTORIES.get(name) if isinstance(name, str) else None
    if factory is None:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    return factory(**hyperparameters)

