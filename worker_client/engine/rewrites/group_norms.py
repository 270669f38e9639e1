"""Group and instance normalizations, with their per-channel scale and shift, differentiated in six passes.

torch exports GroupNorm(G, C) as Reshape(x, [N, G, M]) -> InstanceNormalization(unit scale, zero shift) ->
Reshape back -> Mul(gamma) -> Add(beta), and InstanceNorm as an InstanceNormalization with its own scale and
shift. onnx-ad's adjoint of that recomputes the statistics and the standardized values (five passes over the
activations) and spends some thirteen more on dx, dgamma and dbeta; torch's kernels take two. Every such unit is
y = k_c * xhat + t_c, xhat standardized over each of the N x G groups of M elements, with per-channel k, t:

    k = gamma * s (s: the InstanceNormalization's scale, one per group)      t = gamma * b + beta

Its gradients, with c = x - mean and r = 1 / sqrt(var + eps) per group, ds and db per image and channel:

    ds = sum_hw dy * c     db = sum_hw dy     dk = sum_n r * ds     dt = sum_n db
    dx = dy * (r * k) + c * A + B,   A = -r^3 / M * sum_group(k * ds),   B = -r / M * sum_group(k * db)

that is, a Mul and a ReduceSum, a ReduceSum, and for dx a Mul, a per-row scale and shift and an Add: six passes
on a CPU session, whose copy of the graph runs each per-row Mul and Add as one BatchNormalization
(rewrites/affine.py); the forward (the mean, the centring, the square and its mean, a per-row scale and shift)
keeps c and r for them. Every sum is over centred values: no digits lost to a large mean.

1. `detach_group_norms`, on the forward graph before differentiation: the unit's value is computed as above
   from stand-in inputs for x, k and t (not differentiated), and gains three kinds of terms that are zero in
   value: a probe input P (differentiated: its gradient is dy), and x * Qx, k * Qk, t * Qt with zero stand-ins
   Q -- onnx-ad writes each of their adjoints as a Mul of an adjoint by (an Unsqueeze of) its Q. k and t are
   computed from gamma, s, b and beta in the forward graph, so onnx-ad carries dk and dt on to those.
2. `attach_group_norm_adjoints`, on the differentiated graph: each of those Muls replaced by dx, dk or dt
   computed from dy, c and r as above; the stand-ins read as their values, the probe and the zero terms
   dropped. A unit is described in the model's metadata (onnx-ad keeps it) between the two.

A 1 x 1 Conv, a GroupNorm(8) and a mean squared error, batch 32, one thread, the same model's step built with
and without, interleaved: [32, 32, 32, 32] 4.55 -> 3.30 ms (torch 5.19), [32, 128, 8, 8] 1.29 -> 1.08 (torch
1.92); the zoo groupnorm model's step (Convs, GroupNorm(8), SiLU) 35.9 -> 33.0 and 34.8 -> 32.1 ms.
"""

from __future__ import annotations

import heapq
import json
import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

from worker_client.engine.rewrites.prune import prune
from worker_client.engine.rewrites.toolkit import (Emitter, Writer, constants, drop_values, opset_of, readers_of,
                                                   rebuild, shapes_and_types, subgraph_reads)

__all__ = ["PROBE_PREFIX", "STAND_IN_PREFIX", "UNITS_KEY", "attach_group_norm_adjoints", "detach_group_norms",
           "group_norm_probes"]

#: Name prefix of the stand-in inputs (x, k, t and the zero Q's) onnx-ad does not differentiate.
STAND_IN_PREFIX = "group_norm_stand_in__"
#: Name prefix of the zero probe added to a unit's output (its gradient is dy).
PROBE_PREFIX = "group_norm_probe__"
#: metadata_props key of the units detached, read back after differentiation.
UNITS_KEY = "onnx_ps.group_norms"

#: The first opset whose ReduceSum takes its axes as an input (ReduceMean from 18).
_REDUCE_SUM_AXES_AS_INPUT = 13
_REDUCE_AXES_AS_INPUT = 18
_FLOAT = onnx.TensorProto.FLOAT

#: A per-channel vector the unit reads: (its name, its element count: the channels, or 1 for all of them).
_Vector = tuple[str, int]


def detach_group_norms(model: onnx.ModelProto) -> int:
    """Each float32 InstanceNormalization of static shapes -- over a Reshape of [N, C, ...] into [N, G, M] and
    back, or over [N, C, ...] itself -- with the per-channel Mul and Add after it, computed from stand-ins and
    given its probe and zero terms (module docstring, step 1); in place. Returns the number detached. Undone by
    `attach_group_norm_adjoints` once the graph is differentiated."""
    opset = opset_of(model)
    graph = model.graph
    if opset < _REDUCE_SUM_AXES_AS_INPUT or not any(node.op_type == "InstanceNormalization" for node in graph.node):
        return 0    # no shape inference for the models without one: it runs on every model's build
    shapes, types = shapes_and_types(model)
    known = constants(model)
    producers = {out: node for node in graph.node for out in node.output}
    readers = readers_of(graph)
    outputs = {value.name for value in graph.output}
    emit = Emitter(model, "group_norm")
    units: list[dict] = []
    at_last: dict[int, list[onnx.NodeProto]] = {}    # the unit's nodes, in place of its last node
    dropped: dict[int, onnx.NodeProto] = {}   # by id, holding each (a repeated field's wrappers can be remade)
    inputs: list[onnx.ValueInfoProto] = []
    for node in graph.node:
        match = _match(node, producers, readers, outputs, shapes, types)
        if match is None:
            continue
        x, groups, gamma, beta, out, matched = match
        if any(id(n) in dropped for n in matched):
            continue
        nodes, unit, stand_ins = _detached(node, x, groups, gamma, beta, out, shapes[x], known, opset, emit)
        units.append(unit)
        inputs += stand_ins
        dropped.update((id(n), n) for n in matched)
        at_last[id(matched[-1])] = nodes
    if not units:
        return 0
    rebuild(model, emit, lambda node: at_last.get(id(node), [] if id(node) in dropped else None))
    graph.input.extend(inputs)
    entry = model.metadata_props.add()
    entry.key, entry.value = UNITS_KEY, json.dumps(units)
    return len(units)


def group_norm_probes(model: onnx.ModelProto) -> list[str]:
    """The probe inputs `detach_group_norms` added: differentiated beside the parameters."""
    return [value.name for value in model.graph.input if value.name.startswith(PROBE_PREFIX)]


def _match(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto], readers: dict[str, list[onnx.NodeProto]],
           outputs: set[str], shapes: dict[str, tuple[int, ...]], types: dict[str, int]
           ) -> tuple[str, int, _Vector | None, _Vector | None, str, list[onnx.NodeProto]] | None:
    """(x, groups, gamma and beta (name, element count) or None, the unit's output, its nodes in order) where
    `node` is the InstanceNormalization of a unit `detach_group_norms` takes, else None."""
    if node.op_type != "InstanceNormalization" or node.domain not in ("", "ai.onnx") or len(node.input) != 3:
        return None
    source, result = node.input[0], node.output[0]
    shape = shapes.get(source)
    if shape is None or len(shape) < 3 or types.get(source) != _FLOAT or \
            any(shapes.get(name) != (shape[1],) for name in node.input[1:]):
        return None
    matched = [node]
    x, groups, out = source, shape[1], result
    before = producers.get(source)
    if before is not None and before.op_type == "Reshape" and len(shape) == 3 and result not in outputs:
        original = shapes.get(before.input[0])
        back = readers.get(result, [])
        if original is not None and len(original) >= 3 and original[0] == shape[0] and \
                original[1] % shape[1] == 0 and math.prod(original) == math.prod(shape) and \
                len(back) == 1 and back[0].op_type == "Reshape" and back[0].input[0] == result and \
                shapes.get(back[0].output[0]) == original:
            x, out = before.input[0], back[0].output[0]
            matched.append(back[0])
    channels, rank = shapes[x][1], len(shapes[x])
    gamma = beta = None
    for op in ("Mul", "Add"):
        after = readers.get(out, [])
        if out in outputs or len(after) != 1 or after[0].op_type != op or out not in after[0].input[:2]:
            break
        other = after[0].input[1] if after[0].input[0] == out else after[0].input[0]
        if not _per_channel(shapes.get(other), channels, rank) or types.get(other) != _FLOAT or other == out or \
                shapes.get(after[0].output[0]) != shapes[x]:
            break
        if op == "Mul":
            gamma = (other, math.prod(shapes[other]))
        else:
            beta = (other, math.prod(shapes[other]))
        out = after[0].output[0]
        matched.append(after[0])
    return x, groups, gamma, beta, out, matched


def _per_channel(shape: tuple[int, ...] | None, channels: int, rank: int) -> bool:
    """Whether a value of `shape` broadcasts against [N, channels, ...] (`rank` axes) as one value per channel or
    one for all."""
    if shape is None or len(shape) > rank:
        return False
    full = (1,) * (rank - len(shape)) + tuple(shape)
    return full[0] == 1 and full[1] in (1, channels) and all(size == 1 for size in full[2:])


def _detached(norm: onnx.NodeProto, x: str, groups: int, gamma: _Vector | None, beta: _Vector | None, out: str,
              shape: tuple[int, ...], known: dict[str, np.ndarray], opset: int, emit: Emitter
              ) -> tuple[list[onnx.NodeProto], dict, list[onnx.ValueInfoProto]]:
    """The nodes of one detached unit, its description for the metadata, and its new graph inputs."""
    batch, channels = shape[0], shape[1]
    width, spatial = channels // groups, math.prod(shape[2:])
    size = width * spatial
    epsilon = next((a.f for a in norm.attribute if a.name == "epsilon"), 1e-5)
    write = Writer(emit)
    nodes, node, reshape = write.nodes, write.node, write.reshape

    def per_channel(value: str, count: int) -> str:   # [count] or broadcastable, as [channels]
        flat = reshape(value, [count])
        if count == channels:
            return flat
        return reshape(node("Expand", [reshape(flat, [count, 1]), emit.ints([count, channels // count])]),
                       [channels])

    # k and t from the unit's vectors: differentiated by onnx-ad, carrying dk and dt on to them
    # (a unit scale and zero shift, as torch writes a GroupNorm's, drop out: fewer small nodes either side)
    unit_scale, zero_shift = (_all(known.get(norm.input[i]), value) for i, value in ((1, 1.0), (2, 0.0)))
    gain = per_channel(*gamma) if gamma is not None else None
    k = t = None
    if not unit_scale:
        k = per_channel(norm.input[1], groups)
        k = node("Mul", [k, gain]) if gain else k
    if not zero_shift:
        t = per_channel(norm.input[2], groups)
        t = node("Mul", [t, gain]) if gain else t
    k = k or gain or _vector(emit, np.ones(channels, np.float32))
    if beta is not None:
        t = node("Add", [t, per_channel(*beta)]) if t else per_channel(*beta)
    t = t or _vector(emit, np.zeros(channels, np.float32))
    stand_x, stand_k, stand_t = (emit.name(STAND_IN_PREFIX + "value") for _ in range(3))
    zero_x, zero_k, zero_t = (emit.name(STAND_IN_PREFIX + "zero") for _ in range(3))
    probe = emit.name(PROBE_PREFIX + "y")
    # the value, from the stand-ins: c = x - mean and r = 1 / sqrt(var + eps) per group, kept for the adjoint
    grouped = reshape(stand_x, [batch, groups, size])
    centred = node("Sub", [grouped, _mean(grouped, opset, emit, nodes)])
    variance = _mean(node("Mul", [centred, centred]), opset, emit, nodes)
    eps = emit.scalar(epsilon)
    rate = node("Reciprocal", [node("Sqrt", [node("Add", [variance, eps])])])
    factor = node("Mul", [rate, reshape(stand_k, [1, groups, width])])          # r * k: [N, G, C / G]
    shifts = reshape(node("Expand", [reshape(stand_t, [1, channels]), emit.ints([batch, channels])]),
                     [batch * channels])
    normalized = _affine(reshape(centred, [1, batch * channels, spatial]), reshape(factor, [batch * channels]),
                         shifts, batch * channels, emit, nodes)
    value = reshape(normalized, list(shape))
    # the zero terms and the probe
    kt = node("Add", [node("Mul", [k, zero_k]), node("Mul", [t, zero_t])])
    terms = node("Add", [node("Mul", [x, zero_x]), reshape(kt, [channels] + [1] * (len(shape) - 2))])
    summed = node("Add", [value, terms])
    nodes.append(helper.make_node("Add", [summed, probe], [out], name=emit.name()))
    unit = {"x": x, "k": k, "t": t, "stand_x": stand_x, "stand_k": stand_k, "stand_t": stand_t,
            "zero_x": zero_x, "zero_k": zero_k, "zero_t": zero_t, "probe": probe, "value": value, "out": out,
            "centred": centred, "rate": rate, "factor": factor, "shape": list(shape), "groups": groups}
    declared = [helper.make_tensor_value_info(name, _FLOAT, dims) for name, dims in
                ((stand_x, list(shape)), (stand_k, [channels]), (stand_t, [channels]), (zero_x, [1]),
                 (zero_k, [channels]), (zero_t, [channels]), (probe, list(shape)))]
    return nodes, unit, declared


def _all(value: np.ndarray | None, equal: float) -> bool:
    """Whether `value` is a constant whose every element is `equal`."""
    return value is not None and bool(np.all(value == equal))


def _vector(emit: Emitter, value: np.ndarray) -> str:
    name = emit.name()
    emit.initializers.append(numpy_helper.from_array(value, name))
    return name


def _mean(value: str, opset: int, emit: Emitter, nodes: list[onnx.NodeProto]) -> str:
    """A keepdims ReduceMean of [N, G, M] `value` over its last axis, in the spelling of `opset`."""
    name = emit.name()
    if opset < _REDUCE_AXES_AS_INPUT:
        nodes.append(helper.make_node("ReduceMean", [value], [name], name=name, axes=[2], keepdims=1))
    else:
        nodes.append(helper.make_node("ReduceMean", [value, emit.ints([2])], [name], name=name, keepdims=1))
    return name


def _affine(value: str, scale: str, shift: str | None, count: int, emit: Emitter,
            nodes: list[onnx.NodeProto]) -> str:
    """[1, count, span] `value` times `scale` plus `shift` ([count] each; no shift where None) per row: a Mul and
    an Add, which a CPU session's copy runs as one inference BatchNormalization (rewrites/affine.py). Not written
    as that kernel here: the gradient graph serves CUDA too, where cuDNN's epsilon cannot be 0."""
    column, scaled = emit.name(), emit.name()
    nodes += [emit.reshape(scale, [count, 1], out=column)[0],
              helper.make_node("Mul", [value, column], [scaled], name=scaled)]
    if shift is None:
        return scaled
    offsets, shifted = emit.name(), emit.name()
    nodes += [emit.reshape(shift, [count, 1], out=offsets)[0],
              helper.make_node("Add", [scaled, offsets], [shifted], name=shifted)]
    return shifted


def attach_group_norm_adjoints(model: onnx.ModelProto, prefix: str) -> int:
    """The differentiated graph of a model `detach_group_norms` rewrote, completed and put back, in place (module
    docstring, step 2): onnx-ad's adjoint of each zero term replaced by dx, dk or dt of the unit, the stand-ins
    read as their values, the probes and zero terms dropped. Returns the number of adjoints written."""
    entry = next((p for p in model.metadata_props if p.key == UNITS_KEY), None)
    if entry is None:
        return 0
    units = json.loads(entry.value)
    kept = [p for p in model.metadata_props if p.key != UNITS_KEY]
    model.ClearField("metadata_props")
    model.metadata_props.extend(kept)
    graph = model.graph
    shapes = shapes_and_types(model)[0]
    emit = Emitter(model, "group_norm_adjoint")
    outputs = {value.name for value in graph.output}
    aliases: dict[str, str] = {}     # a zero stand-in and the values onnx-ad reshaped it into -> the stand-in
    for node in graph.node:
        source = node.input[0] if node.input else ""
        if node.op_type in ("Unsqueeze", "Reshape", "Identity") and (source in aliases or source.startswith(
                STAND_IN_PREFIX + "zero")):
            aliases[node.output[0]] = aliases.get(source, source)
    renamed: dict[str, str] = {}
    dropped: dict[int, onnx.NodeProto] = {}   # by id, holding each (a repeated field's wrappers can be remade)
    added: list[onnx.NodeProto] = []
    written = 0
    for unit in units:
        renamed.update({unit["stand_x"]: unit["x"], unit["stand_k"]: unit["k"], unit["stand_t"]: unit["t"],
                        unit["value"]: unit["out"]})
        for node in graph.node:
            if node.output and node.output[0] == unit["out"] and unit["probe"] in node.input:
                dropped[id(node)] = node      # value + zero terms + probe: the value is the output again
        anchors: dict[str, onnx.NodeProto] = {}
        for node in graph.node:
            if node.op_type != "Mul":
                continue
            for name in node.input:
                zero = aliases.get(name, name)
                if zero in (unit["zero_x"], unit["zero_k"], unit["zero_t"]) and name != zero:
                    if zero in anchors:
                        raise ValueError(f"group norm {unit['out']!r}: onnx-ad read the zero stand-in {zero!r} "
                                         f"in two adjoint products, {anchors[zero].output[0]!r} and "
                                         f"{node.output[0]!r}")
                    anchors[zero] = node
        dy = prefix + unit["probe"]
        if not anchors or dy not in outputs:
            continue
        nodes, values = _adjoints(unit, dy, {key: unit["zero_" + key] in anchors for key in "xkt"}, emit)
        for key, value in values.items():
            anchor = anchors[unit["zero_" + key]]
            target = shapes.get(anchor.output[0]) or \
                (*(unit["shape"] if key == "x" else [unit["shape"][1]]), 1)
            nodes.append(emit.reshape(value, list(target), out=anchor.output[0])[0])
            dropped[id(anchor)] = anchor
            written += 1
        added += nodes
    nodes = [node for node in graph.node if id(node) not in dropped] + added
    for node in nodes:
        node.input[:] = [renamed.get(name, name) for name in node.input]
        node.output[:] = [renamed.get(name, name) for name in node.output]
    graph.ClearField("node")
    graph.node.extend(_topological(nodes, graph))
    graph.initializer.extend(emit.initializers)
    gone = {name for unit in units for name in (unit["stand_x"], unit["stand_k"], unit["stand_t"], unit["zero_x"],
                                                 unit["zero_k"], unit["zero_t"], unit["probe"])}
    drop_values(graph, gone | {prefix + unit["probe"] for unit in units}, renamed)
    prune(model)      # the zero terms, onnx-ad's adjoints of the Q's and the reductions that fed the anchors
    return written


def _adjoints(unit: dict, dy: str, wanted: dict[str, bool], emit: Emitter
              ) -> tuple[list[onnx.NodeProto], dict[str, str]]:
    """The nodes computing the unit's dx, dk and dt (those `wanted`), and their names by key (module docstring)."""
    shape, groups = unit["shape"], unit["groups"]
    batch, channels = shape[0], shape[1]
    width, spatial = channels // groups, math.prod(shape[2:])
    size = width * spatial
    write = Writer(emit)
    nodes, node, reshape = write.nodes, write.node, write.reshape

    def summed(value: str, axis: int, keepdims: int) -> str:
        name = emit.name()
        nodes.append(helper.make_node("ReduceSum", [value, emit.ints([axis])], [name], name=name,
                                      keepdims=keepdims))
        return name

    rows = reshape(dy, [batch, channels, spatial])
    centred = reshape(unit["centred"], [batch, channels, spatial])
    values: dict[str, str] = {}
    projected = summed(node("Mul", [rows, centred]), 2, 0) if wanted["x"] or wanted["k"] else ""   # ds [N, C]
    totals = summed(rows, 2, 0) if wanted["x"] or wanted["t"] else ""                             # db [N, C]
    if wanted["k"]:
        rates = reshape(node("Expand", [unit["rate"], emit.ints([batch, groups, width])]), [batch, channels])
        values["k"] = summed(node("Mul", [projected, rates]), 0, 0)
    if wanted["t"]:
        values["t"] = summed(totals, 0, 0)
    if wanted["x"]:
        gains = reshape(unit["k"], [1, channels])
        inverse = emit.scalar(-1.0 / size)

        def per_group(value: str) -> str:   # sum over each group's channels of k * value, times -1 / M: [N, G, 1]
            return node("Mul", [summed(reshape(node("Mul", [value, gains]), [batch, groups, width]), 2, 1),
                                inverse])

        rate = unit["rate"]
        slope = node("Mul", [node("Mul", [node("Mul", [rate, rate]), rate]), per_group(projected)])   # A
        offset = node("Mul", [rate, per_group(totals)])                                                # B
        linear = _affine(reshape(unit["centred"], [1, batch * groups, size]), reshape(slope, [batch * groups]),
                         reshape(offset, [batch * groups]), batch * groups, emit, nodes)
        scaled = _affine(reshape(rows, [1, batch * channels, spatial]), reshape(unit["factor"], [batch * channels]),
                         None, batch * channels, emit, nodes)
        values["x"] = node("Add", [scaled, reshape(linear, [1, batch * channels, spatial])])
    return nodes, values


def _topological(nodes: list[onnx.NodeProto], graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """`nodes` in an order where each comes after the nodes whose outputs it reads, otherwise as given."""
    produced = {name: index for index, node in enumerate(nodes) for name in node.output if name}
    waiting: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    for index, node in enumerate(nodes):
        sources = {produced[name] for name in set(node.input) | subgraph_reads(node) if name in produced}
        sources.discard(index)
        waiting[index] = len(sources)
        for source in sources:
            readers.setdefault(source, []).append(index)
    ready = [index for index, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order: list[onnx.NodeProto] = []
    while ready:
        index = heapq.heappop(ready)
        order.append(nodes[index])
        for reader in readers.get(index, []):
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, reader)
    if len(order) != len(nodes):
        raise ValueError(f"graph {graph.name!r}: {len(nodes) - len(order)} node(s) in a cycle after the group "
                         f"norms' adjoints were written")
    return order
