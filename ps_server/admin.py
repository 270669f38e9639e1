"""ps.v1.Admin: the operator rpcs (checkpoint now, graceful shutdown, reset) over one ShardServer.

Who may call them is decided before these handlers run (ps_server.security: the admin
token, or an OU=ps-admin client certificate under mutual TLS).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from ps_server.service import translate_errors

if TYPE_CHECKING:
    from ps_server.server import ShardServer

log = logging.getLogger(__name__)


class AdminServicer(pb_grpc.AdminServicer):
    """ps.v1.Admin over one ShardServer. Thread-safe."""

    def __init__(self, server: "ShardServer") -> None:
        self.server = server
        self._shutdown_lock = threading.Lock()
        self._shutdown: threading.Thread | None = None

    @property
    def _index(self) -> int:
        return self.server.config.shard_index

    def Checkpoint(self, request, context):
        """Writes a checkpoint now; FAILED_PRECONDITION without a checkpoint directory or parameters."""
        # Not under translate_errors: context.abort raises, and that wrapper would turn it into INTERNAL.
        write = self._checkpoint_writer()
        if write is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"shard {self._index}: checkpointing not available (start it with a checkpoint directory, "
                          "--checkpoint-dir)")
        if not self.server.shard.store.initialized:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"shard {self._index} has no parameters to checkpoint yet (InitParameters first)")
        try:
            path = write()
        except Exception:
            log.exception("shard %d: checkpoint on request failed", self._index)
            path = None
        if path is None:
            context.abort(grpc.StatusCode.INTERNAL, f"shard {self._index}: the checkpoint write failed; see its log")
        step = self._step_of(Path(path))
        log.info("shard %d: checkpoint at step %d written on request of %s", self._index, step, context.peer())
        return pb.CheckpointResponse(path=str(path), step=step)

    def _checkpoint_writer(self):
        """A callable that writes a checkpoint and returns its path (None on failure), or None when there is none."""
        if not self.server.config.checkpoint_dir:
            return None
        checkpoint_now = getattr(self.server, "checkpoint_now", None)
        if callable(checkpoint_now):
            return checkpoint_now
        checkpointer = getattr(self.server, "checkpointer", None)
        if checkpointer is not None and callable(getattr(checkpointer, "checkpoint_now", None)):
            return lambda: checkpointer.checkpoint_now(force=True)
        return None

    def _step_of(self, path: Path) -> int:
        from ps_server.checkpoint import iter_checkpoints

        for step, found in iter_checkpoints(path.parent):
            if found.name == path.name:
                return step
        return self.server.shard.step

    @translate_errors
    def Shutdown(self, request, context):
        """Starts a graceful stop in the background (final checkpoint included) and returns at once."""
        with self._shutdown_lock:
            if self._shutdown is None:
                log.warning("shard %d: shutdown requested by %s%s", self._index, context.peer(),
                            f" ({request.reason})" if request.reason else "")
                # Not a daemon: the process must not exit before the final checkpoint is written.
                self._shutdown = threading.Thread(target=self.server.stop, name="admin-shutdown")
                self._shutdown.start()
        return pb.ShutdownResponse()

    @translate_errors
    def ResetParameters(self, request, context):
        """Drops parameters, optimizer state, step and worker clocks; waiting pulls fail UNAVAILABLE."""
        before = self.server.shard.reset()
        log.warning("shard %d: parameters reset at step %d on request of %s", self._index, before, context.peer())
        return pb.ResetParametersResponse(step=before)
