"""Tensors on the Open Inference Protocol's wire: datatypes, shapes, and the checked decoding of a request's inputs.

Both transports (ps_serve/http.py, ps_serve/grpc_service.py) turn each input of a request
into a numpy array here, against the model's own `TensorSpec` of that input, and turn each
output back:

- JSON data (``"data"``: a flat or nested list, row-major), and gRPC's typed ``contents``;
- raw bytes: Triton's binary tensor data extension over HTTP, ``raw_input_contents`` over
  gRPC. Fixed-size datatypes are the array's bytes in row-major order (little-endian);
  ``BYTES`` is each element as a 4-byte little-endian length and its bytes.

Every check names the input and the values: the datatype the model takes, the rank and the
fixed dimensions of its shape, the number of elements or bytes, the range of integers. A
check that fails raises `RequestError` (HTTP 400). Nothing is converted silently: an FP64
tensor for an FP32 input is refused, as Triton refuses it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ps_serve.errors import RequestError

#: ONNX Runtime's type of a tensor -> the protocol's datatype name.
ONNX_TO_DATATYPE = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16", "tensor(uint32)": "UINT32", "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8", "tensor(int16)": "INT16", "tensor(int32)": "INT32", "tensor(int64)": "INT64",
    "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64",
    "tensor(bfloat16)": "BF16",
    "tensor(string)": "BYTES",
}
#: The protocol's datatype -> the numpy dtype of its arrays (BYTES: Python str objects, as onnxruntime takes them).
NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16), "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8), "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}
#: Datatypes a model may declare that this server cannot carry (numpy has no bfloat16 onnxruntime takes).
UNSUPPORTED = frozenset({"BF16"})
#: Bytes of the length before each element of a BYTES tensor's raw form.
BYTES_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of the model: its name, datatype and shape (-1 for a dynamic axis)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.name} ({self.datatype} {list(self.shape)})"

    def metadata(self) -> dict[str, Any]:
        """The protocol's tensor metadata object."""
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


def datatype_of_onnx(onnx_type: str) -> str | None:
    """The protocol datatype of an onnxruntime type such as ``tensor(float)``; None when it is not a tensor
    the protocol has (a sequence, a map, an optional)."""
    return ONNX_TO_DATATYPE.get(onnx_type)


def spec_shape(dims: Sequence[Any]) -> tuple[int, ...]:
    """onnxruntime's shape (ints, names of symbolic axes, None) as the protocol's: -1 for every axis not fixed."""
    return tuple(d if isinstance(d, int) and d >= 0 else -1 for d in dims)


def datatype_of_array(array: np.ndarray) -> str:
    """The protocol datatype of an output array onnxruntime returned."""
    if array.dtype.kind in "OUS":
        return "BYTES"
    for name, dtype in NUMPY_DTYPES.items():
        if dtype == array.dtype:
            return name
    raise TypeError(f"no protocol datatype for numpy dtype {array.dtype}")


# ---------------------------------------------------------------------- checks shared by both encodings


def check_header(spec: TensorSpec, datatype: Any, shape: Any) -> tuple[int, ...]:
    """The request's shape of an input, after checking its datatype and shape against the model's spec."""
    if not isinstance(datatype, str):
        raise RequestError(f"input '{spec.name}': datatype must be a string such as {spec.datatype!r}, "
                           f"got {datatype!r}")
    if datatype != spec.datatype:
        raise RequestError(f"input '{spec.name}' has datatype {datatype}, but the model takes {spec.datatype} "
                           f"(shape {list(spec.shape)}); send {spec.datatype}")
    if spec.datatype in UNSUPPORTED:
        raise RequestError(f"input '{spec.name}': datatype {spec.datatype} is not supported by this server")
    if not isinstance(shape, (list, tuple)) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise RequestError(f"input '{spec.name}': shape must be a list of integers, got {shape!r}")
    shape = tuple(shape)
    if any(d < 0 for d in shape):
        raise RequestError(f"input '{spec.name}': shape {list(shape)} has a negative dimension")
    if len(shape) != len(spec.shape):
        raise RequestError(f"input '{spec.name}' has shape {list(shape)} (rank {len(shape)}), but the model takes "
                           f"rank {len(spec.shape)}: {list(spec.shape)} (-1: any size)")
    for axis, (given, wanted) in enumerate(zip(shape, spec.shape)):
        if wanted >= 0 and given != wanted:
            raise RequestError(f"input '{spec.name}' has shape {list(shape)}, but the model takes "
                               f"{list(spec.shape)}: axis {axis} must be {wanted}, not {given}")
    return shape


def element_count(shape: Sequence[int]) -> int:
    return math.prod(shape)


# ---------------------------------------------------------------------- JSON data


def from_json(spec: TensorSpec, datatype: Any, shape: Any, data: Any) -> np.ndarray:
    """An input from the protocol's JSON form: ``data`` as a flat or nested list in row-major order."""
    shape = check_header(spec, datatype, shape)
    count = element_count(shape)
    if not isinstance(data, list):
        data = [data]   # a lone scalar, as the spec allows for a one-element tensor
    dtype = NUMPY_DTYPES[spec.datatype]
    if spec.datatype == "BYTES":
        flat = _flatten(spec, data)
        if not all(isinstance(v, str) for v in flat):
            bad = next(v for v in flat if not isinstance(v, str))
            raise RequestError(f"input '{spec.name}' is BYTES: every element of data must be a string, "
                               f"found {bad!r}")
        values = np.empty(len(flat), dtype=object)
        values[:] = flat
    else:
        try:
            values = np.array(data)
        except ValueError as exc:   # a ragged nested list
            raise RequestError(f"input '{spec.name}': data is a ragged nested list ({exc})") from None
        if values.dtype.kind in "fO" and dtype.kind in "iu":
            values = _exact_integers(spec, data, values)
        values = _checked_numbers(spec, values.reshape(-1))
        values = values.astype(dtype, copy=False)
    if values.size != count:
        raise RequestError(f"input '{spec.name}' has shape {list(shape)} ({count} elements), but its data has "
                           f"{values.size} element(s)")
    return values.reshape(shape)


def _flatten(spec: TensorSpec, data: list) -> list:
    flat: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def _exact_integers(spec: TensorSpec, data: list, values: np.ndarray) -> np.ndarray:
    """JSON integers numpy read as floats or objects (a list mixing values beyond int64 with others), as exact
    integers in the input's dtype when they all are integers in its range; else the values as they were."""
    objects = np.array(data, dtype=object).reshape(-1)
    if not all(type(v) is int for v in objects):   # noqa: E721 - bool is not an integer here
        return values
    info = np.iinfo(NUMPY_DTYPES[spec.datatype])
    for bound in (min(objects), max(objects)):
        if not info.min <= bound <= info.max:
            raise RequestError(f"input '{spec.name}' is {spec.datatype}: {bound} is outside {info.min}..{info.max}")
    return np.array(objects.tolist(), dtype=NUMPY_DTYPES[spec.datatype])


def _checked_numbers(spec: TensorSpec, values: np.ndarray) -> np.ndarray:
    """The flat JSON values if they fit the input's datatype: true/false for BOOL, integers in range for the integer
    types, numbers for the floating types."""
    name, datatype = spec.name, spec.datatype
    if values.size == 0:
        return values.astype(NUMPY_DTYPES[datatype])
    kind = values.dtype.kind
    if datatype == "BOOL":
        if kind != "b":
            raise RequestError(f"input '{name}' is BOOL: data must hold true/false, found {_sample(values)}")
        return values
    integer = datatype.startswith(("INT", "UINT"))
    if kind not in "iuf":
        what = "integers" if integer else "numbers"
        raise RequestError(f"input '{name}' is {datatype}: data must hold {what}, found {_sample(values)}")
    if integer:
        if kind == "f":
            fractional = values[~np.isfinite(values) | (values != np.trunc(values))]
            if fractional.size:
                raise RequestError(f"input '{name}' is {datatype}: data must hold integers, found "
                                   f"{_sample(fractional)}")
        info = np.iinfo(NUMPY_DTYPES[datatype])
        for bound in (values.min(), values.max()):
            if not info.min <= int(bound) <= info.max:
                raise RequestError(f"input '{name}' is {datatype}: {int(bound)} is outside {info.min}..{info.max}")
    return values


def _sample(values: np.ndarray) -> str:
    flat = values.reshape(-1)
    return ", ".join(repr(v.item() if hasattr(v, "item") else v) for v in flat[:3]) + (", ..." if flat.size > 3 else "")


def to_json(array: np.ndarray) -> list:
    """An output's ``data``: the array flattened in row-major order (BYTES as strings)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.dtype.kind in "OUS":
        return [_text(v) for v in flat]
    if flat.dtype == np.float16:
        flat = flat.astype(np.float32)
    return flat.tolist()


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


# ---------------------------------------------------------------------- raw bytes


def from_raw(spec: TensorSpec, datatype: Any, shape: Any, raw: bytes | memoryview) -> np.ndarray:
    """An input from its raw bytes: row-major little-endian elements, or BYTES' length-prefixed elements."""
    shape = check_header(spec, datatype, shape)
    count = element_count(shape)
    if spec.datatype == "BYTES":
        return _bytes_from_raw(spec, shape, count, memoryview(raw))
    dtype = NUMPY_DTYPES[spec.datatype]
    needed = count * dtype.itemsize
    if len(raw) != needed:
        raise RequestError(f"input '{spec.name}' has {len(raw)} bytes of binary data, but {spec.datatype} "
                           f"{list(shape)} needs {needed} ({count} x {dtype.itemsize} bytes)")
    values = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)
    if not values.flags.aligned:
        values = values.copy()
    if spec.datatype == "BOOL" and count and np.frombuffer(raw, dtype=np.uint8).max() > 1:
        raise RequestError(f"input '{spec.name}' is BOOL: its bytes must be 0 or 1")
    return values.reshape(shape)


def _bytes_from_raw(spec: TensorSpec, shape: tuple[int, ...], count: int, raw: memoryview) -> np.ndarray:
    items: list[str] = []
    offset = 0
    while offset < len(raw):
        if offset + BYTES_LENGTH.size > len(raw):
            raise RequestError(f"input '{spec.name}': BYTES data ends inside the length of element {len(items)}")
        (length,) = BYTES_LENGTH.unpack_from(raw, offset)
        offset += BYTES_LENGTH.size
        if offset + length > len(raw):
            raise RequestError(f"input '{spec.name}': BYTES element {len(items)} says {length} bytes, but only "
                               f"{len(raw) - offset} are left")
        try:
            items.append(bytes(raw[offset:offset + length]).decode("utf-8"))
        except UnicodeDecodeError:
            raise RequestError(f"input '{spec.name}': BYTES element {len(items)} is not UTF-8 text "
                               "(onnxruntime's strings are text)") from None
        offset += length
    if len(items) != count:
        raise RequestError(f"input '{spec.name}' has shape {list(shape)} ({count} elements), but its binary data "
                           f"holds {len(items)} BYTES element(s)")
    values = np.empty(count, dtype=object)
    values[:] = items
    return values.reshape(shape)


def to_raw(array: np.ndarray) -> bytes:
    """An output's raw bytes: row-major little-endian elements, or BYTES' length-prefixed elements."""
    if array.dtype.kind in "OUS":
        parts = []
        for value in np.ascontiguousarray(array).reshape(-1):
            data = value if isinstance(value, bytes) else str(value).encode("utf-8")
            parts.append(BYTES_LENGTH.pack(len(data)))
            parts.append(data)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
