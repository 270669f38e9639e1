"""Stage "rewrite": exact graph rewrites that steer the model onto onnxruntime's fast kernels.

Every pass computes the same values as the graph it replaces (tests/unit/
test_gradient_engine.py and the test files named after the passes check each one); each module's
docstrings say which slow path it avoids and why the replacement is exact, or, where it regroups
arithmetic (`gates`, `batch_norms`, `accumulators`), equal to rounding.

- `transposed`: ConvTransposes with a trainable weight as Convs with the kernel swapped and
  reversed (on the forward graph: onnx-ad has no weight adjoint for ConvTranspose), and, after
  differentiation, the forward value of those whose phase Convs are the slower as the ConvTranspose again;
- `grouped`: grouped and depthwise Convs, and strided ConvTransposes, whose weight trains keep their
  kernel, their weight detached from onnx-ad (on the forward graph) and its adjoint written by the
  engine after differentiation (onnx-ad has no weight adjoint for either); one whose weight is computed in
  the graph, as a batched MatMul over the kernel windows;
- `indexing`: Slices with a step other than 1 and Pads in mode edge, reflect or wrap as
  step-1 Slices, Reshapes and Gathers (on the forward graph, after the two above, which write
  stepped Slices themselves: onnx-ad differentiates neither form);
- `matmul`: batched weight MatMuls flattened to one GEMM (on the forward graph, so that
  onnx-ad's weight adjoint is one GEMM too);
- `batch_norms`: a normalization by the batch's statistics with its variance reading the mean
  through a stand-in and the mean's derivative carried by a zero per-channel term (on the forward
  graph; the stand-in is read as the mean again after differentiation): two passes fewer in its
  adjoint;
- `detaches`: torch's detach() (an Identity with the dynamo exporter's record) read through a stand-in
  that onnx-ad does not differentiate (on the forward graph; the detached value is read again after
  differentiation): a straight-through estimator's gradient is torch's, not zero;
- `singular`: square roots, fractional powers and L2 norms written with a zero derivative at exactly
  zero, as torch's ReLU and norm adjoints give (on the forward graph: onnx-ad's inf there, times a ReLU
  adjoint's zero mask, is NaN);
- `fold`: shape queries on static tensors folded into constants (and, on both graphs, small float arithmetic on
  constants);
- `powers`: Pows by a constant exponent (a square's adjoint is Pow(x, 1)) as products, roots and reciprocals
  (after differentiation: onnxruntime's Pow is libm's pow at every element but for the exponents 2 and 3);
- `conv`: onnx-ad's conv, average-pool and max-pool adjoints as cheaper ops; conv input
  adjoints (ConvTranspose) as Convs; a Conv's or pool's auto_pad as explicit pads (on the
  forward graph: onnx-ad refuses SAME); a ConvTranspose's output_shape as the pads it implies
  (onnx's shape inference gets the first wrong, and onnxruntime ignores the pads onnx-ad
  writes beside it, on both graphs);
- `sequences`: a SplitToSequence read only at constant positions (torch's chunk and split, from
  the dynamo exporter with optimize=False) as one Split (on the forward graph: onnx-ad
  differentiates no sequence op);
- `pools`: ceil-mode pools: the flag dropped where no window overhangs, and an overhanging
  AveragePool as a zero-padded one times a constant per position (on the forward graph:
  onnx-ad refuses ceil_mode);
- `scatter`: Gather adjoints that rebuild a whole tensor from its pieces (an attention's
  query, key and value), and Slice adjoints (zero Pads) that do the same (an LSTM's gates), as
  one Concat;
- `attention`: a softmax adjoint's row sums, sum_j P dP, where P feeds an attention's MatMul O = P @ V alone, as
  sum_d dO O (FlashAttention's): passes over [.., T, d] instead of [.., T, T] (equal to rounding);
- `sums`: onnx-ad's gradient accumulations of two terms (Sum) as Add, which onnxruntime runs on
  its intra-op pool (its Sum runs on one thread);
- `layout`: transposes, reductions and broadcasts over size-1 axes (the seed axis) without
  those axes; the block-gathering Transpose of a DepthToSpace's (PixelShuffle's) adjoint as one
  SpaceToDepth;
- `masks`: masked adjoints, Where(mask, g, 0), as g times the cast mask (onnxruntime's Where is
  neither vectorized nor parallel);
- `gates`: SiLU's and an exact GELU's input adjoints from the forward's values, in fewer passes
  than onnx-ad's term-by-term form (equal to float32 rounding, not bit for bit);
- `broadcasts`: an Expand (a reduction's adjoint) and the scalar ops after it left to the
  readers that broadcast anyway, instead of materialized at full size;
- `matmul` (on the adjoints): a sum over a batched product's batches (the input weight gradient
  of an LSTM or GRU that onnx-ad expands) as one GEMM of the batches side by side; a Transpose of
  a matrix product as the product of the transposed operands, so a Linear layer's weight gradient
  is not transposed whole after its GEMM;
- `outputs`: each gradient output written by the node that computes it, not copied there by
  onnx-ad's seed-axis Reshape;
- `prune`: nodes and initializers nothing reads, dropped;
- `scans`: the pruning, broadcast and no-op passes (`layout.drop_no_op_layout_ops`) run inside each
  Scan body, which onnxruntime runs once per time step;
- `recurrences`: a recurrent layer's reverse sweep reads the gates its forward sweep computed (taped
  per step) instead of computing them again;
- `accumulators`: a Scan state that sums one matrix product per step (a recurrent weight's gradient
  in the reverse sweep) as one product of the stacked steps after the Scan (equal to rounding);
- `step_factors`: a Scan body's product of a state by two factors that read no state, regrouped so the
  factors meet first (equal to rounding), which the stateless pass then computes outside the loop;
- `stateless`: a Scan body's nodes that read no state of the loop (the reverse sweep's gate derivatives
  from the forward's tapes) computed before the Scan for all steps at once;
- `gate_products`: a reverse step's per-gate products with the recurrent weights, summed, as one GEMM of
  the gates' adjoints side by side and the weights stacked outside the loop (equal to rounding);
- `nchwc`: Convs with fed weights on onnxruntime's channel-blocked CPU kernels (applied to a CPU
  session's copy of the graph when it is opened, never to the cached graph: the layout is the CPU's);
- `col2im`: DepthToSpace as a Col2Im of non-overlapping blocks (a CPU session's copy too: onnxruntime's
  CPU DepthToSpace moves elements one by one), and a ConvTranspose over a map of at most 16 positions,
  strided or not (a Conv's input adjoint there, which `conv` leaves unflipped and unsplit) as one GEMM of
  all the images' positions and a Col2Im;
- `affine`: per-channel scales and shifts (a BatchNorm's, forward and adjoint) as one inference
  BatchNormalization (a CPU session's copy too: onnxruntime's CPU Mul and Add broadcast span by span);
- `winograd`: 3 x 3 Convs of unit stride over maps of at most 16 x 16 positions and at least 64 channels as
  Winograd's F(2 x 2, 3 x 3), 16 GEMMs between constant transforms (on the forward graph of a CPU target, so that
  onnx-ad's adjoints of those GEMMs are the Conv's input and weight adjoints at 4/9 of the multiply-adds);
- `volumes`: 3-D Convs as 2-D Convs over their depth taps stacked as channels (on the forward graph of a CPU
  target, before `indexing`, which rewrites a strided one's stepped Slices): onnxruntime's 3-D Conv is an
  im2col of every tap with no blocked kernels, and its adjoints are no faster;
- `toolkit`: what the passes share (static shapes, constants, fresh names).
"""

from __future__ import annotations

import onnx

from worker_client.engine.rewrites.accumulators import hoist_scan_accumulators
from worker_client.engine.rewrites.attention import softmax_sums_from_outputs
from worker_client.engine.rewrites.batch_norms import detach_batch_norm_statistics
from worker_client.engine.rewrites.broadcasts import broadcast_in_readers
from worker_client.engine.rewrites.col2im import small_map_transposed_conv
from worker_client.engine.rewrites.conv import (
    assign_unique_scatters,
    equal_transposed_conv_pads,
    explicit_auto_pads,
    explicit_transposed_conv_pads,
    flip_unit_stride_transposed_convs,
    gemm_large_kernel_convs,
    narrowing_volume_transposed_conv,
    phases_gain,
    resize_window_spreads,
    route_max_pool_adjoints,
    split_strided_transposed_convs,
)
from worker_client.engine.rewrites.detaches import stop_torch_detaches
from worker_client.engine.rewrites.fold import fold_shape_queries
from worker_client.engine.rewrites.gate_products import merge_gate_products
from worker_client.engine.rewrites.gates import gelu_adjoints, silu_adjoints
from worker_client.engine.rewrites.group_norms import detach_group_norms
from worker_client.engine.rewrites.grouped import detach_grouped_weights, expand_grouped_convs
from worker_client.engine.rewrites.indexing import index_without_steps_or_copying_pads
from worker_client.engine.rewrites.layout import canonicalize_layout_ops, drop_no_op_layout_ops, space_to_depth_transposes
from worker_client.engine.rewrites.masks import masks_as_products
from worker_client.engine.rewrites.matmul import flatten_weight_matmuls, sum_batched_products, untranspose_products
from worker_client.engine.rewrites.outputs import compute_outputs_in_place
from worker_client.engine.rewrites.pools import drop_idle_ceil_modes, pad_overhanging_average_pools
from worker_client.engine.rewrites.powers import powers_as_products
from worker_client.engine.rewrites.prune import prune
from worker_client.engine.rewrites.recurrences import reuse_forward_values
from worker_client.engine.rewrites.scans import rewrite_scan_bodies
from worker_client.engine.rewrites.scatter import concat_padded_pieces, concat_piecewise_scatters
from worker_client.engine.rewrites.sequences import split_constant_sequences
from worker_client.engine.rewrites.singular import guard_singular_zeros
from worker_client.engine.rewrites.stateless import batch_stateless_steps
from worker_client.engine.rewrites.step_factors import regroup_step_factors
from worker_client.engine.rewrites.sums import sums_as_adds
from worker_client.engine.rewrites.transposed import convolve_trained_transposed_convs, restore_transposed_convs
from worker_client.engine.rewrites.volumes import planar_volume_convs
from worker_client.engine.rewrites.winograd import winograd_convs

__all__ = ["TARGETS", "rewrite_adjoints", "rewrite_forward"]


#: What `rewrite_forward` and `rewrite_adjoints` shape a graph for: onnxruntime's CPU kernels, or its CUDA provider
#: (cuDNN's Conv and ConvTranspose, which need none of the CPU's conv rewrites, and no ConvTranspose with unequal
#: pads).
TARGETS = ("cpu", "cuda")


def _check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")


def rewrite_forward(model: onnx.ModelProto, target: str = "cpu") -> onnx.ModelProto:
    """The loss model before differentiation, rewritten in place and returned.

    Its inferred shapes are dropped when anything changed; differentiation infers afresh. `target` (one of
    `TARGETS`) "cpu" adds the 3 x 3 Convs over small maps as Winograd's algorithm (`winograd`).
    """
    _check_target(target)
    changed = stop_torch_detaches(model)   # first: no pass below differentiates through a detach() either
    # the passes below match static shapes only: an exporter's computed bounds, pads, axes and shapes folded first
    changed += fold_shape_queries(model, floats=True)
    changed += split_constant_sequences(model)
    changed += explicit_auto_pads(model)
    changed += explicit_transposed_conv_pads(model, adjoints=False)
    changed += detach_grouped_weights(model)   # first: a strided ConvTranspose it detaches keeps its own op
    changed += convolve_trained_transposed_convs(model)
    changed += detach_batch_norm_statistics(model)
    changed += detach_group_norms(model)
    changed += expand_grouped_convs(model)
    if target == "cpu":   # before `indexing`, which rewrites the stepped Slices of a strided one
        changed += planar_volume_convs(model)
    changed += index_without_steps_or_copying_pads(model)
    changed += drop_idle_ceil_modes(model)
    changed += pad_overhanging_average_pools(model)
    changed += flatten_weight_matmuls(model)
    changed += guard_singular_zeros(model)
    if target == "cpu":   # cuDNN picks its own Winograd and FFT kernels for a Conv
        changed += winograd_convs(model)
    if changed:
        model.graph.ClearField("value_info")
    return model


def rewrite_adjoints(model: onnx.ModelProto, target: str = "cpu") -> onnx.ModelProto:
    """The differentiated model, rewritten in place and returned; the passes run in order.

    `target` "cuda" leaves out the passes that trade a Conv or ConvTranspose for what onnxruntime's CPU
    kernels run faster (a GEMM per output position but for 1-D Convs, flipped and phase-split ConvTransposes:
    on a GPU the many small nodes cost a launch each, 39 against 21 ms a ResNet-18 step on an H200), and gives each
    ConvTranspose equal pads (`equal_transposed_conv_pads`), which the CUDA provider has kernels for."""
    _check_target(target)
    on_cpu = target == "cpu"
    from worker_client.engine.differentiate import GRAD_PREFIX   # here: differentiate imports this package
    fold_shape_queries(model, floats=True)   # everything static, so the passes below apply; an adjoint's exponent
    powers_as_products(model)           # Pow(x, e - 1) of every Pow(x, e) adjoint: libm's pow at every element
    softmax_sums_from_outputs(model)    # onnx-ad's form still: an attention's row sums over [.., T, d], not [.., T, T]
    restore_transposed_convs(model)     # before the passes that read a ConvTranspose's shapes
    explicit_transposed_conv_pads(model, adjoints=True)   # before anything reads a ConvTranspose's inferred shape
    # cuDNN's kernels for 2-D and 3-D weight adjoints; its Conv of a 1-D kernel of a thousand taps is slow
    gemm_large_kernel_convs(model, None if on_cpu else {1})
    resize_window_spreads(model)
    if on_cpu:
        small = small_map_transposed_conv(model)   # those a CPU session runs as a GEMM and a Col2Im (col2im.py)
        narrowing = narrowing_volume_transposed_conv(model)   # 3-D ones faster as they are (conv.py)
        flip_unit_stride_transposed_convs(model, lambda node: not small(node) and not narrowing(node))
        gain = phases_gain(model)       # the others run as onnxruntime's ConvTranspose, or a GEMM and a Col2Im
        split_strided_transposed_convs(model, lambda node: gain(node) and not small(node))
    else:
        equal_transposed_conv_pads(model)
    route_max_pool_adjoints(model)
    assign_unique_scatters(model)
    concat_piecewise_scatters(model)
    concat_padded_pieces(model)
    sums_as_adds(model)
    canonicalize_layout_ops(model)
    space_to_depth_transposes(model)
    masks_as_products(model, GRAD_PREFIX)
    prune(model)                        # the passes below count readers: dead ones first
    if silu_adjoints(model) + gelu_adjoints(model):
        prune(model)
    broadcast_in_readers(model)
    sum_batched_products(model)
    untranspose_products(model)
    compute_outputs_in_place(model, GRAD_PREFIX)
    prune(model)
    rewrite_scan_bodies(model, [prune, drop_no_op_layout_ops, broadcast_in_readers, prune])
    reuse_forward_values(model)         # after the bodies are clean: their nodes are matched one for one
    hoist_scan_accumulators(model)      # after the reuse: the operands it stacks are then the forward's tapes
    regroup_step_factors(model)         # before the stateless pass, which takes the factors' products out
    batch_stateless_steps(model)
    merge_gate_products(model)          # last: the products left in the bodies are the per-step ones
    prune(model)
    return model
