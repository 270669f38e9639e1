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
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from ps_common.errors import DeviceUnavailableError, ModelLoadError, UnsupportedModelError
from worker_client.engine import GradientEngine
from worker_client.engine.coverage import unsupported_nodes
from worker_client.engine.load import load_model
from worker_client.engine.opset import upgrade_opset
from worker_client.engine.rewrites.toolkit import opset_of
from worker_client.engine.selection import classify
from worker_client.engine.support import node_label
from worker_client.engine.training_mode import state_initializers

__all__ = ["CheckReport", "GradientCheck", "check_model", "main"]

#: Lengths of the unit-norm steps along a random direction in each parameter, longest
#: first: a long step can cross a ReLU's or a max's kink, a short one drowns in the float32
#: loss's rounding; the first that agrees decides.
FD_STEPS = (1e-2, 3e-3, 1e-3)
#: Random directions tried per parameter: a step that crosses a kink (a ReLU unit changing
#: sides) disagrees by chance; a wrong gradient disagrees in every direction.
FD_DIRECTIONS = 3
#: A directional derivative agrees when |numeric - analytic| <= FD_RTOL * max(|both|) +
#: FD_ATOL + the rounding of the two losses over the step (FD_ROUNDING relative each).
FD_RTOL, FD_ATOL, FD_ROUNDING = 2e-2, 1e-5, 2e-7
#: The batch a check uses unless told otherwise: small, so the check is quick.
DEFAULT_BATCH = 4
#: Integer inputs (ids) of the random batch are drawn from [0, ID_RANGE): valid indices of
#: any table with at least that many rows.
ID_RANGE = 2


@dataclass(frozen=True)
class GradientCheck:
    """One parameter's directional derivative, by the engine and by central differences."""

    name: str
    analytic: float
    numeric: float
    step: float = FD_STEPS[0]
    loss: float = 0.0

    @property
    def ok(self) -> bool:
        scale = max(abs(self.analytic), abs(self.numeric))
        rounding = FD_ROUNDING * abs(self.loss) / self.step
        return abs(self.numeric - self.analytic) <= FD_RTOL * scale + FD_ATOL + rounding


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
    gradients: list[GradientCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.unsupported and \
            all(g.ok for g in self.gradients)


def check_model(path: str | Path, *, batch_size: int = DEFAULT_BATCH,
                loss: str = "cross_entropy", include: Sequence[str] = (),
                exclude: Sequence[str] = (), expect_parameters: int | None = None,
                seed: int = 0, cache_dir: str | Path | None = None) -> CheckReport:
    """Check the model at `path` (module docstring); never raises for a model problem."""
    report = CheckReport(Path(path))
    try:
        original = load_model(path)
    except ModelLoadError as exc:
        report.error = str(exc)
        return report
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
    if engine is None:
        return report
    values = {**engine.parameters(), **engine.state()}
    report.parameters = [(n, tuple(v.shape), str(v.dtype))
                         for n, v in engine.parameters().items()]
    report.masks = list(engine.mask_names)
    report.gradients = _finite_differences(engine, values, np.random.default_rng(seed))
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


def _finite_differences(engine: GradientEngine, values: dict[str, np.ndarray],
                        rng: np.random.Generator) -> list[GradientCheck]:
    """Per parameter: the gradient along a random unit direction, against the central
    difference of the loss FD_STEP either side along it."""
    batch = _random_batch(engine, rng)
    result = engine.step(values, batch)
    checks = []
    for name in engine.trainable_names:
        for _ in range(FD_DIRECTIONS):
            check = _along_a_direction(engine, values, batch, result, name, rng)
            if check.ok:
                break
        checks.append(check)
    return checks


def _along_a_direction(engine: GradientEngine, values: dict[str, np.ndarray],
                       batch: dict[str, np.ndarray], result, name: str,
                       rng: np.random.Generator) -> GradientCheck:
    """The first of FD_STEPS at which a random direction's derivative agrees (or the last)."""
    value = values[name]
    direction = rng.standard_normal(value.shape)
    direction /= max(float(np.linalg.norm(direction)), 1e-30)
    analytic = float(np.sum(result.gradients[name].astype(np.float64) * direction))
    for step in FD_STEPS:
        moved = {}
        for sign in (1, -1):
            shifted = dict(values, **{name: (value + sign * step * direction)
                                      .astype(value.dtype)})
            moved[sign] = engine.step(shifted, batch).loss
        check = GradientCheck(name, analytic, (moved[1] - moved[-1]) / (2 * step), step,
                              result.loss)
        if check.ok:
            break
    return check


def format_report(report: CheckReport) -> str:
    """The report as text, one finding a line."""
    lines = [f"model {report.model}"]
    before, after = report.opset
    if before:
        lines.append(f"opset {before}" + (f", upgraded to {after} for the gradient rules"
                                          if after != before else ""))
    lines.append(f"trainable parameters: {len(report.parameters)} "
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
    for check in report.gradients:
        verdict = "ok" if check.ok else "MISMATCH"
        lines.append(f"gradient {check.name}: {verdict} (engine {check.analytic:.6g}, "
                     f"central differences {check.numeric:.6g} at step {check.step:g})")
    lines.append("result: " + ("the model trains as reported" if report.ok else
                               "the model does not train as it is"))
    return "\n".join(lines)


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
                         expect_parameters=args.expect_parameters, seed=args.seed)
    print(format_report(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
