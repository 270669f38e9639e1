"""The typed error catalog; only the service boundary turns these into gRPC status codes."""

from __future__ import annotations


class PSError(Exception):
    """Base of every error the parameter server raises on purpose."""


class UnknownTensorError(PSError):
    """A tensor name (or a row range of one) that the model does not have: NOT_FOUND."""


class UnknownWorkerError(PSError):
    """A worker id that is not registered (or whose lease was dropped): NOT_FOUND."""


#: Words every UnknownWorkerError message holds, so a client can tell it from an unknown
#: tensor (both are NOT_FOUND) and register again, e.g. after a shard restart.
UNKNOWN_WORKER_MARK = "is not registered on this shard"


class InvalidTensorError(PSError):
    """Wrong dtype, shape, byte count or row range for a tensor: INVALID_ARGUMENT."""


class InvalidRequestError(PSError):
    """A request whose fields are out of range or inconsistent: INVALID_ARGUMENT."""


class NotInitializedError(PSError):
    """Push or pull before the parameters were initialized: FAILED_PRECONDITION."""


class InitMismatchError(PSError):
    """A re-initialization whose parameter list differs from the one in place: FAILED_PRECONDITION."""


class WaitTimeoutError(PSError):
    """A wait (sync step, SSP hold, barrier) that ran out of time: DEADLINE_EXCEEDED."""


class ShuttingDownError(PSError):
    """The shard is stopping and refuses new work: UNAVAILABLE."""


class PermissionDeniedError(PSError):
    """A caller without the role an rpc needs: PERMISSION_DENIED."""
