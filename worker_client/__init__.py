"""The worker side: the gradient engine, the client library and the worker process."""

from worker_client.client import PSClient, PushReport, RetryPolicy, ServerError
from worker_client.gradients import DeviceUnavailableError, GradientEngine, UnsupportedModelError

__all__ = ["DeviceUnavailableError", "GradientEngine", "PSClient", "PushReport", "RetryPolicy", "ServerError",
           "UnsupportedModelError"]
