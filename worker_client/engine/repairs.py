"""Faults of exporters that every reader of a model mends on load (engine/load.py's read_model), before anything
else sees the file: models that onnxruntime would refuse as written, though what they mean is clear.

- `unique_definitions`: torch.onnx.export's dynamo exporter names a node's output after its torch.fx node ("mean",
  "std", "index") and a buffer after its module path, so a top-level buffer named like an op is defined twice.
- `standard_erfc`: tf2onnx 1.17 writes Keras 3's exact GELU, 0.5 x erfc(-x / sqrt(2)), with an "Erfc" node in the
  ONNX domain, where no opset has such an op.
- `zero_conv_biases`: the dynamo exporter's torch library (onnxscript 0.6's aten_conv3d) gives a Conv3d without a
  bias a zero bias of shape [out_channels, 2] -- ONNX's Conv takes [out_channels] --, so that onnxruntime fails
  every 3-D model with a bias-free convolution at its first run ("bias must be a 1D tensor"): torchvision's r3d_18,
  any Conv3d before a BatchNorm. A Conv's bias that is an Expand of a zero is no bias.
- `topological_order`: ONNX asks for nodes in topological order, and onnx's shape inference reads them so ("Input 0
  expected to have type but instead is null"), but onnxruntime sorts a graph itself and runs one in any order:
  graphs edited by hand or by tools (a node appended for an output added later) come so.
"""

from __future__ import annotations

import heapq
from collections import Counter

import onnx
from onnx import TensorProto, helper, numpy_helper

from worker_client.engine.rewrites.toolkit import subgraph_reads, subgraphs

__all__ = ["repair_exporter_faults", "standard_erfc", "topological_order", "unique_definitions", "zero_conv_biases"]


def repair_exporter_faults(model: onnx.ModelProto) -> list[str]:
    """Every repair below, in place; what each did, for the log ([] for a model that needed none)."""
    done = []
    if topological_order(model.graph):
        done.append("put the nodes in topological order")
    renamed = unique_definitions(model.graph)
    if renamed:
        done.append(f"renamed the second definition of {', '.join(sorted(set(renamed)))} (a node's output named "
                    f"like a weight or an earlier node's output)")
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    erfc = standard_erfc(model.graph, opset)
    if erfc:
        done.append(f"wrote {erfc} Erfc node(s), which no ONNX opset has, as 1 - Erf")
    biases = zero_conv_biases(model.graph)
    if biases:
        done.append(f"dropped the computed zero bias of {biases} convolution(s) (a torch Conv3d without a bias is "
                    f"exported with a bias of the wrong rank)")
    return done


def _rename_outer_reads(graph: onnx.GraphProto, current: dict[str, str]) -> None:
    """Points the reads of outer values inside `graph` (a Loop's body, an If's branch, nested) at their current
    names, where the subgraph does not define a value of that name itself."""
    own = {*(v.name for v in graph.input), *(t.name for t in graph.initializer),
           *(out for node in graph.node for out in node.output)}
    visible = {name: new for name, new in current.items() if name not in own}
    if not visible:
        return
    for node in graph.node:
        node.input[:] = [visible.get(name, name) for name in node.input]
        for inner in subgraphs(node):
            _rename_outer_reads(inner, visible)
    for value in graph.output:
        value.name = visible.get(value.name, value.name)


def unique_definitions(graph: onnx.GraphProto) -> list[str]:
    """Renames each value a node defines again after a graph input, an initializer or an earlier node defined it
    (in place), its readers after it following; returns the names renamed.

    torch.onnx.export's dynamo exporter names a node's output after its torch.fx node ("mean", "index", "std")
    and a buffer after its module path: a top-level buffer named like an op -- register_buffer("mean", ...) for
    an image normalization, beside a .mean() in forward() -- is defined twice, and onnxruntime refuses the file
    ("Duplicate definition of name (mean)"), as onnx's shape inference does (a type or rank "differs"). Nodes are
    in topological order, so each read means the latest definition before it; the later definitions get fresh
    names (`mean__2`), the weights keep theirs. The type annotations of a renamed name (value_info) are dropped:
    which definition each meant is not recorded, and shape inference writes them again."""
    defined = {*(v.name for v in graph.input), *(t.name for t in graph.initializer)}
    taken = set(defined) | {out for node in graph.node for out in node.output}
    current: dict[str, str] = {}
    renamed: list[str] = []
    for node in graph.node:
        if current:
            node.input[:] = [current.get(name, name) for name in node.input]
            for inner in subgraphs(node):
                _rename_outer_reads(inner, current)
        for i, name in enumerate(node.output):
            if not name:
                continue
            if name in defined:
                fresh, k = name, 1
                while fresh in taken:
                    k += 1
                    fresh = f"{name}__{k}"
                taken.add(fresh)
                node.output[i] = current[name] = fresh
                renamed.append(name)
            defined.add(node.output[i])
    if renamed:
        for value in graph.output:
            value.name = current.get(value.name, value.name)
        kept = [v for v in graph.value_info if v.name not in set(renamed)]
        del graph.value_info[:]
        graph.value_info.extend(kept)
    return renamed


def _is_onnx_domain(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx")


def standard_erfc(graph: onnx.GraphProto, opset: int) -> int:
    """Rewrites each Erfc node of the ONNX domain (in place, subgraphs too) as Sub(1, Erf(x)); how many.

    tf2onnx 1.17 converts TensorFlow's Erfc op -- Keras 3's exact GELU is 0.5 x erfc(-x / sqrt(2)) -- to a node of
    the same name in the ONNX domain, which has no such op: onnxruntime refuses the file ("No Op registered for
    Erfc") and onnx's shape inference leaves its output without a shape. erfc(x) = 1 - erf(x) exactly; the 1 is a
    float32 Constant, cast like x (CastLike, opset 15 and later) so that a float64 or float16 model stays one."""
    count = 0
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        for inner in subgraphs(node):
            count += standard_erfc(inner, opset)
        if node.op_type != "Erfc" or not _is_onnx_domain(node) or len(node.input) != 1 or len(node.output) != 1:
            nodes.append(node)
            continue
        count += 1
        x, stem = node.input[0], f"{node.name or node.output[0]}__erfc"
        one = f"{stem}_one"
        nodes.append(helper.make_node("Constant", [], [one], name=f"{stem}_one",
                                      value=helper.make_tensor(one, TensorProto.FLOAT, [], [1.0])))
        if opset >= 15:
            nodes.append(helper.make_node("CastLike", [one, x], [f"{one}_like"], name=f"{stem}_cast"))
            one = f"{one}_like"
        nodes.append(helper.make_node("Erf", [x], [f"{stem}_erf"], name=f"{stem}_erf"))
        nodes.append(helper.make_node("Sub", [one, f"{stem}_erf"], [node.output[0]], name=node.name))
    if count:
        graph.ClearField("node")
        graph.node.extend(nodes)
    return count


def _is_zero_scalar(name: str, producers: dict[str, onnx.NodeProto], initializers: dict[str, onnx.TensorProto]
                    ) -> bool:
    """Whether `name` is one zero: a Constant, an initializer, or either cast (Cast, CastLike)."""
    node = producers.get(name)
    while node is not None and node.op_type in ("Cast", "CastLike") and _is_onnx_domain(node):
        name = node.input[0]
        node = producers.get(name)
    if node is not None:
        value = next((a.t for a in node.attribute if a.name == "value"), None) \
            if node.op_type == "Constant" and _is_onnx_domain(node) else None
    else:
        value = initializers.get(name)
    if value is None:
        return False
    array = numpy_helper.to_array(value)
    return array.size == 1 and not array.any()


def zero_conv_biases(graph: onnx.GraphProto) -> int:
    """Drops (in place, subgraphs too) the bias input of each Conv whose bias is an Expand of a zero (a Constant
    or initializer, cast or not) -- the same Conv without a bias --, and the nodes that computed it that nothing
    else reads; returns how many Convs."""
    count = sum(zero_conv_biases(inner) for node in graph.node for inner in subgraphs(node))
    producers = {out: node for node in graph.node for out in node.output if out}
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    dropped = []
    for node in graph.node:
        if node.op_type != "Conv" or not _is_onnx_domain(node) or len(node.input) != 3:
            continue
        expand = producers.get(node.input[2])
        if expand is not None and expand.op_type == "Expand" and _is_onnx_domain(expand) and \
                _is_zero_scalar(expand.input[0], producers, initializers):
            dropped.append(node.input[2])
            del node.input[2]
            count += 1
    if dropped:
        _drop_unread(graph, dropped)
    return count


def _drop_unread(graph: onnx.GraphProto, names: list[str]) -> None:
    """Removes the producers of `names` that nothing reads any more, and theirs in turn."""
    readers = Counter(name for node in graph.node for name in [*node.input, *subgraph_reads(node)])
    readers.update(value.name for value in graph.output)
    gone: set[int] = set()
    producers = {out: node for node in graph.node for out in node.output if out}
    pending = list(names)
    while pending:
        node = producers.get(pending.pop())
        if node is None or id(node) in gone or any(readers[out] for out in node.output if out):
            continue
        gone.add(id(node))
        for name in [*node.input, *subgraph_reads(node)]:
            readers[name] -= 1
            pending.append(name)
    kept = [node for node in graph.node if id(node) not in gone]
    graph.ClearField("node")
    graph.node.extend(kept)


def topological_order(graph: onnx.GraphProto) -> bool:
    """Reorders the nodes of `graph` (in place, its subgraphs too) so that each comes after the nodes whose outputs
    it reads -- a stable order: nodes already in order keep theirs; whether it moved any. A graph where some value
    is defined twice, or whose reads go round in a cycle, is left as it is (what it means is not clear; the stages
    after say what is wrong)."""
    moved = False
    for node in graph.node:
        for inner in subgraphs(node):
            moved |= topological_order(inner)
    producer: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        for name in node.output:
            if name:
                if name in producer:
                    return moved
                producer[name] = index
    needs = []
    for node in graph.node:
        reads = {name for name in node.input if name} | subgraph_reads(node)   # a body's captures: its node's reads
        needs.append({producer[name] for name in reads if name in producer})
    if all(all(p < index for p in need) for index, need in enumerate(needs)):
        return moved
    readers: dict[int, list[int]] = {}
    waiting = [len(need) for need in needs]
    for index, need in enumerate(needs):
        for p in need:
            readers.setdefault(p, []).append(index)
    ready = [index for index, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for reader in readers.get(index, []):
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, reader)
    if len(order) != len(needs):   # a cycle
        return moved
    nodes = [graph.node[index] for index in order]
    graph.ClearField("node")
    graph.node.extend(nodes)
    return True
