"""The served model: one immutable `ModelState` (session, step, weights) behind a `ServedModel` that swaps it whole.

A `ModelState` is everything one request needs: the onnxruntime session (CPU; one intra-op
thread unless told otherwise), the model's inputs and outputs as the protocol sees them
(`TensorSpec`: datatype and shape, -1 for a dynamic axis), the training step it holds when
known, and the weights it was built with when they were given (read-only arrays). It is never
changed after it is built.

`ServedModel` holds the current state by one reference:

- `current()` returns it. A request takes it once and does all its work on it: decodes its
  inputs against that state's specs, runs that state's session, and reports that state's
  step. It never reads the served model again, so it finishes on the state it started on.
- `swap(new_state)` replaces the reference under a lock, in one assignment, and returns the
  old state. A request that already took the old state finishes on it (its session stays
  alive as long as the request holds it); every later `current()` returns the new one. No
  request can see a mix of two states, because no state is ever modified: a new step is a
  new state.

A state for new weights: ``ModelState.load(path, weights={name: array}, step=N)`` builds a
session from the same file with those initializers replaced (checked for name, dtype and
shape against the file's, since onnxruntime does not check them), or
``ModelState.from_model(model_proto, step=N)`` from a model in memory whose initializers
already hold them; ``served.swap(it)`` serves it. `swap` refuses a state whose inputs or outputs differ from the current one's, so
the metadata a client read stays true.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ps_serve.errors import ModelNotFound, RequestError
from ps_serve.tensors import TensorSpec, datatype_of_onnx, spec_shape

log = logging.getLogger(__name__)

#: The one version a served model has.
VERSION = "1"
#: The platform name of the model metadata (Triton's name for ONNX Runtime models).
PLATFORM = "onnxruntime_onnx"
#: onnxruntime's log level for sessions and runs: fatal only. A request's failure is answered and logged by
#: ps-serve; onnxruntime's own line for it would only repeat it on stderr.
ORT_LOG_LEVEL = 4


class ModelLoadError(ValueError):
    """The model file cannot be served: missing, not ONNX, or refused by onnxruntime."""


def _repaired_session(path: Path, options: ort.SessionOptions) -> ort.InferenceSession | None:
    """A session of the model at `path` as the workers read it (worker_client.engine.load.read_model: its external
    data by the project's rules, and the exporters' faults onnxruntime refuses mended -- a value defined twice by
    torch's dynamo exporter, tf2onnx's Erfc, nodes out of order), or None when that does not load either."""
    from worker_client.engine.load import read_model

    try:
        model = read_model(path)
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception:   # noqa: BLE001 -- the caller reports onnxruntime's refusal of the file itself
        return None


def _exporter_faults(path: Path) -> list[str]:
    """What read_model would mend in the file at `path` (worker_client/engine/repairs.py), read without its external
    data; [] for a file it would not change, or one that does not parse (onnxruntime then says why)."""
    from worker_client.engine.repairs import repair_exporter_faults

    try:
        return repair_exporter_faults(onnx.load(path, load_external_data=False))
    except Exception:   # noqa: BLE001 -- not ONNX, or damaged: the caller's onnxruntime load reports it
        return []


@dataclass(frozen=True, eq=False)
class ModelState:
    """One servable state of the model; immutable (see the module docstring)."""

    session: ort.InferenceSession
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    step: int | None = None
    weights: Mapping[str, np.ndarray] = field(default_factory=lambda: MappingProxyType({}))
    source: str = ""
    #: onnxruntime's handles of the replaced initializers: they must live as long as the session.
    _ort_values: tuple = field(default=(), repr=False)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, threads: int = 1, step: int | None = None,
             weights: Mapping[str, np.ndarray] | None = None) -> "ModelState":
        """A state from an ONNX file, optionally with some initializers replaced by `weights`.

        Raises ModelLoadError naming the file (missing, unreadable, refused by onnxruntime),
        and ValueError naming a weight whose name, dtype or shape is not the file's.
        """
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"model file {str(path)!r} does not exist or is not a file")
        options = _session_options(threads)
        frozen: dict[str, np.ndarray] = {}
        handles = []
        if weights:
            expected = _initializers(path)
            for name, value in weights.items():
                array = _checked_weight(path, expected, name, value)
                handle = ort.OrtValue.ortvalue_from_numpy(array)
                options.add_initializer(name, handle)
                frozen[name] = array
                handles.append(handle)
        mended = _exporter_faults(path)
        if mended:   # some load as written and fail at the first request (a torch Conv3d's bias of the wrong rank)
            session = _repaired_session(path, options)
            if session is None:
                raise ModelLoadError(f"onnxruntime cannot load model {str(path)!r} even with its exporter's faults "
                                     f"mended ({'; '.join(mended)})")
            log.info("model %s: serving it as the workers read it, with its exporter's faults mended: %s", path,
                     "; ".join(mended))
            return cls._of_session(session, str(path), step=step, weights=frozen, handles=tuple(handles))
        try:
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:   # onnxruntime raises its own classes (Fail, InvalidGraph, ...) for a bad file
            session = _repaired_session(path, options)
            if session is None:
                raise ModelLoadError(f"onnxruntime cannot load model {str(path)!r}: {_one_line(exc)}") from exc
            log.info("model %s: onnxruntime refused the file as written (%s); serving it as the workers read it, "
                     "with its exporter's faults mended", path, _one_line(exc))
        return cls._of_session(session, str(path), step=step, weights=frozen, handles=tuple(handles))

    @classmethod
    def from_model(cls, model: onnx.ModelProto | bytes, *, threads: int = 1, step: int | None = None,
                   source: str = "") -> "ModelState":
        """A state from a model in memory (its tensors inside it, under protobuf's 2 GiB), e.g. a file's graph with
        a job's trained values written into its initializers; `source` names it in logs and errors.

        Raises ModelLoadError when onnxruntime refuses it.
        """
        options = _session_options(threads)
        data = model if isinstance(model, bytes) else model.SerializeToString()
        where = source or "in memory"
        try:
            session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise ModelLoadError(f"onnxruntime cannot load model ({where}): {_one_line(exc)}") from exc
        return cls._of_session(session, source, step=step)

    @classmethod
    def _of_session(cls, session: ort.InferenceSession, source: str, *, step: int | None,
                    weights: Mapping[str, np.ndarray] | None = None, handles: tuple = ()) -> "ModelState":
        inputs = tuple(_spec(source, "input", arg) for arg in session.get_inputs())
        outputs = []
        for arg in session.get_outputs():
            if datatype_of_onnx(arg.type) is None:
                log.warning("model %s: output %r is a %s, not a tensor; it is not served", source, arg.name, arg.type)
                continue
            outputs.append(_spec(source, "output", arg))
        if not outputs:
            raise ModelLoadError(f"model {source!r} has no tensor output to serve")
        return cls(session=session, inputs=inputs, outputs=tuple(outputs), step=step,
                   weights=MappingProxyType(dict(weights or {})), source=source, _ort_values=handles)

    def input_spec(self, name: str) -> TensorSpec:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise RequestError(f"unknown input '{name}'; the model takes {self.describe_inputs()}")

    def describe_inputs(self) -> str:
        return ", ".join(spec.describe() for spec in self.inputs)

    def describe_outputs(self) -> str:
        return ", ".join(spec.describe() for spec in self.outputs)

    def output_names(self, requested: Sequence[str] | None) -> list[str]:
        """The outputs to compute: the requested ones (checked), or every served output."""
        if not requested:
            return [spec.name for spec in self.outputs]
        known = {spec.name for spec in self.outputs}
        seen: set[str] = set()
        for name in requested:
            if name not in known:
                raise RequestError(f"unknown output '{name}'; the model outputs {self.describe_outputs()}")
            if name in seen:
                raise RequestError(f"output '{name}' is requested twice")
            seen.add(name)
        return list(requested)

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """The named outputs (all served ones when None) for these inputs, in the order asked.

        Every input of the model must be given, and only those. Raises RequestError naming
        what is wrong, including onnxruntime's refusal of the values (e.g. an index out of a
        table's range).
        """
        known = {spec.name for spec in self.inputs}
        unknown = [name for name in inputs if name not in known]
        if unknown:
            raise RequestError(f"unknown input '{unknown[0]}'; the model takes {self.describe_inputs()}")
        missing = [spec.describe() for spec in self.inputs if spec.name not in inputs]
        if missing:
            raise RequestError(f"missing input(s): {', '.join(missing)}")
        names = self.output_names(outputs)
        run_options = ort.RunOptions()
        run_options.log_severity_level = ORT_LOG_LEVEL
        try:
            values = self.session.run(names, dict(inputs), run_options)
        except Exception as exc:   # onnxruntime's InvalidArgument, Fail, RuntimeException: the inputs' values
            raise RequestError(f"the model cannot run on these inputs: {_one_line(exc)}") from exc
        return dict(zip(names, values))

    def same_interface(self, other: "ModelState") -> bool:
        return self.inputs == other.inputs and self.outputs == other.outputs


class ServedModel:
    """The model a server serves under one name: its current `ModelState`, replaced whole by `swap`."""

    def __init__(self, name: str, state: ModelState, *, version: str = VERSION) -> None:
        if not name or "/" in name:
            raise ValueError(f"a model name must be non-empty and hold no '/', got {name!r}")
        self.name = name
        self.version = version
        self._state = state
        self._lock = threading.Lock()

    def current(self) -> ModelState:
        """The state being served now; a request takes it once and uses only it."""
        return self._state   # one reference read: a whole state, never half of a swap

    def swap(self, new_state: ModelState) -> ModelState:
        """Serves `new_state` from now on and returns the state it replaces.

        Requests that took the old state finish on it. ValueError when the new state's
        inputs or outputs differ from the current one's (clients hold its metadata).
        """
        with self._lock:
            old = self._state
            if not old.same_interface(new_state):
                raise ValueError(f"model {self.name}: the new state's inputs/outputs "
                                 f"({new_state.describe_inputs()} -> {new_state.describe_outputs()}) differ from "
                                 f"the served ones ({old.describe_inputs()} -> {old.describe_outputs()})")
            self._state = new_state
        log.info("model %s now serves step %s (was %s)", self.name, new_state.step, old.step)
        return old

    def check(self, name: str, version: str | None = None) -> None:
        """ModelNotFound unless `name` (and `version`, when given) are this model's."""
        if name != self.name:
            raise ModelNotFound(f"unknown model '{name}'; this server serves '{self.name}'")
        if version is not None and version not in ("", self.version):
            raise ModelNotFound(f"model '{name}' has no version '{version}'; it serves version {self.version}")

    def metadata(self) -> dict[str, Any]:
        """The protocol's model metadata object."""
        state = self.current()
        return {"name": self.name, "versions": [self.version], "platform": PLATFORM,
                "inputs": [spec.metadata() for spec in state.inputs],
                "outputs": [spec.metadata() for spec in state.outputs]}


# ---------------------------------------------------------------------- helpers


def _session_options(threads: int) -> ort.SessionOptions:
    """CPU, `threads` intra-op threads, one inter-op thread, onnxruntime's own logging quiet."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = ORT_LOG_LEVEL
    return options


def _spec(source: str, kind: str, arg: Any) -> TensorSpec:
    datatype = datatype_of_onnx(arg.type)
    if datatype is None:
        raise ModelLoadError(f"model {source!r}: {kind} {arg.name!r} is a {arg.type}, not a tensor; "
                             "the inference protocol carries only tensors")
    return TensorSpec(arg.name, datatype, spec_shape(arg.shape))


def _initializers(path: Path) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The main graph's initializers of a model file: name -> (dtype, shape), read without their data."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise ModelLoadError(f"cannot read model {str(path)!r}: {_one_line(exc)}") from exc
    found = {}
    for tensor in model.graph.initializer:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
        found[tensor.name] = (dtype, tuple(int(d) for d in tensor.dims))
    return found


def _checked_weight(path: Path, expected: Mapping[str, tuple[np.dtype, tuple[int, ...]]], name: str,
                    value: Any) -> np.ndarray:
    """A read-only C-contiguous copy of a weight, if the file has an initializer of that name, dtype and shape."""
    if name not in expected:
        raise ValueError(f"weight {name!r} is not an initializer of model {str(path)!r}")
    dtype, shape = expected[name]
    array = np.asarray(value)
    if array.dtype != dtype or array.shape != shape:
        raise ValueError(f"weight {name!r} is {array.dtype} {list(array.shape)}, but model {str(path)!r} has "
                         f"{dtype} {list(shape)}")
    array = np.array(array, dtype=dtype, order="C", copy=True)
    array.setflags(write=False)
    return array


#: The most characters of onnxruntime's message quoted in an error.
QUOTED_CHARS = 500


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (onnxruntime's span several), cut to QUOTED_CHARS."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= QUOTED_CHARS else text[:QUOTED_CHARS] + " ..."
