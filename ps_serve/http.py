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
carries the served step in ``parameters.step`` when it is known. JSON has no literal for a
non-finite float, so an output's ``data`` writes NaN and the infinities as the strings
``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (protobuf's JSON mapping; numpy reads them back),
and JSON ``data`` of an input must be finite: non-finite inputs travel as binary data.

A body may be compressed (``Content-Encoding: gzip`` or ``deflate``); ps-serve decompresses it
itself, on a worker thread, with the size limit applied to the decompressed bytes too (the
application runs with aiohttp's own decompression off: `HttpApi.runner`).

Errors are ``{"error": "..."}``: 400 for a bad request (the message names the input and the
values; a body that is not valid gzip or deflate, or JSON too deeply nested, is one), 401
without the token, 404 for an unknown model, version or path, 405 for a wrong method, 413 for a
body above the limit (before or after decompression), 415 for a Content-Encoding other than
identity, gzip and deflate; 500 only for a fault of the server.

The event loop only reads bodies and writes answers: decoding, the model run and encoding
happen on the server's worker threads (onnxruntime releases the GIL), so a long inference
never holds up a health check.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import zlib
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from importlib import metadata as _metadata
from typing import Any

import numpy as np
from aiohttp import web

from ps_serve.errors import PayloadTooLarge, RequestError, ServeError, UnsupportedMediaType
from ps_serve.metrics import CONTENT_TYPE_LATEST, ServeMetrics
from ps_serve.model import ModelState, ServedModel
from ps_serve.security import CHALLENGE, TokenCheck
from ps_serve.tensors import JsonNumber, brief, datatype_of_array, from_json, from_raw, to_json, to_raw

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
#: The Content-Encodings a request body may have (lower case) -> the coding's name in messages ("x-gzip" is gzip's
#: old name, RFC 9110 8.4.1.3). Anything else is refused with 415 before the body is read.
CONTENT_CODINGS = {"identity": "identity", "gzip": "gzip", "x-gzip": "gzip", "deflate": "deflate"}
#: The codings a 415 answer names (its Accept-Encoding header, RFC 7694).
ACCEPTED_CODINGS = "gzip, deflate, identity"
#: An Inference-Header-Content-Length value: decimal digits, perhaps with a sign (its range is checked after).
_LENGTH = re.compile(r"[+-]?[0-9]+")


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

    def runner(self, **options: Any) -> web.AppRunner:
        """The runner that serves `app()`: aiohttp's decompression off, since `infer` decompresses a body itself
        (aiohttp's errors for a body that is not what its Content-Encoding says would be answered as faults)."""
        return web.AppRunner(self.app(), auto_decompress=False, **options)

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
            response.headers.update(getattr(exc, "headers", {}))
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
        coding = content_coding(request.headers.get("Content-Encoding"))   # 415 before reading the body
        body = await request.read()
        header_length = request.headers.get(HEADER_LENGTH)
        state = self.served.current()   # the one state this request uses, whatever is swapped in meanwhile
        answer = await asyncio.get_running_loop().run_in_executor(self.executor, self.answer, state, body,
                                                                  header_length, coding)
        response = web.Response(body=answer.body)
        response.headers["Content-Type"] = answer.content_type
        if answer.header_length is not None:
            response.headers[HEADER_LENGTH] = str(answer.header_length)
        return response

    def answer(self, state: ModelState, body: bytes, header_length: str | None, coding: str = "identity") -> Answer:
        """Decompresses and decodes the request, runs the model on `state` and encodes the answer (on a worker
        thread)."""
        body = decompress(body, coding, self.max_request_bytes)
        request = parse_infer_request(state, body, header_length)
        started = time.perf_counter()
        outputs = state.infer(request.inputs, [name for name, _ in request.outputs] or None)
        self.metrics.inference(time.perf_counter() - started)
        asked = dict(request.outputs)

        def binary(name: str) -> bool:
            return request.binary_output if asked.get(name) is None else asked[name]

        return encode_infer_response(self.served, state, request.id, outputs, binary)


# ---------------------------------------------------------------------- decoding a request


def content_coding(header: str | None) -> str:
    """The content coding of a request body from its Content-Encoding header (none: identity); UnsupportedMediaType
    (415) for one this server cannot read, such as br or zstd, or a list of several."""
    coding = (header or "").strip().lower() or "identity"
    if coding not in CONTENT_CODINGS:
        raise UnsupportedMediaType(f"Content-Encoding {header[:40]!r} is not supported; send identity, gzip or "
                                   "deflate", {"Accept-Encoding": ACCEPTED_CODINGS})
    return CONTENT_CODINGS[coding]


def decompress(body: bytes, coding: str, limit: int) -> bytes:
    """The body decompressed from its content coding (`content_coding`): RequestError naming the coding when the
    body is not valid data of it, PayloadTooLarge (413) when it decompresses to more than `limit` bytes."""
    if coding == "identity" or not body:
        return body
    if coding == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    else:   # deflate: the zlib format (RFC 1950), or raw deflate (RFC 1951) as some clients send it
        wbits = zlib.MAX_WBITS if body[0] & 0x0F == 8 else -zlib.MAX_WBITS
    parts: list[bytes] = []
    size = 0
    data = body
    while True:
        decompressor = zlib.decompressobj(wbits)
        try:
            part = decompressor.decompress(data, limit - size + 1)
        except zlib.error as exc:
            raise RequestError(f"the request body is not valid {coding} (Content-Encoding: {coding}): {exc}") from None
        size += len(part)
        if size > limit:
            raise PayloadTooLarge(f"the request body decompresses to more than {limit} bytes, this server's limit "
                                  "(ps-serve --max-request-bytes)")
        parts.append(part)
        if not decompressor.eof:
            raise RequestError(f"the request body is not valid {coding} (Content-Encoding: {coding}): it ends "
                               f"before the compressed data does ({len(body)} bytes)")
        data = decompressor.unused_data
        if not data:
            return b"".join(parts)
        if coding != "gzip" or not data.startswith(b"\x1f\x8b"):   # only gzip may hold several members
            raise RequestError(f"the request body is not valid {coding} (Content-Encoding: {coding}): "
                               f"{len(data)} bytes follow the end of the compressed data")


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
        what = "the request body"
    else:
        text = header_length.strip()
        if not _LENGTH.fullmatch(text):
            raise RequestError(f"{HEADER_LENGTH} must be an integer, got {header_length[:40]!r}")
        shown = text if len(text) <= 24 else text[:21] + "..."
        # a value of more than 24 digits is beyond any body: compared by its sign alone (int() refuses 4300 digits)
        length = int(text) if len(text) <= 24 else (-1 if text.startswith("-") else len(body) + 1)
        if length < 0:
            raise RequestError(f"{HEADER_LENGTH} must be >= 0 and at most the body's size ({len(body)} bytes), got "
                               f"{shown}")
        if length > len(body):
            raise RequestError(f"{HEADER_LENGTH} is {shown}, but the body has {len(body)} bytes; it must be at "
                               "most the body's size")
        if length == 0:
            raise RequestError(f"{HEADER_LENGTH} is 0, but the JSON header cannot be empty: the body starts with the "
                               f"request's JSON, and {HEADER_LENGTH} gives its length in bytes")
        header, binary = body[:length], memoryview(body)[length:]
        what = f"the request's JSON header (the first {length} bytes of the body)"
    try:
        document = json.loads(header, parse_constant=JsonNumber.parse)
    except RecursionError:
        raise RequestError(f"{what} is not valid JSON: nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise RequestError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise RequestError(f"the request must be a JSON object, got {type(document).__name__}")
    request_id = document.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise RequestError(f"id must be a string, got {_short(request_id)}")
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
                raise RequestError(f"input '{name}': binary_data_size must be a non-negative integer, got "
                                   f"{_short(size)}")
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
        raise RequestError(f"{where}: parameter {key!r} must be true or false, got {_short(value)}")
    return value


def _short(value: Any) -> str:
    """A value of the request as JSON text for an error message, cut to 80 characters however large or deep."""
    return brief(value, 80)


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
    header = json.dumps(document, separators=(",", ":"), allow_nan=False).encode()   # to_json wrote no NaN
    if not blobs:
        return Answer(header, "application/json")
    return Answer(b"".join([header, *blobs]), "application/octet-stream", len(header))


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)
