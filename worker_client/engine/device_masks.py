"""Stage "device masks": a CUDA engine's Dropout masks drawn on the GPU, where its step reads them.

On the CPU the engine draws each step's masks with numpy (`GradientEngine._draw_mask`) and feeds them. On a
GPU that is most of a step of a model with many Dropouts: the transformer classifier's 12 masks hold 18.9 M
elements at batch 32, 84 ms to draw on the host here and 75 MB to copy to the device every step, against a
17 ms torch step on an H200. So a CUDA engine draws them with a session of their own -- RandomUniform, kept
where the draw is at least the Dropout's ratio, scaled by 1 / (1 - ratio), as the host's masks are -- and
binds its outputs, left in the GPU's memory, into the gradient session's run (`session.run_bound`).

The draws are onnxruntime's (Philox on CUDA), seeded from the engine's generator: an engine's masks repeat
with its seed, but are not the masks the same seed gives on the CPU. A caller who passes masks (a pipeline
stage, which must use the same masks in its forward and its VJP) gets them fed from the host as before.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from worker_client.engine.session import Placement, open_session

__all__ = ["DeviceMasks", "masks_graph"]

#: The opset of the masks' graph: GreaterOrEqual is an op from 12.
_OPSET = 17
#: An IR version every onnxruntime this project supports loads.
_IR_VERSION = 8
#: The largest seed a float32 attribute holds exactly.
_SEED_LIMIT = 2 ** 24


def masks_graph(masks: Mapping[str, tuple[np.dtype, tuple[int, ...], float]],
                generator: np.random.Generator) -> onnx.ModelProto:
    """A graph without inputs whose outputs are the Dropout masks `masks` names, drawn afresh each run.

    `masks` maps each mask to (numpy dtype, shape, drop ratio); an element is 1 / (1 - ratio) where its
    uniform draw is at least the ratio, else 0 (the host's scaled masks). Each mask's RandomUniform takes one
    seed from `generator`, here.
    """
    nodes, outputs, constants = [], [], []
    for index, (name, (dtype, shape, ratio)) in enumerate(masks.items()):
        element = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        draw, kept, ones = f"draw_{index}", f"kept_{index}", f"ones_{index}"
        nodes += [
            helper.make_node("RandomUniform", [], [draw], dtype=onnx.TensorProto.FLOAT, shape=list(shape),
                             low=0.0, high=1.0, seed=float(generator.integers(1, _SEED_LIMIT))),
            helper.make_node("GreaterOrEqual", [draw, f"ratio_{index}"], [kept]),
            helper.make_node("Cast", [kept], [ones], to=element),
            helper.make_node("Mul", [ones, f"scale_{index}"], [name]),
        ]
        constants += [numpy_helper.from_array(np.array(ratio, np.float32), f"ratio_{index}"),
                      numpy_helper.from_array(np.array(1.0 / (1.0 - ratio), dtype), f"scale_{index}")]
        outputs.append(helper.make_tensor_value_info(name, element, list(shape)))
    graph = helper.make_graph(nodes, "dropout_masks", [], outputs, constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)])
    model.ir_version = _IR_VERSION
    return model


class DeviceMasks:
    """A session that draws every Dropout mask of one step on the placement's GPU (`masks_graph`).

    `masks` maps each mask input to (numpy dtype, shape at the engine's batch size, drop ratio below 1);
    `generator` seeds the draws (one seed a mask, taken once here).
    """

    def __init__(self, masks: Mapping[str, tuple[np.dtype, tuple[int, ...], float]], where: Placement,
                 generator: np.random.Generator) -> None:
        if where.cuda_index is None:
            raise ValueError(f"DeviceMasks draws on a GPU; the placement is {where.device!r}")
        self.names = list(masks)
        self._device_id = where.cuda_index
        self._session = open_session(masks_graph(masks, generator), where, threads=(None, None),
                                     source="the Dropout masks' graph")

    def draw(self) -> dict[str, ort.OrtValue]:
        """This step's masks, in the GPU's memory: name -> OrtValue."""
        binding = self._session.io_binding()
        for name in self.names:
            binding.bind_output(name, "cuda", self._device_id)
        self._session.run_with_iobinding(binding)
        return dict(zip(self.names, binding.get_outputs()))
