"""What exporters do to a model that training would not notice: variables folded away.

tf2onnx freezes a Keras model before converting it, and TensorFlow's graph optimizer then
simplifies ``x + 0`` to ``x`` and ``x * 1`` to ``x``: a Dense or Conv bias initialized to
zeros, or a LayerNormalization's beta, is no longer in the graph and cannot train. Nothing
in the ONNX file says a variable was there; the one trace is a weight layer with no bias
after it. `folded_bias_layers` finds those, and the engine warns about them.

torch.onnx.export's dynamo exporter (its default since torch 2.9) records on each node the
torch op it came from (`pkg.torch.onnx.fx_node`), and writes a BatchNorm that ran in training
mode as an inference BatchNormalization: with `optimize=False` the node keeps its own running
statistics, and `restore_torch_training_batch_norms` puts it back in training mode; with the
default `optimize=True`, onnxscript's rewriter folds it into the Conv or Gemm before it, or
merges its running statistics with equal-valued parameters (its own weight and bias, at
first), and the model can only be refused: it would train without that BatchNorm. A BatchNorm
without running statistics (track_running_stats=False) is written as an inference one fed the
batch's statistics, computed in the graph; it too is put in training mode, which computes the
same statistics and differentiates through them. The same
optimizer merges other parameters with equal values (`merged_torch_parameters`), drops or
renames some (`torch_parameters_renamed_or_dropped`), and writes literals as initializers
(selection.py, rule 5, makes those constants); the engine warns about the first two.

torch.onnx's legacy exporter, exporting in training mode, writes nn.MultiheadAttention's dropout of the
attention weights without the training flag the model's other Dropouts have: the identity. `idle_dropouts`
finds those, and the engine warns about them.
"""

from __future__ import annotations

import re
from collections.abc import Collection

import onnx
from onnx import helper

from ps_common.errors import UnsupportedModelError
from worker_client.engine.rewrites.detaches import is_torch_detach
from worker_client.engine.rewrites.toolkit import constants, subgraphs
from worker_client.engine.selection import (TF2ONNX, TORCH_FX_NODE, TORCH_PRODUCER, VALUE_PRESERVING, consumers,
                                            from_torch_dynamo, node_metadata, only_running_statistics,
                                            reads_torch_parameter, torch_export_name)
from worker_client.engine.support import node_label, nodes_listed

__all__ = ["DYNAMO_REMEDY", "dropped_detaches_warning", "dropped_torch_detaches", "folded_bias_layers",
           "idle_dropouts", "idle_dropouts_warning",
           "folded_keras_batch_norms", "folded_keras_batch_norms_warning", "folded_torch_parameters",
           "folded_torch_parameters_warning", "folded_variables_warning",
           "from_torch_dynamo", "merged_torch_parameters", "merged_warning", "renamed_or_dropped_warning",
           "restore_torch_training_batch_norms", "torch_origin", "torch_padding_rows",
           "torch_parameters_renamed_or_dropped"]

#: Node metadata the dynamo exporter writes besides the torch.fx node a node came from (TORCH_FX_NODE): its module
#: scopes, and the onnxscript rewrite rule that produced it (when one did).
_SCOPES, _RULE = "pkg.torch.onnx.name_scopes", "pkg.onnxscript.rewriter.rule_name"
#: The aten batch norms that take a `training` flag (the sixth argument).
_FLAGGED_BATCH_NORMS = ("batch_norm", "native_batch_norm", "_batch_norm_impl_index")
#: In the dynamo exporter's record of a node: the torch.fx node's own name, its arguments, and a detach() among them.
_FX_NAME = re.compile(r"%(\w+) :")
_FX_ARGUMENTS = re.compile(r"\]\(args = \((.*)\), kwargs")
_DETACH_NAME = re.compile(r"%(detach(?:_\d+)?)\b")
#: What every message about the dynamo exporter's optimizer tells the user to do.
DYNAMO_REMEDY = ("export with dynamo=False as docs/models.md (\"Exporter recipes\") says, or with dynamo=True and "
                 "optimize=False")

#: Weight layers and the input index of their own bias, if the op has one.
_WEIGHT_LAYERS = {"MatMul": None, "Gemm": 2, "Conv": 2, "ConvTranspose": 2}


def folded_bias_layers(model: onnx.ModelProto,
                       trainable: Collection[str]) -> list[onnx.NodeProto]:
    """The weight layers of a tf2onnx model whose trainable weight has no bias after it
    (neither their own bias input nor an Add of a trainable value); [] for other producers."""
    if model.producer_name != TF2ONNX:
        return []
    uses = consumers(model.graph)
    trainable = set(trainable)
    found = []
    for node in model.graph.node:
        if node.op_type not in _WEIGHT_LAYERS or len(node.input) < 2 or \
                node.input[1] not in trainable:
            continue
        own_bias = _WEIGHT_LAYERS[node.op_type]
        if own_bias is not None and len(node.input) > own_bias and node.input[own_bias]:
            continue
        if not _biased(node.output[0], uses, trainable):
            found.append(node)
    return found


def _biased(value: str, uses, trainable: set[str]) -> bool:
    """Whether `value` (or a value-preserving view of it) is added to a trainable value."""
    for node, index in uses.get(value, []):
        if node.op_type == "Add" and len(node.input) == 2 and \
                node.input[1 - index] in trainable:
            return True
        if node.op_type in VALUE_PRESERVING and index == 0 and \
                _biased(node.output[0], uses, trainable):
            return True
    return False


def folded_variables_warning(layers: list[onnx.NodeProto]) -> str:
    """The warning about `layers` (from `folded_bias_layers`)."""
    listed = nodes_listed(layers)
    return (f"{len(layers)} weight layer(s) of this tf2onnx model have no bias: {listed}. If "
            f"the Keras layers had one (use_bias=True, the default), tf2onnx folded the "
            f"zero-initialized bias away and it will not train; LayerNormalization's beta "
            f"goes the same way. Re-export with the marker recipe in docs/models.md, or "
            f"pass --expect-parameters N to make a mismatch an error")


#: The TensorFlow op names a Keras BatchNormalization layer leaves on the nodes tf2onnx writes for it: Keras 3 spells
#: the layer's inference form out ("<layer>/batchnorm/mul_1"), Keras 2 calls FusedBatchNormV3 ("<layer>/FusedBatch...").
_KERAS_BATCH_NORM = re.compile(r"^(.*?)/(?:batchnorm/|FusedBatchNorm)")


def _first_five(names: list[str]) -> str:
    """`names` for a message: the first five, and how many more."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def folded_keras_batch_norms(model: onnx.ModelProto) -> list[str]:
    """The Keras BatchNormalization layers of a tf2onnx model, by their node names, when no BatchNormalization node
    is left of them: tf2onnx exports the inference graph, in which a BatchNormalization is a per-channel scale and
    shift by its moving statistics, and folds that into the Conv or MatMul beside it. [] for other producers."""
    if model.producer_name != TF2ONNX or any(n.op_type == "BatchNormalization" for n in model.graph.node):
        return []
    layers = (_KERAS_BATCH_NORM.match(node.name) for node in model.graph.node)
    return list(dict.fromkeys(match.group(1) for match in layers if match))


def folded_keras_batch_norms_warning(layers: list[str]) -> str:
    """The warning about `layers` (from `folded_keras_batch_norms`)."""
    return (f"{len(layers)} Keras BatchNormalization layer(s) reached this tf2onnx model in inference form "
            f"({_first_five(layers)}): "
            f"tf2onnx exports the inference graph and folds each into the layer beside it, so they train as fixed "
            f"per-channel scales and shifts, not with batch statistics as Keras trains them, and their moving "
            f"statistics never move. Keras' own fit() normalizes by each batch; to train so here, export the model "
            f"from torch by the recipe in docs/models.md, or leave the layers out (docs/models.md, \"Keras / "
            f"TensorFlow\")")


#: How torch.onnx's legacy exporter names a value computed in the graph (an op's output: "onnx::Conv_32"), which
#: its constant folding keeps as the name of the initializer it computes from parameters.
_LEGACY_COMPUTED = "onnx::"


def folded_torch_parameters(model: onnx.ModelProto, trainable: Collection[str]) -> list[str]:
    """The trainable initializers of a model from torch.onnx's legacy exporter that its constant folding computed
    from the module's parameters (named as the graph value they replace: "onnx::Conv_32"); [] for other models.
    Exported in eval mode, a BatchNorm is fused into the Conv before it this way; with folding on in any mode, a
    weight's transpose becomes a weight of its own (untying it from an embedding it was tied to)."""
    if model.producer_name != TORCH_PRODUCER or from_torch_dynamo(model):
        return []
    return [name for name in trainable if name.startswith(_LEGACY_COMPUTED)]


def folded_torch_parameters_warning(names: list[str]) -> str:
    """The warning about `names` (from `folded_torch_parameters`)."""
    return (f"{len(names)} initializer(s) were computed by torch.onnx.export's constant folding from the module's "
            f"parameters ({_first_five(names)}): each trains as a parameter of its own, where torch trains what it was computed "
            f"from -- a BatchNorm the exporter fused into a Conv (eval mode, its default) trains as a plain Conv "
            f"without batch statistics, and a transposed weight no longer shares its gradient with the weight it "
            f"came from. Re-export with training=torch.onnx.TrainingMode.TRAINING and do_constant_folding=False "
            f"(docs/models.md, \"Exporter recipes\")")


def idle_dropouts(model: onnx.ModelProto) -> list[str]:
    """The Dropouts of the main graph with a constant ratio above 0 and no training_mode input (ONNX's default
    then: the identity), in a model where at least one other Dropout's training_mode is a constant true -- a
    training-mode export whose exporter dropped one layer's flag: torch.onnx's legacy exporter writes the attention
    dropout of nn.MultiheadAttention (nn.TransformerEncoderLayer's) so under TrainingMode.TRAINING. Their labels;
    [] when no Dropout trains or none is idle."""
    values = constants(model)

    def constant(name: str) -> object:
        value = values.get(name) if name else None
        return None if value is None or value.size == 0 else value.reshape(-1)[0]

    dropouts = [n for n in model.graph.node if n.op_type == "Dropout" and n.domain in ("", "ai.onnx")]
    if not any(len(n.input) > 2 and constant(n.input[2]) is not None and bool(constant(n.input[2]))
               for n in dropouts):
        return []
    idle = []
    for node in dropouts:
        ratio = constant(node.input[1]) if len(node.input) > 1 else None
        if (len(node.input) < 3 or not node.input[2]) and ratio is not None and float(ratio) > 0:
            idle.append(node_label(node))
    return idle


def idle_dropouts_warning(labels: list[str]) -> str:
    """The warning about `labels` (from `idle_dropouts`)."""
    return (f"{len(labels)} Dropout(s) have a ratio but no training_mode input, so they are the identity (ONNX's "
            f"default) while the model's other Dropouts train: {_first_five(labels)}. torch.onnx's legacy exporter "
            f"writes nn.MultiheadAttention's attention dropout so even under TrainingMode.TRAINING; the engine "
            f"trains these layers without it, where torch applies it. To train the same model on both sides, give "
            f"the attention dropout=0.0 before exporting")


#: The aten op in the dynamo exporter's record of a node, and its overload ("default", "no_stats", ...).
_ATEN_TARGET = re.compile(r"target=torch\.ops\.aten\.(\w+)(?:\.(\w+))?")


def _aten_target(node: onnx.NodeProto) -> tuple[str, str] | None:
    """(aten op, overload or "") of the torch op a dynamo-exported node came from; None without the record."""
    target = _ATEN_TARGET.search(node_metadata(node).get(TORCH_FX_NODE, ""))
    return None if target is None else (target.group(1), target.group(2) or "")


def _torch_batch_norm_training(node: onnx.NodeProto) -> bool | None:
    """From the dynamo exporter's record of the aten op a node came from: True for a batch norm in training mode,
    False for one in eval mode, None when it came from no batch norm (or carries no record)."""
    target = _aten_target(node)
    if target is None or "batch_norm" not in target[0]:
        return None
    op = target[0]   # the name before the overload: _native_batch_norm_legit for its .no_stats too
    if "no_training" in op or "no_update" in op:   # _native_batch_norm_legit_no_training, _batch_norm_no_update
        return False
    if op in _FLAGGED_BATCH_NORMS:
        args = re.search(r"args = \((.*)\), kwargs", node_metadata(node)[TORCH_FX_NODE])
        flags = re.findall(r"(?:^|, )(True|False)(?=,|$)", args.group(1)) if args else []
        return bool(flags) and flags[0] == "True"   # the first bare flag is `training`
    return True   # _native_batch_norm_legit(_functional), _batch_norm_with_update: the training forms


def _without_running_statistics(node: onnx.NodeProto) -> bool:
    """Whether the node came from a BatchNorm with track_running_stats=False (aten's ``.no_stats`` overload)."""
    target = _aten_target(node)
    return target is not None and "batch_norm" in target[0] and target[1] == "no_stats"


def _module_path(node: onnx.NodeProto) -> str:
    """The torch module a dynamo-exported node came from, as its attribute path ("layer1.0.bn1"); "" for none."""
    scopes = re.findall(r"'([^']*)'", node_metadata(node).get(_SCOPES, ""))
    # cumulative paths, outermost first ('', 'net', 'net.1'), then the op itself
    return next((scope for scope in reversed(scopes[:-1]) if scope), "")


def _module_of(node: onnx.NodeProto) -> str:
    """The torch module a dynamo-exported node came from (`_module_path`), or the node's label."""
    return _module_path(node) or node_label(node)


#: What to do about a torch op whose ONNX form cannot be differentiated, by the op's aten name.
_TORCH_OP_REMEDIES = {
    "embedding_bag": "nn.EmbeddingBag exports as a Loop over its bags, through which no gradient can be built "
                     "(from this exporter even for equal-length bags): write it as nn.Embedding followed by a sum "
                     "or mean over the bag axis (masking the padded ids), which trains by rows too",
}


def torch_origin(model: onnx.ModelProto, name: str) -> tuple[str, str]:
    """For a message about node `name` (or a node inside its subgraphs) of a dynamo export: (", from torch's
    aten.OP in module 'M'", " What to do." when the op is known to be untrainable, else ""); ("", "") for a
    node without the exporter's record."""
    node = next((n for n in model.graph.node if n.name == name or _holds_node(n, name)), None)
    target = _aten_target(node) if node is not None else None
    if target is None:
        return "", ""
    op, overload = target
    module = _module_path(node)
    remedy = _TORCH_OP_REMEDIES.get(op)
    if remedy is None:
        # the failure can surface after the untrainable op: an Add of an EmbeddingBag's output, whose rank the
        # bag's Loop over sequences hides
        known = next(((n, target[0]) for n in model.graph.node
                      if (target := _aten_target(n)) and target[0] in _TORCH_OP_REMEDIES), None)
        if known is not None:
            known_module = _module_path(known[0])
            remedy = (f"The model has aten.{known[1]}" + (f" (module {known_module!r})" if known_module else "") +
                      f": {_TORCH_OP_REMEDIES[known[1]]}")
    return (f", from torch's aten.{op}" + (f".{overload}" if overload else "") +
            (f" in module {module!r}" if module else ""), f" {remedy}." if remedy else "")


def _holds_node(node: onnx.NodeProto, name: str) -> bool:
    """Whether a node of `node`'s subgraphs (a Loop's body, an If's branches, nested) is called `name`."""
    return any(inner.name == name or _holds_node(inner, name) for graph in subgraphs(node) for inner in graph.node)


def restore_torch_training_batch_norms(model: onnx.ModelProto, source: str) -> int:
    """Puts each BatchNormalization that the dynamo exporter wrote from a training-mode torch BatchNorm back in
    training mode, with or without running statistics (in place; returns how many). UnsupportedModelError naming
    each module when the exporter folded one into another node or merged its running statistics with other values:
    those models lost the BatchNorm."""
    if not from_torch_dynamo(model):
        return 0
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    uses = consumers(graph)
    producers = {out: node for node in graph.node for out in node.output}
    lost, restored = [], 0
    for node in graph.node:
        if not _torch_batch_norm_training(node):
            continue
        if node.op_type != "BatchNormalization":
            rule = node_metadata(node).get(_RULE, "")
            if "BatchNorm" in rule:
                lost.append(f"{_module_of(node)} (folded into {node_label(node)!r}, a {node.op_type}, by {rule})")
            continue
        if any(a.name == "training_mode" and a.i for a in node.attribute) or any(node.output[1:]):
            continue   # already in training form
        # a module called twice reads, the second time, the first call's new statistics: Identities of its own
        # (the exporter's inference form moves nothing), which lead back to the same buffers
        statistics = [_through_identities(name, producers) for name in node.input[3:5]]
        own = [name in initializers and name not in node.input[:3] and only_running_statistics(name, uses)
               for name in statistics]
        # a BatchNorm without running statistics (track_running_stats=False) is fed the batch's mean and variance,
        # computed in the graph: in training mode it computes the same ones itself, and its gradient reaches the
        # layers before through them (the inference form's does not); the graph's own go unread
        if not all(own) and not _without_running_statistics(node):
            lost.append(f"{_module_of(node)} ({node_label(node)!r}: its running statistics {statistics} are merged "
                        f"with other values)")
            continue
        if all(own):
            node.input[3:5] = statistics
        node.attribute.append(helper.make_attribute("training_mode", 1))
        # training mode has three outputs (onnx's shape inference insists): the new running statistics, unread
        del node.output[1:]
        node.output.extend(f"{node.output[0]}__running_{what}" for what in ("mean", "var"))
        restored += 1
    if lost:
        raise UnsupportedModelError(
            f"{source}: torch.onnx.export's dynamo exporter (the default since torch 2.9) wrote {len(lost)} "
            f"training-mode BatchNorm(s) as inference ones, and its optimizer then folded or merged them: "
            f"{'; '.join(lost)}. Trained as it is, the model would not normalize with batch statistics there: "
            f"{DYNAMO_REMEDY}")
    return restored


def torch_parameters_renamed_or_dropped(model: onnx.ModelProto) -> list[str]:
    """The torch parameters that the ops of a dynamo-exported model read (`%p_<name>` in their records, as
    torch.export spells them) but that no initializer holds under their own name: the exporter's optimizer folded
    them away (a zero bias, a unit scale: they cannot train) or stored them transposed, packed or reshaped under a
    generated name (they train under that name). [] for other models, and for an export with optimize=False."""
    if not from_torch_dynamo(model):
        return []
    referenced = {match for node in model.graph.node
                  for match in re.findall(r"%(p_\w+)", node_metadata(node).get(TORCH_FX_NODE, ""))}
    held = {torch_export_name(t.name) for t in model.graph.initializer}
    return sorted(referenced - held)


def _through_identities(name: str, producers: dict[str, onnx.NodeProto]) -> str:
    """The value `name` is an Identity (of an Identity...) of."""
    while name in producers and producers[name].op_type == "Identity":
        name = producers[name].input[0]
    return name


def renamed_or_dropped_warning(names: list[str]) -> str:
    """The warning about `names` (from `torch_parameters_renamed_or_dropped`)."""
    return (f"{len(names)} torch parameter(s) are not in the graph under their own names ({', '.join(names)}, as "
            f"torch.export names them): the optimizer of torch.onnx.export's dynamo exporter (optimize=True, the "
            f"default) folded each away, so that it does not train (a zero bias, a unit scale), or stored it "
            f"transposed, packed or reshaped under a generated name (val_N), under which it trains. To train the "
            f"module as it is, {DYNAMO_REMEDY}")


def dropped_torch_detaches(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes of a dynamo export whose records read a torch detach() that no node of the graph stands for: the
    exporter's optimizer (optimize=True, the default) removes the Identity it writes for one, and the engine, which
    keeps a detach out of the gradient by that Identity (rewrites/detaches.py), cannot. [] for other models."""
    if not from_torch_dynamo(model):
        return []
    kept = {_FX_NAME.match(node_metadata(node)[TORCH_FX_NODE]).group(1)
            for node in model.graph.node if is_torch_detach(node)}
    readers = []
    for node in model.graph.node:
        arguments = _FX_ARGUMENTS.search(node_metadata(node).get(TORCH_FX_NODE, ""))
        if arguments and any(name not in kept for name in _DETACH_NAME.findall(arguments.group(1))):
            readers.append(node)
    return readers


def dropped_detaches_warning(readers: list[onnx.NodeProto]) -> str:
    """The warning about `readers` (from `dropped_torch_detaches`)."""
    return (f"the optimizer of torch.onnx.export's dynamo exporter (optimize=True, the default) removed the detach() "
            f"read by {nodes_listed(readers)}: the gradient flows through it where torch's does not (a "
            f"straight-through estimator's would be zero). Export with dynamo=True and optimize=False, which keeps "
            f"it (the legacy exporter drops it too)")


def merged_torch_parameters(model: onnx.ModelProto, names: Collection[str]) -> dict[str, list[onnx.NodeProto]]:
    """Of `names`, the torch parameters (an op that reads one came from a torch op reading it) that ops of other
    torch ops read too, with those ops: the dynamo exporter's optimizer merged them with an equal value (another
    layer's fresh LayerNorm weight, a literal), so they would train as one. A parameter every reader of which
    came from an op reading it (tied embeddings: one torch parameter) is not listed. Nodes an onnxscript rule
    wrote (a BatchNorm fused into a Conv) carry another op's record and are not counted. {} for other models."""
    if not from_torch_dynamo(model):
        return {}
    uses = consumers(model.graph)
    merged = {}
    for name in names:
        readers = [node for node, _ in uses.get(name, []) if TORCH_FX_NODE in node_metadata(node)
                   and _RULE not in node_metadata(node)]
        if any(reads_torch_parameter(node, name) for node in readers):
            strangers = [node for node in readers if not reads_torch_parameter(node, name)]
            if strangers:
                merged[name] = strangers
    return merged


def merged_warning(name: str, strangers: list[onnx.NodeProto]) -> str:
    """The warning about one parameter from `merged_torch_parameters`."""
    listed = nodes_listed(strangers)
    return (f"initializer {name!r} (torch parameter {name}) is also read by {listed}, which came from torch ops "
            f"that did not read it: the optimizer of torch.onnx.export's dynamo exporter (optimize=True, the default) "
            f"merged it with a tensor of equal value (another layer's fresh LayerNorm weight, a zero bias, a "
            f"literal), so they would train as one parameter: {DYNAMO_REMEDY}")


#: torch's embedding in the exporter's record: the table, the ids, and padding_idx when the module has one.
_EMBEDDING = re.compile(r"target=torch\.ops\.aten\.embedding\.default\]\(args = \(%\w+, %\w+(?:, (-?\d+))?")


def torch_padding_rows(model: onnx.ModelProto) -> dict[str, int]:
    """The tables of a dynamo-exported model whose torch Embedding has a padding_idx: table -> that row, whose
    gradient torch keeps at zero (the exporter writes a plain Gather and drops it; its record keeps it). Only a
    table that every reader reads as that embedding: a table also read otherwise (tied to an output projection)
    gets gradient in that row from the other use, and is left out. {} for other models."""
    if not from_torch_dynamo(model):
        return {}
    uses = consumers(model.graph)
    rows = {}
    for tensor in model.graph.initializer:
        readers = uses.get(tensor.name, [])
        found = set()
        for node, index in readers:
            match = _EMBEDDING.search(node_metadata(node).get(TORCH_FX_NODE, ""))
            found.add(int(match.group(1)) if node.op_type == "Gather" and index == 0 and match and match.group(1)
                      and reads_torch_parameter(node, tensor.name) else None)
        if len(found) == 1 and None not in found and tensor.dims:
            row = found.pop()
            if -tensor.dims[0] <= row < tensor.dims[0]:
                rows[tensor.name] = row % tensor.dims[0]
    return rows
