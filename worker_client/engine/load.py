"""Stage "load": the model file read, at an IR version the installed onnxruntime accepts."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import onnx
import onnxruntime as ort
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper

from ps_common.errors import ModelLoadError
from worker_client.engine.external_data import check_model_tensors, load_external_data
from worker_client.engine.repairs import repair_exporter_faults

__all__ = ["clamp_ir_version", "load_model", "max_ir_version", "read_model"]

log = logging.getLogger(__name__)

#: What a file that parses but is no whole model, or does not parse, most likely is.
_DAMAGED = "it is empty, truncated, corrupt or not an ONNX file"
#: Opset of the one-node model that probes which IR versions onnxruntime loads.
_PROBE_OPSET = 13
#: The IR version that came with opset 13: the oldest the probe is valid at, and the
#: answer when onnxruntime refuses every newer one.
_PROBE_OLDEST_IR = 7


def load_model(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """The model stored at `path`, its IR version lowered to what onnxruntime loads."""
    model = read_model(path)
    clamp_ir_version(model)
    return model


def read_model(path: str | os.PathLike[str], *, external_data: bool = True) -> onnx.ModelProto:
    """The model stored at `path` (with its external tensor data when `external_data`).

    Raises ModelLoadError naming the file and the problem when the file is missing or
    unreadable, does not parse as ONNX, or parses to no model: protobuf reads an empty or
    cut-short file without complaint, so a model without a graph or an opset is refused
    here rather than in some later stage. Every tensor's data is checked against its dims,
    and external data is opened by the project's own rules (engine/external_data.py: inside
    the model's folder, no symbolic link, the bytes within the file), read when
    `external_data`, else only checked. Faults of exporters that onnxruntime would refuse are
    mended (engine/repairs.py).
    """
    path = Path(path)
    try:
        model = onnx.load(path, load_external_data=False)   # external data: ours, by our rules (below)
    except OSError as exc:
        raise ModelLoadError(f"cannot read the model file {path}: "
                             f"{exc.strerror or exc}") from exc
    except DecodeError as exc:
        raise ModelLoadError(f"the model file {path} ({_size(path)}) does not parse as an "
                             f"ONNX model ({exc}): {_DAMAGED}") from exc
    except Exception as exc:  # noqa: BLE001 -- onnx's own, e.g. for external data
        raise ModelLoadError(f"cannot read the model file {path}: "
                             f"{type(exc).__name__}: {exc}") from exc
    if not model.HasField("graph"):
        raise ModelLoadError(f"the model file {path} ({_size(path)}) holds no graph: "
                             f"{_DAMAGED}")
    if not model.opset_import:
        raise ModelLoadError(f"the model file {path} ({_size(path)}) declares no opset "
                             f"(opset_import is empty): {_DAMAGED}")
    if external_data:
        load_external_data(model, path.parent, where=f"model {path}")
    check_model_tensors(model, path.parent, where=f"model {path}")
    for repair in repair_exporter_faults(model):
        log.info("model %s: %s", path, repair)
    return model


def _size(path: Path) -> str:
    """The file's size for a message, e.g. "512 bytes"."""
    try:
        return f"{path.stat().st_size} bytes"
    except OSError:
        return "size unknown"


@functools.cache
def max_ir_version() -> int:
    """The newest ONNX IR version the installed onnxruntime loads.

    onnx writes its own newest IR version (helper.make_model), which can be ahead of what
    onnxruntime accepts ("Unsupported model IR version"); onnxruntime exposes no query for
    it, so a one-node model is loaded at decreasing versions until one is accepted.
    """
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _PROBE_OPSET)])
    for version in range(onnx.IR_VERSION, _PROBE_OLDEST_IR, -1):
        probe.ir_version = version
        try:
            ort.InferenceSession(probe.SerializeToString(),
                                 providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 -- any refusal means: try an older version
            continue
        return version
    return _PROBE_OLDEST_IR


def clamp_ir_version(model: onnx.ModelProto) -> None:
    """Lower `model.ir_version` (in place) to what onnxruntime loads, if it is newer."""
    model.ir_version = min(model.ir_version, max_ir_version())
