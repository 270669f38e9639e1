"""One pipeline stage's arithmetic: forward a micro-batch, take its cotangents back, sum the gradients.

A `StageRunner` wraps the gradient engines of one stage model (cut.py) and keeps, per step,
what the backward pass needs: each micro-batch's inputs and Dropout masks. It never touches
the network; `LocalPipeline` (below) chains K runners in one process, and the stage worker
(worker.py) runs one between two stage links. The schedule is GPipe's: every micro-batch's
forward, then every backward, each stage's parameter gradients summed over the micro-batches.

- A stage before the last runs `forward` (engine.forward: the training form, batch
  statistics, the masks drawn once per micro-batch) and sends its outputs on, with the
  carried tensors and the labels. Its backward pass is the vector-Jacobian product of its
  subgraph (an engine with loss="vjp"): it recomputes the forward (GPipe's re-materialization:
  no activation inside the stage is kept between the passes) and gives the gradients of its
  parameters and of its inputs.
- The last stage computes the loss on each micro-batch as it arrives (an engine with the
  job's loss, differentiating its inputs too) and sends the inputs' gradients straight back.
  The job's loss is the mean over the whole batch, so each micro-batch's loss and gradients
  are scaled by 1/m (m micro-batches of equal size): summed, they are the whole batch's.

The gradients therefore equal those of the whole model on the whole batch (up to float
rounding), except where the model itself depends on the batch: training-mode
BatchNormalization normalizes each micro-batch by its own statistics, as GPipe does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ps_common.errors import TrainingError
from worker_client.engine import GradientEngine
from worker_client.pipeline.cut import Stage, StagePlan

__all__ = ["LABELS", "LocalPipeline", "StageRunner", "split_batch"]

#: The name under which the labels travel with the activations to the last stage.
LABELS = "labels"


def split_batch(arrays: Mapping[str, np.ndarray], micro_batches: int) -> list[dict[str, np.ndarray]]:
    """`arrays` (axis 0 the batch) cut into `micro_batches` equal parts (TrainingError when the
    batch does not divide)."""
    sizes = {len(a) for a in arrays.values()}
    if len(sizes) != 1:
        raise TrainingError(f"the batch's arrays differ in length: "
                            f"{ {k: len(v) for k, v in arrays.items()} }")
    (size,) = sizes
    if size % micro_batches:
        raise TrainingError(f"a batch of {size} does not split into {micro_batches} equal "
                            f"micro-batches; choose a batch size divisible by --micro-batches")
    step = size // micro_batches
    return [{k: v[i * step:(i + 1) * step] for k, v in arrays.items()} for i in range(micro_batches)]


@dataclass
class _Held:
    """What the backward pass of one micro-batch needs from its forward."""

    inputs: dict[str, np.ndarray]
    masks: dict[str, np.ndarray] = field(default_factory=dict)


class StageRunner:
    """The engines of one stage and the state of the step in flight (module docstring)."""

    def __init__(self, plan: StagePlan, index: int, model_path: str | Path, *, micro_batch_size: int,
                 micro_batches: int, loss: str = "cross_entropy", device: str = "cpu",
                 include: Sequence[str] = (), exclude: Sequence[str] = (), seed: int = 0,
                 intra_op_threads: int | None = None, cache_dir: str | Path | None = None) -> None:
        self.plan = plan
        self.stage: Stage = plan.stages[index]
        self.index = index
        self.last = index == plan.count - 1
        self.micro_batches = micro_batches
        options = dict(batch_size=micro_batch_size, device=device, include=include, exclude=exclude,
                       seed=seed, intra_op_threads=intra_op_threads, cache_dir=cache_dir,
                       input_gradients=self.stage.differentiable)
        self.engine = GradientEngine(model_path, loss=loss if self.last else "vjp", **options)
        self._held: dict[int, _Held] = {}
        self._gradients: dict[str, np.ndarray] = {}
        self._state: dict[str, np.ndarray] = {}
        self.loss = 0.0

    # --- what the stage owns ------------------------------------------------------------

    @property
    def trainable_names(self) -> list[str]:
        return self.engine.trainable_names

    @property
    def state_names(self) -> list[str]:
        return self.engine.state_names

    def parameters(self) -> dict[str, np.ndarray]:
        return self.engine.parameters()

    def initial_state(self) -> dict[str, np.ndarray]:
        return self.engine.state()

    # --- one step ------------------------------------------------------------------------

    def begin(self) -> None:
        """Forgets the step in flight (a new step, or an abandoned one)."""
        self._held.clear()
        self._gradients = {}
        self._state = {}
        self.loss = 0.0

    def forward(self, micro: int, parameters: Mapping[str, np.ndarray],
                received: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """Runs micro-batch `micro` forward. A stage before the last returns what it sends on
        (its outputs, the carried tensors, the labels); the last stage computes its loss and
        gradients now and returns None (`backward` then gives the cotangents to send back)."""
        inputs = {n: received[n] for n in self.stage.inputs}
        if self.last:
            if LABELS not in received:
                raise TrainingError(f"stage {self.index} got micro-batch {micro} without labels")
            result = self.engine.step(parameters, {**inputs, LABELS: received[LABELS]})
            scale = 1.0 / self.micro_batches
            self.loss += result.loss * scale
            self._accumulate({n: g * scale for n, g in result.gradients.items()}, result.state)
            self._held[micro] = _Held({n: g * scale for n, g in result.input_gradients.items()})
            return None
        masks = self.engine.draw_masks()
        outputs, state = self.engine.forward({**parameters, **self._state_or(parameters)},
                                             {**inputs, **masks})
        self._state = state
        self._held[micro] = _Held(inputs, masks)
        sent = dict(outputs)
        sent.update({n: received[n] for n in self.stage.carried})
        if LABELS in received:
            sent[LABELS] = received[LABELS]
        return sent

    def backward(self, micro: int, parameters: Mapping[str, np.ndarray],
                 cotangents: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """Runs micro-batch `micro` backward from the cotangents of what this stage sent (the
        last stage: none); returns the cotangents of what it received (float ones), to send
        back (stage 0: an empty dict)."""
        held = self._held.pop(micro, None)
        if held is None:
            raise TrainingError(f"stage {self.index}: backward of micro-batch {micro}, which "
                                f"has not run forward in this step")
        if self.last:
            back = held.inputs
        else:
            cotangents = dict(cotangents or {})
            seeded = {o: cotangents[o] for o in self.engine.seeded_outputs()}
            result = self.engine.step(parameters, {**held.inputs, **held.masks}, seeded)
            self._accumulate(result.gradients, {})
            back = dict(result.input_gradients)
            for name in self.stage.carried:   # handed on untouched: its cotangent too
                if name in cotangents:
                    back[name] = back[name] + cotangents[name] if name in back else cotangents[name]
        return back if self.index > 0 else {}

    def gradients(self) -> dict[str, np.ndarray]:
        """The step's parameter gradients summed over its micro-batches."""
        return dict(self._gradients)

    def new_state(self) -> dict[str, np.ndarray]:
        """The state (running statistics) after the step's last micro-batch."""
        return dict(self._state)

    # --- helpers ---------------------------------------------------------------------------

    def _state_or(self, parameters: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The state the next micro-batch starts from: the last one's, else what was pulled."""
        return self._state or {n: parameters[n] for n in self.state_names if n in parameters}

    def _accumulate(self, gradients: Mapping[str, np.ndarray], state: Mapping[str, np.ndarray]) -> None:
        for name, value in gradients.items():
            if name in self._gradients:
                self._gradients[name] += value
            else:
                self._gradients[name] = np.array(value, copy=True)
        if state:
            self._state = dict(state)


class LocalPipeline:
    """K stage runners chained in one process: the reference the stage workers must match.

    `gradients(parameters, inputs)` takes the whole model's parameters and a batch (with
    "labels") and returns (loss, gradients) like GradientEngine.gradients, computed stage by
    stage with `micro_batches` micro-batches."""

    def __init__(self, plan: StagePlan, paths: Sequence[str | Path], *, batch_size: int,
                 micro_batches: int = 1, **options) -> None:
        if batch_size % micro_batches:
            raise ValueError(f"batch_size {batch_size} is not divisible by micro_batches {micro_batches}")
        self.runners = [StageRunner(plan, k, path, micro_batch_size=batch_size // micro_batches,
                                    micro_batches=micro_batches, **options)
                        for k, path in enumerate(paths)]
        self.micro_batches = micro_batches

    def parameters(self) -> dict[str, np.ndarray]:
        """Every stage's initial trainable values (the whole model's parameters)."""
        out: dict[str, np.ndarray] = {}
        for runner in self.runners:
            out.update(runner.parameters())
        return out

    def gradients(self, parameters: Mapping[str, np.ndarray], inputs: Mapping[str, np.ndarray]
                  ) -> tuple[float, dict[str, np.ndarray]]:
        own = [{**r.initial_state(), **{n: parameters[n] for n in r.trainable_names + r.state_names
                                        if n in parameters}} for r in self.runners]
        for runner in self.runners:
            runner.begin()
        micro = split_batch(inputs, self.micro_batches)
        for i, batch in enumerate(micro):   # the last stage returns None: it has the loss
            received: dict[str, np.ndarray] | None = batch
            for runner, params in zip(self.runners, own):
                received = runner.forward(i, params, received)
        for i in range(self.micro_batches):
            cotangents: dict[str, np.ndarray] | None = None
            for runner, params in zip(reversed(self.runners), reversed(own)):
                cotangents = runner.backward(i, params, cotangents)
        gradients: dict[str, np.ndarray] = {}
        for runner in self.runners:
            gradients.update(runner.gradients())
        return self.runners[-1].loss, gradients
