"""Faults of exporters that every reader of a model mends on load (engine/load.py's read_model), before anything
else sees the file: models that onnxruntime would refuse as written, though what they mean is clear.

- `unique_definitions`: torch.onnx.export's dynamo exporter names a node's output after its torch.fx node ("mean",
  "std", "index") and a buffer after its module path, so a top-level buffer named like an op is defined twice.
- `standard_erfc`: tf2onnx 1.17 writes Keras 3's exact GELU, 0.5 x erfc(-x / sqrt(2)), with an "Erfc" node in the
  ONNX domain, where no opset has such an op.
- `topological_order`: ONNX asks for nodes in topological order, and onnx's shape inference reads them so ("Input 0
  expected to have type but instead is null"), but onnxruntime sorts a graph itself and runs one in any order:
  graphs edited by hand or by tools (a node appended for an output added later) come so.
"""

from __future__ import annotations

import heapq

import onnx
from onnx import TensorProto, helper

from worker_client.engine.rewrites.toolkit import subgraph_reads, subgraphs

__all__ = ["repair_exporter_faults", "standard_erfc", "topological_order", "unique_definitions"]


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
