"""The raw-bytes gRPC baseline: one BytesValue per call, no chunking, no shards, no state.

`python -m ps_bench.raw_grpc` serves it (printing `RAW_READY {"port": N}`); `RawClient`
pushes and pulls numpy arrays through it the cheapest way gRPC Python allows: one
message with one bytes field, `tobytes()` out and `frombuffer` in. The server keeps the
last pushed message and answers pulls with it as is, so the baseline does no copy of its
own beyond what gRPC and protobuf do.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from concurrent import futures

import grpc
import numpy as np
from google.protobuf import empty_pb2, wrappers_pb2

#: The line the server prints on stdout once it listens, before a JSON object with its port.
READY_PREFIX = "RAW_READY "
#: Server threads (concurrent calls).
SERVER_THREADS = 8
#: Longest wait for one Put or Get, in seconds (a 100 MB message on a loaded machine).
RPC_TIMEOUT = 300
#: How often the server checks for SIGTERM / SIGINT, and its grace for calls in flight when stopping, in seconds.
STOP_POLL_INTERVAL = 0.5
STOP_GRACE = 1

_SERVICE = "bench.RawBytes"
_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


class _Store:
    def __init__(self) -> None:
        self.message = wrappers_pb2.BytesValue()

    def put(self, request: wrappers_pb2.BytesValue, context) -> empty_pb2.Empty:
        self.message = request
        return empty_pb2.Empty()

    def get(self, request: empty_pb2.Empty, context) -> wrappers_pb2.BytesValue:
        return self.message


def serve(port: int = 0) -> tuple[grpc.Server, int]:
    store = _Store()
    handlers = {
        "Put": grpc.unary_unary_rpc_method_handler(store.put, wrappers_pb2.BytesValue.FromString, empty_pb2.Empty.SerializeToString),
        "Get": grpc.unary_unary_rpc_method_handler(store.get, empty_pb2.Empty.FromString, wrappers_pb2.BytesValue.SerializeToString),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=SERVER_THREADS), options=_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, bound


class RawClient:
    """Pushes and pulls one array per server, split evenly over the servers, concurrently."""

    def __init__(self, addresses: list[str]) -> None:
        self.channels = [grpc.insecure_channel(a, options=_OPTIONS) for a in addresses]
        self.put = [c.unary_unary(f"/{_SERVICE}/Put", request_serializer=wrappers_pb2.BytesValue.SerializeToString,
                                  response_deserializer=empty_pb2.Empty.FromString) for c in self.channels]
        self.get = [c.unary_unary(f"/{_SERVICE}/Get", request_serializer=empty_pb2.Empty.SerializeToString,
                                  response_deserializer=wrappers_pb2.BytesValue.FromString) for c in self.channels]
        self.pool = futures.ThreadPoolExecutor(max_workers=max(2, len(addresses)))

    def push(self, array: np.ndarray) -> None:
        pieces = np.array_split(array, len(self.put))
        list(self.pool.map(lambda i: self.put[i](wrappers_pb2.BytesValue(value=pieces[i].tobytes()), timeout=RPC_TIMEOUT),
                           range(len(self.put))))

    def pull(self, dtype: np.dtype) -> list[np.ndarray]:
        return list(self.pool.map(lambda i: np.frombuffer(self.get[i](empty_pb2.Empty(), timeout=RPC_TIMEOUT).value, dtype),
                                  range(len(self.get))))

    def close(self) -> None:
        self.pool.shutdown()
        for c in self.channels:
            c.close()


def main() -> int:
    server, port = serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    print(READY_PREFIX + json.dumps({"port": port}), flush=True)
    while not stop.wait(STOP_POLL_INTERVAL):
        pass
    server.stop(STOP_GRACE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
