"""The adjoint passes run inside the bodies of Scans too: a recurrent layer's reverse sweep.

onnx-ad differentiates an LSTM, GRU or RNN (and a Scan) into a reverse Scan whose body runs once
per time step. Its body is written like any adjoint -- seed axes of size 1 added by Unsqueezes and
Expands, Transposes and reductions over them -- but the passes that strip those from the main
graph never saw it, and onnxruntime pays a fixed cost per node per iteration: the 2-layer LSTM of
ps_bench.zoo_models (40 steps) ran 111 nodes per step in each of its two reverse Scans, 26 ms each.

Here each Scan body of the main graph is wrapped as a model of its own -- its inputs declared with
the static shapes the outer Scan gives them (a state as it is fed, a scanned input without its scan
axis), the outer values it reads declared as inputs too -- and the layout, broadcast and pruning
passes run on it. The body's inputs and outputs keep their names and order; a name a pass writes
that the outer graph also defines is renamed, since a subgraph may not shadow an outer value.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import helper

from worker_client.engine.rewrites.toolkit import (
    Emitter,
    opset_of,
    rebuild,
    replace_items,
    set_attribute,
    shapes_and_types,
    subgraph_reads,
)

__all__ = ["body_as_model", "body_names", "body_of", "drop_dead_body_nodes", "main_scans", "rebuild_around_scans",
           "rescan_inputs", "rewrite_scan_bodies", "scan_layout", "trip_count", "write_layout"]


def rewrite_scan_bodies(model: onnx.ModelProto, passes: list[Callable[[onnx.ModelProto], object]]) -> int:
    """Run `passes` (each takes a model, in place) on the body of each Scan of the main graph; returns the
    number of bodies whose node count went down."""
    graph = model.graph
    scans = main_scans(model)
    if not scans:
        return 0
    shapes, types = shapes_and_types(model)
    outer_names = {value.name for value in [*graph.input, *graph.output]} | \
        {tensor.name for tensor in graph.initializer} | {name for node in graph.node for name in node.output}
    changed = 0
    for index, scan in enumerate(scans):
        body = body_of(scan)
        wrapper = body_as_model(model, scan, body, shapes, types)
        if wrapper is None:
            continue
        before = len(body.node)
        for run in passes:
            run(wrapper)
        if len(wrapper.graph.node) >= before:
            continue
        _unwrap(wrapper, body, outer_names, f"scan{index}")
        changed += 1
    return changed


def body_as_model(model: onnx.ModelProto, scan: onnx.NodeProto, body: onnx.GraphProto,
             shapes: dict[str, tuple[int, ...]], types: dict[str, int]) -> onnx.ModelProto | None:
    """The body as a model: its inputs with the static shapes the Scan feeds, the outer values it reads as
    extra inputs; None where a shape or type is not known."""
    states, axes, _, _, _ = scan_layout(scan)
    declared = []
    for position, (outer, inner) in enumerate(zip(scan.input, body.input)):
        shape = shapes.get(outer)
        if shape is None or outer not in types:
            return None
        if position >= states:
            axis = axes[position - states] % len(shape)
            shape = shape[:axis] + shape[axis + 1:]
        declared.append(helper.make_tensor_value_info(inner.name, types[outer], list(shape)))
    defined = body_names(body)
    captured = sorted({name for node in body.node for name in node.input if name and name not in defined})
    for name in captured:
        if name not in shapes or name not in types:
            return None
        declared.append(helper.make_tensor_value_info(name, types[name], list(shapes[name])))
    graph = helper.make_graph(list(body.node), "scan_body", declared, list(body.output), list(body.initializer))
    wrapper = helper.make_model(graph, opset_imports=list(model.opset_import))
    wrapper.ir_version = model.ir_version
    return wrapper


def body_of(scan: onnx.NodeProto) -> onnx.GraphProto:
    """The Scan's body graph."""
    return next(a.g for a in scan.attribute if a.name == "body")


def scan_layout(scan: onnx.NodeProto) -> tuple[int, list[int], list[int], list[int], list[int]]:
    """(number of states, scan input axes, input directions, scan output axes, output directions), the defaults
    written out."""
    attributes = {a.name: helper.get_attribute_value(a) for a in scan.attribute}
    scanned = attributes["num_scan_inputs"]
    states = len(scan.input) - scanned
    outputs = len(scan.output) - states
    return (states, list(attributes.get("scan_input_axes", [0] * scanned)),
            list(attributes.get("scan_input_directions", [0] * scanned)),
            list(attributes.get("scan_output_axes", [0] * outputs)),
            list(attributes.get("scan_output_directions", [0] * outputs)))


def write_layout(scan: onnx.NodeProto, in_axes: list[int], in_dirs: list[int], out_axes: list[int],
                 out_dirs: list[int]) -> None:
    """The Scan's layout attributes set in place (clearing its attribute field would detach the body the
    caller holds)."""
    for name, value in (("num_scan_inputs", len(in_axes)), ("scan_input_axes", in_axes),
                        ("scan_input_directions", in_dirs), ("scan_output_axes", out_axes),
                        ("scan_output_directions", out_dirs)):
        if isinstance(value, list) and not value:     # no INTS attribute for an empty list: drop it
            existing = next((a for a in scan.attribute if a.name == name), None)
            if existing is not None:
                scan.attribute.remove(existing)
            continue
        set_attribute(scan, name, value)


def body_names(body: onnx.GraphProto) -> set[str]:
    """The names a body defines: its inputs, initializers and node outputs (any other name it reads is
    captured from outside)."""
    return {value.name for value in body.input} | {t.name for t in body.initializer} | \
        {name for node in body.node for name in node.output}


def _unwrap(wrapper: onnx.ModelProto, body: onnx.GraphProto, outer_names: set[str], suffix: str) -> None:
    """The rewritten nodes and initializers back into `body`; names that would shadow outer values renamed."""
    keep = {value.name for value in [*body.input, *body.output]}
    renamed = {}
    for node in wrapper.graph.node:
        for name in node.output:
            if name in outer_names and name not in keep:
                renamed[name] = f"{name}__{suffix}"
    for tensor in wrapper.graph.initializer:
        if tensor.name in outer_names:
            renamed[tensor.name] = f"{tensor.name}__{suffix}"
    for node in wrapper.graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
        node.output[:] = [renamed.get(name, name) for name in node.output]
        if node.name in renamed:
            node.name = renamed[node.name]
    for tensor in wrapper.graph.initializer:
        tensor.name = renamed.get(tensor.name, tensor.name)
    body.ClearField("node")
    body.node.extend(wrapper.graph.node)
    body.ClearField("initializer")
    body.initializer.extend(wrapper.graph.initializer)
    body.ClearField("value_info")


def drop_dead_body_nodes(body: onnx.GraphProto) -> None:
    """The body's nodes and initializers no output of it depends on, dropped (a pass that moved work out of
    the loop leaves them)."""
    needed = {value.name for value in body.output}
    live = []
    for node in reversed(body.node):
        if any(name in needed for name in node.output):
            live.append(node)
            needed |= {name for name in node.input if name} | subgraph_reads(node)
    live.reverse()
    replace_items(body.node, live)
    replace_items(body.initializer, [tensor for tensor in body.initializer if tensor.name in needed])


def main_scans(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The Scans of the main graph (default domain)."""
    return [node for node in model.graph.node if node.op_type == "Scan" and node.domain in ("", "ai.onnx")]


#: What a pass over one Scan returns: (what it changed, nodes to place before the Scan, nodes after it), or None.
ScanRewrite = Callable[[onnx.NodeProto, dict[str, tuple[int, ...]], dict[str, int], Emitter],
                       tuple[int, list[onnx.NodeProto], list[onnx.NodeProto]] | None]


def rebuild_around_scans(model: onnx.ModelProto, stem: str, rewrite: ScanRewrite) -> int:
    """Each Scan of the main graph handed to `rewrite(scan, shapes, types, emit)`, which changes the Scan in
    place and returns what it changed and the nodes to place before and after it (or None); in place.
    Returns the sum of the counts. Scan-8 (opset 8: a batch axis, no per-input axes or directions) is
    left alone."""
    if opset_of(model) < 9 or not main_scans(model):
        return 0
    shapes, types = shapes_and_types(model)
    emit = Emitter(model, stem)
    changed = 0

    def replace(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        nonlocal changed
        if node.op_type != "Scan" or node.domain not in ("", "ai.onnx"):
            return None
        result = rewrite(node, shapes, types, emit)
        if result is None:
            return None
        changed += result[0]
        return [*result[1], node, *result[2]]

    rebuild(model, emit, replace)
    return changed


def trip_count(scan: onnx.NodeProto, shapes: dict[str, tuple[int, ...]]) -> int | None:
    """The Scan's static number of steps, from its scanned inputs' shapes along their scan axes; None where
    one of those shapes is unknown, they disagree, or nothing is scanned."""
    states, axes, _, _, _ = scan_layout(scan)
    lengths = set()
    for name, axis in zip(list(scan.input)[states:], axes):
        shape = shapes.get(name)
        if not shape:
            return None
        lengths.add(shape[axis % len(shape)])
    return lengths.pop() if len(lengths) == 1 else None


def rescan_inputs(scan: onnx.NodeProto, body: onnx.GraphProto,
                  new: list[tuple[str, onnx.ValueInfoProto, int]]) -> None:
    """The Scan's scanned inputs that its body no longer reads dropped and `new` ones appended, each (the
    stacked outer value, the body input that reads a step of it, the direction), scanned along axis 0; in
    place. The body's nodes must already be the ones it keeps."""
    states, in_axes, in_dirs, out_axes, out_dirs = scan_layout(scan)
    still_read = {name for node in body.node for name in [*node.input, *subgraph_reads(node)]} | \
        {value.name for value in body.output}
    inputs = list(body.input)
    keep = [p for p in range(len(inputs)) if p < states or inputs[p].name in still_read]
    scan.input[:] = [scan.input[p] for p in keep] + [outer for outer, _, _ in new]
    replace_items(body.input, [inputs[p] for p in keep] + [info for _, info, _ in new])
    write_layout(scan, [in_axes[p - states] for p in keep if p >= states] + [0] * len(new),
                 [in_dirs[p - states] for p in keep if p >= states] + [direction for _, _, direction in new],
                 out_axes, out_dirs)
