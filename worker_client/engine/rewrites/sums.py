"""onnx-ad's gradient accumulations of two terms as Add: onnxruntime's CPU Sum runs on one thread.

A tensor read by several nodes gets one adjoint from each reader, and onnx-ad adds them with
Sum (a residual block's input, a weight tied to two layers). onnxruntime's CPU Sum kernel is
one loop on the calling thread, where Add, the same arithmetic and broadcasting for two
inputs, splits its work over the intra-op pool: on a (32, 64, 32, 32) float tensor, 0.97 ms
against 0.54 ms with two threads, and 0.96 against 1.01 ms with one. A Sum of three or more
terms stays: a chain of Adds would pass over the data once per term.
"""

from __future__ import annotations

import onnx

__all__ = ["sums_as_adds"]


def sums_as_adds(model: onnx.ModelProto) -> int:
    """Each Sum of exactly two inputs in the main graph turned into an Add, in place; returns how many."""
    changed = 0
    for node in model.graph.node:
        if node.op_type == "Sum" and node.domain in ("", "ai.onnx") and len(node.input) == 2:
            node.op_type = "Add"
            changed += 1
    return changed
