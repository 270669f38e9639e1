"""ps-serve end to end: the real command on port 0, spoken to with Triton's own clients and with plain HTTP.

Each server is a ``python -P -m ps_serve.cli`` child started through ps_common.process (read
by its ``PS_SERVE_READY`` line, stopped by PID). The models: the bundled MLP, a model with
two inputs of different dtypes and three outputs, and a model that maps hashed ids through
an ``ai.onnx.ml`` LabelEncoder into a Gather, as the exporter writes them. Every prediction
is compared with onnxruntime's own on the same inputs. The swap test runs the server in this
process (ps_serve.server.BackgroundServer), since swapping is the Python API that follow mode
calls inside the server's process.
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from prometheus_client.parser import text_string_to_metric_families

from ps_common.process import PIPE, ChildProcess, child_env, python_module_argv
from ps_models.builders import write_model
from ps_serve.cli import READY_PREFIX
from ps_serve.model import ModelState, ServedModel
from ps_serve.server import BackgroundServer, ServeConfig
from ps_tools.certs import make_files, write_files

tritonhttp = pytest.importorskip("tritonclient.http", reason="tritonclient[http] (test extra) is Triton's client")
from tritonclient.utils import InferenceServerException  # noqa: E402 - after the importorskip

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT = 60.0
STOP_GRACE = 5.0
TOKEN = "0123456789abcdef0123456789abcdef"
MLP_STEP = 42


# ---------------------------------------------------------------------- models


def two_input_model(path: Path) -> Path:
    """a FP32 [N, 3] and b INT64 [N, 3] -> sum FP32 (a + b), positive BOOL (a > 0), total INT64 [N] (row sums of b)."""
    nodes = [
        helper.make_node("Cast", ["b"], ["b_float"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["a", "b_float"], ["sum"]),
        helper.make_node("Greater", ["a", "zero"], ["positive"]),
        helper.make_node("ReduceSum", ["b", "axes"], ["total"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "two_inputs",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 3]),
         helper.make_tensor_value_info("b", TensorProto.INT64, ["N", 3])],
        [helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["N", 3]),
         helper.make_tensor_value_info("positive", TensorProto.BOOL, ["N", 3]),
         helper.make_tensor_value_info("total", TensorProto.INT64, ["N"])],
        initializer=[numpy_helper.from_array(np.zeros((), np.float32), "zero"),
                     numpy_helper.from_array(np.array([1], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


#: The hashed ids the LabelEncoder knows, and the table rows they map to (others: row 0).
KEYS, ROWS = [1001, 20002, 300003], [1, 2, 3]


def label_encoder_model(path: Path) -> Path:
    """ids INT64 [N] -> row INT64 [N] (ai.onnx.ml LabelEncoder, unknown ids -> 0) -> embedding FP32 [N, 2] (Gather)."""
    table = np.arange(8, dtype=np.float32).reshape(4, 2) + 0.5
    nodes = [
        helper.make_node("LabelEncoder", ["ids"], ["row"], domain="ai.onnx.ml", keys_int64s=KEYS,
                         values_int64s=ROWS, default_int64=0),
        helper.make_node("Gather", ["table", "row"], ["embedding"], axis=0),
    ]
    graph = helper.make_graph(
        nodes, "hashed_ids",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", 2]),
         helper.make_tensor_value_info("row", TensorProto.INT64, ["N"])],
        initializer=[numpy_helper.from_array(table, "table")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.ml", 3)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def reference(path: Path, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """onnxruntime's own outputs of a model file."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(inputs))))


# ---------------------------------------------------------------------- processes and requests


class Served:
    """A running ps-serve child and what its READY line said."""

    def __init__(self, child: ChildProcess, ready: dict) -> None:
        self.child = child
        self.ready = ready
        self.address = ready["http"]

    def client(self, **kwargs) -> "tritonhttp.InferenceServerClient":
        return tritonhttp.InferenceServerClient(self.address, **kwargs)


def start_serve(model: Path, *flags: str, env: Mapping[str, str] | None = None) -> Served:
    child = ChildProcess("ps-serve", python_module_argv("ps_serve.cli", "--model", str(model), *flags),
                         env=child_env(env, drop=["PS_AUTH_TOKEN"]), cwd=REPO_ROOT, ready_prefix=READY_PREFIX,
                         stderr=PIPE, new_session=False)
    return Served(child, child.wait_ready(READY_TIMEOUT))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("models")
    return {"mlp": write_model("mlp", folder / "mlp.onnx"), "pair": two_input_model(folder / "pair.onnx"),
            "hashed": label_encoder_model(folder / "hashed.onnx")}


@pytest.fixture(scope="module")
def servers(models) -> Iterator[Callable[..., Served]]:
    """serve(model_key, *flags, env=...) -> a started ps-serve; every one stopped by PID at the module's end."""
    started: list[Served] = []

    def serve(key: str, *flags: str, env: Mapping[str, str] | None = None) -> Served:
        served = start_serve(models[key], *flags, env=env)
        started.append(served)
        return served

    yield serve
    for served in started:
        served.child.stop(STOP_GRACE)


@pytest.fixture(scope="module")
def mlp(servers) -> Served:
    return servers("mlp", "--step", str(MLP_STEP), "--grpc-port", "0")


@pytest.fixture(scope="module")
def pair(servers) -> Served:
    return servers("pair", "--name", "pair_model")


def request(address: str, method: str, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None,
            *, context: ssl.SSLContext | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one plain HTTP request (no proxy, no client library)."""
    host, _, port = address.rpartition(":")
    connection = (http.client.HTTPSConnection(host, int(port), timeout=30, context=context) if context
                  else http.client.HTTPConnection(host, int(port), timeout=30))
    try:
        connection.request(method, path, body=body, headers=dict(headers or {}))
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def infer_json(address: str, model: str, document: dict, headers: Mapping[str, str] | None = None) -> tuple[int, dict]:
    status, _, body = request(address, "POST", f"/v2/models/{model}/infer", json.dumps(document).encode(), headers)
    return status, json.loads(body)


def metric_samples(address: str, headers: Mapping[str, str] | None = None) -> dict[tuple, float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    status, _, body = request(address, "GET", "/metrics", headers=headers)
    assert status == 200, body
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def triton_input(name: str, array: np.ndarray, datatype: str, *, binary: bool = True):
    tensor = tritonhttp.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


# ---------------------------------------------------------------------- the READY line, health, metadata


def test_ps_serve_prints_one_ready_line_with_its_http_address_model_step_and_grpc_address(mlp: Served) -> None:
    assert re.fullmatch(r"127\.0\.0\.1:\d+", mlp.ready["http"])
    assert mlp.ready["model"] == "mlp"   # the file's stem
    assert mlp.ready["step"] == MLP_STEP
    assert mlp.ready["tls"] is False and mlp.ready["token"] is False
    assert re.fullmatch(r"127\.0\.0\.1:\d+", mlp.ready["grpc"])
    ready_lines = [line for line in mlp.child.last_lines("stdout") if line.startswith("PS_SERVE_READY")]
    assert len(ready_lines) == 1


def test_health_endpoints_answer_and_tritonclient_reads_the_server_and_model_metadata(mlp: Served) -> None:
    client = mlp.client()
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("mlp")
    assert client.is_model_ready("mlp", "1")
    server = client.get_server_metadata()
    assert server["name"] == "onnx-ps" and "binary_tensor_data" in server["extensions"]
    metadata = client.get_model_metadata("mlp")
    assert metadata == {"name": "mlp", "versions": ["1"], "platform": "onnxruntime_onnx",
                        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 64]}],
                        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]}
    assert client.get_model_metadata("mlp", "1") == metadata
    assert request(mlp.address, "GET", "/v2/health/live")[0] == 200
    assert request(mlp.address, "GET", "/v2/health/ready")[0] == 200


def test_the_model_metadata_of_a_two_input_model_names_each_input_with_its_own_datatype(pair: Served) -> None:
    metadata = pair.client().get_model_metadata("pair_model")
    assert metadata["inputs"] == [{"name": "a", "datatype": "FP32", "shape": [-1, 3]},
                                  {"name": "b", "datatype": "INT64", "shape": [-1, 3]}]
    assert [(o["name"], o["datatype"]) for o in metadata["outputs"]] == [("sum", "FP32"), ("positive", "BOOL"),
                                                                         ("total", "INT64")]


# ---------------------------------------------------------------------- predictions


@pytest.mark.parametrize("binary_in", [True, False], ids=["binary-inputs", "json-inputs"])
@pytest.mark.parametrize("binary_out", [True, False], ids=["binary-outputs", "json-outputs"])
def test_the_mlp_answers_exactly_what_onnxruntime_computes_with_binary_and_json_tensor_data(
        mlp: Served, models, binary_in: bool, binary_out: bool) -> None:
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    result = mlp.client().infer("mlp", [triton_input("x", x, "FP32", binary=binary_in)],
                                outputs=[tritonhttp.InferRequestedOutput("logits", binary_data=binary_out)],
                                request_id="r-1")
    np.testing.assert_array_equal(result.as_numpy("logits"), reference(models["mlp"], {"x": x})["logits"])
    response = result.get_response()
    assert response["id"] == "r-1" and response["model_name"] == "mlp" and response["model_version"] == "1"
    assert response["parameters"] == {"step": MLP_STEP}
    assert ("data" in response["outputs"][0]) is (not binary_out)


def test_tritonclient_with_no_outputs_named_gets_every_output_in_binary(pair: Served, models) -> None:
    a = np.array([[-1.5, 0.0, 2.25], [3.0, -0.5, 1.0]], np.float32)
    b = np.array([[1, 2, 3], [-4, 5, 2**40]], np.int64)
    result = pair.client().infer("pair_model", [triton_input("a", a, "FP32"), triton_input("b", b, "INT64")])
    expected = reference(models["pair"], {"a": a, "b": b})
    for name in ("sum", "positive", "total"):
        np.testing.assert_array_equal(result.as_numpy(name), expected[name])
        assert result.as_numpy(name).dtype == expected[name].dtype
    assert "parameters" not in result.get_response()   # no step was given: none is reported


def test_only_the_requested_outputs_are_answered_in_the_order_asked(pair: Served, models) -> None:
    a = np.array([[1.0, -2.0, 0.5]], np.float32)
    b = np.array([[7, 8, 9]], np.int64)
    result = pair.client().infer("pair_model", [triton_input("a", a, "FP32", binary=False),
                                                triton_input("b", b, "INT64", binary=False)],
                                 outputs=[tritonhttp.InferRequestedOutput("total", binary_data=False),
                                          tritonhttp.InferRequestedOutput("positive", binary_data=True)])
    expected = reference(models["pair"], {"a": a, "b": b})
    assert [o["name"] for o in result.get_response()["outputs"]] == ["total", "positive"]
    assert result.as_numpy("sum") is None
    np.testing.assert_array_equal(result.as_numpy("total"), expected["total"])
    np.testing.assert_array_equal(result.as_numpy("positive"), expected["positive"])


def test_nested_json_data_is_read_row_major_like_a_flat_list(pair: Served, models) -> None:
    a = [[0.5, 1.5, -2.0], [4.0, 0.0, 1.0]]
    b = [[1, 2, 3], [4, 5, 6]]
    status, nested = infer_json(pair.address, "pair_model", {"inputs": [
        {"name": "a", "datatype": "FP32", "shape": [2, 3], "data": a},
        {"name": "b", "datatype": "INT64", "shape": [2, 3], "data": b}]})
    assert status == 200, nested
    status, flat = infer_json(pair.address, "pair_model", {"inputs": [
        {"name": "a", "datatype": "FP32", "shape": [2, 3], "data": sum(a, [])},
        {"name": "b", "datatype": "INT64", "shape": [2, 3], "data": sum(b, [])}]})
    assert status == 200, flat
    assert nested["outputs"] == flat["outputs"]
    expected = reference(models["pair"], {"a": np.array(a, np.float32), "b": np.array(b, np.int64)})
    answered = {o["name"]: o for o in nested["outputs"]}
    assert answered["total"]["data"] == expected["total"].tolist() and answered["total"]["shape"] == [2]
    assert answered["positive"]["data"] == expected["positive"].reshape(-1).tolist()
    assert answered["positive"]["datatype"] == "BOOL"


def test_a_label_encoder_model_maps_hashed_ids_through_its_table_as_onnxruntime_does(servers, models) -> None:
    hashed = servers("hashed")
    ids = np.array([20002, 1001, 555, 300003, 1001], np.int64)
    result = hashed.client().infer("hashed", [triton_input("ids", ids, "INT64")])
    expected = reference(models["hashed"], {"ids": ids})
    np.testing.assert_array_equal(result.as_numpy("row"), [2, 1, 0, 3, 1])
    np.testing.assert_array_equal(result.as_numpy("row"), expected["row"])
    np.testing.assert_array_equal(result.as_numpy("embedding"), expected["embedding"])


# ---------------------------------------------------------------------- bad requests

X_JSON = {"name": "x", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}
A_JSON = {"name": "a", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}
B_JSON = {"name": "b", "datatype": "INT64", "shape": [1, 3], "data": [1, 2, 3]}


@pytest.mark.parametrize(("model", "document", "expected"), [
    ("mlp", {"inputs": [{**X_JSON, "name": "images"}]}, r"unknown input 'images'.*x \(FP32 \[-1, 64\]\)"),
    ("mlp", {"inputs": [{**X_JSON, "shape": [1, 32], "data": [0.0] * 32}]},
     r"input 'x' has shape \[1, 32\].*axis 1 must be 64, not 32"),
    ("mlp", {"inputs": [{**X_JSON, "shape": [64]}]}, r"input 'x' has shape \[64\] \(rank 1\).*rank 2"),
    ("mlp", {"inputs": [{**X_JSON, "datatype": "FP64"}]}, r"input 'x' has datatype FP64, but the model takes FP32"),
    ("mlp", {"inputs": [{**X_JSON, "data": [0.0] * 63}]}, r"input 'x' has shape \[1, 64\] \(64 elements\).*63"),
    ("pair", {"inputs": [A_JSON]}, r"missing input\(s\): b \(INT64 \[-1, 3\]\)"),
    ("pair", {"inputs": [A_JSON, {**B_JSON, "data": [1, 2.5, 3]}]}, r"input 'b' is INT64: data must hold integers.*2\.5"),
    ("pair", {"inputs": [A_JSON, {**B_JSON, "data": ["1", "2", "3"]}]}, r"input 'b' is INT64: data must hold integers"),
    ("pair", {"inputs": [A_JSON, B_JSON], "outputs": [{"name": "mean"}]}, r"unknown output 'mean'"),
    ("pair", {"inputs": [A_JSON, B_JSON, A_JSON]}, r"input 'a' is given twice"),
    ("pair", {"inputs": [{**A_JSON, "data": [[1, 2], [3]]}, B_JSON]}, r"input 'a': data is a ragged nested list"),
])
def test_a_bad_request_gets_400_with_a_message_naming_the_input_and_the_values(
        mlp: Served, pair: Served, model: str, document: dict, expected: str) -> None:
    served, name = (mlp, "mlp") if model == "mlp" else (pair, "pair_model")
    status, answer = infer_json(served.address, name, document)
    assert status == 400, answer
    assert re.search(expected, answer["error"]), answer["error"]


def test_malformed_json_and_binary_data_of_the_wrong_size_get_400(mlp: Served) -> None:
    status, _, body = request(mlp.address, "POST", "/v2/models/mlp/infer", b'{"inputs": [')
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]
    header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 64],
                                     "parameters": {"binary_data_size": 256}}]}).encode()
    status, _, body = request(mlp.address, "POST", "/v2/models/mlp/infer", header + bytes(256),
                              {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400
    assert json.loads(body)["error"] == ("input 'x' has 256 bytes of binary data, but FP32 [2, 64] needs 512 "
                                         "(128 x 4 bytes)")
    status, _, body = request(mlp.address, "POST", "/v2/models/mlp/infer", header + bytes(100),
                              {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and "only 100 bytes of binary data are left" in json.loads(body)["error"]


def test_tritonclient_sees_400_for_a_wrong_shape_and_404_for_an_unknown_model(mlp: Served) -> None:
    client = mlp.client()
    with pytest.raises(InferenceServerException) as raised:
        client.infer("mlp", [triton_input("x", np.zeros((2, 65), np.float32), "FP32")])
    assert raised.value.status() == "400" and "axis 1 must be 64, not 65" in raised.value.message()
    with pytest.raises(InferenceServerException) as raised:
        client.get_model_metadata("resnet")
    assert raised.value.status() == "404" and "unknown model 'resnet'" in raised.value.message()
    status, _, body = request(mlp.address, "POST", "/v2/models/mlp/versions/2/infer", json.dumps(
        {"inputs": [X_JSON]}).encode())
    assert status == 404 and "no version '2'" in json.loads(body)["error"]


# ---------------------------------------------------------------------- security


def test_a_token_is_required_on_every_endpoint_but_the_health_checks(servers, tmp_path) -> None:
    token_file = tmp_path / "serve.token"
    token_file.write_text(TOKEN + "\n")
    served = servers("mlp", "--auth-token-file", str(token_file))
    assert served.ready["token"] is True
    good = {"Authorization": f"Bearer {TOKEN}"}
    for path in ("/v2/health/live", "/v2/health/ready"):
        assert request(served.address, "GET", path)[0] == 200
    for method, path in (("GET", "/v2"), ("GET", "/v2/models/mlp"), ("GET", "/v2/models/mlp/ready"),
                         ("GET", "/metrics"), ("POST", "/v2/models/mlp/infer")):
        body = json.dumps({"inputs": [X_JSON]}).encode() if method == "POST" else None
        for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": TOKEN}):
            status, answer_headers, answer = request(served.address, method, path, body, headers)
            assert status == 401, (path, headers)
            assert "error" in json.loads(answer) and answer_headers["WWW-Authenticate"].startswith("Bearer")
        assert request(served.address, method, path, body, good)[0] == 200, path
    client = served.client()
    with pytest.raises(InferenceServerException) as raised:
        client.get_model_metadata("mlp")
    assert raised.value.status() == "401"
    assert client.get_model_metadata("mlp", headers=good)["name"] == "mlp"


def test_the_token_comes_from_the_workers_environment_variable_when_no_file_is_given(servers) -> None:
    served = servers("mlp", env={"PS_AUTH_TOKEN": TOKEN})
    assert request(served.address, "GET", "/v2/models/mlp")[0] == 401
    assert request(served.address, "GET", "/v2/models/mlp", headers={"Authorization": f"bearer {TOKEN}"})[0] == 200


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("certs")
    write_files(folder, make_files(), force=True)
    return folder


def test_tls_serves_https_and_grpc_that_tritonclient_verifies_with_the_ca(servers, models, certs: Path) -> None:
    served = servers("mlp", "--tls-cert", str(certs / "server.crt"), "--tls-key", str(certs / "server.key"),
                     "--grpc-port", "0")
    assert served.ready["tls"] is True and served.ready["url"].startswith("https://")
    client = served.client(ssl=True, ssl_options={"ca_certs": str(certs / "ca.crt")})
    assert client.is_server_ready()
    x = np.ones((1, 64), np.float32)
    result = client.infer("mlp", [triton_input("x", x, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("logits"), reference(models["mlp"], {"x": x})["logits"])
    trusted = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    assert request(served.address, "GET", "/v2/health/live", context=trusted)[0] == 200
    with pytest.raises(ssl.SSLError):   # another CA's client refuses the server's certificate
        request(served.address, "GET", "/v2/health/live", context=ssl.create_default_context())
    with pytest.raises((http.client.HTTPException, ConnectionError)):   # plaintext is not served on a TLS port
        request(served.address, "GET", "/v2/health/live")
    tritongrpc = pytest.importorskip("tritonclient.grpc")
    secure = tritongrpc.InferenceServerClient(served.ready["grpc"], ssl=True, root_certificates=str(certs / "ca.crt"))
    assert secure.get_model_metadata("mlp").name == "mlp"
    with pytest.raises(InferenceServerException):   # a plaintext gRPC client gets no answer from a TLS port
        tritongrpc.InferenceServerClient(served.ready["grpc"]).get_model_metadata("mlp", client_timeout=5)


# ---------------------------------------------------------------------- metrics


def test_metrics_count_requests_by_endpoint_and_status_and_show_the_served_step(mlp: Served, pair: Served) -> None:
    labels = lambda **kw: tuple(sorted({"model": "mlp", "protocol": "http", **kw}.items()))  # noqa: E731
    before = metric_samples(mlp.address)
    for _ in range(3):
        assert infer_json(mlp.address, "mlp", {"inputs": [X_JSON]})[0] == 200
    assert infer_json(mlp.address, "mlp", {"inputs": [{**X_JSON, "datatype": "FP64"}]})[0] == 400
    after = metric_samples(mlp.address)

    def delta(name: str, key: tuple) -> float:
        return after.get((name, key), 0.0) - before.get((name, key), 0.0)

    assert delta("ps_serve_requests_total", labels(endpoint="infer", code="200")) == 3
    assert delta("ps_serve_requests_total", labels(endpoint="infer", code="400")) == 1
    assert delta("ps_serve_request_duration_seconds_count", labels(endpoint="infer")) == 4
    assert delta("ps_serve_inference_duration_seconds_count", (("model", "mlp"),)) == 3
    assert after[("ps_serve_step", (("model", "mlp"),))] == MLP_STEP
    assert not any(name == "ps_serve_step" for name, _ in metric_samples(pair.address))   # no step given: none shown


# ---------------------------------------------------------------------- gRPC


def test_tritonclient_grpc_reads_the_metadata_and_infers_as_onnxruntime_does(mlp: Served, models) -> None:
    tritongrpc = pytest.importorskip("tritonclient.grpc")
    client = tritongrpc.InferenceServerClient(mlp.ready["grpc"])
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("mlp")
    metadata = client.get_model_metadata("mlp", as_json=True)
    assert metadata["platform"] == "onnxruntime_onnx"
    assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "64"]}]
    assert client.get_server_metadata(as_json=True)["name"] == "onnx-ps"
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    tensor = tritongrpc.InferInput("x", [3, 64], "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("mlp", [tensor], outputs=[tritongrpc.InferRequestedOutput("logits")], request_id="g1")
    np.testing.assert_array_equal(result.as_numpy("logits"), reference(models["mlp"], {"x": x})["logits"])
    response = result.get_response(as_json=True)
    assert response["id"] == "g1" and response["parameters"]["step"]["int64_param"] == str(MLP_STEP)
    bad = tritongrpc.InferInput("x", [3, 63], "FP32")
    bad.set_data_from_numpy(x[:, :63].copy())
    with pytest.raises(InferenceServerException) as raised:
        client.infer("mlp", [bad])
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT" and "axis 1 must be 64" in raised.value.message()


def test_grpc_needs_the_token_on_every_rpc_but_server_live_and_ready(servers) -> None:
    tritongrpc = pytest.importorskip("tritonclient.grpc")
    served = servers("mlp", "--grpc-port", "0", env={"PS_AUTH_TOKEN": TOKEN})
    client = tritongrpc.InferenceServerClient(served.ready["grpc"])
    assert client.is_server_live() and client.is_server_ready()
    with pytest.raises(InferenceServerException) as raised:
        client.get_model_metadata("mlp")
    assert raised.value.status() == "StatusCode.UNAUTHENTICATED"
    assert client.get_model_metadata("mlp", headers={"authorization": f"Bearer {TOKEN}"}).name == "mlp"


# ---------------------------------------------------------------------- stopping and bad arguments


def test_sigterm_stops_ps_serve_within_3_seconds_with_exit_status_0(models) -> None:
    served = start_serve(models["mlp"])
    try:
        assert request(served.address, "GET", "/v2/health/ready")[0] == 200
        started = time.monotonic()
        served.child.send_signal(signal.SIGTERM)
        code = served.child.wait(3.0)
        assert code == 0, served.child.last_lines()
        assert time.monotonic() - started < 3.0
    finally:
        served.child.stop(STOP_GRACE)


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize(("case", "expected"), [
    ("missing model", r"model file '.*nowhere\.onnx' does not exist"),
    ("not onnx", r"onnxruntime cannot load model '.*garbage\.onnx'"),
    ("port in use", r"cannot listen on 127\.0\.0\.1:\d+ \(HTTP\)"),
    ("grpc port in use", r"cannot listen on 127\.0\.0\.1:\d+ \(gRPC\): Address already in use"),
    ("tls unreadable", r"cannot read --tls-cert '.*missing\.crt'"),
    ("plaintext off loopback", r"refusing to serve plaintext HTTP on 0\.0\.0\.0.*--insecure"),
    ("bad name", r"a model name must be non-empty and hold no '/'"),
])
def test_a_bad_argument_ends_with_one_line_naming_it_and_exit_status_2(
        models, tmp_path, busy_port: int, case: str, expected: str) -> None:
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"this is not a model")
    args = {"missing model": ["--model", str(tmp_path / "nowhere.onnx")],
            "not onnx": ["--model", str(garbage)],
            "port in use": ["--model", str(models["mlp"]), "--port", str(busy_port)],
            "grpc port in use": ["--model", str(models["mlp"]), "--grpc-port", str(busy_port)],
            "tls unreadable": ["--model", str(models["mlp"]), "--tls-cert", str(tmp_path / "missing.crt"),
                               "--tls-key", str(tmp_path / "missing.key")],
            "plaintext off loopback": ["--model", str(models["mlp"]), "--host", "0.0.0.0"],
            "bad name": ["--model", str(models["mlp"]), "--name", "a/b"]}[case]
    done = subprocess.run(python_module_argv("ps_serve.cli", *args), capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT, env=child_env(drop=["PS_AUTH_TOKEN"]))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ps-serve: "), done.stderr
    assert re.search(expected, lines[0]), lines[0]
    assert "PS_SERVE_READY" not in done.stdout


# ---------------------------------------------------------------------- swapping the served state


def offset_model(path: Path) -> Path:
    """x FP32 [N, 256] -> y = x @ w + bias, z = 2 * y; the bias is the initializer a swap changes."""
    rng = np.random.default_rng(7)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "bias"], ["y"]),
         helper.make_node("Mul", ["y", "two"], ["z"])], "offset",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 256]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 256])],
        initializer=[numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32), "w"),
                     numpy_helper.from_array(np.zeros(256, np.float32), "bias"),
                     numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


def test_a_swap_during_concurrent_requests_never_answers_with_a_mix_of_two_states(tmp_path) -> None:
    path = offset_model(tmp_path / "offset.onnx")
    states = {step: ModelState.load(path, step=step, weights={"bias": np.full(256, float(step), np.float32)})
              for step in (1, 2)}
    x = np.random.default_rng(3).standard_normal((16, 256)).astype(np.float32)
    expected = {step: state.infer({"x": x}) for step, state in states.items()}
    assert np.allclose(expected[2]["y"] - expected[1]["y"], 1.0)   # the two states differ by a constant
    served = ServedModel("offset", states[1])
    answers: list[tuple[int, np.ndarray, np.ndarray]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def swapper() -> None:
        step = 1
        while not done.is_set():
            step = 3 - step
            served.swap(states[step])
            time.sleep(0.001)

    def caller(address: str) -> None:
        try:
            client = tritonhttp.InferenceServerClient(address)
            for _ in range(25):
                result = client.infer("offset", [triton_input("x", x, "FP32")])
                answers.append((result.get_response()["parameters"]["step"], result.as_numpy("y"),
                                result.as_numpy("z")))
        except BaseException as exc:   # noqa: BLE001 - reported below
            errors.append(exc)

    with BackgroundServer(served, ServeConfig(workers=4)) as server:
        swapping = threading.Thread(target=swapper)
        swapping.start()
        callers = [threading.Thread(target=caller, args=(server.ready["http"],)) for _ in range(4)]
        for thread in callers:
            thread.start()
        for thread in callers:
            thread.join(120)
        done.set()
        swapping.join(10)
    assert not errors, errors
    assert len(answers) == 100
    for step, y, z in answers:
        assert step in (1, 2)
        np.testing.assert_array_equal(y, expected[step]["y"])
        np.testing.assert_array_equal(z, expected[step]["z"])
    assert {step for step, _, _ in answers} == {1, 2}, "the swaps never landed between requests"


def test_bytes_and_fp16_tensors_and_gzip_requests_round_trip_through_tritonclient(tmp_path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["text"], ["text_out"]), helper.make_node("Neg", ["half"], ["half_out"])],
        "strings",
        [helper.make_tensor_value_info("text", TensorProto.STRING, ["N"]),
         helper.make_tensor_value_info("half", TensorProto.FLOAT16, ["N", 2])],
        [helper.make_tensor_value_info("text_out", TensorProto.STRING, ["N"]),
         helper.make_tensor_value_info("half_out", TensorProto.FLOAT16, ["N", 2])])
    path = tmp_path / "strings.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    text = np.array(["id-1", "h\u00e9", ""], dtype=object)
    half = np.array([[0.5, -2.0], [1e4, 0.0], [3.0, -0.25]], np.float16)
    with BackgroundServer(ServedModel("strings", ModelState.load(path))) as server:
        client = tritonhttp.InferenceServerClient(server.ready["http"])
        assert [i["datatype"] for i in client.get_model_metadata("strings")["inputs"]] == ["BYTES", "FP16"]
        for binary, compression in ((True, None), (False, None), (True, "gzip"), (True, "deflate")):
            inputs = [tritonhttp.InferInput("text", [3], "BYTES"), tritonhttp.InferInput("half", [3, 2], "FP16")]
            inputs[0].set_data_from_numpy(text, binary_data=binary)
            inputs[1].set_data_from_numpy(half, binary_data=binary)
            result = client.infer("strings", inputs, request_compression_algorithm=compression, outputs=[
                tritonhttp.InferRequestedOutput(name, binary_data=binary) for name in ("text_out", "half_out")])
            answered = [v.decode() if isinstance(v, bytes) else v for v in result.as_numpy("text_out")]
            assert answered == list(text), (binary, compression)
            assert result.as_numpy("half_out").dtype == np.float16
            np.testing.assert_array_equal(result.as_numpy("half_out"), -half)
