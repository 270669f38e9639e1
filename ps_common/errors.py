"""The one error catalog: every error the project raises on purpose, with its status and reason.

Each class names, as class attributes, the gRPC status code it maps to at the service
boundary (`status`, the name of a `grpc.StatusCode`; None for errors that never cross
the wire) and a stable machine-readable `reason`. The server sends the reason in the
trailing metadata key `REASON_KEY`; the client maps it back to the same class with
`error_for_reason`, so no code ever matches message text. The table is used both ways.

Errors raised only on one side (a corrupt checkpoint, a bad data set, a model that cannot
be differentiated, a launch that cannot start) belong here too, so one place lists
everything a user can be told, and every tool maps them to exit codes the same way.
"""

from __future__ import annotations

from typing import ClassVar

#: Trailing-metadata key carrying an error's `reason` from the server to the client.
REASON_KEY = "ps-error-reason"

#: The longest error message sent in a status (characters): gRPC refuses status details over
#: its metadata limit (8 KiB by default) with RESOURCE_EXHAUSTED, so a huge name echoed back
#: would replace the real status; longer messages are cut, saying how much was cut.
MAX_MESSAGE_CHARS = 2000


def shorten(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` cut to at most about `limit` characters, saying how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


_BY_REASON: dict[str, type["PSError"]] = {}


class PSError(Exception):
    """Base of every error the parameter server raises on purpose.

    A subclass that sets `reason` in its own body joins the catalog (a reason names one
    class only); one that inherits it (ServerError.remote's classes) does not.
    """

    status: ClassVar[str | None] = "INTERNAL"
    reason: ClassVar[str] = "PS_ERROR"

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "reason" in cls.__dict__:
            other = _BY_REASON.setdefault(cls.reason, cls)
            if other is not cls:
                raise TypeError(f"error reason {cls.reason!r} is taken by {other.__qualname__}; "
                                f"{cls.__qualname__} needs its own")


# ---------------------------------------------------------------------- the wire (shard rpcs)


class UnknownTensorError(PSError):
    """A tensor name (or a row range of one) that the model does not have: NOT_FOUND."""

    status, reason = "NOT_FOUND", "UNKNOWN_TENSOR"


class UnknownWorkerError(PSError):
    """A worker id that is not registered (or whose lease was dropped): NOT_FOUND; the client registers again."""

    status, reason = "NOT_FOUND", "UNKNOWN_WORKER"


class InvalidTensorError(PSError):
    """Wrong dtype, shape, byte count or row range for a tensor: INVALID_ARGUMENT."""

    status, reason = "INVALID_ARGUMENT", "INVALID_TENSOR"


class InvalidRequestError(PSError):
    """A request whose fields are out of range, inconsistent or do not parse: INVALID_ARGUMENT."""

    status, reason = "INVALID_ARGUMENT", "INVALID_REQUEST"


class NotInitializedError(PSError):
    """Push or pull before the parameters were initialized: FAILED_PRECONDITION."""

    status, reason = "FAILED_PRECONDITION", "NOT_INITIALIZED"


class InitMismatchError(PSError):
    """A re-initialization whose parameter list differs from the one in place: FAILED_PRECONDITION."""

    status, reason = "FAILED_PRECONDITION", "INIT_MISMATCH"


class SharedMemoryUnavailableError(PSError):
    """Shared memory asked for where there is none (no /dev/shm, no segment opened): FAILED_PRECONDITION;
    the client goes on over gRPC bytes."""

    status, reason = "FAILED_PRECONDITION", "SHARED_MEMORY_UNAVAILABLE"


class CheckpointUnavailableError(PSError):
    """A checkpoint asked for where there is nothing or nowhere to write it: FAILED_PRECONDITION."""

    status, reason = "FAILED_PRECONDITION", "CHECKPOINT_UNAVAILABLE"


class WaitTimeoutError(PSError):
    """A wait (sync step, SSP hold, barrier) that ran out of time: DEADLINE_EXCEEDED."""

    status, reason = "DEADLINE_EXCEEDED", "WAIT_TIMEOUT"


class ShuttingDownError(PSError):
    """The shard is stopping, or was reset while the call waited: UNAVAILABLE."""

    status, reason = "UNAVAILABLE", "SHUTTING_DOWN"


class NotPrimaryError(PSError):
    """A replicated shard's replica that may not take this call now: a backup, or a primary that lost its lease or
    was deposed (docs/replication.md). UNAVAILABLE, so clients retry; the message names the primary it knows."""

    status, reason = "UNAVAILABLE", "NOT_PRIMARY"


class ReplayMismatchError(PSError):
    """A backup replayed its primary's operation to another outcome: it takes a whole state again (never on the
    wire)."""

    status, reason = None, "REPLAY_MISMATCH"


class ResourceExhaustedError(PSError):
    """A request over a configured limit (size, count, concurrent calls): RESOURCE_EXHAUSTED."""

    status, reason = "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED"


class OverloadedError(PSError):
    """Data-plane admission is full (every data-plane slot is busy): RESOURCE_EXHAUSTED; retry with backoff."""

    status, reason = "RESOURCE_EXHAUSTED", "OVERLOADED"


class PermissionDeniedError(PSError):
    """A caller without the role an rpc needs: PERMISSION_DENIED."""

    status, reason = "PERMISSION_DENIED", "PERMISSION_DENIED"


class UnauthenticatedError(PSError):
    """A caller without valid credentials: UNAUTHENTICATED."""

    status, reason = "UNAUTHENTICATED", "UNAUTHENTICATED"


class CheckpointWriteError(PSError):
    """A checkpoint that could not be written (disk full, permissions): INTERNAL, named in the shard's log."""

    status, reason = "INTERNAL", "CHECKPOINT_WRITE_FAILED"


# ---------------------------------------------------------------------- one side only


class CheckpointError(PSError):
    """Base of the errors reading a checkpoint back."""

    status, reason = None, "CHECKPOINT"


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file that does not read back whole: truncated, bad header, missing tensor, checksum mismatch."""

    reason = "CHECKPOINT_CORRUPT"


class CheckpointMismatchError(CheckpointError, ValueError):
    """A valid checkpoint that does not fit this shard's configuration (shard index, shards, mode, ...)."""

    reason = "CHECKPOINT_MISMATCH"


class StoppedError(PSError):
    """A client wait (connect, retry, barrier, pull) ended because the process was asked to stop (SIGTERM, Ctrl-C)."""

    status, reason = None, "STOPPED"


class StageTimeoutError(PSError, TimeoutError):
    """A pipeline stage's wait that ran out: a message from a peer stage, or a peer's published address.

    The message names what was awaited (kind, step, micro-batch, replica, the peer stage, or
    the rendezvous file) and the seconds waited. Never crosses the wire.
    """

    status, reason = None, "STAGE_TIMEOUT"


class ServerError(PSError):
    """A shard answered an rpc with an error status (client side, after retries for UNAVAILABLE).

    The client raises `ServerError.remote(cls)`: a class that is both the catalog class the
    server named in its reason (UnknownWorkerError, WaitTimeoutError, ...) and ServerError,
    so callers catch either. `code` is the grpc.StatusCode, `address` the shard's.
    """

    status, reason = None, "SERVER_ERROR"
    _remote: ClassVar[dict[type, type]] = {}

    def __init__(self, message: str, code: object = None, address: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.address = address

    @property
    def transient(self) -> bool:
        """Whether the server did not answer in time or at all (UNAVAILABLE, DEADLINE_EXCEEDED): worth waiting
        for, where a typed error from the server is final."""
        return getattr(self.code, "name", "") in ("UNAVAILABLE", "DEADLINE_EXCEEDED")

    @classmethod
    def remote(cls, error: type[PSError] | None) -> type["ServerError"]:
        """The class a client raises for a server error of catalog class `error` (ServerError itself for None)."""
        if error is None or issubclass(error, ServerError):
            return cls
        found = cls._remote.get(error)
        if found is None:
            found = cls._remote[error] = type(error.__name__, (error, cls), {"__doc__": error.__doc__,
                                                                             "__module__": error.__module__})
        return found


def error_for_reason(reason: str) -> type[PSError] | None:
    """The catalog class of a machine-readable reason (as sent in REASON_KEY), or None when unknown.

    The catalog holds every PSError subclass defined in this module, and any defined
    elsewhere once its module is imported.
    """
    return _BY_REASON.get(reason)


def catalog() -> dict[str, type[PSError]]:
    """Every error class by reason, for docs and tests."""
    return dict(sorted(_BY_REASON.items()))


# ---------------------------------------------------------------------- the gradient engine


class ModelLoadError(PSError, ValueError):
    """An .onnx file that cannot be read: missing, unreadable, empty, truncated or not ONNX; names the file."""

    status, reason = None, "MODEL_UNREADABLE"


class UnsupportedModelError(PSError, ValueError):
    """A model the gradient engine cannot differentiate or onnxruntime cannot load; names the node and op."""

    status, reason = None, "MODEL_UNSUPPORTED"


class DeviceUnavailableError(PSError, RuntimeError):
    """A device (cuda, cuda:N) without a working onnxruntime execution provider in this installation."""

    status, reason = None, "DEVICE_UNAVAILABLE"


# ---------------------------------------------------------------------- training and data


class TrainingError(PSError, RuntimeError):
    """A training run that cannot go on; the message says what was awaited or what differs."""

    status, reason = None, "TRAINING"


class DatasetError(PSError, ValueError):
    """A dataset spec, file or array that cannot be used; the message names it."""

    status, reason = None, "DATASET"


# ---------------------------------------------------------------------- jobs and tools
# Raised before or around the processes of a job, never across the wire (status None). Each
# keeps the built-in base its callers always caught (ValueError, RuntimeError).


class JobConfigError(PSError, ValueError):
    """A setting, job file or TF_CONFIG that cannot be used; the message names it and the value."""

    status, reason = None, "JOB_CONFIG"


class ProcessStartError(PSError, RuntimeError):
    """A child process that exited, or stayed silent past its timeout, instead of printing its READY line.

    The message names the process, its argv and its last lines of output (ps_common.process).
    """

    status, reason = None, "PROCESS_START"


class ExportError(PSError, ValueError):
    """A trained model that cannot be exported (ps_tools/export.py): a model that does not match the shards, a
    partial checkpoint set, a step that is gone; one line naming the thing and the values (the tools exit 2)."""

    status, reason = None, "EXPORT"


class LaunchError(PSError, RuntimeError):
    """ps-launch could not run the job to the end; the message names the process and what happened."""

    status, reason = None, "LAUNCH_FAILED"
