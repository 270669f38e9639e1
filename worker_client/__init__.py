"""The worker side: the gradient engine, the client library and the worker process."""

from ps_common.errors import DeviceUnavailableError, ModelLoadError, UnsupportedModelError
from worker_client.client import PSClient, PushReport, RetryPolicy, ServerError
from worker_client.engine import GradientEngine
from worker_client.client.rows import dynamic_table

__all__ = ["DeviceUnavailableError", "GradientEngine", "ModelLoadError", "PSClient", "PushReport", "RetryPolicy",
           "ServerError", "UnsupportedModelError", "dynamic_table"]
