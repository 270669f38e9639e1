"""A Scan state that sums one matrix product per step becomes one product after the Scan.

onnx-ad's reverse sweep of a recurrent layer accumulates each recurrent weight's gradient in a state of
its reverse Scan: every step adds h_t^T @ g_t ([H, B] @ [B, H]: the taped hidden state and the gate's
adjoint) to it, so each step pays a Transpose, a small GEMM, the seed axis's Reshapes and an Add over the
[H, H] sum -- four of each per step for an LSTM, 16 of the reverse body's 71 nodes on ps_bench.zoo_models'
LSTM. Torch's cell backward keeps the gates' adjoints of all steps and multiplies once. Here too: a sum of
per-step products is one product of the steps laid side by side,

    sum_t P_t @ Q_t = [P_1 ... P_T] @ [Q_1; ...; Q_T]       (P_t: [M, K], Q_t: [K, N])

so each operand leaves the Scan stacked -- a scanned input, or a value the body hands out per step already
(the gates' adjoints are), is; any other per-step value becomes a scan output -- and one [M, T*K] @
[T*K, N] MatMul after the Scan replaces the state, added to the state's initial value unless that is
zeros. On the 2-layer LSTM the reverse body loses those 16 nodes, and the step took 14.3 -> 13.1 ms
(the bidirectional LSTM 9.4 -> 8.7, the GRU 11.3 -> 10.5; one thread, the same graph with and without).

Matched: a state whose body output is Add(state, X) (or a two-input Sum), the state read by nothing else,
X a MatMul of two 2-D operands (leading axes of size 1 allowed) reached through same-data ops, each operand
a value the body computes or scans per step, through same-data ops and at most one 2-D Transpose. Both
operands' steps are stacked in the same order: the one that needs fewer new scan outputs, a stack in the
other order written anew. A state whose new stacks would hold over 2**24 elements is left alone. Only the
summation order changes.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from worker_client.engine.rewrites.scans import (
    body_as_model,
    body_of,
    drop_dead_body_nodes,
    rebuild_around_scans,
    scan_layout,
    trip_count,
    write_layout,
)
from worker_client.engine.rewrites.toolkit import (
    SAME_DATA_OPS,
    Emitter,
    Writer,
    constants,
    reader_counts,
    shapes_and_types,
)

__all__ = ["hoist_scan_accumulators"]

#: The most elements a new stacked operand may hold (64 MiB of float32): a Scan of many steps over large
#: per-step values keeps its accumulator rather than tape every step.
MAX_STACKED_ELEMENTS = 1 << 24

_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def hoist_scan_accumulators(model: onnx.ModelProto) -> int:
    """Rewrite every accumulating state of the main graph's Scans as one product after the Scan (module
    docstring); in place. Returns the number of states removed."""
    zeros = _zero_values(model)
    return rebuild_around_scans(model, "hoisted", lambda scan, shapes, types, emit:
                                _hoist(model, scan, shapes, types, zeros, emit))


def _zero_values(model: onnx.ModelProto) -> set[str]:
    """Main-graph values known to be all zeros: constants (not an initializer a feed may override), and
    ConstantOfShape of a zero (or of no value)."""
    fed = {value.name for value in model.graph.input}
    zero = {name for name, value in constants(model).items() if value.size and not np.any(value) and name not in fed}
    for node in model.graph.node:
        if node.op_type == "ConstantOfShape":
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is None or not np.any(numpy_helper.to_array(value)):
                zero.add(node.output[0])
    return zero


class _Operand:
    """A MatMul operand as a per-step value of the body: `root` holds the matrix's elements in row-major
    order (`transposed`: those of its transpose), `rows` x `cols` the matrix."""

    def __init__(self, root: str, transposed: bool, rows: int, cols: int) -> None:
        self.root, self.transposed, self.rows, self.cols = root, transposed, rows, cols


def _hoist(model: onnx.ModelProto, scan: onnx.NodeProto, shapes: dict[str, tuple[int, ...]],
           types: dict[str, int], zeros: set[str], emit: Emitter
           ) -> tuple[int, list[onnx.NodeProto], list[onnx.NodeProto]] | None:
    """One Scan's accumulating states rewritten: (how many, no nodes before it, the products after it)."""
    body = body_of(scan)
    states, in_axes, in_dirs, out_axes, out_dirs = scan_layout(scan)
    steps = trip_count(scan, shapes)
    if steps is None or len(scan.output) != len(body.output):
        return None
    wrapper = body_as_model(model, scan, body, shapes, types)
    if wrapper is None:
        return None
    b_shapes, b_types = shapes_and_types(wrapper)
    producers = {name: node for node in body.node for name in node.output}
    readers = reader_counts(body)
    # the per-step values already stacked outside: scanned inputs, and values the body hands out as scan
    # outputs (itself or through an Identity), each by the order of its steps
    stacks: dict[str, dict[int, str]] = {}
    for p in range(states, len(body.input)):
        if in_axes[p - states] % max(len(shapes.get(scan.input[p], (0,))), 1) == 0:
            stacks.setdefault(body.input[p].name, {})[in_dirs[p - states]] = scan.input[p]
    for p in range(states, len(body.output)):
        value = body.output[p].name
        while (node := producers.get(value)) is not None and node.op_type == "Identity":
            value = node.input[0]
        rank = len(b_shapes.get(body.output[p].name, ())) + 1    # the stacked output's
        if scan.output[p] and body.output[p].name in b_shapes and out_axes[p - states] % rank == 0:
            stacks.setdefault(value, {}).setdefault(out_dirs[p - states], scan.output[p])
    per_step = {value.name for value in body.input} | set(producers)

    def through_same_data(name: str) -> str:
        while (node := producers.get(name)) is not None and node.op_type in SAME_DATA_OPS and \
                name in b_shapes and node.input[0] in b_shapes and \
                _non_unit(b_shapes[name]) == _non_unit(b_shapes[node.input[0]]):
            name = node.input[0]
        return name

    def operand(name: str) -> _Operand | None:
        shape = b_shapes.get(name)
        if shape is None or len(shape) < 2 or any(d != 1 for d in shape[:-2]):
            return None
        rows, cols = shape[-2:]
        root = through_same_data(name)
        transposed = False
        node = producers.get(root)
        if node is not None and node.op_type == "Transpose" and node.input[0] in b_shapes:
            before = b_shapes[node.input[0]]
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            if len(before) == 2 and perm in (None, [1, 0]) and before == (cols, rows):
                root, transposed = through_same_data(node.input[0]), True
        if root not in per_step or b_types.get(root) not in _FLOATS or root not in b_shapes:
            return None
        return _Operand(root, transposed, rows, cols)

    found = []     # (state position, left operand, right operand, direction)
    for k in range(states):
        state, result = body.input[k].name, body.output[k].name
        add = producers.get(result)
        if add is None or add.op_type not in ("Add", "Sum") or len(add.input) != 2 or state not in add.input \
                or readers.get(state, 0) != 1 or readers.get(result, 0) != 1 or add.input[0] == add.input[1]:
            continue
        other = add.input[1] if add.input[0] == state else add.input[0]
        product = producers.get(through_same_data(other))
        if product is None or product.op_type != "MatMul" or b_shapes.get(other) is None or \
                b_shapes.get(state) != b_shapes.get(other):
            continue
        left, right = operand(product.input[0]), operand(product.input[1])
        if left is None or right is None or left.cols != right.rows or \
                int(np.prod(b_shapes[state])) != left.rows * right.cols:
            continue
        # the order both operands are stacked in: one that needs the fewest new scan outputs
        direction = min((0, 1), key=lambda d: sum(d not in stacks.get(o.root, {}) for o in (left, right)))
        if any(direction not in stacks.get(o.root, {}) and steps * int(np.prod(b_shapes[o.root])) >
               MAX_STACKED_ELEMENTS for o in (left, right)):
            continue
        found.append((k, left, right, direction))
    if not found:
        return None

    # the operands not yet stacked in that order leave the body as new scan outputs
    new_outputs, copies = [], []
    taken_inside = {value.name for value in [*body.input, *body.output]}
    for _, left, right, direction in found:
        for o in (left, right):
            if direction in stacks.get(o.root, {}):
                continue
            inner = o.root
            if inner in taken_inside:
                inner = emit.name(f"{o.root}_step")
                copies.append(helper.make_node("Identity", [o.root], [inner]))
            outer = emit.name(f"{o.root}_steps")
            new_outputs.append((helper.make_tensor_value_info(inner, b_types[o.root], list(b_shapes[o.root])),
                                outer, direction))
            stacks.setdefault(o.root, {})[direction] = outer

    write = Writer(emit)
    after, node, reshape = write.nodes, write.node, write.reshape

    def side_by_side(o: _Operand, direction: int, left_side: bool) -> str:
        """The steps of `o` as one matrix: [rows, T * cols] on the left, [T * rows, cols] on the right."""
        data = stacks[o.root][direction]
        r, c = o.rows, o.cols
        # the stacked elements in row-major order are [T, r, c] (or [T, c, r] when transposed)
        if left_side and o.transposed:           # [T, c, r] -> [T*c, r], transposed: [r, T*c]
            return node("Transpose", [reshape(data, [steps * c, r])], perm=[1, 0])
        if not left_side and not o.transposed:   # [T, r, c] -> [T*r, c]
            return reshape(data, [steps * r, c])
        inner = [steps, r, c] if not o.transposed else [steps, c, r]
        grouped = node("Transpose", [reshape(data, inner)], perm=[1, 0, 2])
        if left_side:                            # [r, T, c] -> [r, T*c]
            return reshape(grouped, [r, steps * c])
        return node("Transpose", [reshape(grouped, [c, steps * r])], perm=[1, 0])   # [c, T, r] -> [T*r, c]

    removed = sorted(k for k, *_ in found)
    for k, left, right, direction in found:
        total = node("MatMul", [side_by_side(left, direction, True), side_by_side(right, direction, False)])
        shape, target, initial = list(b_shapes[body.input[k].name]), scan.output[k], scan.input[k]
        if initial in zeros:
            reshape(total, shape, target or None)
        else:
            node("Add", [initial, reshape(total, shape)], target or None)

    # the states go; the stacked operands come out
    for k in reversed(removed):
        del scan.input[k]
        del scan.output[k]
        del body.input[k]
        del body.output[k]
    body.node.extend(copies)
    body.output.extend(info for info, _, _ in new_outputs)
    scan.output.extend(outer for _, outer, _ in new_outputs)
    write_layout(scan, in_axes, in_dirs, out_axes + [0] * len(new_outputs),
                 out_dirs + [direction for _, _, direction in new_outputs])
    drop_dead_body_nodes(body)
    return len(removed), [], after


def _non_unit(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)

