"""The composition root of ps-serve: one served model behind the HTTP API (and gRPC, when asked), started and stopped.

`InferenceServer(served, config)` checks the settings (the bind rule, the TLS files) when it
is built, so a bad setting is a ValueError before anything listens; `await start()` listens
(an OSError names a port in use) and returns the fields of the READY line; `await stop()`
stops within `STOP_SECONDS`: health answers "not ready", new connections are refused, requests
in flight get `STOP_SECONDS` to finish.

`BackgroundServer` runs one in a thread of its own (its own event loop), for a program that
serves while it does something else -- a test, or a process that swaps new states into the
`ServedModel` as they come.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ps_serve.http import HttpApi
from ps_serve.metrics import ServeMetrics
from ps_serve.model import ServedModel
from ps_serve.security import TokenCheck, check_bind, server_ssl_context

log = logging.getLogger(__name__)

#: Requests that may run (decode, infer, encode) at once; more wait for a thread.
DEFAULT_WORKERS = 4
#: The largest request body, in bytes.
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
#: How long requests in flight get to finish when the server stops, in seconds.
STOP_SECONDS = 1.0


@dataclass(frozen=True)
class ServeConfig:
    """Where and how to serve; see `ps-serve --help`."""

    host: str = "127.0.0.1"
    port: int = 0
    grpc_port: int | None = None
    workers: int = DEFAULT_WORKERS
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = None
    insecure: bool = False

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


def host_port(host: str, port: int) -> str:
    """``HOST:PORT``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class InferenceServer:
    """One served model on HTTP (and gRPC when `config.grpc_port` is set)."""

    def __init__(self, served: ServedModel, config: ServeConfig) -> None:
        """Checks the settings; ValueError naming the one that cannot be used."""
        if (config.tls_cert is None) != (config.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        for name, value in (("port", config.port), ("grpc port", config.grpc_port)):
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} {value} is not in 0..65535")
        if config.workers < 1:
            raise ValueError(f"workers must be at least 1, got {config.workers}")
        if config.max_request_bytes < 1:
            raise ValueError(f"max request bytes must be at least 1, got {config.max_request_bytes}")
        check_bind(config.host, tls=config.tls, insecure=config.insecure)
        self.ssl_context = server_ssl_context(config.tls_cert, config.tls_key) if config.tls else None
        self.served = served
        self.config = config
        self.metrics = ServeMetrics(served)
        self.tokens = TokenCheck(config.token)
        self.executor = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="ps-serve")
        self.http = HttpApi(served, self.metrics, self.tokens, self.executor,
                            max_request_bytes=config.max_request_bytes)
        self.grpc: Any = None
        if config.grpc_port is not None:
            from ps_serve.grpc_service import GrpcServer   # grpc only when asked for

            self.grpc = GrpcServer(served, self.metrics, self.tokens, config)
        self._runner: web.AppRunner | None = None

    async def start(self) -> dict[str, Any]:
        """Listens; the READY line's fields. OSError (naming the address) when a port cannot be bound."""
        config = self.config
        self._runner = self.http.runner(access_log=None, shutdown_timeout=STOP_SECONDS)
        await self._runner.setup()
        site = web.TCPSite(self._runner, config.host, config.port, ssl_context=self.ssl_context)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise OSError(exc.errno, f"cannot listen on {host_port(config.host, config.port)} (HTTP): "
                                     f"{exc.strerror or exc}") from exc
        port = self._runner.addresses[0][1]
        scheme = "https" if config.tls else "http"
        ready: dict[str, Any] = {"http": host_port(config.host, port), "url": f"{scheme}://{host_port(config.host, port)}",
                                 "model": self.served.name, "version": self.served.version,
                                 "step": self.served.current().step, "tls": config.tls,
                                 "token": self.tokens.required}
        if self.grpc is not None:
            try:
                ready["grpc"] = host_port(config.host, self.grpc.start())
            except OSError:
                await self._runner.cleanup()
                raise
        log.info("serving model %s (%s) on %s%s; %s", self.served.name, self.served.current().source, ready["url"],
                 f" and gRPC {ready['grpc']}" if "grpc" in ready else "",
                 "a token is needed" if self.tokens.required else "no token")
        return ready

    async def stop(self) -> None:
        """Stops listening and lets requests in flight finish, within about 2 x STOP_SECONDS."""
        self.http.stopping = True
        if self.grpc is not None:
            self.grpc.stop(STOP_SECONDS)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.executor.shutdown(wait=False, cancel_futures=True)


class BackgroundServer:
    """An `InferenceServer` on an event loop in a thread of its own; a context manager."""

    def __init__(self, served: ServedModel, config: ServeConfig | None = None) -> None:
        self.server = InferenceServer(served, config or ServeConfig())
        self.ready: dict[str, Any] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ps-serve-loop", daemon=True)

    def start(self, timeout: float = 30.0) -> dict[str, Any]:
        self._thread.start()
        self.ready = asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout)
        return self.ready

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(timeout)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        self._loop.close()

    def __enter__(self) -> "BackgroundServer":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
