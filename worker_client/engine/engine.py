"""GradientEngine: the pipeline's stages run in order, then loss, gradients and predictions."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from ps_common.errors import UnsupportedModelError
from worker_client.engine.batch import fix_batch
from worker_client.engine.cache import cached_or_built, default_cache_dir, entry_path
from worker_client.engine.device_masks import DeviceMasks
from worker_client.engine.differentiate import (
    GRAD_PREFIX,
    GradientGraph,
    StepResult,
    differentiate,
    gradient_graph,
)
from worker_client.engine.exporters import (dropped_detaches_warning, dropped_torch_detaches, folded_bias_layers,
                                             folded_keras_batch_norms, folded_keras_batch_norms_warning,
                                             folded_torch_parameters, folded_torch_parameters_warning,
                                             folded_variables_warning, idle_dropouts, idle_dropouts_warning,
                                             renamed_or_dropped_warning,
                                             restore_torch_training_batch_norms, torch_padding_rows,
                                             torch_parameters_renamed_or_dropped)
from worker_client.engine.feeds import (
    check_shape,
    coerce,
    data_inputs_of,
    declared_dims,
    element_dtype,
    parameter_feed,
    shown,
)
from worker_client.engine.lift import lift_parameters
from worker_client.engine.external_data import load_external_data
from worker_client.engine.load import clamp_ir_version, load_model, read_model
from worker_client.engine.loss import LossSpec, attach_loss, parse_loss, probability_output
from worker_client.engine.opset import upgrade_opset
from worker_client.engine.rewrites import rewrite_adjoints, rewrite_forward
from worker_client.engine.rewrites.affine import channel_affines
from worker_client.engine.rewrites.conv import equal_transposed_conv_pads
from worker_client.engine.rewrites.col2im import depth_to_space_as_col2im, small_transposed_convs_as_col2im
from worker_client.engine.rewrites.masks import selects_as_products
from worker_client.engine.rewrites.nchwc import block_convs, nchwc_block_size
from worker_client.engine.rewrites.prune import prune
from worker_client.engine.session import open_session, placement, run_bound
from worker_client.engine.sparse import SparsePlan, declared_dynamic_tables, find_sparse_tables, rewrite_sparse
from worker_client.engine.support import check_registered_ops, warn_caller
from worker_client.engine.thread_choice import ThreadChoice, loops
from worker_client.engine.trainables import FLOAT_TYPES, initial_values, trainable_parameters
from worker_client.engine.training_mode import (
    inference_form,
    state_initializers,
    training_form,
)

__all__ = ["GradientEngine", "StepResult"]


class GradientEngine:
    """Loss and gradients of an ONNX model for given parameter values and a fixed-size batch.

    The engine lifts the model's trainable initializers into graph inputs, appends a loss,
    differentiates the result with onnx-ad's reverse pass and runs it in one onnxruntime
    session; `_build` lists the stages in order (docs/engine-pipeline.md). The built
    gradient model is cached on disk (`cache_dir`, default $ONNX_PS_CACHE or
    ~/.cache/onnx-ps/gradients), keyed by the model's graph and the options that shape it,
    and written atomically.

    Trainable parameters are the floating-point initializers that `selection.classify`
    calls parameters (not BatchNormalization running statistics, not constants such as an
    epsilon or a shape), narrowed by `include` / `exclude` glob patterns; an include
    pattern without wildcards that names a constant exactly trains it. With
    `expect_parameters` a different count is an error (an exporter folded variables away).

    Exporting from torch: ``torch.onnx.export(model, args, path, dynamo=False,
    training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
    dynamic_axes={name: {0: "batch"}, ...})``. In eval mode the exporter de-duplicates
    initializers that hold equal values -- two fresh LayerNorms, zero-initialized biases --
    into one, so those layers silently train as one tied parameter; the engine warns when
    one initializer feeds several layers. Training mode exports BatchNormalization and
    Dropout in their training forms, which train as torch trains them
    (training_mode.py): BatchNormalization with the batch's statistics, its running
    statistics kept as state (`state_names`, fed with the parameters; `step` returns their
    new values) and used by `predict`; Dropout with a mask the engine draws from a generator
    seeded with `seed`, or that the caller feeds (`mask_names`).

    The batch axis is axis 0 of every model input. The gradient model fixes it to
    `batch_size` (some onnx-ad rules need static shapes); `predict` keeps the model's own,
    ideally dynamic, batch axis. `loss=None` builds no gradient model (predict only).

    Not thread-safe: one engine serves one worker loop (onnxruntime parallelizes inside a
    call; see `intra_op_threads`). `intra_op_threads` bounds the threads of one step; for a graph
    with a loop (a recurrent layer's Scan), whose many small ops per time step can run slower on
    several threads, the first steps also run on one thread and the faster is kept (`step_threads`).
    """

    def __init__(self, model_path: str | os.PathLike[str], *, batch_size: int,
                 loss: str | None = "cross_entropy", device: str = "cpu",
                 include: Sequence[str] = (), exclude: Sequence[str] = (),
                 expect_parameters: int | None = None, seed: int | Sequence[int] = 0,
                 intra_op_threads: int | None = None, inter_op_threads: int | None = None,
                 cache_dir: str | os.PathLike[str] | None = None,
                 sparse_tables: Sequence[str] = (), sparse_min_rows: int | None = None,
                 sparse_min_bytes: int | None = None, dense_tables: Sequence[str] = (),
                 dynamic_tables: Sequence[str] = (),
                 input_gradients: Sequence[str] = ()) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        for name, threads in (("intra_op_threads", intra_op_threads),
                              ("inter_op_threads", inter_op_threads)):
            if threads is not None and (not isinstance(threads, int) or threads < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {threads!r}")
        if isinstance(include, str) or isinstance(exclude, str):
            raise TypeError("include and exclude are sequences of glob patterns, not strings")
        if expect_parameters is not None and (not isinstance(expect_parameters, int)
                                              or expect_parameters < 1):
            raise ValueError(f"expect_parameters must be a positive integer or None, got "
                             f"{expect_parameters!r}")
        self._expect = expect_parameters
        self._generator = np.random.default_rng(seed)   # Dropout masks
        self.model_path = Path(model_path)
        self.batch_size = batch_size
        self.device = device
        self._placement = placement(device)  # before the model is read: a bad device fails fast
        self._loss: LossSpec | None = None if loss is None else parse_loss(loss)
        self._threads = (intra_op_threads, inter_op_threads)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.cache_path: Path | None = None
        self.cache_hit = False
        self._graph: GradientGraph | None = None
        self._eval_session: ort.InferenceSession | None = None
        self._device_masks: DeviceMasks | None = None   # a CUDA engine's, made at its first step (device_masks.py)
        if isinstance(sparse_tables, str):
            raise TypeError("sparse_tables is a sequence of table names, not a string")
        if isinstance(dynamic_tables, str) or isinstance(dense_tables, str):
            raise TypeError("dynamic_tables and dense_tables are sequences of table names, not strings")
        self._dense_request = tuple(dense_tables)
        self._min_bytes = sparse_min_bytes
        # a dynamic table trains sparsely: it is named for stage "sparse" too
        self._dynamic_request = tuple(dynamic_tables)
        self._sparse_request = (tuple(dict.fromkeys([*sparse_tables, *dynamic_tables])), sparse_min_rows)
        if isinstance(input_gradients, str):
            raise TypeError("input_gradients is a sequence of input names, not a string")
        self.input_gradient_names: list[str] = list(input_gradients)
        self._forward_session: ort.InferenceSession | None = None
        self._build(include, exclude)

    # --- construction: the pipeline ---------------------------------------------------

    def _build(self, include: Sequence[str], exclude: Sequence[str]) -> None:
        """The stages, in order; the gradient model's own are in `_gradient_graph`."""
        named, min_rows = self._sparse_request
        self.sparse = SparsePlan({}, [])
        self.data_inputs: dict[str, tuple[np.dtype, tuple | None]] = {}   # set below, from the model as given
        if named or min_rows is not None or self._min_bytes is not None:
            # stage "sparse": each table's Gathers read only the batch's rows (engine/sparse.py); a table
            # in external data is mapped from its file, never read whole into the model
            model = read_model(self.model_path, external_data=False)
            self.data_inputs = data_inputs_of(model)
            # the exporter's records name the tables, which the rewrite renames (T.rows)
            padding, renamed = torch_padding_rows(model), torch_parameters_renamed_or_dropped(model)
            declared = declared_dynamic_tables(model) if self._min_bytes is not None else []
            dynamic = tuple(dict.fromkeys([*self._dynamic_request, *declared]))
            tables = find_sparse_tables(model, min_rows=min_rows, min_bytes=self._min_bytes,
                                        named=tuple(dict.fromkeys([*named, *declared])), exclude=self._dense_request,
                                        dynamic=dynamic)
            if tables:
                model, self.sparse = rewrite_sparse(model, tables, self.batch_size,
                                                    base_dir=self.model_path.parent, dynamic=dynamic)
            load_external_data(model, self.model_path.parent, where=f"model {self.model_path}")
            clamp_ir_version(model)
        else:
            model = load_model(self.model_path)
            self.data_inputs = data_inputs_of(model)
            padding, renamed = torch_padding_rows(model), torch_parameters_renamed_or_dropped(model)
        for name, row in padding.items():   # a table by rows: its row gradients keep that row at zero
            if name in self.sparse.tables:
                self.sparse.tables[name].padding_row = row
        check_registered_ops(model, str(self.model_path))
        keras_norms = folded_keras_batch_norms(model)
        if keras_norms:
            warn_caller(f"{self.model_path}: {folded_keras_batch_norms_warning(keras_norms)}")
        detaches = dropped_torch_detaches(model)
        if detaches:
            warn_caller(f"{self.model_path}: {dropped_detaches_warning(detaches)}")
        idle = idle_dropouts(model)
        if idle:
            warn_caller(f"{self.model_path}: {idle_dropouts_warning(idle)}")
        # before the opset upgrade, which drops the node metadata it reads
        restore_torch_training_batch_norms(model, str(self.model_path))
        model = upgrade_opset(model, self.model_path)
        self.trainable_names: list[str] = trainable_parameters(
            model, include=include, exclude=exclude, source=self.model_path,
            expect=self._expect)
        folded = folded_bias_layers(model, self.trainable_names)
        if folded:
            warn_caller(f"{self.model_path}: {folded_variables_warning(folded)}")
        if renamed:
            warn_caller(f"{self.model_path}: {renamed_or_dropped_warning(renamed)}")
        computed = folded_torch_parameters(model, self.trainable_names)
        if computed:
            warn_caller(f"{self.model_path}: {folded_torch_parameters_warning(computed)}")
        self._initial = initial_values(model, self.trainable_names)
        #: torch Embeddings' padding_idx rows (dynamo exports record them): their gradient is kept at zero
        self._padding_rows = {name: row for name, row in padding.items() if name in self._initial}
        bfloat16 = [name for name, value in self._initial.items() if value.dtype.name == "bfloat16"]
        if bfloat16:   # onnxruntime's Python API takes no ml_dtypes array: the first run failed with a bare
            # "Numpy_type 256 can't be converted to MLDataType"
            raise UnsupportedModelError(
                f"{self.model_path}: parameter(s) {bfloat16} are bfloat16, which onnxruntime's Python API cannot "
                f"be fed; store them as float32 or float16 (a job can still send float32 tensors as bfloat16 "
                f"over the wire: --wire-dtype bfloat16)")
        self.state_names: list[str] = state_initializers(model)
        self._state_initial = initial_values(model, self.state_names)
        self._lifted = lift_parameters(model, self.trainable_names + self.state_names)
        fed = set(self.trainable_names) | set(self.state_names)
        self.input_names: list[str] = [v.name for v in self._lifted.graph.input
                                       if v.name not in fed]
        self.output_names: list[str] = [v.name for v in self._lifted.graph.output]
        self._check_input_gradients()
        loss = self._loss
        if loss is None:
            return  # predict only: no gradient model, no cache entry
        self.cache_path = entry_path(self.cache_dir, self._lifted, batch_size=self.batch_size,
                                     loss=loss, trainable=self.trainable_names + self.state_names,
                                     inputs=self.input_gradient_names, target=self._placement.target)
        self._graph, self.cache_hit = cached_or_built(self.cache_path,
                                                      lambda: self._gradient_graph(loss))
        placed = self._for_placement(self._graph.model)      # once: the trial's one-thread session runs it too
        self._sessions = ThreadChoice(
            open_session(placed, self._placement, threads=self._threads, source=self.model_path),
            threads=self._threads[0],
            open_single=lambda: open_session(placed, self._placement, threads=(1, self._threads[1]),
                                             source=self.model_path),
            trial=self._placement.cuda_index is None and loops(placed))
        self._prepare_gradient_run(self._graph)

    def _for_placement(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """A model as this placement's session runs it (the gradient, forward or evaluation model): on the CPU,
        with the Convs that gain on onnxruntime's channel-blocked kernels moved there (rewrites/nchwc.py; only
        Convs of static shapes), DepthToSpace and ConvTransposes over small maps, strided or not, as Col2Im
        (rewrites/col2im.py), per-channel scales and shifts as BatchNormalization (rewrites/affine.py) and the
        gradients' Wheres over whole tensors as products (rewrites/masks.py), then pruned; on CUDA, with each
        ConvTranspose padded unequally given equal pads and a Slice (the CUDA provider has no kernel for it; the
        gradient graph, built for the target, has none left). A copy, so the cached graph is left as it was."""
        if self._placement.cuda_index is not None:
            if not any(n.op_type == "ConvTranspose" for n in model.graph.node):
                return model
            cuda = onnx.ModelProto()
            cuda.CopyFrom(model)
            equal_transposed_conv_pads(cuda)   # a model's own unequally padded ConvTranspose would run on the CPU
            return cuda
        block = nchwc_block_size()
        ops = {n.op_type for n in model.graph.node}
        if not ops & {"DepthToSpace", "ConvTranspose"} and not (block and "Conv" in ops) and \
                not ops & {"Mul", "Add", "Sub", "Where"}:
            return model
        cpu = onnx.ModelProto()
        cpu.CopyFrom(model)
        changed = depth_to_space_as_col2im(cpu) + small_transposed_convs_as_col2im(cpu)
        changed += selects_as_products(cpu, GRAD_PREFIX) if "Where" in ops else 0
        # before the blocked Convs, whose outputs onnx's shape inference cannot follow (their domain is
        # onnxruntime's): the affine pass matches static shapes only
        changed += channel_affines(cpu, self._threads[0])
        if block and "Conv" in ops:
            changed += block_convs(cpu, block)
        if not changed:
            return model
        prune(cpu)   # the shape constants of the nodes replaced: onnxruntime logs a warning for each unread one
        return cpu

    def _gradient_graph(self, loss: LossSpec) -> GradientGraph:
        """The stages that turn the lifted model into the gradient model, in order (run
        only when the cache has no entry for it)."""
        try:
            model, forms = training_form(self._lifted, self.state_names, scaled_masks=True)
            model = fix_batch(model, self.input_names + list(forms.dropout_rates),
                              self.batch_size)
            state_outputs = [v for v in model.graph.output
                             if v.name in forms.state_outputs.values()]
            wrt = self.trainable_names + self.input_gradient_names
            if loss.kind == "vjp":   # every float output seeded by a fed cotangent
                seeded = self.seeded_outputs()
                model = rewrite_forward(model, self._placement.target)
                model = differentiate(model, wrt, None, seeded=seeded)
                model = rewrite_adjoints(model, self._placement.target)
                return gradient_graph(model, "", None, self.trainable_names, forms,
                                      seeded=seeded, inputs=self.input_gradient_names)
            model, loss_output, labels = attach_loss(model, loss, self.batch_size)
            # the loss took the model's outputs; the running statistics' are outputs again before any pass prunes
            # what no output reads (the group norms' adjoints do, inside differentiate)
            model.graph.output.extend(state_outputs)
            model = rewrite_forward(model, self._placement.target)
            model = differentiate(model, wrt, loss_output)
            model = rewrite_adjoints(model, self._placement.target)
            return gradient_graph(model, loss_output, labels, self.trainable_names, forms,
                                  inputs=self.input_gradient_names)
        except UnsupportedModelError as exc:
            raise UnsupportedModelError(f"{self.model_path}: {exc}") from exc

    def _prepare_gradient_run(self, graph: GradientGraph) -> None:
        """Everything `gradients` needs per call, computed once."""
        session_inputs = {v.name: v for v in graph.model.graph.input}
        fed = set(self.trainable_names) | set(self.state_names) | set(graph.dropout_rates) \
            | set(graph.seed_inputs.values())
        self._feeds = {name: (element_dtype(value), declared_dims(value))
                       for name, value in session_inputs.items() if name not in fed}
        # a VJP's cotangents, by output name: (seed input, dtype, the output's dims)
        self._seeds = {output: (seed, element_dtype(session_inputs[seed]),
                                (declared_dims(session_inputs[seed]) or [None])[:-1])
                       for output, seed in graph.seed_inputs.items()}
        self.mask_names: list[str] = list(graph.dropout_rates)
        self._masks = {name: (element_dtype(session_inputs[name]),
                              declared_dims(session_inputs[name]), rate)
                       for name, rate in graph.dropout_rates.items()}
        self._has_loss = bool(graph.loss_output)   # a VJP has none
        self._fetches = [graph.loss_output] * self._has_loss + [
            graph.gradient_outputs[name] for name in self.trainable_names] + [
            graph.input_gradient_outputs[name] for name in self.input_gradient_names] + [
            graph.state_outputs[name] for name in self.state_names]
        # a gradient output has the shape its computing node gives it (onnx-ad's seed axis of 1 is
        # dropped where that saves a copy: rewrites/outputs.py); step() reshapes each to its parameter's
        declared = {v.name: declared_dims(v) for v in graph.model.graph.output}

        def bound_shape(output: str, shape: tuple[int, ...]) -> tuple[int, ...]:
            dims = declared.get(output)
            static = dims is not None and all(isinstance(d, int) for d in dims)
            return tuple(dims) if static else shape + (1,)

        specs = []
        if self._has_loss:
            loss_type = next(v for v in graph.model.graph.output if v.name == graph.loss_output)
            specs.append((graph.loss_output, element_dtype(loss_type), ()))
        specs += [(graph.gradient_outputs[name], self._initial[name].dtype,
                   bound_shape(graph.gradient_outputs[name], self._initial[name].shape))
                  for name in self.trainable_names]
        specs += [(graph.input_gradient_outputs[name], self._feeds[name][0],
                   bound_shape(graph.input_gradient_outputs[name], tuple(self._feeds[name][1])))
                  for name in self.input_gradient_names]
        specs += [(graph.state_outputs[name], value.dtype, value.shape)
                  for name, value in self._state_initial.items()]
        self._output_specs = specs
        self._bind_outputs = self._placement.cuda_index is not None
        self._classes: int | None = None
        if self._loss is not None and self._loss.kind == "cross_entropy":
            logits = declared_dims(self._lifted.graph.output[0])
            if logits and len(logits) >= 2 and isinstance(logits[1], int):   # (batch, classes, d1, ...)
                self._classes = logits[1]

    # --- public API ---------------------------------------------------------------------

    def parameters(self) -> dict[str, np.ndarray]:
        """The model's initial trainable values (copies), in `trainable_names` order."""
        return {name: value.copy() for name, value in self._initial.items()}

    def server_parameters(self) -> dict[str, np.ndarray]:
        """What the shards hold as values: `parameters()` with each sparse table whole in place of its rows
        parameter; a dynamic table is neither (the shards create its rows: `dynamic_tables()`).

        A table is the engine's own array, not a copy (read-only: a table in external data is
        mapped from its file, so a 10^7-row table costs no memory until it is sent)."""
        rows = {t.rows_name for t in self.sparse.tables.values()}
        out = {name: value for name, value in self.parameters().items() if name not in rows}
        out.update({name: t.initial for name, t in self.sparse.tables.items() if not t.dynamic})
        return out

    def dynamic_tables(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """{table: (row shape, dtype)} of the tables the shards hold as dynamic tables (docs/protocol.md,
        "Dynamic tables"): rows keyed by any int64 id, created on first use."""
        return {name: (tuple(t.shape[1:]), t.initial.dtype) for name, t in self.sparse.tables.items() if t.dynamic}

    def state(self) -> dict[str, np.ndarray]:
        """The model's initial state values (copies), in `state_names` order: the running
        statistics of training-mode BatchNormalization, fed like parameters, never
        differentiated; `step` returns their new values."""
        return {name: value.copy() for name, value in self._state_initial.items()}

    def gradients(self, parameters: Mapping[str, np.ndarray],
                  inputs: Mapping[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
        """The loss and its gradient with respect to every trainable parameter (`step`
        without the new state)."""
        result = self.step(parameters, inputs)
        return result.loss, result.gradients

    def step(self, parameters: Mapping[str, np.ndarray],
             inputs: Mapping[str, np.ndarray],
             cotangents: Mapping[str, np.ndarray] | None = None) -> StepResult:
        """The loss, its gradient with respect to every trainable parameter (and to each of
        `input_gradient_names`), and the new value of every state tensor.

        `parameters` holds a value for every name in `trainable_names` and `state_names`;
        `inputs` holds every model input (batch axis 0 of length `batch_size`) and, when a
        loss with labels was attached, "labels". A Dropout mask (`mask_names`) may be given
        too (1 keeps an element, 0 drops it); one not given is drawn from the engine's
        generator (`seed`). Float data is cast to the model's float type. Raises ValueError
        naming the input and the expected and received shapes on any mismatch.

        With loss="vjp", `cotangents` holds one array per `seeded_outputs()` name, shaped
        like that output: the gradients are then those of sum(output * cotangent), and
        the result's loss is 0.0 (a vector-Jacobian product has none).
        """
        if self._graph is None:
            raise RuntimeError("this engine was built with loss=None and computes no "
                               "gradients; pass loss='cross_entropy', 'mse' or 'output:NAME'")
        feed = parameter_feed(parameters, {**self._initial, **self._state_initial})
        on_gpu: dict[str, ort.OrtValue] = {}
        if self._placement.cuda_index is not None and self._masks and not set(self._masks) & set(inputs):
            on_gpu = self._gpu_masks()
        else:
            feed.update(self._mask_feed(inputs))
        feed.update(self._seed_feed(cotangents))
        unknown = set(inputs) - set(self._feeds) - set(self._masks)
        if unknown:
            raise ValueError(f"unknown inputs {sorted(unknown)}; the model takes "
                             f"{sorted(self._feeds)}")
        for name, (dtype, dims) in self._feeds.items():
            if name not in inputs:
                raise ValueError(f"input {name!r} is missing; expected shape "
                                 f"{shown(dims)} of {dtype}")
            what = "labels" if name == self._graph.labels else f"input {name!r}"
            array = coerce(what, inputs[name], dtype)
            check_shape(what, array, dims)
            feed[name] = array
        if self._classes is not None and self._graph.labels is not None:
            labels = feed[self._graph.labels]
            if labels.size and (labels.min() < 0 or labels.max() >= self._classes):
                raise ValueError(f"labels must lie in [0, {self._classes}), got values in "
                                 f"[{labels.min()}, {labels.max()}]")
        if self._bind_outputs:
            results = self._sessions.run(lambda session: run_bound(session, feed, self._output_specs, on_gpu))
        else:
            results = self._sessions.run(lambda session: session.run(self._fetches, feed))
        loss = float(results[0]) if self._has_loss else 0.0
        rest = iter(results[1:] if self._has_loss else results)
        gradients = {name: next(rest).reshape(self._initial[name].shape)
                     for name in self.trainable_names}
        for name, row in self._padding_rows.items():
            gradients[name][row] = 0
        wrt_inputs = {name: next(rest).reshape(feed[name].shape) for name in self.input_gradient_names}
        state = {name: next(rest) for name in self.state_names}
        return StepResult(loss, gradients, state, wrt_inputs)

    def _seed_feed(self, cotangents: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """The VJP's seed inputs from `cotangents` (checked: every seeded output, its shape)."""
        given = dict(cotangents or {})
        if not self._seeds:
            if given:
                raise ValueError(f"cotangents {sorted(given)} given, but this engine's loss is "
                                 f"{self._loss.key() if self._loss else None}, not 'vjp'")
            return {}
        unknown = set(given) - set(self._seeds)
        if unknown:
            raise ValueError(f"cotangents for {sorted(unknown)}, which are not seeded outputs; "
                             f"the seeded outputs are {sorted(self._seeds)}")
        feed = {}
        for output, (seed, dtype, dims) in self._seeds.items():
            if output not in given:
                raise ValueError(f"the cotangent of output {output!r} is missing; expected "
                                 f"shape {shown(dims)} of {dtype}")
            array = coerce(f"cotangent of {output!r}", given[output], dtype)
            check_shape(f"cotangent of {output!r}", array, dims)
            feed[seed] = array[..., None]
        return feed

    def seeded_outputs(self) -> list[str]:
        """The outputs a loss="vjp" engine takes cotangents for: every floating-point output."""
        return [v.name for v in self._lifted.graph.output
                if v.type.tensor_type.elem_type in FLOAT_TYPES]

    def _check_input_gradients(self) -> None:
        declared = {v.name: v for v in self._lifted.graph.input}
        for name in self.input_gradient_names:
            if name not in self.input_names:
                raise ValueError(f"input_gradients names {name!r}, which is not a data input of "
                                 f"{self.model_path}; its inputs are {self.input_names}")
            if declared[name].type.tensor_type.elem_type not in FLOAT_TYPES:
                raise ValueError(f"input_gradients names {name!r}, which is not a floating-point "
                                 f"input: it has no gradient")

    def forward(self, parameters: Mapping[str, np.ndarray], inputs: Mapping[str, np.ndarray]
                ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The model's outputs as training computes them, and the new state: (outputs, state).

        Unlike `predict`, the training form: BatchNormalization with the batch's statistics,
        Dropout with the masks in `inputs` (or drawn, as `step` draws them), at this
        engine's batch size. A pipeline stage runs it to send its activations on, then `step`
        (loss="vjp") with the same inputs and masks for their gradients.
        """
        if self._graph is None:
            raise RuntimeError("this engine was built with loss=None and has no training form; "
                               "`predict` runs the model")
        if self._forward_session is None:
            model, forms = training_form(self._lifted, self.state_names, scaled_masks=True)
            model = fix_batch(model, self.input_names + list(forms.dropout_rates), self.batch_size)
            self._forward_fetches = self.output_names + [forms.state_outputs[name]
                                                         for name in self.state_names]
            self._forward_inputs = {v.name: (element_dtype(v), declared_dims(v))
                                    for v in model.graph.input}
            self._forward_session = open_session(self._for_placement(model), self._placement,
                                                 threads=self._threads, source=self.model_path)
        feed = parameter_feed(parameters, {**self._initial, **self._state_initial})
        feed.update(self._mask_feed(inputs))
        unknown = set(inputs) - set(self.input_names) - set(self._masks) - {"labels"}
        if unknown:
            raise ValueError(f"unknown inputs {sorted(unknown)}; the model takes {self.input_names}")
        for name in self.input_names:
            dtype, dims = self._forward_inputs[name]
            if name not in inputs:
                raise ValueError(f"input {name!r} is missing; expected shape {shown(dims)} of {dtype}")
            array = coerce(f"input {name!r}", inputs[name], dtype)
            check_shape(f"input {name!r}", array, dims)
            feed[name] = array
        results = self._forward_session.run(self._forward_fetches, feed)
        count = len(self.output_names)
        return (dict(zip(self.output_names, results[:count])),
                dict(zip(self.state_names, results[count:])))

    def feed_specs(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """What `step` takes besides parameters, state and masks: every input and the labels,
        name -> (dtype, shape at this engine's batch size)."""
        if self._graph is None:
            raise RuntimeError("this engine was built with loss=None and takes no batches")
        return {name: (dtype, tuple(d if isinstance(d, int) else self.batch_size
                                    for d in dims or ()))
                for name, (dtype, dims) in self._feeds.items()}

    def feed_dims(self) -> dict[str, tuple[int | str | None, ...] | None]:
        """Like `feed_specs`, the shapes as the gradient model declares them: axis 0 is the batch
        size, an axis of any length is a name or None (None for no shape at all)."""
        if self._graph is None:
            raise RuntimeError("this engine was built with loss=None and takes no batches")
        return {name: None if dims is None else tuple(dims) for name, (_, dims) in self._feeds.items()}

    @property
    def takes_labels(self) -> bool:
        """Whether `step` takes the data's labels: a loss with labels is attached (not loss="output:NAME", "vjp"
        or None)."""
        return self._graph is not None and "labels" in self._feeds

    @property
    def step_threads(self) -> int | None:
        """The intra-op threads the gradient step runs on: `intra_op_threads` as given (None: onnxruntime's
        default), or 1 once the first steps measured one thread faster for a graph that loops (a recurrent
        layer's Scan; thread_choice.py). None too for an engine built with loss=None."""
        return None if self._graph is None else self._sessions.threads

    @property
    def providers(self) -> list[str]:
        """The onnxruntime execution providers the gradient step's session runs on, first the preferred
        (["CUDAExecutionProvider", "CPUExecutionProvider"] on a GPU: nodes CUDA has no kernel for run on the
        CPU); for an engine built with loss=None, its `predict` session's, or the placement's before one opens."""
        session = self._sessions.session if self._graph is not None else self._eval_session
        if session is not None:
            return list(session.get_providers())
        return [p if isinstance(p, str) else p[0] for p in self._placement.providers]

    @property
    def trying_threads(self) -> bool:
        """Whether the steps still alternate between the threads asked for and one thread (the first dozen
        steps of a graph that loops, `step_threads`); a benchmark warms the engine until this is False."""
        return self._graph is not None and self._sessions.deciding

    @property
    def loss_kind(self) -> str | None:
        """The attached loss: "cross_entropy", "bce", "mse", "output", "vjp", or None (predict only)."""
        return None if self._loss is None else self._loss.kind

    @property
    def output_activation(self) -> str | None:
        """"softmax" or "sigmoid" when the first output is probabilities (loss.probability_output) -- with a loss,
        only when it is the loss that reads their logits (cross-entropy, binary cross-entropy); else None."""
        return probability_output(self._lifted, None if self._loss is None else self._loss.kind)

    @property
    def num_classes(self) -> int | None:
        """The classes of a cross-entropy loss (the logits' width), when the model says."""
        return self._classes if self._graph is not None else None

    def draw_masks(self) -> dict[str, np.ndarray]:
        """A fresh Dropout mask (1 keeps an element, 0 drops it) for every `mask_names` entry,
        from the engine's generator (what `step` draws for a mask it is not given)."""
        return {name: self._draw_mask(name, scaled=False) for name in self._masks}

    def _mask_shape(self, name: str) -> tuple[int, ...]:
        """The shape of the Dropout mask `name` at this engine's batch size."""
        return tuple(d if isinstance(d, int) else self.batch_size for d in self._masks[name][1] or ())

    def _gpu_masks(self) -> dict[str, ort.OrtValue]:
        """A step's scaled masks drawn on the GPU, left there (device_masks.py: drawn and copied from the host,
        a model with many Dropouts spent most of its GPU step on them)."""
        if self._device_masks is None:
            self._device_masks = DeviceMasks({name: (dtype, self._mask_shape(name), rate)
                                              for name, (dtype, _, rate) in self._masks.items()},
                                             self._placement, self._generator)
        return self._device_masks.draw()

    def _draw_mask(self, name: str, *, scaled: bool) -> np.ndarray:
        """One Dropout's mask from the generator: each element kept with probability 1 - ratio,
        a 32-bit draw at or above ratio * 2**32; 1 where kept, or 1 / (1 - ratio) when `scaled`."""
        dtype, _, rate = self._masks[name]
        shape = self._mask_shape(name)
        count = int(np.prod(shape))
        # the generator's raw 64-bit words, two 32-bit draws each: a third of the time of
        # Generator.random's doubles, which every step paid for every masked element
        draws = self._generator.bit_generator.random_raw(-(-count // 2)).view(np.uint32)[:count]
        kept = (draws >= np.uint32(min(math.ceil(rate * 2.0 ** 32), 2 ** 32 - 1))).reshape(shape)
        if scaled:
            return np.multiply(kept, dtype.type(1.0 / (1.0 - rate)), dtype=dtype)
        return kept.astype(dtype)

    def _mask_feed(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each Dropout's mask as the sessions take it, over the keep rate (the training form's
        `scaled_masks`): the caller's 0/1 mask (checked) scaled, else one drawn scaled."""
        feed = {}
        for name, (dtype, dims, rate) in self._masks.items():
            if name in inputs:
                mask = coerce(f"mask {name!r}", inputs[name], dtype)
                check_shape(f"mask {name!r}", mask, dims)
                feed[name] = mask * dtype.type(1.0 / (1.0 - rate)) if rate else mask
            else:
                feed[name] = self._draw_mask(name, scaled=True)
        return feed

    def predict(self, parameters: Mapping[str, np.ndarray],
                inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's outputs for `inputs` at `parameters`, any batch size.

        Runs the model itself (no loss, no gradient), keeping its own batch axis; a model
        exported with a fixed batch size is run on zero-padded chunks of that size.
        """
        if self._eval_session is None:
            self._eval_session = open_session(self._for_placement(inference_form(self._lifted)), self._placement,
                                              threads=self._threads, source=self.model_path)
        feed = parameter_feed(parameters, {**self._initial, **self._state_initial})
        declared = {v.name: v for v in self._lifted.graph.input}
        unknown = set(inputs) - set(self.input_names) - {"labels"}
        if unknown:
            raise ValueError(f"unknown inputs {sorted(unknown)}; the model takes "
                             f"{self.input_names}")
        batch: int | None = None
        for name in self.input_names:
            if name not in inputs:
                raise ValueError(f"input {name!r} is missing; expected shape "
                                 f"{shown(declared_dims(declared[name]))}")
            array = coerce(f"input {name!r}", inputs[name], element_dtype(declared[name]))
            check_shape(f"input {name!r}", array, declared_dims(declared[name]),
                        free_batch=True)
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

    def _fixed_batch(self) -> int | None:
        """The model's own batch size when its first shaped input fixes axis 0, else None."""
        for name in self.input_names:
            value = next(v for v in self._lifted.graph.input if v.name == name)
            dims = declared_dims(value)
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
