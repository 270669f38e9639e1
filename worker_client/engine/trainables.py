"""Stage "trainables": which initializers train, and a warning for each one shared by layers."""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from ps_common.errors import UnsupportedModelError
from worker_client.engine.exporters import DYNAMO_REMEDY, merged_torch_parameters, merged_warning
from worker_client.engine.selection import (FLOAT_TYPES, TF2ONNX, classify, consumers, from_torch_dynamo,
                                            names_torch_parameter)
from worker_client.engine.support import nodes_listed, warn_caller

__all__ = ["FLOAT_TYPES", "initial_values", "keras_layer_shares", "select_trainable", "shared_parameters",
           "tie_warning", "trainable_parameters"]

#: Ops that hold a layer's own weights; one initializer feeding two of them ties two layers.
LAYER_OPS = frozenset({"Gemm", "MatMul", "Conv", "ConvTranspose", "Einsum", "Gather", "Add",
                       "Mul", "LayerNormalization", "BatchNormalization", "GroupNormalization",
                       "InstanceNormalization", "RMSNormalization", "PRelu"})
#: Ops that hand a weight on unchanged in value; a tie is looked for through them.
PASS_THROUGH = frozenset({"Identity", "Cast", "Transpose", "Reshape", "Flatten", "Squeeze",
                          "Unsqueeze"})
#: The characters that make an include pattern a wildcard rather than one exact name.
_WILDCARDS = frozenset("*?[")

#: Fewest elements a shared parameter needs to be reported as tied (one-element ones are not).
_TIE_MIN_ELEMENTS = 2

_EXPORT_HINT = ("torch.onnx.export(..., training=torch.onnx.TrainingMode.TRAINING, "
                "do_constant_folding=False)")


def trainable_parameters(model: onnx.ModelProto, *, include: Sequence[str],
                         exclude: Sequence[str], source: str | os.PathLike[str],
                         expect: int | None = None) -> list[str]:
    """The names of the parameters to train (see `select_trainable`), in initializer order.

    Raises UnsupportedModelError when none is left, or when `expect` is given and differs
    from how many there are; warns for each one that several layers share
    (`shared_parameters`). `source` names the model file in both.
    """
    names = select_trainable(model, include=include, exclude=exclude)
    if not names:
        raise UnsupportedModelError(
            f"{source}: no trainable parameters (floating-point initializers) "
            f"match include={list(include)} exclude={list(exclude)}")
    if expect is not None and len(names) != expect:
        raise UnsupportedModelError(
            f"{source}: expected {expect} trainable parameters, but the model has "
            f"{len(names)}: {_listed(model, names)}. If the exporter folded some away "
            f"(tf2onnx folds zero- or one-initialized Keras variables into constants), "
            f"re-export with the recipe in docs/models.md; if the rule picked a constant "
            f"or missed a weight, name them with include / exclude patterns")
    dynamo = from_torch_dynamo(model)
    merged = merged_torch_parameters(model, names)   # a dynamo export's record says which ties torch had
    for name, strangers in merged.items():
        warn_caller(f"{source}: {merged_warning(name, strangers)}")
    # a torch parameter of a dynamo export: its sharing is torch's own (tied embeddings), or merged, said above
    uses = consumers(model.graph) if dynamo else {}
    untold = [name for name in names if not names_torch_parameter(name, uses)]
    for name, nodes in shared_parameters(model, untold).items():
        if model.producer_name == TF2ONNX and keras_layer_shares(name, nodes):
            continue
        warn_caller(f"{source}: {tie_warning(name, nodes, dynamo=dynamo)}")
    return names


def keras_layer_shares(name: str, nodes: Sequence[onnx.NodeProto]) -> bool:
    """Whether a tf2onnx initializer and every node reading it lie in one Keras layer's scope, as the TensorFlow
    names tf2onnx keeps say ("functional_1/time_distributed_1/..."): the layer applies its own variable several
    times (TimeDistributed, one per time step), a sharing Keras has itself -- not equal values tf2onnx merged,
    which come from different layers."""
    parts = name.split("/")
    if len(parts) < 3:
        return False
    scope = "/".join(parts[:2]) + "/"
    return all(node.name.startswith(scope) for node in nodes)


def _listed(model: onnx.ModelProto, names: Sequence[str]) -> str:
    dims = {t.name: tuple(t.dims) for t in model.graph.initializer}
    return ", ".join(f"{name} {dims[name]}" for name in names)


def initial_values(model: onnx.ModelProto, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The values the model file holds for the initializers `names`, in that order."""
    initial = {t.name: t for t in model.graph.initializer}
    return {name: numpy_helper.to_array(initial[name]) for name in names}


def select_trainable(model: onnx.ModelProto, *, include: Sequence[str] = (),
                     exclude: Sequence[str] = ()) -> list[str]:
    """Names of the trainable initializers, in initializer order.

    The candidates are the initializers `selection.classify` calls parameters. A non-empty
    `include` keeps the candidates matching one of its glob patterns, and a pattern without
    wildcards that names a constant exactly trains that constant too (the way to override
    the rule: ``include=["*", "temperature"]``); `exclude` then drops those matching one of
    its own. Raises UnsupportedModelError for an include pattern that matches no
    floating-point initializer, or that names running statistics, which never train.
    """
    roles = classify(model)
    for pattern in include:
        matched = [name for name in roles if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise UnsupportedModelError(
                f"include pattern {pattern!r} matches no floating-point initializer; the "
                f"model's are {list(roles)}")
        if _is_exact(pattern) and roles[pattern].kind == "state":
            raise UnsupportedModelError(
                f"include names {pattern!r}, which is state "
                f"({roles[pattern].reason}), not a trainable parameter")
    chosen = []
    for name, role in roles.items():
        if include:
            named = any(_is_exact(p) and p == name for p in include)
            if not named and (role.kind != "parameter" or not any(
                    fnmatch.fnmatchcase(name, p) for p in include)):
                continue
        elif role.kind != "parameter":
            continue
        if any(fnmatch.fnmatchcase(name, p) for p in exclude):
            continue
        chosen.append(name)
    return chosen


def _is_exact(pattern: str) -> bool:
    return not _WILDCARDS & set(pattern)


def shared_parameters(model: onnx.ModelProto,
                      names: Iterable[str]) -> dict[str, list[onnx.NodeProto]]:
    """Parameters (of two or more elements) that feed two or more layer nodes.

    A weight is followed through value-preserving ops (Identity, Transpose, Reshape, ...),
    which is how torch.onnx.export's eval-mode initializer de-duplication wires one merged
    initializer into every layer that held the same values.
    """
    graph = model.graph
    uses = consumers(graph)
    sizes = {t.name: int(np.prod(t.dims, dtype=np.int64)) for t in graph.initializer}
    shared = {}
    for name in names:
        if sizes.get(name, 0) < _TIE_MIN_ELEMENTS:
            continue
        layers: dict[int, onnx.NodeProto] = {}
        frontier, seen = [name], {name}
        while frontier:
            tensor = frontier.pop()
            for node, index in uses.get(tensor, []):
                if node.op_type in PASS_THROUGH and index == 0:
                    fresh = [out for out in node.output if out and out not in seen]
                    seen.update(fresh)
                    frontier.extend(fresh)
                elif node.op_type in LAYER_OPS:
                    layers[id(node)] = node
        if len(layers) >= 2:
            shared[name] = list(layers.values())
    return shared


def tie_warning(name: str, nodes: Sequence[onnx.NodeProto], *, dynamo: bool = False) -> str:
    """The text of the warning about one parameter shared by several layers; `dynamo`: the model is from
    torch.onnx's dynamo exporter, whose optimizer merges equal-valued initializers in any mode."""
    listed = nodes_listed(nodes)
    cause = (f"If the model came from torch.onnx.export in eval mode, the exporter merged parameters that held "
             f"equal values (fresh LayerNorms, zero biases) into one initializer: re-export with {_EXPORT_HINT}"
             if not dynamo else
             "torch.onnx.export's dynamo exporter (the default since torch 2.9) merges parameters that hold equal "
             f"values (fresh LayerNorms, zero biases) into one initializer when it optimizes the graph: re-{DYNAMO_REMEDY}")
    return (f"initializer {name!r} feeds {len(nodes)} layers: {listed}; they are trained as "
            f"one tied parameter. {cause}. Ignore this "
            f"warning if the sharing is intended (tied embeddings), or exclude the "
            f"initializer if it is a constant")
