"""Run time: the caller's parameters and inputs checked and converted to what a session takes."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper

__all__ = ["check_shape", "coerce", "data_inputs_of", "declared_dims", "element_dtype", "parameter_feed",
           "shown"]

#: A declared shape: an int per static axis, the symbol (or None) of a dynamic one.
Dims = tuple[int | str | None, ...]


def declared_dims(value: onnx.ValueInfoProto) -> Dims | None:
    """The shape a graph input or output declares; None when it declares none."""
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                 for d in tensor_type.shape.dim)


def data_inputs_of(model: onnx.ModelProto) -> dict[str, tuple[np.dtype, Dims | None]]:
    """The model's data inputs as its file declares them: graph inputs that are no initializer, each with its
    element dtype and declared dims (axis 0 the batch)."""
    initializers = {t.name for t in model.graph.initializer}
    return {v.name: (element_dtype(v), declared_dims(v)) for v in model.graph.input if v.name not in initializers}


def element_dtype(value: onnx.ValueInfoProto) -> np.dtype:
    """The numpy dtype of a graph input's or output's elements."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))


def shown(dims: Dims | None) -> object:
    """`dims` for a message: "?" for an unnamed dynamic axis, "any" for no shape at all."""
    if dims is None:
        return "any"
    return tuple(d if isinstance(d, int) else (d or "?") for d in dims)


def coerce(what: str, array: object, dtype: np.dtype) -> np.ndarray:
    """`array` as a C-contiguous `dtype` array, converting only where no meaning is lost:
    float to float (float64 data for a float32 model), integer or bool to float, and
    integer to integer when every value fits."""
    value = np.asarray(array)
    if value.dtype == dtype:
        return _c_order(value)
    if dtype.kind == "f" and value.dtype.kind in "fiub":
        return _c_order(value, dtype)
    if dtype.kind in "iu" and value.dtype.kind in "iu":
        info = np.iinfo(dtype)
        if value.size and (value.min() < info.min or value.max() > info.max):
            raise ValueError(f"{what}: values in [{value.min()}, {value.max()}] do not fit "
                             f"the expected {dtype}")
        return _c_order(value, dtype)
    raise ValueError(f"{what}: expected dtype {dtype}, got {value.dtype}, which does not "
                     f"convert safely")


def _c_order(value: np.ndarray, dtype: np.dtype | None = None) -> np.ndarray:
    """`value` as a C-contiguous array of `dtype`, copying only when needed. Not
    np.ascontiguousarray, which turns a 0-d array (a scalar parameter) into a 1-d one."""
    return np.asarray(value, dtype=dtype, order="C")


def check_shape(what: str, array: np.ndarray, expected: Dims | None, *,
                free_batch: bool = False) -> None:
    """Raise unless `array.shape` matches `expected` (symbolic entries match anything, and
    so does axis 0 when `free_batch`)."""
    if expected is None:
        return
    fits = len(array.shape) == len(expected) and all(
        not isinstance(want, int) or got == want or (free_batch and axis == 0)
        for axis, (got, want) in enumerate(zip(array.shape, expected)))
    if not fits:
        raise ValueError(f"{what}: expected shape {shown(expected)}, got {tuple(array.shape)}")


def parameter_feed(parameters: Mapping[str, np.ndarray],
                   initial: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`parameters` checked against the trainable parameters' `initial` values (one for
    each, same shape, a dtype that converts safely) and converted to their dtypes."""
    missing = [name for name in initial if name not in parameters]
    if missing:
        raise ValueError(f"parameters are missing {missing}")
    unknown = set(parameters) - set(initial)
    if unknown:
        raise ValueError(f"unknown parameters {sorted(unknown)}; the trainable "
                         f"parameters are {list(initial)}")
    feed = {}
    for name, value in initial.items():
        converted = coerce(f"parameter {name!r}", parameters[name], value.dtype)
        check_shape(f"parameter {name!r}", converted, value.shape)
        feed[name] = converted
    return feed
