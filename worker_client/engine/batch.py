"""Stage "batch": the batch axis of every data input fixed to the training batch size."""

from __future__ import annotations

from collections.abc import Sequence

import onnx

from worker_client.engine.support import infer_shapes

__all__ = ["fix_batch"]


def fix_batch(lifted: onnx.ModelProto, inputs: Sequence[str],
              batch_size: int) -> onnx.ModelProto:
    """A copy of `lifted` whose `inputs` have a batch axis of `batch_size`, shapes inferred."""
    model = onnx.ModelProto()
    model.CopyFrom(lifted)
    _fix_batch_axis(model, inputs, batch_size)
    return infer_shapes(model)


def _fix_batch_axis(model: onnx.ModelProto, inputs: Sequence[str], batch_size: int) -> None:
    """Set axis 0 of `inputs`, every input dimension sharing its symbol, and axis 0 of the outputs where it is that
    symbol, to `batch_size`; an output's later axes with the symbol become unknown.

    Several onnx-ad rules (Conv's input adjoint, for one) need static shapes; the batch is
    the one dimension a training step fixes.
    """
    graph = model.graph
    symbols: set[str] = set()
    for value in graph.input:
        if value.name not in inputs:
            continue
        dims = value.type.tensor_type.shape.dim
        if not value.type.tensor_type.HasField("shape") or len(dims) == 0:
            continue  # a scalar input (a flag, a rate) has no batch axis
        first = dims[0]
        if first.HasField("dim_value"):
            if first.dim_value != batch_size:
                raise ValueError(
                    f"input {value.name!r} has a fixed batch dimension of {first.dim_value}, "
                    f"but batch_size={batch_size}; export the model with a dynamic batch "
                    f"axis or use batch_size={first.dim_value}")
            continue
        if first.dim_param:
            symbols.add(first.dim_param)
        first.Clear()
        first.dim_value = batch_size
    for value in graph.input:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param in symbols:
                dim.Clear()
                dim.dim_value = batch_size
    for value in graph.output:
        # an output's other axes are left to inference: torch's exporter has named a feature map's height
        # "batch" (after a Concat and a Pad), which fixed to the batch size contradicted the computed shape
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.HasField("dim_param") and dim.dim_param in symbols:
                dim.Clear()
                if axis == 0:
                    dim.dim_value = batch_size
    graph.ClearField("value_info")  # stale wherever the batch was symbolic
