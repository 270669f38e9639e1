"""Stage "session": the onnxruntime session that runs a model on the chosen device."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from ps_common.errors import DeviceUnavailableError, UnsupportedModelError
from worker_client.engine.rewrites.vector_products import vector_products_as_columns

__all__ = ["Placement", "open_session", "placement", "run_bound"]

#: onnxruntime's provider for NVIDIA GPUs.
CUDA_PROVIDER = "CUDAExecutionProvider"
#: onnxruntime's provider for the CPU, present in every installation.
CPU_PROVIDER = "CPUExecutionProvider"


@dataclass(frozen=True)
class Placement:
    """Where sessions run: the device as given, onnxruntime's providers for it in order of
    preference, and the CUDA device index (None on the CPU)."""

    device: str
    providers: list[str | tuple[str, dict[str, str]]]
    cuda_index: int | None

    @property
    def target(self) -> str:
        """The kind of device the gradient graph's rewrites are for (rewrites.TARGETS)."""
        return "cpu" if self.cuda_index is None else "cuda"


def placement(device: str) -> Placement:
    """The Placement for "cpu", "cuda" or "cuda:N".

    Raises ValueError for any other spelling and DeviceUnavailableError when this
    onnxruntime has no CUDA provider.
    """
    if device == "cpu":
        return Placement(device, [CPU_PROVIDER], None)
    if device == "cuda" or device.startswith("cuda:"):
        index = device.partition(":")[2] or "0"
        if not index.isdigit():
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        available = ort.get_available_providers()
        if CUDA_PROVIDER not in available:
            raise DeviceUnavailableError(
                f"device={device!r} needs onnxruntime's {CUDA_PROVIDER}, but this "
                f"onnxruntime ({ort.__version__}) offers only {available}; install "
                f"onnxruntime-gpu (pip install 'onnx-ps[gpu]') in place of onnxruntime")
        # TF32 off (onnxruntime's CUDA provider turns it on by default): float32 products in full, as torch's
        # matmuls and the CPU compute them. With TF32's 10-bit mantissa a ReLU whose input lies near 0 can flip,
        # and one flipped mask entry of the test MLP moved its first layer's gradient by 4.5% against the CPU's;
        # off, the two agree to 2e-7 (H200, onnxruntime-gpu 1.31.1). Workers on GPUs and CPUs of one job
        # then push the same gradients.
        return Placement(device, [(CUDA_PROVIDER, {"device_id": index, "use_tf32": "0"}), CPU_PROVIDER],
                         int(index))
    raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def open_session(model: onnx.ModelProto, where: Placement, *,
                 threads: tuple[int | None, int | None],
                 source: str | os.PathLike[str]) -> ort.InferenceSession:
    """A session running `model` with every graph optimization, on `where`.

    `threads` is (intra_op_threads, inter_op_threads), None for onnxruntime's default; more
    than one inter-op thread runs independent nodes in parallel. `source` names the model
    file in errors: UnsupportedModelError when onnxruntime refuses the model,
    DeviceUnavailableError when it cannot start the CUDA provider.
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    intra, inter = threads
    if intra is not None:
        options.intra_op_num_threads = intra
    if inter is not None:
        options.inter_op_num_threads = inter
        if inter > 1:
            options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    model = vector_products_as_columns(model)   # onnxruntime's FusedMatMul miscomputes transA with a vector
    try:
        session = ort.InferenceSession(model.SerializeToString(), sess_options=options,
                                       providers=where.providers)
    except Exception as exc:  # onnxruntime raises its own untyped Fail / InvalidGraph
        raise UnsupportedModelError(
            f"{source}: onnxruntime {ort.__version__} cannot load the model "
            f"(opset {[(o.domain or 'ai.onnx', o.version) for o in model.opset_import]}, "
            f"IR {model.ir_version}): {exc}") from exc
    if where.cuda_index is not None and CUDA_PROVIDER not in session.get_providers():
        # onnxruntime-gpu falls back to the CPU, with only a log line, when the CUDA
        # provider cannot start (no driver, no such device, missing CUDA libraries)
        raise DeviceUnavailableError(
            f"device={where.device!r}: onnxruntime could not start its "
            f"{CUDA_PROVIDER} (the session runs on {session.get_providers()}); "
            f"check the NVIDIA driver, CUDA/cuDNN libraries and the device index")
    return session


def run_bound(session: ort.InferenceSession, feed: dict[str, np.ndarray],
              outputs: list[tuple[str, np.dtype, tuple[int, ...]]],
              on_device: Mapping[str, ort.OrtValue] | None = None) -> list[np.ndarray]:
    """One run through an IO binding; the results land in freshly allocated host arrays.

    `outputs` lists (name, dtype, shape) of every result. On CUDA the binding copies each
    input to the device once and each result straight into its final host array, rather
    than through onnxruntime's own staging buffers and a second copy into numpy. `on_device`
    holds inputs already in the device's memory (a CUDA engine's Dropout masks), bound as they are.
    """
    binding = session.io_binding()
    for name, array in feed.items():
        binding.bind_cpu_input(name, array)
    for name, value in (on_device or {}).items():
        binding.bind_ortvalue_input(name, value)
    results = []
    for name, dtype, shape in outputs:
        result = np.empty(shape, dtype)
        binding.bind_output(name, "cpu", 0, dtype, shape, result.ctypes.data)
        results.append(result)
    session.run_with_iobinding(binding)
    return results
