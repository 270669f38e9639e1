"""The `ps-check` command: what the gradient engine makes of a model, before a job trains it.

    ps-check MODEL.onnx [--batch-size 4] [--loss cross_entropy] [--include P,...]
                        [--exclude P,...] [--expect-parameters N] [--seed 0]

It reports the opset (and the upgrade, if any), the trainable parameters (name, shape,
dtype), the model's state (training-mode BatchNormalization's running statistics), the
floating-point initializers that do not train and why (selection.py's rule), the Dropout
masks the worker will feed, every warning the engine gives (tied or folded variables), the
nodes between a parameter and the loss that have no gradient (with what to do), and then
checks the gradient of every parameter against central finite differences of the loss on
a small random batch. Exit status 0 when the model trains as reported, 1 when it does not,
2 for bad arguments.

How the gradients are checked. The engine's gradient of a parameter, projected on a random
unit direction, is compared with the central difference (L(+h) - L(-h)) / 2h of the loss
along it. The losses come from a float64 copy of what the engine differentiates (the
training form at the check's batch size with the loss attached, every float tensor widened
to float64), run by onnxruntime, or by onnx's reference evaluator where onnxruntime has no
float64 kernel (Conv, pooling, Erf, GRU); the step h is FD_STEP times the parameter's norm
(at least 1). Both are needed for a deep ReLU network with training-mode BatchNorm at a
small batch: its loss has a kink wherever a unit changes sides, and the units are so many
that a step of 1e-3 crosses dozens of kinks (about 20 of the 32768 units of the ResNet-14
fixture along conv1.weight, about 600 of a ResNet-18's 2.2 million), which puts the central
difference off by 5-60% in float64 as in float32; a step short enough to cross none leaves
a float32 loss's rounding (1e-7 of it) larger than the difference it measures. In float64
a step of 1e-6 of the norm crosses none or a few, and the rounding is a few 1e-8 of the
loss's scale. The rest is measured, not assumed: half the gap between the forward and
backward differences, |L(+h) + L(-h) - 2 L(0)| / 2h, bounds the error that a kink inside
the step puts in the central difference (and the curvature's), and is added to the
tolerance. A parameter passes when most of FD_DIRECTIONS random directions agree. When no
float64 copy runs (an op neither runner has, or its loss is not the engine's), the
engine's own float32 losses are differenced at FD_STEP["float32"], and the report says so.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import AttributeProto, TensorProto, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.ops._op import OpRunUnaryNum

from ps_common.errors import DeviceUnavailableError, ModelLoadError, UnsupportedModelError
from worker_client.engine import GradientEngine
from worker_client.engine.batch import fix_batch
from worker_client.engine.coverage import unsupported_nodes
from worker_client.engine.lift import lift_parameters
from worker_client.engine.exporters import restore_torch_training_batch_norms
from worker_client.engine.rewrites.detaches import is_torch_detach
from worker_client.engine.rewrites.prune import live
from worker_client.engine.load import load_model
from worker_client.engine.loss import attach_loss, parse_loss
from worker_client.engine.opset import upgrade_opset
from worker_client.engine.rewrites.fold import fold_shape_queries
from worker_client.engine.rewrites.indexing import index_without_steps_or_copying_pads
from worker_client.engine.rewrites.prune import prune
from worker_client.engine.rewrites.toolkit import opset_of
from worker_client.engine.selection import classify
from worker_client.engine.support import node_label
from worker_client.engine.training_mode import state_initializers, training_form

__all__ = ["CheckReport", "DirectionCheck", "GradientCheck", "check_model", "main"]

#: The step along a unit direction, as a fraction of the parameter's norm (of 1 for a
#: parameter whose norm is below 1), by the precision the losses are computed in. float64:
#: short enough to cross almost no ReLU or max kink even in a deep network at batch 4, long
#: enough that the loss's rounding stays far below the derivative. float32 (only when no
#: float64 copy runs): the float32 loss's rounding forbids a shorter one.
FD_STEP = {"float64": 1e-6, "float32": 1e-3}
#: The rounding of a loss, relative to it, by precision: the central difference carries
#: FD_ROUNDING * |loss| / step of it.
FD_ROUNDING = {"float64": 1e-14, "float32": 2e-7}
#: Random directions per parameter; the parameter passes when most agree (the check stops
#: as soon as the majority is decided, so a correct parameter costs two).
FD_DIRECTIONS = 3
#: A direction agrees when |numeric - analytic| <= FD_RTOL * max(|both|) + FD_ATOL + the
#: measured higher-order term |L(+h) + L(-h) - 2 L(0)| / 2h + the rounding.
FD_RTOL, FD_ATOL = 1e-2, 1e-6
#: The float64 copy's loss must equal the engine's float32 loss to this fraction, or the copy
#: is not what the engine differentiates and the check falls back to float32.
FD_LOSS_AGREEMENT = 1e-4
#: The batch a check uses unless told otherwise: small, so the check is quick.
DEFAULT_BATCH = 4
#: Integer inputs (ids) of the random batch are drawn from [0, ID_RANGE): valid indices of
#: any table with at least that many rows.
ID_RANGE = 2

_NARROW_FLOATS = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16})


#: A long check (a large model differenced in float64 by onnx's reference evaluator can take minutes per
#: parameter) says on stderr which parameter it is at, at most this often (seconds); a short one says nothing.
PROGRESS_EVERY = 10.0


@dataclass(frozen=True)
class DirectionCheck:
    """A parameter's derivative along one unit direction: the engine's gradient projected
    on it, and the central difference of the loss over `step` either side."""

    analytic: float
    numeric: float
    step: float
    spread: float = 0.0      # |L(+h) + L(-h) - 2 L(0)| / 2h, measured
    rounding: float = 0.0    # FD_ROUNDING * |L| / h

    @property
    def tolerance(self) -> float:
        return (FD_RTOL * max(abs(self.analytic), abs(self.numeric)) + FD_ATOL +
                self.spread + self.rounding)

    @property
    def ok(self) -> bool:
        return abs(self.numeric - self.analytic) <= self.tolerance


@dataclass(frozen=True)
class GradientCheck:
    """One parameter's directional derivatives, by the engine and by central differences;
    `ok` when most of the directions tried agree."""

    name: str
    directions: tuple[DirectionCheck, ...]

    @property
    def agreeing(self) -> int:
        return sum(d.ok for d in self.directions)

    @property
    def ok(self) -> bool:
        return 2 * self.agreeing > len(self.directions)

    @property
    def shown(self) -> DirectionCheck:
        """The first direction whose verdict is the parameter's."""
        return next(d for d in self.directions if d.ok == self.ok)

    @property
    def analytic(self) -> float:
        return self.shown.analytic

    @property
    def numeric(self) -> float:
        return self.shown.numeric

    @property
    def step(self) -> float:
        return self.shown.step


@dataclass
class CheckReport:
    """Everything `ps-check` found; `ok` when the model trains as reported."""

    model: Path
    opset: tuple[int, int] = (0, 0)                     # in the file, as differentiated
    parameters: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)
    state: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    constants: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)
    masks: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    unsupported: list[tuple[str, str]] = field(default_factory=list)   # (node, op)
    error: str | None = None
    differences: str = ""      # how the losses were computed (float64 copy or float32)
    gradients: list[GradientCheck] = field(default_factory=list)
    detached: list[str] = field(default_factory=list)   # parameters before a torch detach(): not differenced

    @property
    def ok(self) -> bool:
        return self.error is None and not self.unsupported and \
            all(g.ok for g in self.gradients)


def check_model(path: str | Path, *, batch_size: int = DEFAULT_BATCH,
                loss: str = "cross_entropy", include: Sequence[str] = (),
                exclude: Sequence[str] = (), expect_parameters: int | None = None,
                seed: int = 0, cache_dir: str | Path | None = None,
                progress: Callable[[int, int, str], None] | None = None) -> CheckReport:
    """Check the model at `path` (module docstring); never raises for a model problem. `progress(done, total,
    name)` is called before each parameter's gradient is differenced."""
    report = CheckReport(Path(path))
    try:
        original = load_model(path)
    except ModelLoadError as exc:
        report.error = str(exc)
        return report
    try:   # the copy checked against is the model the engine trains
        restore_torch_training_batch_norms(original, str(path))
    except UnsupportedModelError:
        pass   # the engine refuses the model below, with this error
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = upgrade_opset(original, path)
        engine = _engine(report, path, batch_size, loss, include, exclude, expect_parameters,
                         seed, cache_dir)
    report.warnings = [str(w.message) for w in caught]
    report.opset = (opset_of(original), opset_of(model))
    roles = classify(model)
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
    chosen = set(engine.trainable_names) if engine else {
        n for n, r in roles.items() if r.kind == "parameter"}
    kept = set(engine.state_names if engine else state_initializers(model))
    for name, role in roles.items():
        if name in kept:
            report.state.append((name, shapes[name]))
        elif role.kind == "state":
            report.constants.append((name, shapes[name], f"{role.reason} of an eval-mode "
                                                         f"BatchNormalization: frozen"))
        elif name not in chosen:
            reason = role.reason if role.kind == "constant" else "excluded by a pattern"
            report.constants.append((name, shapes[name], reason))
    report.unsupported = [(node_label(n), n.op_type)
                          for n in _downstream(model, chosen, unsupported_nodes(model))]
    if engine is None:   # the parameters that would train, so the refusal can be acted on (--exclude)
        types = {t.name: onnx.helper.tensor_dtype_to_np_dtype(t.data_type) for t in model.graph.initializer}
        report.parameters = [(n, shapes[n], str(np.dtype(types[n]))) for n in roles if n in chosen]
        return report
    values = {**engine.parameters(), **engine.state()}
    report.parameters = [(n, tuple(v.shape), str(v.dtype))
                         for n, v in engine.parameters().items()]
    report.masks = list(engine.mask_names)
    rng = np.random.default_rng(seed)
    batch = _random_batch(engine, rng)
    result = engine.step(values, batch)
    function = _loss_function(model, engine, loss, batch, values, result.loss)
    report.differences = function.how
    # a parameter before a torch detach(): its gradient is torch's, not the loss's derivative (a straight-through
    # estimator's passes round() as if it were the identity), so differences of the loss cannot check it
    _, before_detaches = live(model.graph, [node.input[0] for node in model.graph.node if is_torch_detach(node)])
    report.detached = [n for n in engine.trainable_names if n in before_detaches]
    report.gradients = _finite_differences(engine, values, result, function, rng, skip=set(report.detached),
                                           progress=progress)
    return report


def _engine(report: CheckReport, path, batch_size, loss, include, exclude, expect, seed,
            cache_dir) -> GradientEngine | None:
    try:
        return GradientEngine(path, batch_size=batch_size, loss=loss, include=include,
                              exclude=exclude, expect_parameters=expect, seed=seed,
                              cache_dir=cache_dir)
    except (UnsupportedModelError, ModelLoadError, DeviceUnavailableError, ValueError) as exc:
        report.error = f"{type(exc).__name__}: {exc}"
        return None


def _downstream(model: onnx.ModelProto, sources: set[str],
                candidates: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The `candidates` that read a value computed from one of `sources`."""
    reached = set(sources)
    for node in model.graph.node:
        if reached.intersection(node.input):
            reached.update(node.output)
    return [n for n in candidates if reached.intersection(n.input)]


def _random_batch(engine: GradientEngine, rng: np.random.Generator) -> dict[str, np.ndarray]:
    batch = {}
    for name, (dtype, shape) in engine.feed_specs().items():
        if name == "labels" and engine.num_classes is not None:
            batch[name] = rng.integers(0, engine.num_classes, shape).astype(dtype)
        elif dtype.kind == "f":
            batch[name] = rng.standard_normal(shape).astype(dtype)
        else:
            batch[name] = rng.integers(0, ID_RANGE, shape).astype(dtype)
    return {**batch, **engine.draw_masks()}   # one mask for every evaluation


@dataclass(frozen=True)
class _Loss:
    """The loss on the check's batch as a function of the parameter and state values."""

    at: Callable[[Mapping[str, np.ndarray]], float]
    precision: str      # "float64" or "float32": the key of FD_STEP and FD_ROUNDING
    start: float        # at the model's own values
    how: str            # for the report


def _loss_function(model: onnx.ModelProto, engine: GradientEngine, loss: str,
                   batch: Mapping[str, np.ndarray], values: Mapping[str, np.ndarray],
                   engine_loss: float) -> _Loss:
    """A float64 copy of the model's loss when one runs and agrees with the engine's, else
    the engine's own float32 loss (the report says why)."""
    try:
        at, runner, start = _float64_loss(model, engine, loss, batch, values)
        if not abs(start - engine_loss) <= FD_LOSS_AGREEMENT * max(abs(engine_loss), 1.0):
            raise ValueError(f"its loss {start:.9g} is not the engine's {engine_loss:.9g}")
    except Exception as exc:  # noqa: BLE001 -- any failure of the copy: float32 instead
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return _Loss(lambda moved: engine.step(moved, batch).loss, "float32", engine_loss,
                     f"central differences of the engine's float32 loss (the float64 copy "
                     f"of the model did not run: {reason}), steps of "
                     f"{FD_STEP['float32']:g} x max(norm, 1); less precise: a deep ReLU "
                     f"network may show a false mismatch")
    return _Loss(at, "float64", start,
                 f"central differences of a float64 copy of the loss, run by {runner}, "
                 f"steps of {FD_STEP['float64']:g} x max(norm, 1)")


def _float64_loss(model: onnx.ModelProto, engine: GradientEngine, loss: str,
                  batch: Mapping[str, np.ndarray], values: Mapping[str, np.ndarray]
                  ) -> tuple[Callable[[Mapping[str, np.ndarray]], float], str, float]:
    """What the engine differentiates -- the training form at its batch size with the loss
    attached -- with every float tensor widened to float64, as a function of the parameter
    and state values; what runs it (onnxruntime when it has a float64 kernel for every op,
    onnx's reference evaluator when not: Conv, pooling, GRU); and its loss at `values`."""
    lifted = lift_parameters(model, engine.trainable_names + engine.state_names)
    forward, forms = training_form(lifted, engine.state_names)
    forward = fix_batch(forward, engine.input_names + list(forms.dropout_rates),
                        engine.batch_size)
    _widen(forward.graph)
    forward, _, _ = attach_loss(forward, parse_loss(loss), engine.batch_size)
    prune(forward)   # the running statistics' updates: the loss does not read them
    # the reference evaluator's Pad refuses negative pads: written as the engine writes them (a Slice and a Pad),
    # after folding the exporter's arithmetic on shapes that hides the static shapes this needs
    if any(node.op_type == "Pad" for node in forward.graph.node):
        fold_shape_queries(forward)
        index_without_steps_or_copying_pads(forward)
    failures = []
    for runner in (_onnxruntime_runner, _reference_runner):
        try:
            run, inputs, name = runner(forward)
            fixed = {key: _float64(array) for key, array in batch.items() if key in inputs}

            def at(moved: Mapping[str, np.ndarray], run=run, inputs=inputs,
                   fixed=fixed) -> float:
                feed = {key: _float64(array) for key, array in moved.items() if key in inputs}
                return float(run({**fixed, **feed}))

            return at, name, at(values)   # a missing kernel may fail only when run
        except Exception as exc:  # noqa: BLE001 -- e.g. no float64 kernel: the next runner
            failures.append(exc)
    raise failures[-1]


_Runner = Callable[[dict[str, np.ndarray]], np.ndarray]


def _onnxruntime_runner(model: onnx.ModelProto) -> tuple[_Runner, set[str], str]:
    options = ort.SessionOptions()
    options.log_severity_level = 4   # a missing float64 kernel is expected, not news
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return ((lambda feed: session.run(None, feed)[0]),
            {v.name for v in session.get_inputs()}, "onnxruntime")


#: Ops whose onnx reference kernels compute in float32 whatever they are given (onnx 1.23: AffineGrid returns
#: float32 for float64 inputs, and GridSample's result is 2e-7 off a float64 one): a float64 copy through them
#: has float32 noise, which central differences over a 1e-6 step blow up into false mismatches.
_FLOAT32_REFERENCE_OPS = frozenset({"AffineGrid", "GridSample"})


def _reference_runner(model: onnx.ModelProto) -> tuple[_Runner, set[str], str]:
    narrow = sorted({n.op_type for n in model.graph.node} & _FLOAT32_REFERENCE_OPS)
    if narrow:
        raise ValueError(f"onnx's reference evaluator computes {', '.join(narrow)} in float32")
    evaluator = ReferenceEvaluator(model, new_ops=[_Erf])
    return ((lambda feed: evaluator.run(None, feed)[0]), set(evaluator.input_names),
            "onnx's reference evaluator")


class _Erf(OpRunUnaryNum):
    """Erf in float64: the reference evaluator's own rounds every value to float32, which
    puts 1e-7 noise in a GELU network's loss."""

    op_domain = ""

    def _run(self, x: np.ndarray) -> tuple[np.ndarray]:
        return (np.vectorize(math.erf, otypes=[np.float64])(x).astype(x.dtype),)


_Erf.__name__ = "Erf"   # the reference evaluator knows an op's implementation by class name


def _float64(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array)
    return array.astype(np.float64) if array.dtype.kind == "f" else array


def _widen(graph: onnx.GraphProto) -> None:
    """Every float32, float16 and bfloat16 tensor of `graph` (and its subgraphs) float64, in
    place: initializers, declared values, Cast targets, constants."""
    for tensor in graph.initializer:
        if tensor.data_type in _NARROW_FLOATS:
            tensor.CopyFrom(_widened(tensor))
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.type.tensor_type.elem_type in _NARROW_FLOATS:
            value.type.tensor_type.elem_type = TensorProto.DOUBLE
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == AttributeProto.INT and attribute.name in ("to", "dtype") \
                    and attribute.i in _NARROW_FLOATS:
                attribute.i = TensorProto.DOUBLE
            elif attribute.type == AttributeProto.TENSOR and \
                    attribute.t.data_type in _NARROW_FLOATS:
                attribute.t.CopyFrom(_widened(attribute.t))
            elif attribute.type == AttributeProto.GRAPH:
                _widen(attribute.g)
            elif attribute.type == AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    _widen(subgraph)
        if node.op_type == "ConstantOfShape" and not node.attribute:   # float32 0 by default
            node.attribute.append(onnx.helper.make_attribute(
                "value", numpy_helper.from_array(np.zeros(1, np.float64))))
        if node.op_type == "Constant":   # value_float(s) would make a float32 constant
            for attribute in list(node.attribute):
                if attribute.name in ("value_float", "value_floats"):
                    value = (np.array(attribute.f) if attribute.name == "value_float"
                             else np.array(attribute.floats))
                    node.attribute.remove(attribute)
                    node.attribute.append(onnx.helper.make_attribute(
                        "value", numpy_helper.from_array(value.astype(np.float64))))


def _widened(tensor: TensorProto) -> TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64),
                                   tensor.name)


def _finite_differences(engine: GradientEngine, values: dict[str, np.ndarray], result,
                        loss: _Loss, rng: np.random.Generator, skip: set[str] = frozenset(),
                        progress: Callable[[int, int, str], None] | None = None) -> list[GradientCheck]:
    """Per parameter but those in `skip`: its derivative along random unit directions, by the engine and by
    central differences of `loss`, until most of FD_DIRECTIONS agree or most cannot."""
    checks = []
    names = [name for name in engine.trainable_names if name not in skip]
    for done, name in enumerate(names):
        if progress is not None:
            progress(done, len(names), name)
        value = values[name]
        step = FD_STEP[loss.precision] * max(float(np.linalg.norm(value.astype(np.float64))),
                                             1.0)
        gradient = result.gradients[name].astype(np.float64)
        directions: list[DirectionCheck] = []
        while True:
            directions.append(_along_a_direction(values, name, gradient, step, loss, rng))
            agreeing = sum(d.ok for d in directions)
            undecided = FD_DIRECTIONS - len(directions)
            if 2 * agreeing > FD_DIRECTIONS or 2 * (agreeing + undecided) <= FD_DIRECTIONS:
                break
        checks.append(GradientCheck(name, tuple(directions)))
    return checks


def _along_a_direction(values: dict[str, np.ndarray], name: str, gradient: np.ndarray,
                       step: float, loss: _Loss, rng: np.random.Generator) -> DirectionCheck:
    """One random unit direction: the gradient on it against (L(+h) - L(-h)) / 2h."""
    value = values[name]
    direction = rng.standard_normal(value.shape)
    direction /= max(float(np.linalg.norm(direction)), 1e-30)
    moved = {}
    for sign in (1, -1):
        shifted = value.astype(np.float64) + sign * step * direction
        if loss.precision != "float64":
            shifted = shifted.astype(value.dtype)
        moved[sign] = loss.at(dict(values, **{name: shifted}))
    return DirectionCheck(analytic=float(np.sum(gradient * direction)),
                          numeric=(moved[1] - moved[-1]) / (2 * step), step=step,
                          spread=abs(moved[1] + moved[-1] - 2 * loss.start) / (2 * step),
                          rounding=FD_ROUNDING[loss.precision] * abs(loss.start) / step)


def format_report(report: CheckReport) -> str:
    """The report as text, one finding a line."""
    lines = [f"model {report.model}"]
    before, after = report.opset
    if before:
        lines.append(f"opset {before}" + (f", upgraded to {after} for the gradient rules"
                                          if after != before else ""))
    heading = "trainable parameters" if report.error is None else "parameters that would train"
    lines.append(f"{heading}: {len(report.parameters)} "
                 f"({sum(int(np.prod(s, dtype=np.int64)) for _, s, _ in report.parameters)} "
                 f"values)")
    lines += [f"  {name} {shape} {dtype}" for name, shape, dtype in report.parameters]
    lines.append(f"state (not trained; running statistics kept on the shards): "
                 f"{len(report.state)}")
    lines += [f"  {name} {shape}" for name, shape in report.state]
    lines.append(f"not trained: {len(report.constants)}")
    lines += [f"  {name} {shape}: {why}" for name, shape, why in report.constants]
    if report.masks:
        lines.append(f"Dropout masks drawn by the worker: {', '.join(report.masks)}")
    lines += [f"warning: {text}" for text in report.warnings]
    for node, op in report.unsupported:
        lines.append(f"unsupported: node {node!r} ({op}) has no gradient rule and lies after "
                     f"a trainable parameter: exclude the parameters upstream of it "
                     f"(--exclude), or re-export without {op} (docs/models.md)")
    if report.error:
        lines.append(f"error: {report.error}")
    if report.differences:
        lines.append(f"gradient check: {report.differences}; a parameter passes when most of "
                     f"{FD_DIRECTIONS} random directions agree (tried one by one, until the outcome is settled)")
    for check in report.gradients:
        verdict = "ok" if check.ok else "MISMATCH"
        shown = check.shown
        lines.append(f"gradient {check.name}: {verdict} (engine {shown.analytic:.6g}, "
                     f"central differences {shown.numeric:.6g} +- {shown.tolerance:.2g} at "
                     f"step {shown.step:.3g}; {check.agreeing} of {len(check.directions)} "
                     f"directions agree)")
    lines += [f"gradient {name}: not checked (a torch detach() reads a value computed from it: the engine's "
              f"gradient skips that path, as torch's does, and differences of the loss cannot)"
              for name in report.detached]
    lines.append("result: " + ("the model trains as reported" if report.ok else
                               "the model does not train as it is"))
    return "\n".join(lines)


class _ProgressLines:
    """ps-check's progress on stderr: a line naming the parameter being checked, when PROGRESS_EVERY seconds have
    passed since the check began or since the last line (stdout keeps the report alone)."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.started = self.last

    def __call__(self, done: int, total: int, name: str) -> None:
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY:
            self.last = now
            print(f"ps-check: differencing the gradient of {name} ({done + 1} of {total} parameters, "
                  f"{now - self.started:.0f} s so far)", file=sys.stderr, flush=True)


def _patterns(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ps-check", description="Report what the gradient engine makes of an ONNX model: "
                                     "trainable parameters, state, constants, unsupported "
                                     "nodes, and a finite-difference check of its gradients.")
    parser.add_argument("model", help="the .onnx file")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH,
                        help=f"examples in the random batch (default: {DEFAULT_BATCH})")
    parser.add_argument("--loss", default="cross_entropy",
                        help="cross_entropy, mse or output:NAME (default: cross_entropy)")
    parser.add_argument("--include", type=_patterns, default=[], metavar="PATTERN,...",
                        help="train only the parameters matching these glob patterns")
    parser.add_argument("--exclude", type=_patterns, default=[], metavar="PATTERN,...",
                        help="do not train the parameters matching these glob patterns")
    parser.add_argument("--expect-parameters", type=int, default=None, metavar="N",
                        help="report an error unless exactly N parameters train")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random batch")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    ort.set_default_logger_severity(3)
    report = check_model(args.model, batch_size=args.batch_size, loss=args.loss,
                         include=args.include, exclude=args.exclude,
                         expect_parameters=args.expect_parameters, seed=args.seed, progress=_ProgressLines())
    print(format_report(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
