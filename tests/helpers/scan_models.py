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
