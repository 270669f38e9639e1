"""Dead nodes and initializers dropped: the clean-up after onnx-ad and the other rewrites."""

from __future__ import annotations

import onnx

from worker_client.engine.rewrites.toolkit import subgraph_reads

__all__ = ["prune"]


def _node_reads(node: onnx.NodeProto) -> set[str]:
    """Every name a node reads, its subgraphs (which may capture outer names) included."""
    return {name for name in node.input if name} | subgraph_reads(node)


def prune(model: onnx.ModelProto) -> None:
    """Drop nodes and initializers no output depends on, in place.

    onnx-ad's constant folding leaves dead Constant nodes and initializers behind, and
    onnxruntime logs a warning for every one of them.
    """
    graph = model.graph
    needed = {value.name for value in graph.output}
    live = []
    for node in reversed(graph.node):
        if any(name in needed for name in node.output):
            live.append(node)
            needed |= _node_reads(node)
    live.reverse()
    graph.ClearField("node")
    graph.node.extend(live)
    kept = [tensor for tensor in graph.initializer if tensor.name in needed]
    graph.ClearField("initializer")
    graph.initializer.extend(kept)
