"""Pipeline (model) parallelism: a model's graph cut into stages that separate workers run.

`cut.py` chooses the cuts and writes each stage's model; `stage.py` runs one stage's forward
and backward passes over micro-batches (and `LocalPipeline` chains them in one process).
"""
