"""A gRPC proxy for tests that replays pushes: every Push and PushPull reaches the shard twice, as a retry after a
lost answer would, and the client gets the second answer.

At-most-once is the shard's promise (a retried push is acknowledged, never applied again);
this is how the tests exercise it on the paths training really takes, without a test knob
in the product. The proxy forwards every rpc of ps.v1.ParameterServer as raw bytes (requests,
responses, metadata and deadline unchanged), so it can stand between real worker processes
and real shards: point `--servers` at `ReplayProxy.address`.
"""

from __future__ import annotations

import threading
from concurrent import futures
from collections.abc import Iterator

import grpc

from ps_proto.v1 import parameter_server_pb2 as pb

#: The rpcs whose every request is sent twice.
REPLAYED = frozenset({"Push", "PushPull"})
SERVICE = pb.DESCRIPTOR.services_by_name["ParameterServer"]


class ReplayProxy:
    """Forwards ps.v1.ParameterServer to `upstream`, replaying Push and PushPull (module docstring). A context
    manager; counts the replays it made in `replayed`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self._channel = grpc.insecure_channel(upstream, options=[("grpc.max_receive_message_length", -1),
                                                                 ("grpc.max_send_message_length", -1)])
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16),
                                   options=[("grpc.max_receive_message_length", -1),
                                            ("grpc.max_send_message_length", -1)])
        self.replayed = 0
        self._lock = threading.Lock()
        handlers = {m.name: self._handler(m) for m in SERVICE.methods}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    def _count(self) -> None:
        with self._lock:
            self.replayed += 1

    def _handler(self, method) -> grpc.RpcMethodHandler:
        path = f"/{SERVICE.full_name}/{method.name}"
        replay = method.name in REPLAYED
        kind = ("stream" if method.client_streaming else "unary") + "_" + \
            ("stream" if method.server_streaming else "unary")
        upstream = getattr(self._channel, kind)(path, request_serializer=None, response_deserializer=None)

        def options(context: grpc.ServicerContext) -> dict:
            return {"metadata": tuple(context.invocation_metadata()), "timeout": context.time_remaining()}

        def forward(call):
            try:
                return call()
            except grpc.RpcError as exc:
                raise _Relayed(exc) from exc

        def unary_unary(request: bytes, context):
            try:
                answer = forward(lambda: upstream(request, **options(context)))
                if replay:   # the first answer "lost": the client sees the retry's
                    self._count()
                    answer = forward(lambda: upstream(request, **options(context)))
                return answer
            except _Relayed as relayed:
                relayed.abort(context)

        def stream_unary(requests: Iterator[bytes], context):
            messages = list(requests)
            try:
                answer = forward(lambda: upstream(iter(messages), **options(context)))
                if replay:
                    self._count()
                    answer = forward(lambda: upstream(iter(messages), **options(context)))
                return answer
            except _Relayed as relayed:
                relayed.abort(context)

        def unary_stream(request: bytes, context):
            try:
                yield from forward(lambda: list(upstream(request, **options(context))))
            except _Relayed as relayed:
                relayed.abort(context)

        behaviors = {"unary_unary": unary_unary, "stream_unary": stream_unary, "unary_stream": unary_stream}
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(behaviors[kind], request_deserializer=None, response_serializer=None)

    def __enter__(self) -> "ReplayProxy":
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(0).wait(5)
        self._channel.close()


class _Relayed(Exception):
    """An upstream error status, to be passed on to the client unchanged (status, details, reason)."""

    def __init__(self, error: grpc.RpcError) -> None:
        super().__init__(error.details())
        self.error = error

    def abort(self, context: grpc.ServicerContext) -> None:
        context.set_trailing_metadata(tuple(self.error.trailing_metadata() or ()))
        context.abort(self.error.code(), self.error.details() or "")
