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

import itertools
import json
import math
import struct
from collections.abc import Iterable, Iterator, Sequence
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
                           f"got {_show(datatype)}")
    if datatype != spec.datatype:
        raise RequestError(f"input '{spec.name}' has datatype {datatype}, but the model takes {spec.datatype} "
                           f"(shape {list(spec.shape)}); send {spec.datatype}")
    if spec.datatype in UNSUPPORTED:
        raise RequestError(f"input '{spec.name}': datatype {spec.datatype} is not supported by this server")
    if not isinstance(shape, (list, tuple)) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise RequestError(f"input '{spec.name}': shape must be a list of integers, got {_show(shape)}")
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

#: The most nesting levels of ``data`` an error message spells out; deeper nesting is given as a count.
SHOWN_LEVELS = 8
#: The most characters of one value an error message quotes.
SHOWN_CHARS = 40
#: How an answer's JSON writes the non-finite floats (JSON has no literal for them): the strings of protobuf's
#: JSON mapping, which numpy (and so tritonclient's ``as_numpy``) reads back as floats.
NON_FINITE_TEXT = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


class JsonNumber(float):
    """A JSON constant ``NaN``, ``Infinity`` or ``-Infinity`` as a float that keeps its text, so that the error
    refusing it quotes what the client sent (Python's json reads the constants; strict JSON has none). The HTTP
    API reads request bodies with ``json.loads(..., parse_constant=JsonNumber.parse)``."""

    text: str

    @classmethod
    def parse(cls, text: str) -> "JsonNumber":
        number = cls(float(text))
        number.text = text
        return number


def from_json(spec: TensorSpec, datatype: Any, shape: Any, data: Any) -> np.ndarray:
    """An input from the protocol's JSON form: ``data`` as a flat list in row-major order, or nested as the shape.

    gRPC's typed ``contents`` come here too, as flat lists. Floats must be finite in the input's datatype (a
    non-finite value travels only as binary data); JSON's true/false are taken for BOOL inputs only.
    """
    shape = check_header(spec, datatype, shape)
    count = element_count(shape)
    if not isinstance(data, list):
        data = [data]   # a lone scalar, as the spec allows for a one-element tensor
    dims = _nesting(spec, shape, data)
    depth = len(dims)
    if spec.datatype == "BYTES":
        flat = _regular_leaves(spec, data, dims)
        if not all(isinstance(v, str) for v in flat):
            bad = next(v for v in flat if not isinstance(v, str))
            if isinstance(bad, list):
                raise RequestError(f"input '{spec.name}': data is a ragged nested list (an element at depth {depth} "
                                   f"is a list, {_show(bad)})")
            raise RequestError(f"input '{spec.name}' is BYTES: every element of data must be a string, "
                               f"found {_show(bad)}")
        _check_nesting(spec, shape, dims)
        values = np.empty(len(flat), dtype=object)
        values[:] = flat
    else:
        try:
            values = np.array(data)
        except ValueError as exc:   # a ragged nested list
            raise RequestError(f"input '{spec.name}': data is a ragged nested list ({exc})") from None
        _check_nesting(spec, shape, dims)
        values = _checked_numbers(spec, data, depth, values)
    if values.size != count:
        raise RequestError(f"input '{spec.name}' has shape {list(shape)} ({count} elements), but its data has "
                           f"{values.size} element(s)")
    return values.reshape(shape)


def _nesting(spec: TensorSpec, shape: tuple[int, ...], data: list) -> list[int]:
    """How `data` nests, read along its first elements (``[2, 64]`` for two lists of 64; ``[128]`` flat); refused
    at once when it nests deeper than the shape's rank, however regular (the rest is checked once the data is read:
    `_check_nesting`)."""
    dims: list[int] = []
    item: Any = data
    while isinstance(item, list):
        dims.append(len(item))
        if not item:
            break
        item = item[0]
    if len(dims) > max(len(shape), 1):
        _check_nesting(spec, shape, dims)
    return dims


def _check_nesting(spec: TensorSpec, shape: tuple[int, ...], dims: list[int]) -> None:
    """Nested data must nest as the shape, as the protocol has it: a flat list of every element, or lists nested
    exactly as the shape (row-major either way)."""
    if len(dims) > 1 and tuple(dims) != shape:
        nests = f"as {dims}" if len(dims) <= SHOWN_LEVELS else f"{len(dims)} levels deep"
        raise RequestError(f"input '{spec.name}': data nests {nests} but shape is {list(shape)}; give data as a flat "
                           "list of every element in row-major order, or nested exactly as the shape")


def _regular_leaves(spec: TensorSpec, data: list, dims: Sequence[int]) -> list:
    """The elements of `data` in row-major order, when it nests as `dims` everywhere (else a ragged-list error)."""
    level = [data]
    for depth, size in enumerate(dims):
        below: list = []
        for item in level:
            if not isinstance(item, list) or len(item) != size:
                raise RequestError(f"input '{spec.name}': data is a ragged nested list (a list at depth {depth} "
                                   f"holds {_show(item)}, not {size} element(s))")
            below.extend(item)
        level = below
    return level


def _leaves(data: list, depth: int) -> Iterator[Any]:
    """The elements of `data`, a regular nesting `depth` deep (numpy built an array of it), in row-major order."""
    leaves: Iterable[Any] = data
    for _ in range(depth - 1):
        leaves = itertools.chain.from_iterable(leaves)
    return iter(leaves)


def _checked_numbers(spec: TensorSpec, data: list, depth: int, values: np.ndarray) -> np.ndarray:
    """The flat values (numpy's array of `data`) in the input's dtype, if they fit its datatype: true/false for BOOL,
    integers in range for the integer types, numbers finite in the type for the floating types."""
    name, datatype = spec.name, spec.datatype
    dtype = NUMPY_DTYPES[datatype]
    values = values.reshape(-1)
    if values.size == 0:
        return values.astype(dtype)
    kind = values.dtype.kind
    if datatype == "BOOL":
        if kind != "b":
            found = next((v for v in _leaves(data, depth) if not isinstance(v, bool)), values[0])
            raise RequestError(f"input '{name}' is BOOL: data must hold true/false, found {_show(found)}")
        return values
    integer = datatype.startswith(("INT", "UINT"))
    what = "integers" if integer else "numbers"
    if kind == "b" or (kind in "iufO" and bool in map(type, _leaves(data, depth))):
        found = next(v for v in _leaves(data, depth) if isinstance(v, bool))
        raise RequestError(f"input '{name}' is {datatype}: data must hold {what}, found {_show(found)} (true/false "
                           "are taken for BOOL inputs only)")
    if kind == "O" and all(type(v) in (int, float, JsonNumber) for v in values):
        values = _big_numbers(spec, values)   # integers beyond 64 bits, mixed with others
        kind = values.dtype.kind
    if kind not in "iuf":
        found = next((v for v in _leaves(data, depth) if type(v) not in (int, float, JsonNumber)), values[0])
        raise RequestError(f"input '{name}' is {datatype}: data must hold {what}, found {_show(found)}")
    if integer:
        if kind == "f":
            values = _exact_integers(spec, data, depth, values)
        info = np.iinfo(dtype)
        for bound in (values.min(), values.max()):
            if not info.min <= int(bound) <= info.max:
                raise RequestError(f"input '{name}' is {datatype}: {int(bound)} is outside {info.min}..{info.max}")
        return values.astype(dtype, copy=False)
    with np.errstate(over="ignore", invalid="ignore"):
        cast = values.astype(dtype, copy=False)
    finite = np.isfinite(cast)
    if not finite.all():
        index = int(np.argmin(finite))
        found = next(itertools.islice(_leaves(data, depth), index, None), values[index])
        if _non_finite(found):
            why = ("JSON has no NaN or Infinity" if isinstance(found, JsonNumber) else
                   "a JSON number beyond float64's range, such as 1e400, reads as inf")
            raise RequestError(f"input '{name}' is {datatype}: data must hold finite numbers, found {_show(found)} "
                               f"({why}); send non-finite values as binary data")
        largest = np.finfo(dtype).max.item()
        raise RequestError(f"input '{name}' is {datatype}: {_show(found)} is outside {datatype}'s finite range "
                           f"-{largest:.8g}..{largest:.8g}")
    return cast


def _non_finite(value: Any) -> bool:
    """Whether a value the client sent is itself NaN or infinite (not a number too large for the datatype)."""
    if isinstance(value, JsonNumber):
        return True
    return isinstance(value, (float, np.floating)) and not math.isfinite(value)


def _big_numbers(spec: TensorSpec, values: np.ndarray) -> np.ndarray:
    """Numbers numpy kept as Python objects (an integer beyond 64 bits among them): exact integers for an integer
    input (RequestError for one out of its range), floats (inf beyond float64's range) for a floating one."""
    if spec.datatype.startswith(("INT", "UINT")):
        if any(type(v) is not int for v in values):
            fractional = [v for v in values if type(v) is not int and not float(v).is_integer()]
            if fractional:
                raise RequestError(f"input '{spec.name}' is {spec.datatype}: data must hold integers, found "
                                   f"{_show(fractional[0])}")
        return _in_integer_range(spec, [int(v) for v in values])
    return np.array([_to_float(v) for v in values], dtype=np.float64)


def _to_float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:   # an integer beyond float64's range
        return math.inf if value > 0 else -math.inf


def _exact_integers(spec: TensorSpec, data: list, depth: int, values: np.ndarray) -> np.ndarray:
    """Integer inputs that numpy read as floats (a list mixing integers and floats such as 3.0): the values, if
    every one is integral, as exact integers when the JSON gave them as integers (a float64 holds only 53 bits)."""
    fractional = ~np.isfinite(values) | (values != np.trunc(values))
    if fractional.any():
        index = int(np.argmax(fractional))
        found = next(itertools.islice(_leaves(data, depth), index, None), values[index])
        raise RequestError(f"input '{spec.name}' is {spec.datatype}: data must hold integers, found {_show(found)}")
    objects = list(_leaves(data, depth))
    if all(type(v) is int for v in objects):   # noqa: E721 - exactly int: JSON integers
        return _in_integer_range(spec, objects)
    return values


def _in_integer_range(spec: TensorSpec, numbers: list[int]) -> np.ndarray:
    """Python integers as the input's integer dtype; RequestError naming the first bound outside its range."""
    info = np.iinfo(NUMPY_DTYPES[spec.datatype])
    for bound in (min(numbers), max(numbers)):
        if not info.min <= bound <= info.max:
            raise RequestError(f"input '{spec.name}' is {spec.datatype}: {_show(bound)} is outside "
                               f"{info.min}..{info.max}")
    return np.array(numbers, dtype=NUMPY_DTYPES[spec.datatype])


def _show(value: Any) -> str:
    """One value as an error message quotes it (`brief`, cut to SHOWN_CHARS)."""
    return brief(value, SHOWN_CHARS)


def brief(value: Any, limit: int, levels: int = 3) -> str:
    """A value of a request as JSON text, as the client wrote it where known (a JsonNumber's text), cut to `limit`
    characters: a few elements of a list or object, `levels` deep. Bounded however large or deep the value is."""
    text = _brief(value, levels)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _brief(value: Any, levels: int) -> str:
    if isinstance(value, (list, tuple)):
        if not value:
            return "[]"
        if levels == 0:
            return "[...]"
        items = [_brief(v, levels - 1) for v in value[:4]]
        return "[" + ", ".join(items) + (", ...]" if len(value) > 4 else "]")
    if isinstance(value, dict):
        if not value:
            return "{}"
        if levels == 0:
            return "{...}"
        items = [f"{_brief(k, 0)}: {_brief(v, levels - 1)}" for k, v in itertools.islice(value.items(), 4)]
        return "{" + ", ".join(items) + (", ...}" if len(value) > 4 else "}")
    if isinstance(value, JsonNumber):
        return value.text
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, str):
        return json.dumps(value[:80], ensure_ascii=False)
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<an integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)   # nan, inf, -inf: what Python read (JSON has no literal for them)
    if isinstance(value, (bool, int, float)) or value is None:
        return json.dumps(value)
    return brief(repr(value), 80)


def to_json(array: np.ndarray) -> list:
    """An output's ``data``: the array flattened in row-major order (BYTES as strings), every float finite or one of
    the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (JSON has no literal for them; NON_FINITE_TEXT)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.dtype.kind in "OUS":
        return [_text(v) for v in flat]
    if flat.dtype == np.float16:
        flat = flat.astype(np.float32)
    data = flat.tolist()
    if flat.dtype.kind == "f":
        for index in np.flatnonzero(~np.isfinite(flat)).tolist():
            data[index] = NON_FINITE_TEXT[repr(float(data[index]))]
    return data


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
