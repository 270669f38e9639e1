"""Stage "trainables": which initializers train, and a warning for each one shared by layers."""

from __future__ import annotations

import fnmatch
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ps_common.errors import UnsupportedModelError
from worker_client.engine.support import node_label, warn_caller

__all__ = ["FLOAT_TYPES", "initial_values", "select_trainable", "shared_parameters",
           "tie_warning", "trainable_parameters"]

#: Element types a parameter can have.
FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16,
                         TensorProto.BFLOAT16})
#: Ops that hold a layer's own weights; one initializer feeding two of them ties two layers.
LAYER_OPS = frozenset({"Gemm", "MatMul", "Conv", "ConvTranspose", "Einsum", "Gather", "Add",
                       "Mul", "LayerNormalization", "BatchNormalization", "GroupNormalization",
                       "InstanceNormalization", "RMSNormalization", "PRelu"})
#: Ops that hand a weight on unchanged in value; a tie is looked for through them.
PASS_THROUGH = frozenset({"Identity", "Cast", "Transpose", "Reshape", "Flatten", "Squeeze",
                          "Unsqueeze"})

#: BatchNormalization's input indices of its running mean and variance: not trainable.
_RUNNING_STATISTICS = (3, 4)
#: Fewest elements a shared parameter needs to be reported as tied (one-element ones are not).
_TIE_MIN_ELEMENTS = 2

_EXPORT_HINT = ("torch.onnx.export(..., training=torch.onnx.TrainingMode.TRAINING, "
                "do_constant_folding=False)")


def trainable_parameters(model: onnx.ModelProto, *, include: Sequence[str],
                         exclude: Sequence[str], source: str | os.PathLike[str]) -> list[str]:
    """The names of the parameters to train (see `select_trainable`), in initializer order.

    Raises UnsupportedModelError when none is left; warns for each one that several layers
    share (`shared_parameters`). `source` names the model file in both.
    """
    names = select_trainable(model, include=include, exclude=exclude)
    if not names:
        raise UnsupportedModelError(
            f"{source}: no trainable parameters (floating-point initializers) "
            f"match include={list(include)} exclude={list(exclude)}")
    for name, nodes in shared_parameters(model, names).items():
        warn_caller(f"{source}: {tie_warning(name, nodes)}")
    return names


def initial_values(model: onnx.ModelProto, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The values the model file holds for the initializers `names`, in that order."""
    initial = {t.name: t for t in model.graph.initializer}
    return {name: numpy_helper.to_array(initial[name]) for name in names}


def _consumers(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    """Tensor name -> the (node, input index) pairs reading it in the top-level graph."""
    found: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name:
                found[name].append((node, index))
    return found


def _statistics_only(graph: onnx.GraphProto, name: str,
                     consumers: dict[str, list[tuple[onnx.NodeProto, int]]]) -> bool:
    """Whether `name` only ever reaches BatchNormalization's running mean or variance."""
    uses = consumers.get(name, [])
    if not uses:
        return False
    for node, index in uses:
        if node.op_type == "Identity":
            if not _statistics_only(graph, node.output[0], consumers):
                return False
        elif not (node.op_type == "BatchNormalization" and index in _RUNNING_STATISTICS):
            return False
    return True


def select_trainable(model: onnx.ModelProto, *, include: Sequence[str] = (),
                     exclude: Sequence[str] = ()) -> list[str]:
    """Names of the trainable initializers, in initializer order.

    Every floating-point initializer is a candidate, except BatchNormalization running
    statistics (they are not differentiable operands). A non-empty `include` keeps the
    candidates matching one of its glob patterns; `exclude` then drops those matching one of
    its own.
    """
    graph = model.graph
    consumers = _consumers(graph)
    chosen = []
    for tensor in graph.initializer:
        if tensor.data_type not in FLOAT_TYPES or _statistics_only(graph, tensor.name,
                                                                    consumers):
            continue
        if include and not any(fnmatch.fnmatchcase(tensor.name, p) for p in include):
            continue
        if any(fnmatch.fnmatchcase(tensor.name, p) for p in exclude):
            continue
        chosen.append(tensor.name)
    return chosen


def shared_parameters(model: onnx.ModelProto,
                      names: Iterable[str]) -> dict[str, list[onnx.NodeProto]]:
    """Parameters (of two or more elements) that feed two or more layer nodes.

    A weight is followed through value-preserving ops (Identity, Transpose, Reshape, ...),
    which is how torch.onnx.export's eval-mode initializer de-duplication wires one merged
    initializer into every layer that held the same values.
    """
    graph = model.graph
    consumers = _consumers(graph)
    sizes = {t.name: int(np.prod(t.dims, dtype=np.int64)) for t in graph.initializer}
    shared = {}
    for name in names:
        if sizes.get(name, 0) < _TIE_MIN_ELEMENTS:
            continue
        layers: dict[int, onnx.NodeProto] = {}
        frontier, seen = [name], {name}
        while frontier:
            tensor = frontier.pop()
            for node, index in consumers.get(tensor, []):
                if node.op_type in PASS_THROUGH and index == 0:
                    fresh = [out for out in node.output if out and out not in seen]
                    seen.update(fresh)
                    frontier.extend(fresh)
                elif node.op_type in LAYER_OPS:
                    layers[id(node)] = node
        if len(layers) >= 2:
            shared[name] = list(layers.values())
    return shared


def tie_warning(name: str, nodes: Sequence[onnx.NodeProto]) -> str:
    """The text of the warning about one parameter shared by several layers."""
    listed = ", ".join(f"{node_label(n)} ({n.op_type})" for n in nodes)
    return (f"initializer {name!r} feeds {len(nodes)} layers: {listed}; they are trained as "
            f"one tied parameter. If the model came from torch.onnx.export in eval mode, "
            f"the exporter merged parameters that held equal values (fresh LayerNorms, zero "
            f"biases) into one initializer: re-export with {_EXPORT_HINT}. Ignore this "
            f"warning if the sharing is intended (tied embeddings), or exclude the "
            f"initializer if it is a constant")
