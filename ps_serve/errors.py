"""The errors ps-serve answers with, each with its HTTP status (and so its gRPC status).

A `RequestError` is the caller's mistake: a malformed body, an unknown input, a wrong shape,
datatype or byte count, a missing input (400); `ModelNotFound` names a model or version this
server does not serve (404); `PayloadTooLarge` (413) and `UnsupportedMediaType` (415) are HTTP's
answers to a body above the limit once decompressed and to a Content-Encoding this server
cannot read. Their messages name the input and the values, and are sent to
the caller as they are (``{"error": "..."}`` over HTTP, the status details over gRPC). Any
other exception is the server's own fault (500) and its message is logged, not sent.
"""

from __future__ import annotations


class ServeError(Exception):
    """An error with an HTTP status; its message is meant for the caller."""

    status = 500


class RequestError(ServeError, ValueError):
    """The request cannot be served as it is (HTTP 400, gRPC INVALID_ARGUMENT)."""

    status = 400


class ModelNotFound(ServeError, LookupError):
    """The request names a model or version this server does not serve (HTTP 404, gRPC NOT_FOUND)."""

    status = 404


class PayloadTooLarge(ServeError):
    """The request body, once decompressed, is larger than the server's limit (HTTP 413)."""

    status = 413


class UnsupportedMediaType(ServeError):
    """The request body has a Content-Encoding this server cannot read (HTTP 415, with `headers` to send)."""

    status = 415

    def __init__(self, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = dict(headers or {})


class Unauthenticated(ServeError, PermissionError):
    """The request carries no valid bearer token (HTTP 401, gRPC UNAUTHENTICATED)."""

    status = 401
