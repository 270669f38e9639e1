"""torch's `detach()` kept out of the gradient, as torch keeps it.

ONNX has no stop-gradient: a value computed from the parameters is differentiated wherever it is read. torch's
dynamo exporter (optimize=False, the documented recipe) writes each `x.detach()` as an Identity whose record
names aten.detach; the legacy exporter drops it without a trace. Differentiated through, a straight-through
estimator -- q = x + (round(x) - x).detach(), as quantization-aware training, a VQ-VAE's codebook lookup or a hard
Gumbel-softmax write it -- has the gradient 1 + 0 - 1 = 0 where torch's is 1, and the layers before stop training.

`stop_torch_detaches` (before differentiation) points every reader of such an Identity's output at a stand-in
input onnx-ad does not differentiate; `attach_detached` (after differentiation) reads the detached value itself
there again. The forward values are unchanged; the gradient is torch's.
"""

from __future__ import annotations

import re

import onnx

from worker_client.engine.rewrites.toolkit import read_stand_ins, value_types
from worker_client.engine.selection import TORCH_FX_NODE, node_metadata

__all__ = ["DETACHED_PREFIX", "attach_detached", "is_torch_detach", "stop_torch_detaches"]

#: Name prefix of the stand-in input for a detached value (then the name of the value detached).
DETACHED_PREFIX = "detached__"
#: The torch op in the record the dynamo exporter keeps on each node: detach() is aten.detach.default.
_DETACH = re.compile(r"target=torch\.ops\.aten\.detach\.")


def is_torch_detach(node: onnx.NodeProto) -> bool:
    """Whether `node` is an Identity the dynamo exporter wrote for a torch `detach()`."""
    return node.op_type == "Identity" and _DETACH.search(node_metadata(node).get(TORCH_FX_NODE, "")) is not None


def stop_torch_detaches(model: onnx.ModelProto) -> int:
    """Every reader of a torch detach's output reads a stand-in input for the detached value instead (module
    docstring); in place. The Identity stays for a graph output or a subgraph that captures its output. Returns the
    number of detaches stopped."""
    graph = model.graph
    detaches = {node.output[0]: node.input[0] for node in graph.node if is_torch_detach(node)}
    if not detaches:
        return 0
    # the stand-in declares the value's inferred type: its rank, with the dims inference could not fix symbolic
    # (a dynamo flatten's Reshape to [Squeeze(Shape(x)), 48] keeps the batch axis unknown until later passes fold it)
    declared = {name: value for name, value in value_types(model).items() if value.tensor_type.elem_type}
    stand_ins: dict[str, onnx.ValueInfoProto] = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            source = detaches.get(name)
            if source is None or source not in declared:   # no type for the input: left to onnx-ad, as before
                continue
            stand_in = DETACHED_PREFIX + source
            node.input[index] = stand_in
            if stand_in not in stand_ins:
                stand_ins[stand_in] = onnx.ValueInfoProto(name=stand_in)
                stand_ins[stand_in].type.CopyFrom(declared[source])
    graph.input.extend(stand_ins.values())
    return len(stand_ins)


def attach_detached(model: onnx.ModelProto) -> int:
    """The differentiated graph of a model `stop_torch_detaches` rewrote, each stand-in read as the value it stands
    for; in place. Returns the number of stand-ins removed."""
    return read_stand_ins(model, DETACHED_PREFIX)
