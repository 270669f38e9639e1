"""The Open Inference Protocol (KServe v2) over HTTP/REST, on aiohttp.

Endpoints (``{version}`` is optional everywhere it appears: ``/versions/1``):

  GET  /v2/health/live                  200 {"live": true}                       (no token needed)
  GET  /v2/health/ready                 200 {"ready": true}; 503 while stopping    (no token needed)
  GET  /v2                              server metadata: name, version, extensions
  GET  /v2/models/{name}[/versions/{version}]           model metadata
  GET  /v2/models/{name}[/versions/{version}]/ready     200 {"name", "ready": true}
  POST /v2/models/{name}[/versions/{version}]/infer     inference
  GET  /metrics                         Prometheus text (ps_serve/metrics.py)

An inference request is JSON, or -- Triton's binary tensor data extension, which
``tritonclient.http`` uses by default -- a JSON header of ``Inference-Header-Content-Length``
bytes followed by the inputs' raw bytes, each input saying how many
(``parameters.binary_data_size``). An output is answered in binary when it asks for it
(``outputs[i].parameters.binary_data``) or the request does for all
(``parameters.binary_data_output``); the answer then has the same layout. Every answer
carries the served step in ``parameters.step`` when it is known.

Errors are ``{"error": "..."}``: 400 for a bad request (the message names the input and the
values), 401 without the token, 404 for an unknown model, version or path, 405 for a wrong
method, 413 for a body above the limit; 500 only for a fault of the server.

The event loop only reads bodies and writes answers: decoding, the model run and encoding
happen on the server's worker threads (onnxruntime releases the GIL), so a long inference
never holds up a health check.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from importlib import metadata as _metadata
from typing import Any

import numpy as np
from aiohttp import web

from ps_serve.errors import RequestError, ServeError
from ps_serve.metrics import CONTENT_TYPE_LATEST, ServeMetrics
from ps_serve.model import ModelState, ServedModel
from ps_serve.security import CHALLENGE, TokenCheck
from ps_serve.tensors import datatype_of_array, from_json, from_raw, to_json, to_raw

log = logging.getLogger(__name__)

#: The server's name in its metadata.
SERVER_NAME = "onnx-ps"
#: The protocol extensions this server implements.
EXTENSIONS = ("binary_tensor_data",)
#: The header that gives the length of the JSON part of a binary request or answer.
HEADER_LENGTH = "Inference-Header-Content-Length"
#: Endpoints that need no token: the health checks, for probes.
OPEN_ENDPOINTS = frozenset({"server_live", "server_ready"})
#: Request-level parameters that ask for something this server does not do.
UNSUPPORTED_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")


def server_version() -> str:
    try:
        return _metadata.version("onnx-ps")
    except _metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class Answer:
    """An inference answer's body and headers, made on a worker thread."""

    body: bytes
    content_type: str
    header_length: int | None = None


class HttpApi:
    """The routes of one served model; `app()` is the aiohttp application."""

    def __init__(self, served: ServedModel, metrics: ServeMetrics, tokens: TokenCheck, executor: Executor,
                 *, max_request_bytes: int) -> None:
        self.served = served
        self.metrics = metrics
        self.tokens = tokens
        self.executor = executor
        self.max_request_bytes = max_request_bytes
        self.stopping = False

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_request_bytes, middlewares=[self._middleware])
        model = "/v2/models/{name}"
        version = "/v2/models/{name}/versions/{version}"
        app.router.add_get("/v2/health/live", self.server_live, name="server_live")
        app.router.add_get("/v2/health/ready", self.server_ready, name="server_ready")
        app.router.add_get("/v2", self.server_metadata, name="server_metadata")
        app.router.add_get("/metrics", self.prometheus, name="metrics")
        for prefix, suffix in ((model, ""), (version, "_version")):
            app.router.add_get(prefix, self.model_metadata, name="model_metadata" + suffix)
            app.router.add_get(prefix + "/ready", self.model_ready, name="model_ready" + suffix)
            app.router.add_post(prefix + "/infer", self.infer, name="infer" + suffix)
        return app

    # ------------------------------------------------------------------ the middleware: token, errors, metrics

    @web.middleware
    async def _middleware(self, request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        started = time.perf_counter()
        route = request.match_info.route
        endpoint = (route.name if route is not None else None) or "unmatched"
        endpoint = endpoint.removesuffix("_version")
        authorization = request.headers.get("Authorization")
        try:
            if endpoint not in OPEN_ENDPOINTS and not self.tokens.allows(authorization):
                log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote,
                            self.tokens.refusal(authorization))
                response = error_response(401, self.tokens.refusal(authorization))
                response.headers["WWW-Authenticate"] = CHALLENGE
            else:
                response = await handler(request)
        except ServeError as exc:
            response = error_response(exc.status, str(exc))
        except web.HTTPRequestEntityTooLarge:
            response = error_response(413, f"the request body is larger than {self.max_request_bytes} bytes, this "
                                           "server's limit (ps-serve --max-request-bytes)")
        except web.HTTPException as exc:   # no route (404), a wrong method (405)
            why = {404: f"no endpoint {request.path}", 405: f"{request.method} is not allowed on {request.path}"}
            response = error_response(exc.status, why.get(exc.status, exc.reason))
        except Exception:   # a fault of the server, not of the request
            log.exception("%s %s failed", request.method, request.path)
            response = error_response(500, "internal server error (see the server's log)")
        self.metrics.request("http", endpoint, response.status, time.perf_counter() - started)
        return response

    # ------------------------------------------------------------------ health and metadata

    async def server_live(self, request: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def server_ready(self, request: web.Request) -> web.Response:
        ready = not self.stopping
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response({"name": SERVER_NAME, "version": server_version(), "extensions": list(EXTENSIONS)})

    async def model_metadata(self, request: web.Request) -> web.Response:
        self._check_model(request)
        return web.json_response(self.served.metadata())

    async def model_ready(self, request: web.Request) -> web.Response:
        self._check_model(request)
        return web.json_response({"name": self.served.name, "ready": not self.stopping},
                                 status=200 if not self.stopping else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        response = web.Response(body=self.metrics.exposition())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    def _check_model(self, request: web.Request) -> None:
        self.served.check(request.match_info["name"], request.match_info.get("version"))

    # ------------------------------------------------------------------ inference

    async def infer(self, request: web.Request) -> web.Response:
        self._check_model(request)
        body = await request.read()
        header_length = request.headers.get(HEADER_LENGTH)
        state = self.served.current()   # the one state this request uses, whatever is swapped in meanwhile
        answer = await asyncio.get_running_loop().run_in_executor(self.executor, self.answer, state, body,
                                                                  header_length)
        response = web.Response(body=answer.body)
        response.headers["Content-Type"] = answer.content_type
        if answer.header_length is not None:
            response.headers[HEADER_LENGTH] = str(answer.header_length)
        return response

    def answer(self, state: ModelState, body: bytes, header_length: str | None) -> Answer:
        """Decodes the request, runs the model on `state` and encodes the answer (on a worker thread)."""
        request = parse_infer_request(state, body, header_length)
        started = time.perf_counter()
        outputs = state.infer(request.inputs, [name for name, _ in request.outputs] or None)
        self.metrics.inference(time.perf_counter() - started)
        asked = dict(request.outputs)

        def binary(name: str) -> bool:
            return request.binary_output if asked.get(name) is None else asked[name]

        return encode_infer_response(self.served, state, request.id, outputs, binary)


# ---------------------------------------------------------------------- decoding a request


@dataclass(frozen=True)
class InferRequest:
    """A decoded inference request: its id, its inputs as arrays, the requested outputs and their encoding."""

    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: list[tuple[str, bool | None]]   # (name, binary; None: the request's default); empty: every output
    binary_output: bool                 # the default for outputs not named


def parse_infer_request(state: ModelState, body: bytes, header_length: str | None) -> InferRequest:
    """An inference request from its body (JSON, or JSON and binary tensor data), checked against `state`."""
    if header_length is None:
        header, binary = body, memoryview(b"")
    else:
        try:
            length = int(header_length)
        except ValueError:
            raise RequestError(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 <= length <= len(body):
            raise RequestError(f"{HEADER_LENGTH} is {length}, but the body has {len(body)} bytes")
        header, binary = body[:length], memoryview(body)[length:]
    try:
        document = json.loads(header)
    except (UnicodeDecodeError, ValueError) as exc:
        raise RequestError(f"the request is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise RequestError(f"the request must be a JSON object, got {type(document).__name__}")
    request_id = document.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise RequestError(f"id must be a string, got {request_id!r}")
    parameters = _parameters(document.get("parameters"), "the request")
    for name in UNSUPPORTED_PARAMETERS:
        if parameters.get(name) not in (None, 0, "", False):
            raise RequestError(f"parameter {name!r}: sequences are not supported by this server")
    binary_output = _flag(parameters, "binary_data_output", "the request")
    inputs = _inputs(state, document.get("inputs"), binary)
    outputs = _outputs(document.get("outputs"))
    return InferRequest(request_id, inputs, outputs, binary_output)


def _inputs(state: ModelState, items: Any, binary: memoryview) -> dict[str, np.ndarray]:
    if not isinstance(items, list) or not items:
        raise RequestError(f"the request needs 'inputs', a non-empty list; the model takes {state.describe_inputs()}")
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for index, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise RequestError(f"inputs[{index}] must be an object with a 'name', got {_short(item)}")
        name = item["name"]
        if name in inputs:
            raise RequestError(f"input '{name}' is given twice")
        spec = state.input_spec(name)
        for key in ("datatype", "shape"):
            if key not in item:
                raise RequestError(f"input '{name}' has no '{key}'; the model takes {spec.describe()}")
        parameters = _parameters(item.get("parameters"), f"input '{name}'")
        size = parameters.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise RequestError(f"input '{name}': binary_data_size must be a non-negative integer, got {size!r}")
            if "data" in item:
                raise RequestError(f"input '{name}' has both 'data' and binary_data_size; send one")
            if offset + size > len(binary):
                raise RequestError(f"input '{name}' says binary_data_size {size}, but only {len(binary) - offset} "
                                   "bytes of binary data are left in the body")
            inputs[name] = from_raw(spec, item["datatype"], item["shape"], binary[offset:offset + size])
            offset += size
        elif "data" in item:
            inputs[name] = from_json(spec, item["datatype"], item["shape"], item["data"])
        else:
            raise RequestError(f"input '{name}' has neither 'data' nor parameters.binary_data_size")
    if offset != len(binary):
        raise RequestError(f"the body has {len(binary) - offset} bytes of binary data that no input's "
                           "binary_data_size accounts for")
    return inputs


def _outputs(items: Any) -> list[tuple[str, bool | None]]:
    if items is None:
        return []
    if not isinstance(items, list):
        raise RequestError(f"'outputs' must be a list, got {_short(items)}")
    outputs = []
    for index, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise RequestError(f"outputs[{index}] must be an object with a 'name', got {_short(item)}")
        where = f"output '{item['name']}'"
        parameters = _parameters(item.get("parameters"), where)
        if parameters.get("classification") not in (None, 0):
            raise RequestError(f"{where}: the classification extension is not supported by this server")
        binary = _flag(parameters, "binary_data", where, default=None)
        outputs.append((item["name"], binary))
    return outputs


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(f"{where}: 'parameters' must be an object, got {_short(value)}")
    return value


def _flag(parameters: dict[str, Any], key: str, where: str, default: bool | None = False) -> Any:
    value = parameters.get(key, default)
    if value is not default and not isinstance(value, bool):
        raise RequestError(f"{where}: parameter {key!r} must be true or false, got {value!r}")
    return value


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, (bytes, memoryview)) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------------- encoding the answer


def encode_infer_response(served: ServedModel, state: ModelState, request_id: str | None,
                          outputs: dict[str, np.ndarray], binary: Callable[[str], bool]) -> Answer:
    """The answer's body: JSON alone, or JSON then the binary outputs' bytes when any output is binary."""
    document: dict[str, Any] = {"model_name": served.name, "model_version": served.version}
    if request_id is not None:
        document["id"] = request_id
    if state.step is not None:
        document["parameters"] = {"step": state.step}
    tensors, blobs = [], []
    for name, array in outputs.items():
        tensor: dict[str, Any] = {"name": name, "datatype": datatype_of_array(array), "shape": list(array.shape)}
        if binary(name):
            raw = to_raw(array)
            tensor["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            tensor["data"] = to_json(array)
        tensors.append(tensor)
    document["outputs"] = tensors
    header = json.dumps(document, separators=(",", ":")).encode()
    if not blobs:
        return Answer(header, "application/json")
    return Answer(b"".join([header, *blobs]), "application/octet-stream", len(header))


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)
