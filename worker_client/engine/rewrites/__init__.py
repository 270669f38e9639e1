"""Stage "rewrite": exact graph rewrites that steer the model onto onnxruntime's fast kernels.

Every pass computes the same values as the graph it replaces (tests/unit/
test_gradient_engine.py checks each one); each module's docstrings say which slow path it
avoids and why the replacement is exact.

- `grouped`: grouped and depthwise Convs with a trainable weight as a batched MatMul over
  the kernel windows (on the forward graph: onnx-ad has no weight adjoint for group > 1);
- `matmul`: batched weight MatMuls flattened to one GEMM (on the forward graph, so that
  onnx-ad's weight adjoint is one GEMM too);
- `fold`: shape queries on static tensors folded into constants;
- `conv`: onnx-ad's conv, average-pool and max-pool adjoints as cheaper ops; conv input
  adjoints (ConvTranspose) as Convs;
- `scatter`: Gather adjoints that rebuild a whole tensor from its pieces (an attention's
  query, key and value) as one Concat;
- `layout`: transposes, reductions and broadcasts over size-1 axes (the seed axis) without
  those axes;
- `prune`: nodes and initializers nothing reads, dropped;
- `nchwc`: Convs with fed weights on onnxruntime's channel-blocked CPU kernels (applied to a CPU
  session's copy of the graph when it is opened, never to the cached graph: the layout is the CPU's);
- `toolkit`: what the passes share (static shapes, constants, fresh names).
"""

from __future__ import annotations

import onnx

from worker_client.engine.rewrites.conv import (
    assign_unique_scatters,
    flip_unit_stride_transposed_convs,
    gemm_large_kernel_convs,
    resize_window_spreads,
    route_max_pool_adjoints,
    split_strided_transposed_convs,
)
from worker_client.engine.rewrites.fold import fold_shape_queries
from worker_client.engine.rewrites.grouped import expand_grouped_convs
from worker_client.engine.rewrites.layout import canonicalize_layout_ops
from worker_client.engine.rewrites.matmul import flatten_weight_matmuls
from worker_client.engine.rewrites.prune import prune
from worker_client.engine.rewrites.scatter import concat_piecewise_scatters

__all__ = ["rewrite_adjoints", "rewrite_forward"]


def rewrite_forward(model: onnx.ModelProto) -> onnx.ModelProto:
    """The loss model before differentiation, rewritten in place and returned.

    Its inferred shapes are dropped when anything changed; differentiation infers afresh.
    """
    changed = expand_grouped_convs(model)
    changed += flatten_weight_matmuls(model)
    if changed:
        model.graph.ClearField("value_info")
    return model


def rewrite_adjoints(model: onnx.ModelProto) -> onnx.ModelProto:
    """The differentiated model, rewritten in place and returned; the passes run in order."""
    fold_shape_queries(model)           # everything static, so the passes below apply
    gemm_large_kernel_convs(model)
    resize_window_spreads(model)
    flip_unit_stride_transposed_convs(model)
    split_strided_transposed_convs(model)
    route_max_pool_adjoints(model)
    assign_unique_scatters(model)
    concat_piecewise_scatters(model)
    canonicalize_layout_ops(model)
    prune(model)
    return model
