"""Retrying a call to a server: the one retry loop of every client of the product (PSClient, StageLink).

A call is retried only when it fails with UNAVAILABLE (the server is not up, restarting, or
the connection broke) or RESOURCE_EXHAUSTED with reason OVERLOADED (the shard's admission
refused it before doing anything), with bounded exponential backoff and jitter. Any other
status is final and raised at once as the error catalog's class for the reason the server
sent (also a ServerError), so callers catch typed errors, never status codes.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from ps_common.errors import REASON_KEY, OverloadedError, ServerError, StoppedError, error_for_reason

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["RetryPolicy", "call_with_retries", "probe", "reason_of", "server_error"]


def probe(address: str, timeout: float = 1.0) -> str:
    """Why a TCP connection to HOST:PORT fails ("connection refused", "name does not resolve", ...), or
    "the port accepts connections, but gRPC does not answer" when it does not fail."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return "the port accepts connections, but gRPC does not answer there (TLS or another service?)"
    except ValueError:
        return f"{address!r} is not HOST:PORT"
    except socket.gaierror as exc:
        return f"the host name {host!r} does not resolve ({exc.strerror})"
    except TimeoutError:
        return f"no answer within {timeout:g} s (a firewall, or a host that is down?)"
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()


def reason_of(exc: grpc.RpcError) -> str:
    """The catalog reason a server sent with an error status (trailing metadata), or "" when none."""
    for key, value in (exc.trailing_metadata() or ()):
        if key == REASON_KEY:
            return value
    return ""


def server_error(exc: grpc.RpcError, message: str, address: str) -> ServerError:
    """The typed error for a failed rpc: the catalog class the server named, which is also a ServerError (a
    status without a reason, gRPC's own, is a plain ServerError: see its `transient`)."""
    return ServerError.remote(error_for_reason(reason_of(exc)))(message, exc.code(), address)


def retryable(exc: grpc.RpcError) -> bool:
    """UNAVAILABLE, or the shard's admission refusing a call it did nothing with (OVERLOADED)."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE or reason_of(exc) == OverloadedError.reason


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of UNAVAILABLE: attempts in all, first backoff and its cap (seconds), doubled each time with jitter.

    With a `window` (seconds, > 0) the retries also go on, past `attempts`, until that long
    after the first try (the last sleep is cut to end there): the time a restarting server
    has to come back (the worker's `reconnect_timeout`). Either way the retries end, with
    ServerError naming the server, the attempts and the seconds spent.
    """

    attempts: int = 6
    initial_backoff: float = 0.2
    max_backoff: float = 3.0
    window: float = 0.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"Invalid retry attempts: {self.attempts}")
        if not 0 < self.initial_backoff <= self.max_backoff:
            raise ValueError(f"Invalid backoff: initial {self.initial_backoff}, max {self.max_backoff}")
        if not self.window >= 0:
            raise ValueError(f"Invalid retry window: {self.window} (must be >= 0 seconds)")

    def pause(self, attempt: int, elapsed: float, backoff: float) -> float | None:
        """Seconds to sleep before trying again after `attempt` failed tries, `elapsed` s after the first; None: give up.

        `backoff` is the current backoff (before jitter: half to all of it is slept).
        """
        sleep = backoff * (0.5 + random.random() / 2)
        if attempt < self.attempts:
            return sleep
        if elapsed < self.window:
            return min(sleep, self.window - elapsed)
        return None


def call_with_retries(call: Callable[[], T], *, what: str, address: str, policy: RetryPolicy,
                      stop: threading.Event | None = None, on_unavailable: Callable[[float], None] | None = None,
                      level: int = logging.WARNING) -> T:
    """call(), retried as `policy` says while it fails with a retryable status (module docstring).

    `what` names the call and its target in messages ("PushPull on shard 1 (HOST:PORT)").
    A set `stop` ends the retries with StoppedError within the current pause.
    `on_unavailable(seconds since the first failure)` runs before each pause (a StageLink
    looks its peer up again there). Gives up with the catalog's error naming the attempts
    and the seconds spent.
    """
    backoff = policy.initial_backoff
    started = time.monotonic()
    attempt = 0
    failing_since: float | None = None
    while True:
        attempt += 1
        try:
            return call()
        except grpc.RpcError as exc:
            code, now = exc.code(), time.monotonic()
            elapsed = now - started
            pause = policy.pause(attempt, elapsed, backoff) if retryable(exc) else None
            if pause is not None:
                failing_since = failing_since or now
                if on_unavailable is not None:
                    on_unavailable(now - failing_since)
                log.log(level, "%s %s (attempt %d, %.1f s), retrying in %.2f s: %s", what,
                        "unavailable" if code == grpc.StatusCode.UNAVAILABLE else "overloaded", attempt, elapsed, pause,
                        exc.details())
                if (stop or threading.Event()).wait(pause):
                    raise StoppedError(f"{what}: stopped while retrying (attempt {attempt}, {elapsed:.1f} s)") from exc
                backoff = min(backoff * 2, policy.max_backoff)
                continue
            details = exc.details()
            if code == grpc.StatusCode.UNAVAILABLE:
                window = f", reconnect window {policy.window:g} s" if policy.window else ""
                prefix, details = f" after {attempt} attempts", f"{details} (gave up after {elapsed:.1f} s{window})"
            elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
                prefix = f" after {elapsed:.1f} s"
            else:
                prefix = ""
            raise server_error(exc, f"{what} failed{prefix}: {code.name}: {details}", address) from exc
