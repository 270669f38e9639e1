"""Small hand-built models around one Scan, as the Scan-body passes' tests build them."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

#: The opset and IR version the hand-built models declare.
OPSET, IR_VERSION = 17, 9


def scan_model(scan: onnx.NodeProto, inputs: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
    """A model of the one node `scan`, fed `inputs` and handing out every output of the Scan (float32)."""
    graph = helper.make_graph([scan], "reverse", inputs,
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in scan.output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return model


def body_ops(model: onnx.ModelProto) -> list[str]:
    """The op types of the body of the model's (first) Scan, in order."""
    scan = next(n for n in model.graph.node if n.op_type == "Scan")
    return [n.op_type for n in next(a.g for a in scan.attribute if a.name == "body").node]


def reverse_op_counts(model: onnx.ModelProto, op_type: str) -> list[int]:
    """How many `op_type` nodes each reverse sweep's body holds (onnx-ad names those bodies "...adjoint...")."""
    bodies = [next(a.g for a in scan.attribute if a.name == "body")
              for scan in model.graph.node if scan.op_type == "Scan"]
    return [sum(n.op_type == op_type for n in body.node) for body in bodies if "adjoint" in body.name]
