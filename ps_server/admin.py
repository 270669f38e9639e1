"""ps.v1.Admin: the operator rpcs (checkpoint now, graceful shutdown, reset) over one shard.

Who may call them is decided before these handlers run (ps_server.security: the admin
token, or an OU=ps-admin client certificate under mutual TLS). The handlers follow the
service's order: check, call the domain, translate errors (the catalog), fill the response.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ps_common.errors import CheckpointUnavailableError, CheckpointWriteError
from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from ps_server.checkpoints import Checkpointer, checkpoint_step
from ps_common.boundary import translate_errors
from ps_server.shard import Shard

log = logging.getLogger(__name__)


class AdminServicer(pb_grpc.AdminServicer):
    """ps.v1.Admin over one shard, its checkpointer (None without a checkpoint directory) and its stop. Thread-safe."""

    def __init__(self, shard: Shard, checkpointer: Checkpointer | None, stop: Callable[[], None]) -> None:
        self.shard = shard
        self.checkpointer = checkpointer
        self._stop = stop
        self._shutdown_lock = threading.Lock()
        self._shutdown: threading.Thread | None = None

    @property
    def _index(self) -> int:
        return self.shard.config.shard_index

    @translate_errors
    def Checkpoint(self, request, context):
        """Writes a checkpoint now; FAILED_PRECONDITION without a checkpoint directory or parameters."""
        if self.checkpointer is None:
            raise CheckpointUnavailableError(
                f"shard {self._index}: checkpointing not available (start it with a checkpoint directory, "
                "--checkpoint-dir)")
        if not self.shard.store.initialized:
            raise CheckpointUnavailableError(
                f"shard {self._index} has no parameters to checkpoint yet (InitParameters first)")
        path = self.checkpointer.checkpoint_now(force=True)
        if path is None:
            raise CheckpointWriteError(f"shard {self._index}: the checkpoint write to "
                                       f"{self.checkpointer.directory.path} failed; see the shard's log")
        step = checkpoint_step(path)
        log.info("shard %d: checkpoint at step %d written on request of %s", self._index, step, context.peer())
        return pb.CheckpointResponse(path=str(path), step=step)

    @translate_errors
    def Shutdown(self, request, context):
        """Starts a graceful stop in the background (final checkpoint included) and returns at once."""
        with self._shutdown_lock:
            if self._shutdown is None:
                log.warning("shard %d: shutdown requested by %s%s", self._index, context.peer(),
                            f" ({request.reason})" if request.reason else "")
                # Not a daemon: the process must not exit before the final checkpoint is written.
                self._shutdown = threading.Thread(target=self._stop, name="admin-shutdown")
                self._shutdown.start()
        return pb.ShutdownResponse()

    @translate_errors
    def ResetParameters(self, request, context):
        """Drops parameters, optimizer state, step and worker clocks; waiting pulls fail UNAVAILABLE."""
        before = self.shard.reset()
        log.warning("shard %d: parameters reset at step %d on request of %s", self._index, before, context.peer())
        return pb.ResetParametersResponse(step=before)
