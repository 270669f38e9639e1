"""The Open Inference Protocol (KServe v2) over gRPC: ``inference.GRPCInferenceService``, the part ps-serve implements.

ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata and ModelInfer, with the
messages of protos/inference/grpc_service.proto (the specification's field numbers, so
``tritonclient.grpc`` works unchanged). The handlers are registered by the service's full
name, as the specification spells it; the messages live in a package of our own (the .proto
file says why). The other rpcs of the specification (streaming, model repository, shared
memory, statistics, ...) answer UNIMPLEMENTED, as gRPC does for any unknown method.

ModelInfer takes its inputs from ``raw_input_contents`` (what tritonclient sends: every input
or none) or from each input's typed ``contents`` (the one list of its datatype, such as
``fp32_contents``; never both for one input), checked as the HTTP API checks them
(ps_serve/tensors.py), and answers every output in ``raw_output_contents``, with the served
step as the ``step`` parameter when it is known. Errors: INVALID_ARGUMENT (a bad request),
NOT_FOUND (an unknown model or version), UNAUTHENTICATED (no token, on every rpc but
ServerLive and ServerReady), INTERNAL (a fault of the server).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np

from ps_common.access import server_credentials
from ps_common.tls import AUTH_METADATA_KEY
from ps_serve.errors import RequestError, ServeError, Unauthenticated
from ps_serve.http import EXTENSIONS, SERVER_NAME, server_version
from ps_serve.metrics import ServeMetrics
from ps_serve.model import PLATFORM, ModelState, ServedModel
from ps_serve.proto import grpc_service_pb2 as pb
from ps_serve.security import TokenCheck
from ps_serve.tensors import check_header, datatype_of_array, element_count, from_json, from_raw, to_raw

log = logging.getLogger(__name__)

#: The service's full name on the wire, as the specification has it.
SERVICE = "inference.GRPCInferenceService"
#: rpc -> (request class, response class, metrics endpoint name, needs the token).
RPCS: dict[str, tuple[Any, Any, str, bool]] = {
    "ServerLive": (pb.ServerLiveRequest, pb.ServerLiveResponse, "server_live", False),
    "ServerReady": (pb.ServerReadyRequest, pb.ServerReadyResponse, "server_ready", False),
    "ModelReady": (pb.ModelReadyRequest, pb.ModelReadyResponse, "model_ready", True),
    "ServerMetadata": (pb.ServerMetadataRequest, pb.ServerMetadataResponse, "server_metadata", True),
    "ModelMetadata": (pb.ModelMetadataRequest, pb.ModelMetadataResponse, "model_metadata", True),
    "ModelInfer": (pb.ModelInferRequest, pb.ModelInferResponse, "infer", True),
}
#: Each datatype's typed list in InferTensorContents (FP16 has none: it travels raw).
CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
           404: grpc.StatusCode.NOT_FOUND}


class InferenceService:
    """The rpcs' behaviour over one served model."""

    def __init__(self, served: ServedModel, metrics: ServeMetrics, tokens: TokenCheck) -> None:
        self.served = served
        self.metrics = metrics
        self.tokens = tokens
        self.stopping = False

    def handler(self) -> grpc.GenericRpcHandler:
        handlers = {}
        for rpc, (request_class, response_class, endpoint, needs_token) in RPCS.items():
            handlers[rpc] = grpc.unary_unary_rpc_method_handler(
                self._wrapped(getattr(self, rpc), endpoint, needs_token),
                request_deserializer=request_class.FromString, response_serializer=response_class.SerializeToString)
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def _wrapped(self, behavior: Callable, endpoint: str, needs_token: bool) -> Callable:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                if needs_token:
                    authorization = _metadata(context, AUTH_METADATA_KEY)
                    if not self.tokens.allows(authorization):
                        raise Unauthenticated(self.tokens.refusal(authorization))
                return behavior(request)
            except ServeError as exc:
                code = _STATUS.get(exc.status, grpc.StatusCode.INTERNAL)
                message = str(exc)
            except Exception:   # a fault of the server, not of the request
                log.exception("gRPC %s failed", endpoint)
                code, message = grpc.StatusCode.INTERNAL, "internal server error (see the server's log)"
            finally:
                self.metrics.request("grpc", endpoint, code.name, time.perf_counter() - started)
            context.abort(code, message)

        return call

    # ------------------------------------------------------------------ health and metadata

    def ServerLive(self, request: pb.ServerLiveRequest) -> pb.ServerLiveResponse:  # noqa: N802 - the rpc's name
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request: pb.ServerReadyRequest) -> pb.ServerReadyResponse:  # noqa: N802
        return pb.ServerReadyResponse(ready=not self.stopping)

    def ModelReady(self, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:  # noqa: N802
        self.served.check(request.name, request.version)
        return pb.ModelReadyResponse(ready=not self.stopping)

    def ServerMetadata(self, request: pb.ServerMetadataRequest) -> pb.ServerMetadataResponse:  # noqa: N802
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=server_version(), extensions=list(EXTENSIONS))

    def ModelMetadata(self, request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:  # noqa: N802
        self.served.check(request.name, request.version)
        state = self.served.current()
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=self.served.name, versions=[self.served.version], platform=PLATFORM,
            inputs=[tensor(name=s.name, datatype=s.datatype, shape=s.shape) for s in state.inputs],
            outputs=[tensor(name=s.name, datatype=s.datatype, shape=s.shape) for s in state.outputs])

    # ------------------------------------------------------------------ inference

    def ModelInfer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:  # noqa: N802
        self.served.check(request.model_name, request.model_version)
        state = self.served.current()   # the one state this request uses, whatever is swapped in meanwhile
        for name in ("sequence_id", "sequence_start", "sequence_end"):
            if name in request.parameters and _value(request.parameters[name]) not in (0, "", False):
                raise RequestError(f"parameter {name!r}: sequences are not supported by this server")
        inputs = _inputs(state, request)
        wanted = []
        for output in request.outputs:
            if "classification" in output.parameters and _value(output.parameters["classification"]) not in (0, None):
                raise RequestError(f"output '{output.name}': the classification extension is not supported")
            wanted.append(output.name)
        started = time.perf_counter()
        outputs = state.infer(inputs, wanted or None)
        self.metrics.inference(time.perf_counter() - started)
        response = pb.ModelInferResponse(model_name=self.served.name, model_version=self.served.version,
                                         id=request.id)
        if state.step is not None:
            response.parameters["step"].int64_param = state.step
        for name, array in outputs.items():
            response.outputs.add(name=name, datatype=datatype_of_array(array), shape=array.shape)
            response.raw_output_contents.append(to_raw(array))
        return response


def _inputs(state: ModelState, request: pb.ModelInferRequest) -> dict[str, np.ndarray]:
    raw = request.raw_input_contents
    if not request.inputs:
        raise RequestError(f"the request has no inputs; the model takes {state.describe_inputs()}")
    if raw and len(raw) != len(request.inputs):
        raise RequestError(f"the request has {len(request.inputs)} inputs but {len(raw)} raw_input_contents: "
                           "give raw contents for every input or for none")
    inputs: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(request.inputs):
        if tensor.name in inputs:
            raise RequestError(f"input '{tensor.name}' is given twice")
        spec = state.input_spec(tensor.name)
        shape = check_header(spec, tensor.datatype, list(tensor.shape))
        given = [descriptor.name for descriptor, _ in tensor.contents.ListFields()]   # the non-empty typed lists
        if raw:
            if given:
                raise RequestError(f"input '{tensor.name}' has both 'contents' ({', '.join(given)}) and "
                                   "raw_input_contents; send one")
            inputs[tensor.name] = from_raw(spec, tensor.datatype, shape, raw[index])
            continue
        field = CONTENTS_FIELD.get(tensor.datatype)
        if field is None:
            raise RequestError(f"input '{tensor.name}' is {tensor.datatype}, which has no typed contents: send it in "
                               "raw_input_contents")
        if given and given != [field]:
            raise RequestError(f"{tensor.datatype} input '{tensor.name}' takes {field}; got "
                               f"{' and '.join(given)}")
        if not given and element_count(shape):
            raise RequestError(f"input '{tensor.name}' has no data: give its {element_count(shape)} element(s) in "
                               f"contents.{field} or in raw_input_contents")
        values = list(getattr(tensor.contents, field))
        if tensor.datatype == "BYTES":
            try:
                values = [v.decode("utf-8") for v in values]
            except UnicodeDecodeError:
                raise RequestError(f"input '{tensor.name}': a BYTES element is not UTF-8 text") from None
        inputs[tensor.name] = from_json(spec, tensor.datatype, shape, values)
    return inputs


def _value(parameter: pb.InferParameter) -> Any:
    choice = parameter.WhichOneof("parameter_choice")
    return None if choice is None else getattr(parameter, choice)


def _metadata(context: grpc.ServicerContext, key: str) -> str | None:
    for name, value in context.invocation_metadata() or ():
        if name == key:
            return value.decode("ascii", "replace") if isinstance(value, bytes) else value
    return None


def _check_free(host: str, port: int, address: str) -> None:
    """OSError naming the address when the port is taken, before gRPC tries (its failure logs a line of its own)."""
    try:
        family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(where)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {address} (gRPC): {exc.strerror or exc}") from exc


class GrpcServer:
    """The gRPC server of `InferenceService`, on its own threads."""

    def __init__(self, served: ServedModel, metrics: ServeMetrics, tokens: TokenCheck, config: Any) -> None:
        """Checks the TLS files (ValueError naming one that cannot be used)."""
        self.config = config
        self.service = InferenceService(served, metrics, tokens)
        self.credentials = server_credentials(config.tls_cert, config.tls_key) if config.tls else None
        self._server: grpc.Server | None = None

    def start(self) -> int:
        """Listens; the bound port. OSError naming the address when it cannot be bound."""
        config = self.config
        options = [("grpc.max_receive_message_length", config.max_request_bytes),
                   ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)]
        server = grpc.server(ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="ps-serve-grpc"),
                             handlers=[self.service.handler()], options=options)
        address = f"[{config.host}]:{config.grpc_port}" if ":" in config.host else f"{config.host}:{config.grpc_port}"
        if config.grpc_port:
            _check_free(config.host, config.grpc_port, address)
        try:
            if self.credentials is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, self.credentials)
        except RuntimeError as exc:   # grpcio: "Failed to bind to address ..."
            raise OSError(98, f"cannot listen on {address} (gRPC): {exc}") from exc
        if port == 0:
            raise OSError(98, f"cannot listen on {address} (gRPC): the port is in use or the address is not local")
        server.start()
        self._server = server
        return port

    def stop(self, grace: float) -> None:
        self.service.stopping = True
        if self._server is not None:
            self._server.stop(grace).wait(grace + 1.0)
            self._server = None
