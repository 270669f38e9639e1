"""The worker's training: the loop, its events, evaluation, and the checks before a worker starts.

| module | what it holds |
| --- | --- |
| `loop.py` | `Trainer` (join, the one training loop, leave) and `TrainingPlan` |
| `events.py` | where events go: `JsonLinesSink` for launchers, `TextSink` for people |
| `evaluate.py` | test loss, accuracy and AUC of a model's predictions |
| `preflight.py` | the model, the data and the settings checked against each other before anything starts |
| `tensorboard.py` | events written as TensorBoard scalars |

The loop talks to the shards only through the client library (worker_client/client); it
knows no gRPC.
"""

from ps_common.errors import TrainingError
from worker_client.training.evaluate import binary_auc, evaluate, metrics_of
from worker_client.training.events import EventSink, JsonLinesSink, TextSink, format_event, peak_rss_mb
from worker_client.training.loop import RECHECK_SECONDS, START_BARRIER, Trainer, TrainingPlan

__all__ = ["RECHECK_SECONDS", "START_BARRIER", "EventSink", "JsonLinesSink", "TextSink", "Trainer", "TrainingError",
           "TrainingPlan", "binary_auc", "evaluate", "format_event", "metrics_of", "peak_rss_mb"]
