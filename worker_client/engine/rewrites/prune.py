"""Dead nodes and initializers dropped: the clean-up after onnx-ad and the other rewrites."""

from __future__ import annotations

from collections.abc import Iterable

import onnx

from worker_client.engine.rewrites.toolkit import subgraph_reads

__all__ = ["live", "prune"]


def _node_reads(node: onnx.NodeProto) -> set[str]:
    """Every name a node reads, its subgraphs (which may capture outer names) included."""
    return {name for name in node.input if name} | subgraph_reads(node)


def live(graph: onnx.GraphProto, outputs: Iterable[str]) -> tuple[list[onnx.NodeProto], set[str]]:
    """The nodes `outputs` depend on, in the graph's order, and the names of every value they depend on
    (`outputs` themselves included)."""
    needed = set(outputs)
    nodes = []
    for node in reversed(graph.node):
        if any(name in needed for name in node.output):
            nodes.append(node)
            needed |= _node_reads(node)
    nodes.reverse()
    return nodes, needed


def prune(model: onnx.ModelProto) -> None:
    """Drop nodes and initializers no output depends on, in place.

    onnx-ad's constant folding leaves dead Constant nodes and initializers behind, and
    onnxruntime logs a warning for every one of them.
    """
    graph = model.graph
    live_nodes, needed = live(graph, (value.name for value in graph.output))
    graph.ClearField("node")
    graph.node.extend(live_nodes)
    kept = [tensor for tensor in graph.initializer if tensor.name in needed]
    graph.ClearField("initializer")
    graph.initializer.extend(kept)
