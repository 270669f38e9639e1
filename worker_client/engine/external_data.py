"""Stage "load", its one door to the disk: every tensor's data checked, external data opened safely.

A model's tensors may keep their bytes in files beside it (ONNX external data: a
`location` relative to the model's folder, an `offset` and a `length`). A model file is
input from whoever made it, so a location is a request to read some file of this host
(its bytes become parameters any worker can pull). Every path of the project that reads a
model's tensors -- dense parameters, sparse and dynamic tables mapped from their file,
pipeline stage cuts, `ps-check`, the launcher's and the worker's checks -- goes through
this module, which applies at least onnx's own rules:

- the location is relative, not empty, names no `..` and no absolute path;
- it is opened one component at a time below the model's folder, never following a
  symbolic link (a linked file or a linked folder on the way is refused), and must end at
  a regular file;
- the offset and the length are non-negative integers that lie within the file, and the
  bytes are exactly the tensor's size (its dims times its dtype's size).

Tensors whose bytes are in the model are checked too (`check_tensor_data`): a tensor that
declares dims must carry that many values, so a crafted 2^40 x 2^40 tensor without data is
refused naming the file and the tensor before any array is made.

Every refusal is a ModelLoadError naming the model file, the tensor and the value.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import onnx
from onnx import TensorProto, helper

from ps_common.errors import ModelLoadError

__all__ = ["ExternalRef", "check_model_tensors", "check_tensor_data", "load_external_data", "map_external",
           "open_external", "read_external", "tensors_of"]

#: The keys an external-data entry may have (onnx's list); others are ignored, as onnx does.
KNOWN_KEYS = frozenset({"location", "offset", "length", "checksum", "basepath"})
#: The typed value fields of a TensorProto, by data type, for tensors without raw_data.
_TYPED_FIELDS = {
    TensorProto.FLOAT: "float_data", TensorProto.COMPLEX64: "float_data",
    TensorProto.DOUBLE: "double_data", TensorProto.COMPLEX128: "double_data",
    TensorProto.INT64: "int64_data", TensorProto.UINT32: "uint64_data", TensorProto.UINT64: "uint64_data",
    TensorProto.STRING: "string_data",
}
#: Values per element stored in the typed field (complex numbers are two floats).
_PER_ELEMENT = {TensorProto.COMPLEX64: 2, TensorProto.COMPLEX128: 2}
#: 4-bit types: two elements a byte in raw data and in each int32_data value.
_PACKED = frozenset(getattr(TensorProto, name) for name in ("INT4", "UINT4", "FLOAT4E2M1") if hasattr(TensorProto, name))


@dataclass(frozen=True)
class ExternalRef:
    """Where one tensor's bytes lie: an open file descriptor (owned by the caller) and the byte range."""

    fd: int
    offset: int
    length: int
    location: str

    def close(self) -> None:
        os.close(self.fd)


def tensors_of(model: onnx.ModelProto) -> Iterator[TensorProto]:
    """Every tensor of the model: initializers and Constant/attribute tensors, in subgraphs too."""

    def of_graph(graph: onnx.GraphProto) -> Iterator[TensorProto]:
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.HasField("t"):
                    yield attribute.t
                yield from attribute.tensors
                if attribute.HasField("g"):
                    yield from of_graph(attribute.g)
                for sub in attribute.graphs:
                    yield from of_graph(sub)

    yield from of_graph(model.graph)
    for function in model.functions:
        for node in function.node:
            for attribute in node.attribute:
                if attribute.HasField("t"):
                    yield attribute.t


def _itemsize(tensor: TensorProto, where: str) -> int:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{where}: tensor {tensor.name!r} has data type {tensor.data_type}, which onnx does not "
                             "define") from exc


def _expected_bytes(tensor: TensorProto, where: str) -> int:
    """The bytes the tensor's dims and dtype need, as a Python int (no overflow); negative dims refused."""
    if any(d < 0 for d in tensor.dims):
        raise ModelLoadError(f"{where}: tensor {tensor.name!r} declares a negative dimension in its shape "
                             f"{list(tensor.dims)}")
    count = math.prod(tensor.dims)
    if tensor.data_type in _PACKED:
        return (count + 1) // 2
    return count * _itemsize(tensor, where)


def check_tensor_data(tensor: TensorProto, where: str) -> None:
    """A tensor stored in the model carries exactly the values its dims declare (ModelLoadError otherwise).

    Cheap: only lengths are compared, no value is read. External tensors are checked when
    opened (`open_external`); strings are counted, not sized.
    """
    if tensor.data_location == TensorProto.EXTERNAL:
        return
    if any(d < 0 for d in tensor.dims):
        raise ModelLoadError(f"{where}: tensor {tensor.name!r} declares a negative dimension in its shape "
                             f"{list(tensor.dims)}")
    count = math.prod(tensor.dims)
    if tensor.data_type == TensorProto.STRING:
        found, unit = len(tensor.string_data), "strings"
        if found != count:
            raise ModelLoadError(f"{where}: tensor {tensor.name!r} declares shape {list(tensor.dims)} ({count} "
                                 f"values) but holds {found} {unit}")
        return
    need = _expected_bytes(tensor, where)
    if tensor.HasField("raw_data"):
        found = len(tensor.raw_data)
        if found != need:
            raise ModelLoadError(f"{where}: tensor {tensor.name!r} declares shape {list(tensor.dims)} of "
                                 f"{helper.tensor_dtype_to_np_dtype(tensor.data_type)} ({need} bytes) "
                                 f"but holds {found} bytes: the file is damaged or was crafted")
        return
    if tensor.data_type in _PACKED:
        return   # packed in int32_data in more than one way across onnx versions: left to onnx
    field = _TYPED_FIELDS.get(tensor.data_type, "int32_data")   # int8..int32, bool, float16, bfloat16: int32_data
    found = len(getattr(tensor, field))
    want = count * _PER_ELEMENT.get(tensor.data_type, 1)
    if found != want and not (count == 0 and found == 0):
        raise ModelLoadError(f"{where}: tensor {tensor.name!r} declares shape {list(tensor.dims)} ({count} values) "
                             f"but holds {found} values in {field}: the file is damaged or was crafted")


def _entries(tensor: TensorProto, where: str) -> dict[str, str]:
    info = {e.key: e.value for e in tensor.external_data if e.key in KNOWN_KEYS}
    if not info.get("location"):
        raise ModelLoadError(f"{where}: tensor {tensor.name!r} is marked as external data but names no location")
    return info


def _non_negative(info: dict[str, str], key: str, tensor: TensorProto, where: str) -> int | None:
    if key not in info:
        return None
    try:
        value = int(info[key])
    except ValueError:
        value = -1
    if value < 0:
        raise ModelLoadError(f"{where}: tensor {tensor.name!r}: external data {key} {info[key]!r} is not a "
                             "non-negative integer")
    return value


def _checked_location(location: str, tensor: TensorProto, where: str) -> tuple[str, ...]:
    """The location's components: relative, no '..', no empty or NUL name."""
    if "\0" in location:
        raise ModelLoadError(f"{where}: tensor {tensor.name!r}: external data location {location!r} holds a NUL byte")
    path = PurePosixPath(location)
    if path.is_absolute() or location.startswith(("\\", "~")) or (len(location) > 1 and location[1] == ":"):
        raise ModelLoadError(f"{where}: tensor {tensor.name!r}: external data location {location!r} is an absolute "
                             "path; it must be relative to the model's folder")
    parts = tuple(p for p in path.parts if p != ".")
    if not parts:
        raise ModelLoadError(f"{where}: tensor {tensor.name!r}: external data location {location!r} names the "
                             "model's folder, not a file in it")
    if ".." in parts:
        raise ModelLoadError(f"{where}: tensor {tensor.name!r}: external data location {location!r} points outside "
                             "the model's folder")
    return parts


def _open_beneath(base_dir: Path, parts: tuple[str, ...], tensor: TensorProto, location: str, where: str) -> int:
    """An fd of the regular file base_dir/parts, walked one component at a time without following links."""
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    try:
        directory = os.open(base_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise ModelLoadError(f"{where}: tensor {tensor.name!r}: cannot open the model's folder {base_dir}: "
                             f"{exc.strerror}") from exc
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            shown = "/".join(parts[:i + 1])
            try:
                info = os.stat(name, dir_fd=directory, follow_symlinks=False)
            except FileNotFoundError as exc:
                raise ModelLoadError(f"{where}: tensor {tensor.name!r}: its external data file {location!r} is "
                                     f"missing ({base_dir / shown} does not exist)") from exc
            except OSError as exc:
                raise ModelLoadError(f"{where}: tensor {tensor.name!r}: cannot read external data {location!r}: "
                                     f"{exc.strerror}") from exc
            if stat.S_ISLNK(info.st_mode):
                raise ModelLoadError(f"{where}: tensor {tensor.name!r}: external data location {location!r} goes "
                                     f"through a symbolic link ({base_dir / shown}); external data must be a "
                                     "regular file inside the model's folder")
            wanted = stat.S_ISREG if last else stat.S_ISDIR
            if not wanted(info.st_mode):
                kind = "a regular file" if last else "a folder"
                raise ModelLoadError(f"{where}: tensor {tensor.name!r}: external data location {location!r}: "
                                     f"{base_dir / shown} is not {kind}")
            flags = os.O_RDONLY | nofollow | (0 if last else getattr(os, "O_DIRECTORY", 0))
            try:
                fd = os.open(name, flags | getattr(os, "O_NONBLOCK", 0) * last, dir_fd=directory)
            except OSError as exc:   # a link swapped in between the stat and the open (ELOOP), or gone
                raise ModelLoadError(f"{where}: tensor {tensor.name!r}: cannot open external data {location!r} "
                                     f"safely: {exc.strerror}") from exc
            os.close(directory)
            directory = fd
        opened = os.fstat(directory)
        if not stat.S_ISREG(opened.st_mode):
            raise ModelLoadError(f"{where}: tensor {tensor.name!r}: external data location {location!r} is not a "
                                 "regular file")
        fd, directory = directory, -1
        return fd
    finally:
        if directory >= 0:
            os.close(directory)


def open_external(tensor: TensorProto, base_dir: str | os.PathLike[str] | None, *, where: str) -> ExternalRef:
    """The checked location of an external tensor's bytes (see the module's rules); ModelLoadError otherwise.

    `where` names the model file in messages. The caller closes the returned fd.
    """
    info = _entries(tensor, where)
    location = info["location"]
    if base_dir is None:
        raise ModelLoadError(f"{where}: tensor {tensor.name!r} is in external data ({location!r}), but the "
                             "model's folder is unknown (the model was not read from a file)")
    if tensor.data_type == TensorProto.STRING:
        raise ModelLoadError(f"{where}: tensor {tensor.name!r}: string tensors cannot be external data")
    parts = _checked_location(location, tensor, where)
    offset = _non_negative(info, "offset", tensor, where) or 0
    length = _non_negative(info, "length", tensor, where)
    need = _expected_bytes(tensor, where)
    fd = _open_beneath(Path(base_dir), parts, tensor, location, where)
    try:
        size = os.fstat(fd).st_size
        available = size - offset
        if available < 0:
            raise ModelLoadError(f"{where}: tensor {tensor.name!r}: external data offset {offset} is past the end "
                                 f"of {location!r} ({size} bytes)")
        if length is None:
            length = available
        if length > available:
            raise ModelLoadError(f"{where}: tensor {tensor.name!r}: external data length {length} from offset "
                                 f"{offset} passes the end of {location!r} ({size} bytes)")
        if length != need:
            raise ModelLoadError(f"{where}: tensor {tensor.name!r} of shape {list(tensor.dims)} needs {need} bytes, "
                                 f"its external data in {location!r} has {length}")
        return ExternalRef(fd, offset, length, location)
    except BaseException:
        os.close(fd)
        raise


def read_external(tensor: TensorProto, base_dir: str | os.PathLike[str] | None, *, where: str) -> bytes:
    """An external tensor's bytes, read through `open_external`."""
    ref = open_external(tensor, base_dir, where=where)
    try:
        return os.pread(ref.fd, ref.length, ref.offset) if ref.length else b""
    finally:
        ref.close()


def map_external(tensor: TensorProto, base_dir: str | os.PathLike[str] | None, *, where: str) -> np.ndarray:
    """An external tensor as a read-only array mapped from its file (never read whole), through `open_external`."""
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).newbyteorder("<")
    shape = tuple(int(d) for d in tensor.dims)
    ref = open_external(tensor, base_dir, where=where)
    if ref.length == 0:
        ref.close()
        return np.empty(shape, dtype=dtype)
    with os.fdopen(ref.fd, "rb") as file:   # closed here; the mapping stays valid
        return np.memmap(file, dtype=dtype, mode="r", offset=ref.offset, shape=shape)


def check_model_tensors(model: onnx.ModelProto, base_dir: str | os.PathLike[str] | None, *, where: str) -> None:
    """Every tensor's data checked, external ones opened and closed again without reading (ModelLoadError)."""
    for tensor in tensors_of(model):
        if tensor.data_location == TensorProto.EXTERNAL:
            open_external(tensor, base_dir, where=where).close()
        else:
            check_tensor_data(tensor, where)


def load_external_data(model: onnx.ModelProto, base_dir: str | os.PathLike[str] | None, *, where: str) -> None:
    """Reads every external tensor's bytes into the model (in place), through `open_external`."""
    for tensor in tensors_of(model):
        if tensor.data_location == TensorProto.EXTERNAL:
            tensor.raw_data = read_external(tensor, base_dir, where=where)
            tensor.data_location = TensorProto.DEFAULT
            del tensor.external_data[:]
