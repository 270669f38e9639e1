"""The shard's event bus: domain events ("push", "step", "pull", ...) to listeners such as metrics and checkpoints."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

Listener = Callable[..., None]   # listener(event: str, **fields)


class Events:
    """Listeners subscribed to one shard's events. Emitting calls each listener in order, on the caller's
    thread (sometimes under the shard's lock): listeners must be cheap and never block. A listener that
    raises is logged and skipped; the others still run."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def emit(self, event: str, **fields: object) -> None:
        for listener in list(self._listeners):
            try:
                listener(event, **fields)
            except Exception:  # a listener's bug must not fail a push
                log.exception("listener %r failed on event %r", listener, event)
