"""The gradient engine: an ONNX model in, its loss and gradients out, one module per stage.

`GradientEngine` (engine.py) runs the stages in this order when it is built
(docs/engine-pipeline.md says what each takes and returns):

1. load          -- read the .onnx file, at an IR version onnxruntime loads; opset --
                    upgrade a model below opset 16
2. trainables    -- choose the initializers that train (selection.py's rule); warn about
                    tied ones and folded ones (exporters.py); find the state
3. lift          -- make the parameters and the state graph inputs
4. cache         -- find the gradient model on disk; on a miss build it (5-9) and store it
5. training mode -- training-mode BatchNormalization and Dropout as arithmetic and a mask
   batch         -- fix the batch axis of the data inputs
6. loss          -- append the loss as the model's one output
7. rewrites      -- exact rewrites for fast onnxruntime kernels, on the forward graph
8. differentiate -- onnx-ad's reverse pass: one gradient output per parameter
9. rewrites      -- exact rewrites again, on the adjoints; dead nodes pruned
10. session      -- the onnxruntime session on the chosen device

At run time feeds.py checks and converts the caller's arrays; support.py holds helpers
several stages share.
"""

from worker_client.engine.cache import default_cache_dir
from worker_client.engine.engine import GradientEngine, StepResult

__all__ = ["GradientEngine", "StepResult", "default_cache_dir"]
