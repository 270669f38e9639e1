"""ps-serve against hostile inputs: every bad body is a 4xx naming what is wrong, never a 500 or a traceback in the
server's log, and no answer is JSON a strict parser rejects.

One server runs in this process (ps_serve.server.BackgroundServer, HTTP and gRPC on port 0 of 127.0.0.1) on a model
built here: x FP32 [N, 4] -> recip = 1/x and root = sqrt(x) (so 0 and -1 make infinities and NaN), h FP16 [N, 4] ->
half (h itself), n INT64 [N, 4] -> count (n itself). Every request is sent with a timeout.
"""

from __future__ import annotations

import gzip
import http.client
import json
import logging
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from ps_serve.errors import RequestError
from ps_serve.http import parse_infer_request
from ps_serve.model import ModelState, ServedModel
from ps_serve.server import BackgroundServer, ServeConfig
from ps_serve.tensors import TensorSpec, from_json, to_json

#: Seconds any one request may take.
TIMEOUT = 30.0
#: The server's body limit: small, so that a decompression bomb is cheap to send.
MAX_REQUEST_BYTES = 1 << 20
INFER = "/v2/models/hostile/infer"


def hostile_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Reciprocal", ["x"], ["recip"]), helper.make_node("Sqrt", ["x"], ["root"]),
         helper.make_node("Identity", ["h"], ["half"]), helper.make_node("Identity", ["n"], ["count"])],
        "hostile",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT16, ["N", 4]),
         helper.make_tensor_value_info("n", TensorProto.INT64, ["N", 4])],
        [helper.make_tensor_value_info("recip", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("root", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("half", TensorProto.FLOAT16, ["N", 4]),
         helper.make_tensor_value_info("count", TensorProto.INT64, ["N", 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    served = ServedModel("hostile", ModelState.from_model(hostile_model(), source="hostile"))
    with BackgroundServer(served, ServeConfig(grpc_port=0, max_request_bytes=MAX_REQUEST_BYTES)) as background:
        yield background


@pytest.fixture
def server_errors(caplog: pytest.LogCaptureFixture) -> Iterator[list[logging.LogRecord]]:
    """The ERROR records (a fault of the server, with its traceback) logged while a test runs."""
    caplog.set_level(logging.ERROR)
    records: list[logging.LogRecord] = []
    yield records
    records.extend(r for r in caplog.records if r.levelno >= logging.ERROR)
    assert not records, [r.getMessage() for r in records]


def post(server: BackgroundServer, body: bytes, headers: Mapping[str, str] | None = None,
         path: str = INFER) -> tuple[int, dict[str, str], bytes]:
    host, _, port = server.ready["http"].rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def strict_json(body: bytes) -> Any:
    """JSON as a strict parser reads it: NaN, Infinity and -Infinity are errors, as in JSON.parse."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(body, parse_constant=refuse)


def inputs(x: Any = None, h: Any = None, n: Any = None, replace: dict | None = None) -> list[dict]:
    """A valid request's inputs for one row, with any input's data (or whole tensor: `replace`) replaced."""
    tensors = {"x": {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": x if x is not None else [1, 2, 3, 4]},
               "h": {"name": "h", "datatype": "FP16", "shape": [1, 4], "data": h if h is not None else [1, 2, 3, 4]},
               "n": {"name": "n", "datatype": "INT64", "shape": [1, 4], "data": n if n is not None else [1, 2, 3, 4]}}
    for name, tensor in (replace or {}).items():
        tensors[name] = tensor
    return list(tensors.values())


def infer(server: BackgroundServer, document: dict | bytes,
          headers: Mapping[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    body = document if isinstance(document, bytes) else json.dumps(document).encode()
    status, answer_headers, answer = post(server, body, headers)
    return status, answer_headers, strict_json(answer)


# ---------------------------------------------------------------------- 1. bodies the server cannot decode


def test_json_nested_100000_levels_deep_is_a_400_not_a_recursion_error(server, server_errors) -> None:
    body = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":' + b"[" * 100_000 + b"]" * 100_000 + b"}]}"
    status, _, answer = infer(server, body)
    assert (status, answer) == (400, {"error": "the request body is not valid JSON: nested too deeply"})


def test_data_nested_deeper_than_the_shape_but_within_the_json_limit_is_a_400_naming_the_depth(
        server, server_errors) -> None:
    deep: Any = [1.0]
    for _ in range(500):
        deep = [deep]
    status, _, answer = infer(server, {"inputs": inputs(x=deep), "id": deep, "parameters": {"x": deep}})
    assert status == 400
    assert answer["error"].startswith("id must be a string, got [[[[...]]]]"), answer
    status, _, answer = infer(server, {"inputs": inputs(x=deep)})
    assert status == 400
    assert answer["error"].startswith("input 'x': data nests 501 levels deep but shape is [1, 4]"), answer


def test_a_body_that_says_gzip_but_is_not_gzip_is_a_400_naming_the_coding(server, server_errors) -> None:
    status, _, answer = infer(server, b"notgzip", {"Content-Encoding": "gzip"})
    assert status == 400
    assert answer["error"].startswith("the request body is not valid gzip (Content-Encoding: gzip): "), answer
    assert "incorrect header check" in answer["error"]
    truncated = gzip.compress(json.dumps({"inputs": inputs()}).encode())[:-12]
    status, _, answer = infer(server, truncated, {"Content-Encoding": "gzip"})
    assert status == 400 and "it ends before the compressed data does" in answer["error"], answer
    status, _, answer = infer(server, b"\x78\x9c garbage", {"Content-Encoding": "deflate"})
    assert status == 400 and answer["error"].startswith("the request body is not valid deflate"), answer


@pytest.mark.parametrize("coding", ["br", "zstd", "compress", "gzip, deflate"])
def test_a_content_encoding_the_server_cannot_read_is_a_415_naming_it_and_the_codings_it_reads(
        server, server_errors, coding: str) -> None:
    status, headers, answer = infer(server, b"\x8b\x00\x80 not brotli either", {"Content-Encoding": coding})
    assert status == 415
    assert answer == {"error": f"Content-Encoding {coding!r} is not supported; send identity, gzip or deflate"}
    assert headers["Accept-Encoding"] == "gzip, deflate, identity"


@pytest.mark.parametrize(("coding", "compress"), [
    ("gzip", gzip.compress), ("x-gzip", gzip.compress), ("GZIP", gzip.compress),
    ("deflate", zlib.compress), ("deflate", lambda data: zlib.compress(data, wbits=-15)),
    ("identity", lambda data: data)])
def test_gzip_and_deflate_bodies_are_still_read(server, server_errors, coding: str, compress) -> None:
    status, _, answer = infer(server, compress(json.dumps({"inputs": inputs()}).encode()),
                              {"Content-Encoding": coding})
    assert status == 200, answer
    assert {o["name"]: o["data"] for o in answer["outputs"]}["count"] == [1, 2, 3, 4]


def test_a_gzip_body_that_decompresses_beyond_the_limit_is_a_413(server, server_errors) -> None:
    bomb = gzip.compress(b'{"inputs": [' + b" " * (4 * MAX_REQUEST_BYTES) + b"]}")
    assert len(bomb) < MAX_REQUEST_BYTES
    status, _, answer = infer(server, bomb, {"Content-Encoding": "gzip"})
    assert status == 413
    assert answer["error"].startswith(f"the request body decompresses to more than {MAX_REQUEST_BYTES} bytes")


# ---------------------------------------------------------------------- 2. non-finite numbers


@pytest.mark.parametrize(("literal", "shown"), [
    (b"1e400", "found inf (a JSON number beyond float64's range, such as 1e400, reads as inf)"),
    (b"NaN", "found NaN (JSON has no NaN or Infinity)"),
    (b"-Infinity", "found -Infinity (JSON has no NaN or Infinity)")])
def test_a_non_finite_fp32_value_is_a_400_naming_the_input_the_datatype_and_the_value(
        server, server_errors, literal: bytes, shown: str) -> None:
    body = json.dumps({"inputs": inputs(x=[1, 2, 3, "VALUE"])}).encode().replace(b'"VALUE"', literal)
    status, _, answer = infer(server, body)
    assert status == 400
    assert answer["error"] == f"input 'x' is FP32: data must hold finite numbers, {shown}; send non-finite values " \
                              "as binary data"


def test_a_value_beyond_fp16s_range_is_a_400_not_a_silent_infinity(server, server_errors) -> None:
    status, _, answer = infer(server, {"inputs": inputs(h=[1, 2, 1e6, 4])})
    assert (status, answer) == (400, {"error": "input 'h' is FP16: 1000000.0 is outside FP16's finite range "
                                               "-65504..65504"})
    status, _, answer = infer(server, {"inputs": inputs(x=[1, 2, 3, 1e39])})
    assert status == 400
    assert answer["error"] == "input 'x' is FP32: 1e+39 is outside FP32's finite range -3.4028235e+38..3.4028235e+38"
    status, _, answer = infer(server, {"inputs": inputs(h=[65504, -65504, 0, 1])})
    assert status == 200, answer


def test_non_finite_outputs_are_the_strings_nan_infinity_and_minus_infinity_in_valid_json(
        server, server_errors) -> None:
    status, headers, answer = infer(server, {"inputs": inputs(x=[0.0, -0.0, -1.0, 4.0])})
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    outputs = {o["name"]: o["data"] for o in answer["outputs"]}
    assert outputs["recip"] == ["Infinity", "-Infinity", -1.0, 0.25]
    assert outputs["root"][2] == "NaN" and outputs["root"][3] == 2.0
    np.testing.assert_array_equal(np.array(outputs["root"], np.float32), [0.0, -0.0, np.nan, 2.0])
    # in binary the floats' own bytes travel
    binary = {"inputs": inputs(x=[0.0, -0.0, -1.0, 4.0]), "parameters": {"binary_data_output": True},
              "outputs": [{"name": "recip"}]}
    status, headers, body = post(server, json.dumps(binary).encode())
    length = int(headers["Inference-Header-Content-Length"])
    assert status == 200 and strict_json(body[:length])["outputs"][0]["parameters"]["binary_data_size"] == 16
    assert np.frombuffer(body[length:], np.float32).tolist()[:3] == [np.inf, -np.inf, -1.0]


def test_to_json_writes_every_non_finite_float_as_a_string_for_each_float_datatype() -> None:
    for dtype in (np.float16, np.float32, np.float64):
        data = to_json(np.array([[np.nan, np.inf], [-np.inf, 1.5]], dtype))
        assert data == ["NaN", "Infinity", "-Infinity", 1.5]
        assert np.isnan(np.array(data, dtype)[0]) and np.array(data, dtype)[1:].tolist() == [np.inf, -np.inf, 1.5]


# ---------------------------------------------------------------------- 3. nesting that does not match the shape


def test_data_nested_otherwise_than_the_shape_is_a_400_and_flat_or_shaped_data_is_taken(server, server_errors) -> None:
    spec = TensorSpec("x", "FP32", (-1, 64))
    with pytest.raises(RequestError) as raised:
        from_json(spec, "FP32", [2, 64], [[0.0] * 32] * 4)
    assert str(raised.value).startswith("input 'x': data nests as [4, 32] but shape is [2, 64]"), raised.value
    assert from_json(spec, "FP32", [2, 64], [0.0] * 128).shape == (2, 64)
    assert from_json(spec, "FP32", [2, 64], [[0.0] * 64] * 2).shape == (2, 64)
    text = TensorSpec("s", "BYTES", (-1, 2))
    with pytest.raises(RequestError) as raised:
        from_json(text, "BYTES", [2, 2], [["a"], ["b"], ["c"], ["d"]])
    assert str(raised.value).startswith("input 's': data nests as [4, 1] but shape is [2, 2]"), raised.value
    with pytest.raises(RequestError) as raised:
        from_json(text, "BYTES", [2, 2], [["a", "b"], ["c", ["d"]]])
    assert str(raised.value).startswith("input 's': data is a ragged nested list"), raised.value
    assert from_json(text, "BYTES", [2, 2], [["a", "b"], ["c", "d"]]).tolist() == [["a", "b"], ["c", "d"]]
    status, _, answer = infer(server, {"inputs": inputs(replace={
        "x": {"name": "x", "datatype": "FP32", "shape": [2, 4], "data": [[1, 2], [3, 4], [5, 6], [7, 8]]}})})
    assert (status, answer) == (400, {"error": "input 'x': data nests as [4, 2] but shape is [2, 4]; give data as a "
                                               "flat list of every element in row-major order, or nested exactly as "
                                               "the shape"})


# ---------------------------------------------------------------------- 4. gRPC contents


def grpc_infer(server: BackgroundServer, request: Any) -> Any:
    grpc = pytest.importorskip("grpc")
    from ps_serve.proto import grpc_service_pb2 as pb

    with grpc.insecure_channel(server.ready["grpc"]) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)
        return call(request, timeout=TIMEOUT)


def grpc_request(**contents: dict[str, list]) -> Any:
    """A ModelInfer request for one row of each input; `contents` sets an input's typed lists."""
    from ps_serve.proto import grpc_service_pb2 as pb

    request = pb.ModelInferRequest(model_name="hostile")
    for name, datatype in (("x", "FP32"), ("h", "FP16"), ("n", "INT64")):
        tensor = request.inputs.add(name=name, datatype=datatype, shape=[1, 4])
        for field, values in contents.get(name, {}).items():
            getattr(tensor.contents, field).extend(values)
    return request


def test_grpc_refuses_raw_and_typed_contents_for_one_input_as_http_refuses_data_and_binary(
        server, server_errors) -> None:
    grpc = pytest.importorskip("grpc")
    request = grpc_request(x={"fp32_contents": [1, 2, 3, 4]})
    request.raw_input_contents.extend([np.float32([1, 2, 3, 4]).tobytes(), np.float16([1, 2, 3, 4]).tobytes(),
                                       np.int64([1, 2, 3, 4]).tobytes()])
    with pytest.raises(grpc.RpcError) as raised:
        grpc_infer(server, request)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "input 'x' has both 'contents' (fp32_contents) and raw_input_contents; send one"
    del request.inputs[0].contents.fp32_contents[:]
    assert [o.name for o in grpc_infer(server, request).outputs] == ["recip", "root", "half", "count"]


def test_grpc_typed_contents_of_another_datatype_are_named_not_counted_as_no_data(server, server_errors) -> None:
    grpc = pytest.importorskip("grpc")
    request = grpc_request(x={"int_contents": [1, 2, 3, 4]}, n={"int64_contents": [1, 2, 3, 4]})
    with pytest.raises(grpc.RpcError) as raised:
        grpc_infer(server, request)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "FP32 input 'x' takes fp32_contents; got int_contents"
    request = grpc_request(x={"fp32_contents": [1, 2, 3, float("nan")]}, n={"int64_contents": [1, 2, 3, 4]})
    with pytest.raises(grpc.RpcError) as raised:
        grpc_infer(server, request)
    assert raised.value.details().startswith("input 'x' is FP32: data must hold finite numbers, found nan")


# ---------------------------------------------------------------------- 5. Inference-Header-Content-Length


@pytest.mark.parametrize(("length", "message"), [
    ("-1", "Inference-Header-Content-Length must be >= 0 and at most the body's size ({size} bytes), got -1"),
    ("0", "Inference-Header-Content-Length is 0, but the JSON header cannot be empty: the body starts with the "
          "request's JSON, and Inference-Header-Content-Length gives its length in bytes"),
    ("99999999999999999999999", "Inference-Header-Content-Length is 99999999999999999999999, but the body has "
                                "{size} bytes; it must be at most the body's size"),
    ("-" + "9" * 5000, "Inference-Header-Content-Length must be >= 0 and at most the body's size ({size} bytes), got "
                       "-" + "9" * 20 + "..."),
    ("1_0", "Inference-Header-Content-Length must be an integer, got '1_0'")])
def test_an_inference_header_content_length_out_of_range_is_a_400_saying_what_it_must_be(
        server, server_errors, length: str, message: str) -> None:
    header = json.dumps({"inputs": inputs(replace={"x": {"name": "x", "datatype": "FP32", "shape": [1, 4],
                                                         "parameters": {"binary_data_size": 16}}})}).encode()
    body = header + np.float32([1, 2, 3, 4]).tobytes()
    status, _, answer = infer(server, body, {"Inference-Header-Content-Length": length})
    assert (status, answer) == (400, {"error": message.format(size=len(body))})
    status, _, answer = infer(server, body, {"Inference-Header-Content-Length": str(len(header))})
    assert status == 200, answer


# ---------------------------------------------------------------------- 6. booleans


@pytest.mark.parametrize(("datatype", "data", "message"), [
    ("INT64", [1, True, 3], "input 't' is INT64: data must hold integers, found true (true/false are taken for BOOL "
                            "inputs only)"),
    ("INT64", [True, False, True], "input 't' is INT64: data must hold integers, found true"),
    ("FP32", [1.5, False, 3], "input 't' is FP32: data must hold numbers, found false"),
    ("UINT8", [[1], [True], [3]], "input 't' is UINT8: data must hold integers, found true"),
    ("BOOL", [True, 1, False], "input 't' is BOOL: data must hold true/false, found 1"),
])
def test_true_and_false_are_taken_for_bool_inputs_only(datatype: str, data: list, message: str) -> None:
    spec = TensorSpec("t", datatype, (-1, 1) if isinstance(data[0], list) else (-1,))
    shape = [3, 1] if isinstance(data[0], list) else [3]
    with pytest.raises(RequestError) as raised:
        from_json(spec, datatype, shape, data)
    assert str(raised.value).startswith(message), raised.value
    assert from_json(TensorSpec("t", "BOOL", (-1,)), "BOOL", [2], [True, False]).tolist() == [True, False]


def test_true_in_int64_data_is_a_400_over_http(server, server_errors) -> None:
    status, _, answer = infer(server, {"inputs": inputs(n=[1, True, 3, 4])})
    assert (status, answer) == (400, {"error": "input 'n' is INT64: data must hold integers, found true (true/false "
                                               "are taken for BOOL inputs only)"})


def test_the_parser_reads_nan_literals_as_values_to_refuse_not_as_a_json_error() -> None:
    class State:
        inputs = (TensorSpec("x", "FP32", (-1,)),)

        def input_spec(self, name: str) -> TensorSpec:
            return self.inputs[0]

    body = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1, Infinity]}]}'
    with pytest.raises(RequestError) as raised:
        parse_infer_request(State(), body, None)
    assert str(raised.value).startswith("input 'x' is FP32: data must hold finite numbers, found Infinity")
