"""A recurrent layer's reverse sweep reads the forward sweep's gates instead of computing them again.

onnx-ad differentiates an LSTM, GRU or RNN (which it expands into a Scan over the layer's equations) into
a forward Scan that tapes the hidden and cell states it starts each step from, and a reverse Scan whose
body first recomputes that step's gates from the taped states: the layer's four (LSTM) or three (GRU)
[B, H] @ [H, H] products, their sums with the input projection and their activations, once more per time
step. Torch's cell keeps the gates from the forward pass instead. Here the reverse body's nodes that
compute what the forward body computed at the same step -- the same op on the same values: the taped
states, the same scanned inputs, the same values from outside -- are matched to the forward's nodes; the
values the rest of the reverse body reads from them become scan outputs of the forward Scan (taped like
its states) and scanned inputs of the reverse one, and the recomputation goes. On ps_bench.zoo_models'
2-layer LSTM each reverse step lost its four GEMMs and twelve other nodes (87 -> 71 per step).

Exact: the forward's values are the ones the reverse recomputed bit for bit (the same kernels on the same
inputs). Steps are matched through the Scans' directions: the reverse Scan reads step t of the forward's
tapes at its own step T-1-t, and the new tapes are read the same way.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from worker_client.engine.rewrites.scans import (
    body_as_model,
    body_names,
    body_of,
    main_scans,
    rescan_inputs,
    scan_layout,
    trip_count,
    write_layout,
)
from worker_client.engine.rewrites.toolkit import (
    RANDOM_OPS,
    Emitter,
    constants,
    opset_of,
    replace_items,
    shapes_and_types,
    subgraph_reads,
    subgraphs,
)

__all__ = ["reuse_forward_values"]


def reuse_forward_values(model: onnx.ModelProto) -> int:
    """Rewrite each reverse Scan of the main graph that recomputes values a Scan before it computes (module
    docstring); in place. Returns the number of reverse-body nodes dropped."""
    if opset_of(model) < 9:
        return 0
    scans = main_scans(model)
    if len(scans) < 2:
        return 0
    shapes, types = shapes_and_types(model)
    outer = _OuterValues(model)
    names = Emitter(model, "reused")
    dropped = 0
    for position, reverse in enumerate(scans):
        for forward in reversed(scans[:position]):     # the closest Scan before it first
            removed = _reuse(model, forward, reverse, shapes, types, outer, names)
            if removed:
                dropped += removed
                shapes, types = shapes_and_types(model)   # the Scans' inputs and outputs changed
                break
    return dropped


class _OuterValues:
    """Whether two names of the main graph hold the same value: the same name, equal constants, or the same
    deterministic op on the same values (onnx-ad writes each Scan's transposed weights afresh)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.values = constants(model)
        self.producers = {name: node for node in model.graph.node for name in node.output}
        self.memo: dict[tuple[str, str], bool] = {}

    def same(self, a: str, b: str, depth: int = 0) -> bool:
        if a == b:
            return True
        key = (a, b) if a < b else (b, a)
        if key in self.memo:
            return self.memo[key]
        result = False
        if a in self.values and b in self.values:
            x, y = self.values[a], self.values[b]
            result = x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
        elif depth < 8 and a in self.producers and b in self.producers:
            p, q = self.producers[a], self.producers[b]
            result = (_signature(p) == _signature(q) and list(p.output).index(a) == list(q.output).index(b)
                      and len(p.input) == len(q.input) and _deterministic(p)
                      and all(self.same(x, y, depth + 1) for x, y in zip(p.input, q.input)))
        self.memo[key] = result
        return result


def _signature(node: onnx.NodeProto) -> tuple:
    if subgraphs(node):
        return (node.domain, node.op_type, id(node))      # a subgraph: never the same as another node
    return (node.domain, node.op_type, tuple(sorted(a.SerializeToString() for a in node.attribute)))


def _deterministic(node: onnx.NodeProto) -> bool:
    return node.op_type not in RANDOM_OPS


def _reuse(model: onnx.ModelProto, forward: onnx.NodeProto, reverse: onnx.NodeProto,
           shapes: dict[str, tuple[int, ...]], types: dict[str, int], outer: _OuterValues, names: Emitter) -> int:
    steps = trip_count(forward, shapes)
    if steps is None or steps != trip_count(reverse, shapes):
        return 0
    f_body, r_body = body_of(forward), body_of(reverse)
    f_states, f_in_axes, f_in_dirs, f_out_axes, f_out_dirs = scan_layout(forward)
    r_states, r_in_axes, r_in_dirs, r_out_axes, r_out_dirs = scan_layout(reverse)
    f_wrapper = body_as_model(model, forward, f_body, shapes, types)
    r_wrapper = body_as_model(model, reverse, r_body, shapes, types)
    if f_wrapper is None or r_wrapper is None:
        return 0
    f_shapes, f_types = shapes_and_types(f_wrapper)
    r_shapes, r_types = shapes_and_types(r_wrapper)
    f_constants, r_constants = constants(f_wrapper), constants(r_wrapper)
    f_defined, r_defined = body_names(f_body), body_names(r_body)

    # what each reverse-body input is on the forward side, and the step relation (reversed or not)
    key: dict[str, tuple] = {}
    reversed_steps: set[bool] = set()
    f_scanned = {name: (f_body.input[p].name, f_in_dirs[p - f_states])
                 for p, name in enumerate(forward.input) if p >= f_states and f_in_axes[p - f_states] == 0}
    f_producers = {name: node for node in f_body.node for name in node.output}

    def source_of(name: str) -> str:      # a tape is an Identity of the value it hands out
        while (node := f_producers.get(name)) is not None and node.op_type == "Identity":
            name = node.input[0]
        return name

    f_taped = {name: (source_of(f_body.output[p].name), f_out_dirs[p - f_states])
               for p, name in enumerate(forward.output) if p >= f_states and name and f_out_axes[p - f_states] == 0}
    for p in range(r_states, len(reverse.input)):
        if r_in_axes[p - r_states] != 0:
            continue
        name, direction = reverse.input[p], r_in_dirs[p - r_states]
        source = f_scanned.get(name) or f_taped.get(name)
        if source is None:
            continue
        key[r_body.input[p].name] = ("f", source[0])
        reversed_steps.add(direction != source[1])
    if len(reversed_steps) != 1:
        return 0
    flipped = reversed_steps.pop()

    def outside_key(name: str, constant_values: dict[str, np.ndarray], reads_outer: list[str]) -> tuple | None:
        if name in constant_values:
            value = constant_values[name]
            return ("const", str(value.dtype), value.shape, value.tobytes())
        for other in reads_outer:
            if outer.same(name, other):
                return ("outer", other)
        reads_outer.append(name)
        return ("outer", name)

    canonical_outer: list[str] = []

    def input_keys(node: onnx.NodeProto, known: dict[str, tuple], constant_values: dict[str, np.ndarray],
                   defined: set[str]) -> list[tuple | None]:
        """Each input as a key: a known body value, a constant or outside value, or ("missing", name)."""
        keys: list[tuple | None] = []
        for name in node.input:
            if not name:
                keys.append(None)
            elif name in known:
                keys.append(known[name])
            elif name in constant_values or name not in defined:
                keys.append(outside_key(name, constant_values, canonical_outer))
            else:
                keys.append(("missing", name))
        return keys

    f_key = {v.name: ("f", v.name) for v in f_body.input}
    index: dict[tuple, onnx.NodeProto] = {}
    for node in f_body.node:
        inputs = input_keys(node, f_key, f_constants, f_defined)
        for name in node.output:
            f_key[name] = ("f", name)
        if _deterministic(node):
            index.setdefault((_signature(node), tuple(inputs)), node)

    matched: list[onnx.NodeProto] = []
    for node in r_body.node:
        if node.op_type == "Constant":     # read by value (its readers key it as a constant): nothing to take
            continue
        inputs = input_keys(node, key, r_constants, r_defined)
        if any(item is not None and item[0] == "missing" for item in inputs):
            continue
        twin = index.get((_signature(node), tuple(inputs)))
        if twin is None or not _deterministic(node):
            continue
        matched.append(node)
        for mine, theirs in zip(node.output, twin.output):
            if mine:
                key[mine] = ("f", theirs)
    costly = [node for node in matched if node.op_type != "Identity"]
    if not costly:
        return 0
    matched_ids = {id(node) for node in matched}
    kept = [node for node in r_body.node if id(node) not in matched_ids]
    reads = {name for node in kept for name in [*node.input, *subgraph_reads(node)]}
    reads |= {value.name for value in r_body.output}
    needed = sorted(name for node in matched for name in node.output if name in reads)
    if any(name not in r_types for name in needed):
        return 0
    # the forward hands out each needed value per step (a tape), the reverse reads it as a scanned input
    f_outputs = list(f_body.output)
    f_copies: list[onnx.NodeProto] = []
    r_copies: list[onnx.NodeProto] = []
    r_outputs = {value.name for value in r_body.output}
    new_r_inputs = []
    for name in needed:
        theirs = key[name][1]
        existing = next((outer_name for outer_name, (value, direction) in f_taped.items()
                         if value == theirs and direction == 0), None)
        if existing is None:
            existing = names.name(f"tape_{theirs}")
            inner = theirs
            if any(v.name == theirs for v in [*f_outputs, *f_body.input]):
                inner = names.name(theirs)
                f_copies.append(helper.make_node("Identity", [theirs], [inner]))
            # onnxruntime's Scan wants each body output's shape where it cannot infer one itself
            known = f_shapes.get(theirs, r_shapes.get(name))
            f_outputs.append(helper.make_tensor_value_info(inner, f_types.get(theirs, r_types[name]),
                                                           list(known) if known is not None else None))
            forward.output.append(existing)
            f_out_axes.append(0)
            f_out_dirs.append(0)
            f_taped[existing] = (theirs, 0)
        shape = r_shapes.get(name)
        inner = name
        if name in r_outputs:      # handed on as the reverse body's own output: read under another name
            inner = names.name(name)
            r_copies.append(helper.make_node("Identity", [inner], [name]))
        new_r_inputs.append((existing, helper.make_tensor_value_info(
            inner, r_types[name], list(shape) if shape is not None else None)))
    replace_items(f_body.output, f_outputs)
    f_body.node.extend(f_copies)
    write_layout(forward, f_in_axes, f_in_dirs, f_out_axes, f_out_dirs)
    kept = [*r_copies, *kept]          # the copies read body inputs only: first
    replace_items(r_body.node, kept)
    rescan_inputs(reverse, r_body, [(outer_name, info, int(flipped)) for outer_name, info in new_r_inputs])
    used = {name for node in kept for name in [*node.input, *subgraph_reads(node)]}
    replace_items(r_body.initializer, [t for t in r_body.initializer if t.name in used])
    r_body.ClearField("value_info")
    return len(costly)

