"""Per-channel scales and shifts as onnxruntime's BatchNormalization kernel, on the CPU.

A training-mode BatchNorm scales and shifts its activations by per-channel vectors twice a step: the
forward's x_c * k + beta, and its adjoint's g * k1 + x_c * k2 + k3; other layers do it once (a per-channel
bias, a squeeze-and-excitation gate). onnxruntime's CPU Mul and Add broadcast [N, C, H, W] against
[1, C, 1, 1] one H x W span at a time, and each is a pass of its own over the tensor. Its inference
BatchNormalization computes x * scale + bias per channel in one pass, its loop made for exactly that
layout: with mean 0, variance 1 and epsilon 0 it is x * scale + bias (1 / sqrt(1 + 0) is 1). One
thread, batch 32, median ms of a Mul then an Add against one BatchNormalization: [32, 64, 32, 32]
0.49 / 0.17, [32, 128, 16, 16] 0.23 / 0.098, [32, 256, 8, 8] 0.19 / 0.050, [32, 512, 4, 4] 0.25 / 0.042;
a Mul alone on [32, 512, 4, 4] took 0.12. BatchNormalization runs on one thread, so at two threads
the pair's lead shrinks on large maps ([32, 64, 32, 32] 0.25 / 0.20) and from three threads on it would
lose there; on small maps it holds at any count ([32, 512, 4, 4] at two threads 0.13 / 0.043). With one
element per channel and row ([B * T, D] by [D]: a LayerNorm's affine) nothing is gained (0.156 / 0.153
on [32, 64, 384]), so that is left alone.

Rewritten, for float32 values of static shape, where the vectors vary along one axis only and the other
operand has the result's full shape:
- Add(Mul(x, a), c) and Sub(Mul(x, a), c): BatchNormalization(x, a, +-c), wherever an axis' span (the
  elements after it) is between 2 and MAX_SPAN, and on any span when the session runs on at most
  MAX_WIDE_THREADS threads;
- Add(Add(u, Mul(x, a)), c) (the adjoint's form, either operand order): Add(u, BatchNormalization(x, a, c)),
  under the same rule -- one pass less;
- a lone Mul(x, a), Add(x, c) or Sub(x, c) where the span is between 2 and MAX_SPAN;
each on results of at least MIN_ELEMENTS elements.
Identity Reshapes (the same static shape in and out) between the nodes are looked through. The result
equals the unfused arithmetic up to float32 rounding (a sum's terms may be added in another order); where a
scale is infinite, onnxruntime's kernel folds it into the shift (shift - 0 * scale) and the whole channel
comes out NaN, not infinite -- non-finite either way, and a shard refuses a push of either alike.

Applied to a CPU session's copy of a graph when it is opened (as rewrites/nchwc.py), never to the cached
gradient graph: the figures are onnxruntime's CPU kernels'.
"""

from __future__ import annotations

import math
import os

import numpy as np
import onnx
from onnx import helper, numpy_helper

from worker_client.engine.rewrites.toolkit import Emitter, opset_of, reader_counts, shapes_and_types

__all__ = ["MAX_SPAN", "MAX_WIDE_THREADS", "MIN_ELEMENTS", "channel_affines"]

#: The longest span (elements per channel and row) on which a lone per-channel op, or a pair on a session of
#: more than MAX_WIDE_THREADS threads, is moved: at 64 ([32, 256, 8, 8]) a lone Mul took 0.096 ms at one
#: thread and 0.052 at two, BatchNormalization 0.050 and 0.052; at 256 the lone Mul is close at one thread
#: (0.112 / 0.098) and ahead at two (0.060 / 0.102).
MAX_SPAN = 64
#: Intra-op threads up to which a pair is fused on any span (measured at one and two).
MAX_WIDE_THREADS = 2
#: The fewest elements a rewritten result has: below, the nodes' fixed costs (the vectors' Reshapes among them)
#: outweigh the passes saved (a softmax adjoint's [4, 10, 1] by [4, 1, 1] is left as it is).
MIN_ELEMENTS = 2 ** 14
#: The first opset of BatchNormalization without the `spatial` attribute (every input per channel).
_OPSET = 9
_FLOAT = onnx.TensorProto.FLOAT


def channel_affines(model: onnx.ModelProto, threads: int | None) -> int:
    """Rewrite the main graph's per-channel scales and shifts as BatchNormalization (module docstring), in
    place; `threads` is the session's intra-op thread count (None: onnxruntime's default, one per core).
    Returns the number of results rewritten."""
    if opset_of(model) < _OPSET or not any(n.op_type in ("Mul", "Add", "Sub") for n in model.graph.node):
        return 0
    wide = (threads or os.cpu_count() or 1) <= MAX_WIDE_THREADS   # 0 or None: onnxruntime's default, a thread a core
    return _Fuser(model, wide).run()


class _Fuser:
    def __init__(self, model: onnx.ModelProto, wide: bool) -> None:
        self.model, self.wide = model, wide
        self.shapes, self.types = shapes_and_types(model)
        self.readers = reader_counts(model.graph)
        self.producer = {out: node for node in model.graph.node for out in node.output}
        self.emit = Emitter(model, "affine")
        self.dropped: set[int] = set()      # id() of nodes whose work moved into a BatchNormalization
        self.replaced: dict[int, list[onnx.NodeProto]] = {}
        self._fills: dict[tuple[int, float], str] = {}

    def run(self) -> int:
        nodes = list(self.model.graph.node)
        for node in nodes:      # pairs first: their Muls must not be taken as lone ones
            if node.op_type in ("Add", "Sub") and node.domain in ("", "ai.onnx"):
                self._pair(node)
        for node in nodes:
            if node.op_type in ("Mul", "Add", "Sub") and node.domain in ("", "ai.onnx") and \
                    id(node) not in self.dropped and id(node) not in self.replaced:
                self._lone(node)
        if not self.replaced:
            return 0
        kept: list[onnx.NodeProto] = []
        for node in nodes:
            if id(node) in self.dropped:
                continue
            kept.extend(self.replaced.get(id(node), [node]))
        self.model.graph.ClearField("node")
        self.model.graph.node.extend(kept)
        self.model.graph.initializer.extend(self.emit.initializers)
        return len(self.replaced)

    # -- matching

    def _full(self, node: onnx.NodeProto) -> tuple[int, ...] | None:
        """The static float32 shape of the node's result, when it has one of rank 2 or more."""
        shape = self.shapes.get(node.output[0])
        if shape is None or len(shape) < 2 or self.types.get(node.output[0]) != _FLOAT or \
                math.prod(shape) < MIN_ELEMENTS:
            return None
        return shape

    def _axis(self, name: str, full: tuple[int, ...]) -> int | None:
        """The one axis along which `name` (broadcast to `full`) varies, where it is a float32 vector of that
        axis' length; None otherwise."""
        shape = self.shapes.get(name)
        if shape is None or len(shape) > len(full) or self.types.get(name) != _FLOAT:
            return None
        padded = (1,) * (len(full) - len(shape)) + tuple(shape)
        varying = [axis for axis, size in enumerate(padded) if size != 1]
        if len(varying) != 1 or padded[varying[0]] != full[varying[0]]:
            return None
        return varying[0]

    def _span_allows(self, full: tuple[int, ...], axis: int, pair: bool) -> bool:
        span = math.prod(full[axis + 1:])
        return span >= 2 and (span <= MAX_SPAN or (pair and self.wide))

    def _through(self, name: str) -> tuple[str, list[onnx.NodeProto]]:
        """`name` traced back through Reshapes that keep its static shape and are read only once: (the value they
        reshape, those Reshapes)."""
        chain = []
        while True:
            node = self.producer.get(name)
            if node is None or node.op_type != "Reshape" or self.readers[name] != 1 or \
                    self.shapes.get(node.input[0]) is None or self.shapes.get(node.input[0]) != self.shapes.get(name):
                return name, chain
            chain.append(node)
            name = node.input[0]

    def _scaled(self, name: str, full: tuple[int, ...], axis: int) -> tuple[str, str, list[onnx.NodeProto]] | None:
        """(x, a, the nodes to drop) where `name`, read once, is Mul(x, a) -- x of shape `full`, a a vector of
        `axis` -- seen through identity Reshapes; else None."""
        if self.readers[name] != 1:
            return None
        source, chain = self._through(name)
        node = self.producer.get(source)
        if node is None or node.op_type != "Mul" or node.domain not in ("", "ai.onnx") or \
                self.readers[source] != 1 or id(node) in self.dropped or id(node) in self.replaced:
            return None
        found = self._vector_operand(node, full, axis)
        return None if found is None else (found[0], found[1], [node, *chain])

    def _vector_operand(self, node: onnx.NodeProto, full: tuple[int, ...], axis: int | None = None
                        ) -> tuple[str, str, int, bool] | None:
        """(the operand of shape `full`, the vector, its axis, whether the vector is subtracted) of a Mul, Add or
        Sub of the two (in either order, but a Sub's vector second); with `axis`, only a vector of that axis."""
        orders = [(0, 1)] if node.op_type == "Sub" else [(0, 1), (1, 0)]
        for this, other in orders:
            found = self._axis(node.input[other], full)
            if found is not None and (axis is None or found == axis) and self.shapes.get(node.input[this]) == full:
                return node.input[this], node.input[other], found, node.op_type == "Sub"
        return None

    def _pair(self, node: onnx.NodeProto) -> None:
        full = self._full(node)
        found = self._vector_operand(node, full) if full is not None else None
        if found is None:
            return
        operand, shift, axis, negate = found
        if not self._span_allows(full, axis, pair=True):
            return
        scaled = self._scaled(operand, full, axis)
        if scaled is not None:   # Add(Mul(x, a), c)
            x, scale, drop = scaled
            self._fuse(node, x, scale, shift, negate, axis, full, drop, [])
            return
        if negate or self.readers[operand] != 1:
            return
        source, chain = self._through(operand)
        total = self.producer.get(source)
        if total is None or total.op_type != "Add" or total.domain not in ("", "ai.onnx") or \
                self.readers[source] != 1 or id(total) in self.replaced or id(total) in self.dropped:
            return
        for rest, term in (total.input, reversed(total.input)):
            scaled = self._scaled(term, full, axis) if self.shapes.get(rest) == full else None
            if scaled is not None:   # Add(Add(u, Mul(x, a)), c)
                x, scale, drop = scaled
                self._fuse(node, x, scale, shift, False, axis, full, [*drop, total, *chain], [rest])
                return

    def _lone(self, node: onnx.NodeProto) -> None:
        full = self._full(node)
        found = self._vector_operand(node, full) if full is not None else None
        if found is None or not self._span_allows(full, found[2], pair=False):
            return
        x, vector, axis, negate = found
        scale, shift = (vector, None) if node.op_type == "Mul" else (None, vector)
        self._fuse(node, x, scale, shift, negate, axis, full, [], [])

    # -- emitting

    def _fill(self, channels: int, value: float) -> str:
        key = (channels, value)
        if key not in self._fills:
            name = self.emit.name()
            self.emit.initializers.append(numpy_helper.from_array(np.full(channels, value, np.float32), name))
            self._fills[key] = name
        return self._fills[key]

    def _fuse(self, node: onnx.NodeProto, x: str, scale: str | None, shift: str | None, negate: bool, axis: int,
              full: tuple[int, ...], drop: list[onnx.NodeProto], added: list[str]) -> None:
        """`node`'s result as BatchNormalization(x, scale, +-shift) (plus `added`, when given), the nodes in
        `drop` removed."""
        channels = full[axis]
        nodes: list[onnx.NodeProto] = []
        vectors = []
        for which, (vector, fill) in enumerate(((scale, 1.0), (shift, 0.0))):
            if vector is None:
                vectors.append(self._fill(channels, fill))
                continue
            if which == 1 and negate:
                flipped = self.emit.name()
                nodes.append(helper.make_node("Neg", [vector], [flipped], name=flipped))
                vector = flipped
            reshape, flat = self.emit.reshape(vector, [channels])
            nodes.append(reshape)
            vectors.append(flat)
        direct = axis == 1 and len(full) >= 3   # [N, C, ...] as it is; else as [outer, C, span]
        source = x
        if not direct:
            lift, source = self.emit.reshape(x, [math.prod(full[:axis]), channels, math.prod(full[axis + 1:])])
            nodes.append(lift)
        final = node.output[0]
        affine = final if direct and not added else self.emit.name()
        nodes.append(helper.make_node("BatchNormalization", [source, *vectors, self._fill(channels, 0.0),
                                                             self._fill(channels, 1.0)],
                                      [affine], name=self.emit.name(), epsilon=0.0))
        if not direct:
            shaped = final if not added else self.emit.name()
            nodes.append(helper.make_node("Reshape", [affine, self.emit.ints(list(full))], [shaped],
                                          name=self.emit.name()))
            affine = shaped
        if added:
            nodes.append(helper.make_node("Add", [added[0], affine], [final], name=self.emit.name()))
        # the node that writes the result keeps the replaced node's name; every other name is new (a node's name
        # is often its output's, which the Reshapes above would otherwise take twice)
        nodes[-1].name = node.name or nodes[-1].name
        for dropped in drop:
            self.dropped.add(id(dropped))
        self.replaced[id(node)] = nodes
