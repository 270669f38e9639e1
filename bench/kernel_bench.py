"""The kernels a gradient step is made of, onnxruntime's CPU kernels against torch's, one op at a time.

`grad_bench` times whole steps; this times the products inside them, on the shapes of the models
users train at batch 32, so a gap between the two steps can be put where it is: in the graph
(what the engine asks onnxruntime to do) or in the kernels (how fast onnxruntime does it). Each
case is one ONNX node in an onnxruntime session (CPU provider, all graph optimizations) and the
same product in torch, on the same arrays and threads:

- ``gemm``: the transformer classifier's matrix products (``ps_bench.torch_models``' ``transformer``:
  2048 tokens, d_model 384, feed-forward 1536), in the three layouts its gradient step runs them:
  ``nn`` (forward and input adjoints), ``tn`` (weight adjoints: A transposed), ``nt`` (a Linear's
  forward, the weight transposed). onnxruntime runs them on MLAS's SGEMM, torch on MKL's.
- ``conv``: ResNet-18's 3x3 convolutions at each feature-map size (32x32x64 .. 4x4x512), as
  onnxruntime's Conv (MLAS: im2col, then a GEMM per image) and as torch's conv2d (oneDNN); and,
  as ``onnxruntime[nchwc]``, the Conv as the engine runs it on a CPU where it takes the
  channel-blocked kernels (`worker_client.engine.rewrites.nchwc`: larger feature maps only), the
  reorders of the activations and of the filter included; and, as ``onnxruntime[winograd]``, the
  Conv as Winograd's F(2x2,3x3) in ONNX ops where the engine writes it so on a CPU
  (`worker_client.engine.rewrites.winograd`: smaller feature maps only), the filter's transform included.

JSON lines (ps_bench.harness.emit): ``kernel_gflops_CASE`` of each system (multiply-adds x 2 over the
median time) and ``kernel_speedup_CASE`` of ``onnxruntime/torch`` (torch's time over onnxruntime's
fastest form: below 1 when onnxruntime's kernel is the slower), with the threads and the load average.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

try:
    import torch
    import torch.nn.functional as F
except ImportError as exc:  # torch is a benchmark-only dependency
    raise SystemExit("ps_bench.kernel_bench compares against torch, which is not installed here; run it in "
                     "an environment of its own that has torch and the project (docs/benchmarks.md)") from exc

from ps_bench import harness
from worker_client.engine.rewrites.col2im import depth_to_space_as_col2im
from worker_client.engine.rewrites.nchwc import block_convs, nchwc_block_size
from worker_client.engine.rewrites.winograd import winograd_convs

#: name -> (M, K, N, transA, transB): C[M, N] = op(A) @ op(B)
GEMMS: dict[str, tuple[int, int, int, int, int]] = {
    "gemm_ffn_up_nn": (2048, 384, 1536, 0, 0),
    "gemm_ffn_down_nn": (2048, 1536, 384, 0, 0),
    "gemm_ffn_up_nt": (2048, 384, 1536, 0, 1),
    "gemm_ffn_weight_tn": (1536, 2048, 384, 1, 0),
    "gemm_qkv_weight_tn": (384, 2048, 1152, 1, 0),
}
#: name -> (batch, channels in, channels out, height = width), 3x3 kernel, stride 1, padding 1
CONVS: dict[str, tuple[int, int, int, int]] = {
    "conv_32x32x64": (32, 64, 64, 32),
    "conv_16x16x128": (32, 128, 128, 16),
    "conv_8x8x256": (32, 256, 256, 8),
    "conv_4x4x512": (32, 512, 512, 4),
}
CASES = [*GEMMS, *CONVS]


def _model(node: onnx.NodeProto, inputs: dict[str, np.ndarray]) -> onnx.ModelProto:
    graph = helper.make_graph([node], "kernel",
                              [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape) for k, v in inputs.items()],
                              [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _case(name: str, rng: np.random.Generator, threads: int) -> tuple[float, dict[str, Callable[[], np.ndarray]]]:
    """(multiply-adds, each system's call returning its result)."""
    if name in GEMMS:
        m, k, n, trans_a, trans_b = GEMMS[name]
        a = rng.standard_normal((k, m) if trans_a else (m, k), dtype=np.float32)
        b = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
        feeds = {"a": a, "b": b}
        session = _session(_model(helper.make_node("Gemm", ["a", "b"], ["y"], transA=trans_a, transB=trans_b), feeds),
                           threads)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        ta, tb = (ta.t() if trans_a else ta), (tb.t() if trans_b else tb)
        return float(m) * k * n, {"onnxruntime": lambda: session.run(None, feeds)[0],
                                  "torch": lambda: torch.mm(ta, tb).numpy()}
    batch, cin, cout, size = CONVS[name]
    x = rng.standard_normal((batch, cin, size, size), dtype=np.float32)
    w = (rng.standard_normal((cout, cin, 3, 3), dtype=np.float32) / np.sqrt(cin * 9)).astype(np.float32)
    feeds = {"x": x, "w": w}
    model = _model(helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]), feeds)
    session = _session(model, threads)
    tx, tw = torch.from_numpy(x), torch.from_numpy(w)
    calls = {"onnxruntime": lambda: session.run(None, feeds)[0],
             "torch": lambda: F.conv2d(tx, tw, padding=1).numpy()}
    winograd = onnx.ModelProto()
    winograd.CopyFrom(model)
    winograd.opset_import[0].version = 18   # Col2Im's; Conv is the same op there
    if winograd_convs(winograd):   # only where the engine would write it so
        depth_to_space_as_col2im(winograd)   # the tiles' layout as a CPU session runs it
        tiled = _session(winograd, threads)
        calls["onnxruntime[winograd]"] = lambda: tiled.run(None, feeds)[0]
    block = nchwc_block_size()
    if block and block_convs(model, block):   # only where the engine would block it
        blocked = _session(model, threads)
        calls["onnxruntime[nchwc]"] = lambda: blocked.run(None, feeds)[0]
    return float(batch) * cout * size * size * cin * 9, calls


def bench_case(name: str, *, threads: int, repeats: int, rng: np.random.Generator) -> list[dict]:
    macs, calls = _case(name, rng, threads)
    results = {system: call() for system, call in calls.items()}
    theirs = results["torch"]
    scale = float(np.max(np.abs(theirs))) or 1.0
    for system, ours in results.items():
        if not np.allclose(ours, theirs, rtol=1e-3, atol=1e-3 * scale):
            raise SystemExit(f"kernel_bench: {name}: {system} and torch disagree "
                             f"(largest difference {float(np.max(np.abs(ours - theirs))):.3g})")
    times: dict[str, list[float]] = {system: [] for system in calls}
    order = list(calls.items())
    for _ in range(3):   # warm-up: packing buffers, the allocators' arenas
        for _, call in order:
            call()
    for round_ in range(repeats):   # interleaved, the order reversing each round
        for system, call in (order if round_ % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            call()
            times[system].append(time.perf_counter() - start)
    medians = {system: statistics.median(samples) for system, samples in times.items()}
    extra = {"threads": threads, "repeats": repeats, "machine": harness.machine()}
    records = [harness.emit(system, f"kernel_gflops_{name}", 0.0, 2 * macs / seconds / 1e9, "GFLOP/s",
                            ms=round(seconds * 1000, 3), **extra) for system, seconds in medians.items()]
    fastest = min((s for s in medians if s != "torch"), key=lambda s: medians[s])
    records.append(harness.emit("onnxruntime/torch", f"kernel_speedup_{name}", 0.0,
                                medians["torch"] / medians[fastest], "x", onnxruntime=fastest, **extra))
    return records


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ps_bench.kernel_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=CASES, help="cases to run [all]")
    parser.add_argument("--threads", type=int, default=1,
                        help="onnxruntime intra-op threads = torch.set_num_threads [1]")
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per system and case [15]")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.repeats < 1:
        parser.error(f"--threads {args.threads} and --repeats {args.repeats} must be at least 1")
    torch.set_num_threads(args.threads)
    harness.steady_heap()   # torch at its best (harness.steady_heap)
    torch.set_num_interop_threads(1)
    harness.log(f"kernel_bench: {args.threads} thread(s), {harness.machine()}")
    rng = np.random.default_rng(0)
    for name in args.cases:
        bench_case(name, threads=args.threads, repeats=args.repeats, rng=rng)
    return 0


if __name__ == "__main__":
    sys.exit(main())
