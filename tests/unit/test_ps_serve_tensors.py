"""ps-serve's tensors on the wire (ps_serve/tensors.py) and the HTTP request parser (ps_serve/http.py): every
encoding decodes to the array it encodes, and every mistake is a RequestError naming the input and the values."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ps_serve.errors import RequestError
from ps_serve.http import parse_infer_request
from ps_serve.tensors import TensorSpec, from_json, from_raw, spec_shape, to_json, to_raw

X = TensorSpec("x", "FP32", (-1, 3))


@pytest.mark.parametrize(("datatype", "values"), [
    ("BOOL", [True, False, True, True, False, False]),
    ("UINT8", [0, 1, 2, 253, 254, 255]),
    ("INT8", [-128, -1, 0, 1, 2, 127]),
    ("UINT16", [0, 1, 2, 3, 4, 65535]),
    ("INT32", [-2**31, -1, 0, 1, 2, 2**31 - 1]),
    ("INT64", [-2**63, -1, 0, 1, 2**40, 2**63 - 1]),
    ("UINT64", [0, 1, 2, 3, 2**63, 2**64 - 1]),
    ("FP16", [0.5, -1.0, 2.0, 65504.0, 0.0, -0.25]),
    ("FP32", [0.1, -1e30, 3.5, 0.0, 1e-30, 7.0]),
    ("FP64", [0.1, -1e300, 3.5, 0.0, 1e-300, 7.0]),
    ("BYTES", ["a", "", "héllo", "x" * 300, "0", "\u2603"]),
])
def test_raw_and_json_encodings_of_every_datatype_decode_to_the_same_array(datatype: str, values: list) -> None:
    spec = TensorSpec("t", datatype, (-1, 3))
    from_data = from_json(spec, datatype, [2, 3], values)
    assert from_data.shape == (2, 3)
    raw = to_raw(from_data)
    from_bytes = from_raw(spec, datatype, [2, 3], raw)
    assert from_bytes.dtype == from_data.dtype
    assert from_bytes.tolist() == from_data.tolist()
    assert from_json(spec, datatype, [2, 3], to_json(from_bytes)).tolist() == from_data.tolist()


def test_fixed_size_raw_bytes_are_little_endian_row_major() -> None:
    array = from_raw(TensorSpec("t", "INT32", (2, 2)), "INT32", [2, 2], bytes([1, 0, 0, 0, 2, 0, 0, 0,
                                                                               0, 1, 0, 0, 0, 0, 0, 1]))
    assert array.tolist() == [[1, 2], [256, 2**24]]


def test_bytes_raw_form_is_a_4_byte_length_before_each_element() -> None:
    raw = to_raw(np.array(["ab", "", "c"], dtype=object))
    assert raw == b"\x02\x00\x00\x00ab\x00\x00\x00\x00\x01\x00\x00\x00c"


@pytest.mark.parametrize(("spec", "datatype", "shape", "data", "message"), [
    (X, "FP64", [1, 3], [1, 2, 3], "input 'x' has datatype FP64, but the model takes FP32"),
    (X, "FP32", [1, 4], [1, 2, 3, 4], "input 'x' has shape [1, 4], but the model takes [-1, 3]: axis 1 must be 3, not 4"),
    (X, "FP32", [3], [1, 2, 3], "input 'x' has shape [3] (rank 1), but the model takes rank 2"),
    (X, "FP32", [1, -3], [], "input 'x': shape [1, -3] has a negative dimension"),
    (X, "FP32", "1,3", [1, 2, 3], "input 'x': shape must be a list of integers, got \"1,3\""),
    (X, "FP32", [2, 3], [1, 2, 3], "input 'x' has shape [2, 3] (6 elements), but its data has 3 element(s)"),
    (X, "FP32", [1, 3], [1, None, 3], "input 'x' is FP32: data must hold numbers, found null"),
    (TensorSpec("n", "INT8", (3,)), "INT8", [3], [1, 200, 3], "input 'n' is INT8: 200 is outside -128..127"),
    (TensorSpec("n", "UINT8", (3,)), "UINT8", [3], [1, -1, 3], "input 'n' is UINT8: -1 is outside 0..255"),
    (TensorSpec("n", "INT64", (3,)), "INT64", [3], [1, 2.5, 3], "input 'n' is INT64: data must hold integers, found 2.5"),
    (TensorSpec("f", "BOOL", (3,)), "BOOL", [3], [1, 0, 1], "input 'f' is BOOL: data must hold true/false"),
    (TensorSpec("s", "BYTES", (2,)), "BYTES", [2], ["a", 3], "input 's' is BYTES: every element of data must be a "
                                                              "string, found 3"),
])
def test_json_data_that_does_not_fit_the_input_is_refused_naming_the_input_and_the_values(
        spec, datatype, shape, data, message: str) -> None:
    with pytest.raises(RequestError) as raised:
        from_json(spec, datatype, shape, data)
    assert str(raised.value).startswith(message), str(raised.value)


def test_integral_floats_are_taken_for_integer_inputs_as_json_writers_often_send_them() -> None:
    assert from_json(TensorSpec("n", "INT64", (-1,)), "INT64", [2], [3.0, -4.0]).tolist() == [3, -4]


@pytest.mark.parametrize(("datatype", "shape", "raw", "message"), [
    ("FP32", [1, 3], bytes(8), "input 'x' has 8 bytes of binary data, but FP32 [1, 3] needs 12 (3 x 4 bytes)"),
    ("BOOL", [3], bytes([1, 2, 0]), "input 'x' is BOOL: its bytes must be 0 or 1"),
    ("BYTES", [2], b"\x01\x00\x00\x00a", "input 'x' has shape [2] (2 elements), but its binary data holds 1 BYTES"),
    ("BYTES", [1], b"\x05\x00\x00\x00ab", "input 'x': BYTES element 0 says 5 bytes, but only 2 are left"),
    ("BYTES", [1], b"\x02\x00", "input 'x': BYTES data ends inside the length of element 0"),
    ("BYTES", [1], b"\x01\x00\x00\x00\xff", "input 'x': BYTES element 0 is not UTF-8 text"),
])
def test_raw_bytes_that_do_not_fit_the_input_are_refused(datatype: str, shape: list, raw: bytes, message: str) -> None:
    spec = TensorSpec("x", datatype, tuple(-1 for _ in shape))
    with pytest.raises(RequestError) as raised:
        from_raw(spec, datatype, shape, raw)
    assert str(raised.value).startswith(message), str(raised.value)


def test_onnxruntime_shapes_become_protocol_shapes_with_minus_one_for_every_axis_not_fixed() -> None:
    assert spec_shape(["batch", 64, None, 3]) == (-1, 64, -1, 3)


class _State:
    """The part of a ModelState the parser reads: the input specs."""

    inputs = (X, TensorSpec("ids", "INT64", (-1,)))

    def input_spec(self, name: str) -> TensorSpec:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise RequestError(f"unknown input '{name}'")

    def describe_inputs(self) -> str:
        return ", ".join(spec.describe() for spec in self.inputs)


def binary_body(document: dict, *blobs: bytes) -> tuple[bytes, str]:
    header = json.dumps(document).encode()
    return header + b"".join(blobs), str(len(header))


def test_a_binary_request_takes_each_inputs_bytes_in_order_and_the_output_choices() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    ids = np.array([7, 8], np.int64)
    body, length = binary_body({
        "id": "q", "parameters": {"binary_data_output": True},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": 24}},
                   {"name": "ids", "datatype": "INT64", "shape": [2], "data": [7, 8]}],
        "outputs": [{"name": "y", "parameters": {"binary_data": False}}, {"name": "z"}]}, x.tobytes())
    request = parse_infer_request(_State(), body, length)
    assert request.id == "q" and request.binary_output is True
    assert request.outputs == [("y", False), ("z", None)]
    np.testing.assert_array_equal(request.inputs["x"], x)
    np.testing.assert_array_equal(request.inputs["ids"], ids)


@pytest.mark.parametrize(("document", "blobs", "length", "message"), [
    ({"inputs": [{"name": "ids", "datatype": "INT64", "shape": [1], "data": [1]}]}, [b"\x00" * 3], None,
     "the body has 3 bytes of binary data that no input's binary_data_size accounts for"),
    ({"inputs": [{"name": "ids", "datatype": "INT64", "shape": [1], "parameters": {"binary_data_size": 8},
                  "data": [1]}]}, [bytes(8)], None, "input 'ids' has both 'data' and binary_data_size"),
    ({"inputs": [{"name": "ids", "datatype": "INT64", "shape": [1]}]}, [], None,
     "input 'ids' has neither 'data' nor parameters.binary_data_size"),
    ({"inputs": [{"name": "ids", "shape": [1], "data": [1]}]}, [], None, "input 'ids' has no 'datatype'"),
    ({"inputs": {"name": "ids"}}, [], None, "the request needs 'inputs', a non-empty list"),
    ({"inputs": [{"name": "ids", "datatype": "INT64", "shape": [1], "data": [1]}],
      "parameters": {"sequence_id": 5}}, [], None, "parameter 'sequence_id': sequences are not supported"),
    ({"inputs": [{"name": "ids", "datatype": "INT64", "shape": [1], "data": [1]}],
      "outputs": [{"name": "y", "parameters": {"binary_data": "yes"}}]}, [], None,
     "output 'y': parameter 'binary_data' must be true or false"),
    ({"inputs": []}, [], "x9", "Inference-Header-Content-Length must be an integer, got 'x9'"),
    ({"inputs": []}, [], "100000", "Inference-Header-Content-Length is 100000, but the body has"),
])
def test_a_malformed_request_is_refused_with_a_message_saying_what_is_wrong(document, blobs, length,
                                                                            message: str) -> None:
    body, header_length = binary_body(document, *blobs)
    with pytest.raises(RequestError) as raised:
        parse_infer_request(_State(), body, length if length is not None else (header_length if blobs else None))
    assert str(raised.value).startswith(message), str(raised.value)


def test_a_body_that_is_not_json_is_a_request_error_not_a_crash() -> None:
    for body in (b"\xff\xfe", b"[1, 2]", b"{"):
        with pytest.raises(RequestError):
            parse_infer_request(_State(), body, None)
