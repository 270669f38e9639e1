"""The error boundary of every servicer of the product (ps.v1.ParameterServer, Admin, StageExchange).

Domain code raises the catalog's typed errors (ps_common/errors.py); only here do they
become gRPC statuses, with the catalog's machine-readable reason in the trailing metadata
(REASON_KEY), which the client maps back to the same class. Bytes that do not parse are the
caller's error (INVALID_ARGUMENT), a client stream that ends under a handler is CANCELLED,
and anything else is a bug: INTERNAL, logged, and the server keeps serving.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from ps_common.errors import REASON_KEY, InvalidRequestError, PSError, shorten

log = logging.getLogger(__name__)

__all__ = ["Malformed", "abort_with", "safe_deserializer", "status_of", "translate_errors"]


def status_of(exc: PSError) -> grpc.StatusCode:
    """The status code the catalog gives an error (INTERNAL for one that never should cross the wire)."""
    return getattr(grpc.StatusCode, exc.status or "INTERNAL", grpc.StatusCode.INTERNAL)


def abort_with(context: grpc.ServicerContext, exc: PSError) -> None:
    """Ends the rpc with the error's status, its message, and its reason in the trailing metadata."""
    context.set_trailing_metadata(((REASON_KEY, exc.reason),))
    context.abort(status_of(exc), shorten(str(exc)))


@dataclass(frozen=True)
class Malformed:
    """What a request deserializer hands the handler for bytes that do not parse (never raises)."""

    rpc: str
    nbytes: int
    error: str

    def refusal(self) -> InvalidRequestError:
        """The error the caller gets for it: INVALID_ARGUMENT naming the rpc and the parser's complaint."""
        return InvalidRequestError(f"{self.rpc}: the request's {self.nbytes} bytes do not parse as its message "
                                   f"({self.error})")


def safe_deserializer(message_type, rpc: str) -> Callable[[bytes], object]:
    """`message_type.FromString` that returns Malformed instead of raising.

    gRPC answers a deserializer's exception with INTERNAL ("Exception deserializing
    request!"), but bytes that do not parse are the caller's error: translate_errors turns
    Malformed into INVALID_ARGUMENT naming the rpc and the parser's complaint.
    """

    def deserialize(raw: bytes) -> object:
        try:
            return message_type.FromString(raw)
        except Exception as exc:  # protobuf's DecodeError, or anything the parser raises on garbage
            return Malformed(rpc, len(raw), f"{type(exc).__name__}: {exc}")

    return deserialize


def translate_errors(method: Callable) -> Callable:
    """Turns typed domain errors into their status (abort_with); anything else is a bug: INTERNAL.

    A request that did not parse (Malformed) is INVALID_ARGUMENT. A client stream that ends
    under the handler (the client cancelled, or a watchdog cut it) is CANCELLED, logged at
    debug level: it is the client's doing, not the server's.
    """
    where = method.__qualname__.split(".")[0].replace("Servicer", "")

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            if isinstance(request, Malformed):
                raise request.refusal()
            return method(self, request, context)
        except PSError as exc:
            abort_with(context, exc)
        except grpc.RpcError as exc:   # raised by a client stream's request iterator when the call ends
            log.debug("%s.%s: the client stream ended under the handler: %s", where, method.__name__, exc)
            context.abort(grpc.StatusCode.CANCELLED, f"{method.__name__}: the request stream was cancelled")
        except Exception as exc:  # a bug: log it, keep serving
            log.exception("internal error in %s.%s", where, method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}: {type(exc).__name__}: {exc}")

    return wrapper
