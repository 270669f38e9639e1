"""Gradient engine: onnx-ad reverse pass on onnxruntime; export torch with TrainingMode.TRAINING."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ad
import onnxruntime as ort
from onnx import helper, numpy_helper

from ps_common.errors import DeviceUnavailableError
from ps_common.errors import UnsupportedModelError
from worker_client.engine.batch import fix_batch
from worker_client.engine.differentiate import (
    GradientGraph,
    differentiate,
    gradient_graph,
    refuse_training_mode,
)
from worker_client.engine.lift import data_inputs, lift_parameters
from worker_client.engine.load import load_model, max_ir_version
from worker_client.engine.loss import LossSpec, attach_loss, parse_loss
from worker_client.engine.rewrites import rewrite_adjoints, rewrite_forward
from worker_client.engine.trainables import select_trainable, shared_parameters, tie_warning

__all__ = ["DeviceUnavailableError", "GradientEngine", "UnsupportedModelError",
           "default_cache_dir"]

#: Bumped whenever the gradient graph built for the same options changes.
GRAPH_FORMAT = 8


def default_cache_dir() -> Path:
    """$ONNX_PS_CACHE, else ~/.cache/onnx-ps/gradients."""
    configured = os.environ.get("ONNX_PS_CACHE")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "onnx-ps" / "gradients"


def _providers(device: str) -> tuple[list[str | tuple[str, dict[str, str]]], int | None]:
    """onnxruntime providers for "cpu", "cuda" or "cuda:N", and the CUDA device id."""
    if device == "cpu":
        return ["CPUExecutionProvider"], None
    if device == "cuda" or device.startswith("cuda:"):
        index = device.partition(":")[2] or "0"
        if not index.isdigit():
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        available = ort.get_available_providers()
        if "CUDAExecutionProvider" not in available:
            raise DeviceUnavailableError(
                f"device={device!r} needs onnxruntime's CUDAExecutionProvider, but this "
                f"onnxruntime ({ort.__version__}) offers only {available}; install "
                f"onnxruntime-gpu (pip install 'onnx-ps[gpu]') in place of onnxruntime")
        return [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"], \
            int(index)
    raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def _dims(value: onnx.ValueInfoProto) -> tuple[int | str | None, ...] | None:
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                 for d in tensor_type.shape.dim)


def _np_dtype(value: onnx.ValueInfoProto) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))


def _coerce(what: str, array: object, dtype: np.dtype) -> np.ndarray:
    """`array` as a C-contiguous `dtype` array, converting only where no meaning is lost:
    float to float (float64 data for a float32 model), integer or bool to float, and
    integer to integer when every value fits."""
    value = np.asarray(array)
    if value.dtype == dtype:
        return np.ascontiguousarray(value)
    if dtype.kind == "f" and value.dtype.kind in "fiub":
        return np.ascontiguousarray(value, dtype=dtype)
    if dtype.kind in "iu" and value.dtype.kind in "iu":
        info = np.iinfo(dtype)
        if value.size and (value.min() < info.min or value.max() > info.max):
            raise ValueError(f"{what}: values in [{value.min()}, {value.max()}] do not fit "
                             f"the expected {dtype}")
        return np.ascontiguousarray(value, dtype=dtype)
    raise ValueError(f"{what}: expected dtype {dtype}, got {value.dtype}, which does not "
                     f"convert safely")


def _check_shape(what: str, array: np.ndarray, expected: tuple[int | str | None, ...] | None,
                 *, free_batch: bool = False) -> None:
    """Raise unless `array.shape` matches `expected` (symbolic entries match anything)."""
    if expected is None:
        return
    fits = len(array.shape) == len(expected) and all(
        not isinstance(want, int) or got == want or (free_batch and axis == 0)
        for axis, (got, want) in enumerate(zip(array.shape, expected)))
    if not fits:
        shown = tuple(want if isinstance(want, int) else (want or "?") for want in expected)
        raise ValueError(f"{what}: expected shape {shown}, got {tuple(array.shape)}")


def _content_key(lifted: onnx.ModelProto, options: Mapping[str, object]) -> str:
    """Hash of the model's graph (trainable values excluded: they are inputs now) and the
    options that change the gradient graph."""
    digest = hashlib.sha256()
    digest.update(lifted.SerializeToString(deterministic=True))
    digest.update(json.dumps(dict(options), sort_keys=True).encode())
    return digest.hexdigest()[:40]


def _atomic_save(model: onnx.ModelProto, path: Path) -> None:
    """Write `model` to a temporary file beside `path`, then rename it into place, so a
    reader never sees a partial file and concurrent writers race harmlessly."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.stem,
                                         suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(model.SerializeToString())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


class GradientEngine:
    """Loss and gradients of an ONNX model for given parameter values and a fixed-size batch.

    The engine lifts the model's trainable initializers into graph inputs, appends a loss,
    differentiates the result with onnx-ad's reverse pass and runs it in one onnxruntime
    session. The built gradient model is cached on disk (`cache_dir`, default
    $ONNX_PS_CACHE or ~/.cache/onnx-ps/gradients), keyed by the model's graph and the
    options that shape it, and written atomically.

    Trainable parameters are the floating-point initializers (BatchNormalization running
    statistics excepted), narrowed by `include` / `exclude` glob patterns; a constant that
    must not train should be a Constant node, or excluded.

    Exporting from torch: ``torch.onnx.export(model, args, path, dynamo=False,
    training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
    dynamic_axes={name: {0: "batch"}, ...})``. In eval mode the exporter de-duplicates
    initializers that hold equal values -- two fresh LayerNorms, zero-initialized biases --
    into one, so those layers silently train as one tied parameter; the engine warns when
    one initializer feeds several layers. Training mode exports BatchNormalization and
    Dropout in their training forms, which have no deterministic gradient and are refused
    with `UnsupportedModelError`; export such a model with ``model.eval()``,
    ``training=torch.onnx.TrainingMode.EVAL`` and ``keep_initializers_as_inputs=True``
    (which skips the de-duplication), or remove / fold those layers.

    The batch axis is axis 0 of every model input. The gradient model fixes it to
    `batch_size` (some onnx-ad rules need static shapes); `predict` keeps the model's own,
    ideally dynamic, batch axis. `loss=None` builds no gradient model (predict only).

    Not thread-safe: one engine serves one worker loop (onnxruntime parallelizes inside a
    call; see `intra_op_threads`).
    """

    def __init__(self, model_path: str | os.PathLike[str], *, batch_size: int,
                 loss: str | None = "cross_entropy", device: str = "cpu",
                 include: Sequence[str] = (), exclude: Sequence[str] = (),
                 intra_op_threads: int | None = None, inter_op_threads: int | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        for name, threads in (("intra_op_threads", intra_op_threads),
                              ("inter_op_threads", inter_op_threads)):
            if threads is not None and (not isinstance(threads, int) or threads < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {threads!r}")
        if isinstance(include, str) or isinstance(exclude, str):
            raise TypeError("include and exclude are sequences of glob patterns, not strings")
        self.model_path = Path(model_path)
        self.batch_size = batch_size
        self.device = device
        self._providers, self._device_id = _providers(device)
        self._loss: LossSpec | None = None if loss is None else parse_loss(loss)
        self._threads = (intra_op_threads, inter_op_threads)

        model = load_model(self.model_path)
        self.trainable_names: list[str] = select_trainable(model, include=include,
                                                           exclude=exclude)
        if not self.trainable_names:
            raise UnsupportedModelError(
                f"{self.model_path}: no trainable parameters (floating-point initializers) "
                f"match include={list(include)} exclude={list(exclude)}")
        for name, nodes in shared_parameters(model, self.trainable_names).items():
            warnings.warn(f"{self.model_path}: {tie_warning(name, nodes)}", UserWarning,
                          stacklevel=2)
        initial = {t.name: t for t in model.graph.initializer}
        self._initial = {name: numpy_helper.to_array(initial[name])
                         for name in self.trainable_names}
        self._lifted = lift_parameters(model, self.trainable_names)
        trainable = set(self.trainable_names)
        self.input_names: list[str] = [v.name for v in data_inputs(self._lifted)
                                       if v.name not in trainable]
        self.output_names: list[str] = [v.name for v in self._lifted.graph.output]
        self._eval_session: ort.InferenceSession | None = None

        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.cache_path: Path | None = None
        self.cache_hit = False
        self._graph: GradientGraph | None = None
        if self._loss is not None:
            self._graph = self._load_or_build(self._loss)
            self._session = self._make_session(self._graph.model)
            self._prepare_gradient_run(self._graph)

    # --- construction -------------------------------------------------------------------

    def _load_or_build(self, loss: LossSpec) -> GradientGraph:
        options = {"batch_size": self.batch_size, "loss": loss.key(),
                   "trainable": self.trainable_names, "onnx_ad": onnx_ad.__version__,
                   "onnx": onnx.__version__, "ir_version": max_ir_version(),
                   "format": GRAPH_FORMAT}
        self.cache_path = self.cache_dir / f"{_content_key(self._lifted, options)}.onnx"
        if self.cache_path.is_file():
            try:
                graph = GradientGraph.from_model(onnx.load(self.cache_path))
            except Exception as exc:  # noqa: BLE001 -- a damaged entry is rebuilt
                warnings.warn(f"rebuilding the unreadable cached gradient model "
                              f"{self.cache_path}: {exc}", UserWarning, stacklevel=3)
            else:
                self.cache_hit = True
                return graph
        try:
            graph = self._gradient_graph(loss)
        except UnsupportedModelError as exc:
            raise UnsupportedModelError(f"{self.model_path}: {exc}") from exc
        try:
            _atomic_save(graph.model, self.cache_path)
        except OSError as exc:  # a read-only or full disk costs a rebuild next time, no more
            warnings.warn(f"could not cache the gradient model at {self.cache_path}: {exc}",
                          UserWarning, stacklevel=3)
        return graph

    def _gradient_graph(self, loss: LossSpec) -> GradientGraph:
        """The stages that build the gradient model from the lifted one, in order."""
        refuse_training_mode(self._lifted)
        model = fix_batch(self._lifted, self.input_names, self.batch_size)
        model, loss_output, labels = attach_loss(model, loss, self.batch_size)
        model = rewrite_forward(model)
        model = differentiate(model, self.trainable_names, loss_output)
        model = rewrite_adjoints(model)
        return gradient_graph(model, loss_output, labels, self.trainable_names)

    def _make_session(self, model: onnx.ModelProto) -> ort.InferenceSession:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        intra, inter = self._threads
        if intra is not None:
            options.intra_op_num_threads = intra
        if inter is not None:
            options.inter_op_num_threads = inter
            if inter > 1:
                options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        try:
            session = ort.InferenceSession(model.SerializeToString(), sess_options=options,
                                           providers=self._providers)
        except Exception as exc:  # onnxruntime raises its own untyped Fail / InvalidGraph
            raise UnsupportedModelError(
                f"{self.model_path}: onnxruntime {ort.__version__} cannot load the model "
                f"(opset {[(o.domain or 'ai.onnx', o.version) for o in model.opset_import]}, "
                f"IR {model.ir_version}): {exc}") from exc
        if self._device_id is not None and \
                "CUDAExecutionProvider" not in session.get_providers():
            # onnxruntime-gpu falls back to the CPU, with only a log line, when the CUDA
            # provider cannot start (no driver, no such device, missing CUDA libraries)
            raise DeviceUnavailableError(
                f"device={self.device!r}: onnxruntime could not start its "
                f"CUDAExecutionProvider (the session runs on {session.get_providers()}); "
                f"check the NVIDIA driver, CUDA/cuDNN libraries and the device index")
        return session

    def _prepare_gradient_run(self, graph: GradientGraph) -> None:
        """Everything `gradients` needs per call, computed once."""
        session_inputs = {v.name: v for v in graph.model.graph.input}
        trainable = set(self.trainable_names)
        self._feeds = {name: (_np_dtype(session_inputs[name]), _dims(session_inputs[name]))
                       for name in session_inputs if name not in trainable}
        self._parameter_specs = {name: (self._initial[name].dtype, self._initial[name].shape)
                                 for name in self.trainable_names}
        self._fetches = [graph.loss_output] + [graph.gradient_outputs[name]
                                               for name in self.trainable_names]
        # onnx-ad's gradients carry a trailing seed axis of length 1
        loss_type = next(v for v in graph.model.graph.output if v.name == graph.loss_output)
        self._output_specs = [(graph.loss_output, _np_dtype(loss_type), ())] + [
            (graph.gradient_outputs[name], self._initial[name].dtype,
             self._initial[name].shape + (1,)) for name in self.trainable_names]
        self._bind_outputs = self._device_id is not None
        self._classes: int | None = None
        if self._loss is not None and self._loss.kind == "cross_entropy":
            logits = _dims(self._lifted.graph.output[0])
            if logits and len(logits) == 2 and isinstance(logits[1], int):
                self._classes = logits[1]

    # --- public API ---------------------------------------------------------------------

    def parameters(self) -> dict[str, np.ndarray]:
        """The model's initial trainable values (copies), in `trainable_names` order."""
        return {name: value.copy() for name, value in self._initial.items()}

    def gradients(self, parameters: Mapping[str, np.ndarray],
                  inputs: Mapping[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
        """The loss and its gradient with respect to every trainable parameter.

        `parameters` holds a value for every name in `trainable_names`; `inputs` holds every
        model input (batch axis 0 of length `batch_size`) and, when a loss with labels was
        attached, "labels". Float data is cast to the model's float type. Raises ValueError
        naming the input and the expected and received shapes on any mismatch.
        """
        if self._graph is None:
            raise RuntimeError("this engine was built with loss=None and computes no "
                               "gradients; pass loss='cross_entropy', 'mse' or 'output:NAME'")
        feed = self._parameter_feed(parameters)
        unknown = set(inputs) - set(self._feeds)
        if unknown:
            raise ValueError(f"unknown inputs {sorted(unknown)}; the model takes "
                             f"{sorted(self._feeds)}")
        for name, (dtype, dims) in self._feeds.items():
            if name not in inputs:
                raise ValueError(f"input {name!r} is missing; expected shape "
                                 f"{self._shown(dims)} of {dtype}")
            what = "labels" if name == self._graph.labels else f"input {name!r}"
            array = _coerce(what, inputs[name], dtype)
            _check_shape(what, array, dims)
            feed[name] = array
        if self._classes is not None and self._graph.labels is not None:
            labels = feed[self._graph.labels]
            if labels.size and (labels.min() < 0 or labels.max() >= self._classes):
                raise ValueError(f"labels must lie in [0, {self._classes}), got values in "
                                 f"[{labels.min()}, {labels.max()}]")
        results = self._run(feed)
        loss = float(results[0])
        return loss, {name: value.reshape(self._parameter_specs[name][1])
                      for name, value in zip(self.trainable_names, results[1:])}

    def predict(self, parameters: Mapping[str, np.ndarray],
                inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's outputs for `inputs` at `parameters`, any batch size.

        Runs the model itself (no loss, no gradient), keeping its own batch axis; a model
        exported with a fixed batch size is run on zero-padded chunks of that size.
        """
        if self._eval_session is None:
            self._eval_session = self._make_session(self._lifted)
        feed = self._parameter_feed(parameters)
        declared = {v.name: v for v in self._lifted.graph.input}
        unknown = set(inputs) - set(self.input_names) - {"labels"}
        if unknown:
            raise ValueError(f"unknown inputs {sorted(unknown)}; the model takes "
                             f"{self.input_names}")
        batch: int | None = None
        for name in self.input_names:
            if name not in inputs:
                raise ValueError(f"input {name!r} is missing; expected shape "
                                 f"{self._shown(_dims(declared[name]))}")
            array = _coerce(f"input {name!r}", inputs[name], _np_dtype(declared[name]))
            _check_shape(f"input {name!r}", array, _dims(declared[name]), free_batch=True)
            if array.ndim:
                if batch is not None and array.shape[0] != batch:
                    raise ValueError(f"input {name!r}: batch of {array.shape[0]}, but other "
                                     f"inputs have {batch}")
                batch = array.shape[0]
            feed[name] = array
        fixed = self._fixed_batch()
        if fixed is None or batch is None or batch == fixed:
            values = self._eval_session.run(self.output_names, feed)
            return dict(zip(self.output_names, values))
        return self._predict_in_chunks(feed, batch, fixed)

    # --- helpers ------------------------------------------------------------------------

    @staticmethod
    def _shown(dims: tuple[int | str | None, ...] | None) -> object:
        if dims is None:
            return "any"
        return tuple(d if isinstance(d, int) else (d or "?") for d in dims)

    def _parameter_feed(self, parameters: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [name for name in self.trainable_names if name not in parameters]
        if missing:
            raise ValueError(f"parameters are missing {missing}")
        unknown = set(parameters) - set(self._initial)
        if unknown:
            raise ValueError(f"unknown parameters {sorted(unknown)}; the trainable "
                             f"parameters are {self.trainable_names}")
        feed = {}
        for name, initial in self._initial.items():
            value = _coerce(f"parameter {name!r}", parameters[name], initial.dtype)
            _check_shape(f"parameter {name!r}", value, initial.shape)
            feed[name] = value
        return feed

    def _run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        """One gradient evaluation; the results land in freshly allocated host arrays.

        On CUDA the IO binding copies each input to the device once and each result
        straight into its final host array, rather than through onnxruntime's own staging
        buffers and a second copy into numpy.
        """
        if not self._bind_outputs:
            return self._session.run(self._fetches, feed)
        binding = self._session.io_binding()
        for name, array in feed.items():
            binding.bind_cpu_input(name, array)
        results = []
        for name, dtype, shape in self._output_specs:
            result = np.empty(shape, dtype)
            binding.bind_output(name, "cpu", 0, dtype, shape, result.ctypes.data)
            results.append(result)
        self._session.run_with_iobinding(binding)
        return results

    def _fixed_batch(self) -> int | None:
        for name in self.input_names:
            value = next(v for v in self._lifted.graph.input if v.name == name)
            dims = _dims(value)
            if dims:
                return dims[0] if isinstance(dims[0], int) else None
        return None

    def _predict_in_chunks(self, feed: dict[str, np.ndarray], batch: int,
                           fixed: int) -> dict[str, np.ndarray]:
        pieces: dict[str, list[np.ndarray]] = {name: [] for name in self.output_names}
        assert self._eval_session is not None
        for start in range(0, batch, fixed):
            chunk = dict(feed)
            for name in self.input_names:
                part = feed[name][start:start + fixed]
                if part.ndim and part.shape[0] < fixed:
                    padding = np.zeros((fixed - part.shape[0],) + part.shape[1:], part.dtype)
                    part = np.concatenate([part, padding])
                chunk[name] = part
            for name, value in zip(self.output_names,
                                   self._eval_session.run(self.output_names, chunk)):
                if value.ndim == 0 or value.shape[0] != fixed:
                    raise ValueError(
                        f"output {name!r} has no batch axis (shape {value.shape}), so a "
                        f"batch of {batch} cannot be run in chunks of the model's fixed "
                        f"batch size {fixed}")
                pieces[name].append(value)
        return {name: np.concatenate(parts)[:batch] for name, parts in pieces.items()}
