"""ONNX builders for the bundled models, written with onnx.helper and seeded numpy weights."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "BATCH_DIM",
    "BUILDERS",
    "IR_VERSION",
    "OPSET",
    "build_embedding_model",
    "build_lenet",
    "build_mlp",
    "build_tiny_transformer",
    "input_name_of",
    "write_model",
]

#: Opset of every bundled model: 18 has LayerNormalization, ScatterND(reduction="add") (which
#: onnx-ad needs to differentiate Gather and MaxPool) and ReduceMean with `axes` as an input.
OPSET = 18
#: IR version written into every model; onnxruntime refuses files newer than it knows.
IR_VERSION = 9
#: Name of the symbolic leading dimension of every input and output.
BATCH_DIM = "batch"
#: Producer recorded in every model.
PRODUCER = "onnx-ps.models"


class _Graph:
    """Collects nodes, trainable initializers and frozen constants for one model.

    Convention the gradient engine relies on: every float initializer is a trainable
    parameter, and every fixed number (scales, shapes, axes) is a Constant node instead,
    so lifting initializers to inputs never turns a constant into a parameter.
    """

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set()
        self._counter = 0

    def _fresh(self, stem: str) -> str:
        self._counter += 1
        name = f"{stem}_{self._counter}"
        self._names.add(name)
        return name

    def param(self, name: str, value: np.ndarray) -> str:
        """Add a float32 trainable initializer called `name` and return its name."""
        if name in self._names:
            raise ValueError(f"parameter name {name!r} is used twice")
        self._names.add(name)
        self.initializers.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def const(self, value: float | Sequence[int] | np.ndarray, *, dtype: np.dtype | type,
              stem: str = "const") -> str:
        """Add a Constant node holding `value` (not trainable) and return its output name."""
        array = np.asarray(value, dtype=dtype)
        out = self._fresh(stem)
        self.nodes.append(helper.make_node(
            "Constant", [], [out], name=f"{out}_node",
            value=numpy_helper.from_array(array, f"{out}_value")))
        return out

    def op(self, op_type: str, inputs: Sequence[str], *, out: str | None = None,
           stem: str | None = None, **attrs: object) -> str:
        """Append one node and return the name of its (single) output."""
        if out is None:
            out = self._fresh(stem or op_type.lower())
        else:
            self._names.add(out)
        self.nodes.append(helper.make_node(op_type, list(inputs), [out],
                                           name=f"{out}_node", **attrs))
        return out

    # -- layers ---------------------------------------------------------------------------

    def dense(self, x: str, prefix: str, fan_in: int, fan_out: int, *, init: str,
              out: str | None = None) -> str:
        """x @ W + b with W of shape (fan_in, fan_out); `init` is "he" or "glorot"."""
        weight = self.param(f"{prefix}.weight", self.weights((fan_in, fan_out), fan_in,
                                                             fan_out, init=init))
        bias = self.param(f"{prefix}.bias", np.zeros(fan_out, np.float32))
        return self.op("Gemm", [x, weight, bias], out=out, stem=prefix)

    def projection(self, x: str, prefix: str, fan_in: int, fan_out: int, *, init: str) -> str:
        """MatMul + Add on a tensor of any rank (Gemm only takes matrices)."""
        weight = self.param(f"{prefix}.weight", self.weights((fan_in, fan_out), fan_in,
                                                             fan_out, init=init))
        bias = self.param(f"{prefix}.bias", np.zeros(fan_out, np.float32))
        return self.op("Add", [self.op("MatMul", [x, weight], stem=prefix), bias],
                       stem=f"{prefix}_biased")

    def weights(self, shape: tuple[int, ...], fan_in: int, fan_out: int, *,
                init: str) -> np.ndarray:
        """He-normal (for layers followed by Relu/GELU) or Glorot-uniform weights."""
        if init == "he":
            return self.rng.normal(0.0, math.sqrt(2.0 / fan_in), size=shape).astype(np.float32)
        if init == "glorot":
            limit = math.sqrt(6.0 / (fan_in + fan_out))
            return self.rng.uniform(-limit, limit, size=shape).astype(np.float32)
        raise ValueError(f"unknown init {init!r}; expected 'he' or 'glorot'")

    def layer_norm(self, x: str, prefix: str, dim: int) -> str:
        scale = self.param(f"{prefix}.weight", np.ones(dim, np.float32))
        bias = self.param(f"{prefix}.bias", np.zeros(dim, np.float32))
        return self.op("LayerNormalization", [x, scale, bias], stem=prefix, axis=-1,
                       epsilon=1e-5)

    def gelu(self, x: str) -> str:
        """Exact GELU, 0.5 * x * (1 + erf(x / sqrt(2))); the Gelu op needs opset 20."""
        scaled = self.op("Div", [x, self.const(math.sqrt(2.0), dtype=np.float32)])
        erf = self.op("Erf", [scaled])
        one_plus = self.op("Add", [erf, self.const(1.0, dtype=np.float32)])
        half_x = self.op("Mul", [x, self.const(0.5, dtype=np.float32)])
        return self.op("Mul", [half_x, one_plus], stem="gelu")

    # -- assembly -------------------------------------------------------------------------

    def model(self, *, name: str, inputs: Sequence[onnx.ValueInfoProto],
              logits: str, num_classes: int, doc: str,
              metadata: dict[str, object]) -> onnx.ModelProto:
        output = helper.make_tensor_value_info(logits, TensorProto.FLOAT,
                                               [BATCH_DIM, num_classes])
        graph = helper.make_graph(self.nodes, name, list(inputs), [output],
                                  initializer=self.initializers, doc_string=doc)
        model = helper.make_model(graph, producer_name=PRODUCER, producer_version="1",
                                  opset_imports=[helper.make_opsetid("", OPSET)],
                                  doc_string=doc)
        model.ir_version = IR_VERSION
        helper.set_model_props(model, {key: json.dumps(value) if not isinstance(value, str)
                                       else value for key, value in metadata.items()})
        onnx.checker.check_model(model, full_check=True)
        return model


def _positive(**values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")


def build_mlp(input_dim: int = 64, hidden: Sequence[int] = (128, 64), num_classes: int = 10,
              *, seed: int = 0) -> onnx.ModelProto:
    """A multilayer perceptron: (Gemm + Relu) per hidden size, then a Gemm to the logits.

    Input "x" is float32 (batch, input_dim); output "logits" is (batch, num_classes).
    Parameters are `fc1.weight`, `fc1.bias`, ... with weights shaped (fan_in, fan_out);
    hidden layers are He-initialized, the output layer Glorot, biases zero.
    """
    hidden = tuple(int(h) for h in hidden)
    _positive(input_dim=input_dim, num_classes=num_classes)
    for index, size in enumerate(hidden):
        _positive(**{f"hidden[{index}]": size})
    g = _Graph(seed)
    h, width = "x", input_dim
    for index, size in enumerate(hidden, start=1):
        h = g.op("Relu", [g.dense(h, f"fc{index}", width, size, init="he")], stem=f"relu{index}")
        width = size
    logits = g.dense(h, f"fc{len(hidden) + 1}", width, num_classes, init="glorot",
                     out="logits")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH_DIM, input_dim])
    return g.model(name="mlp", inputs=[x], logits=logits, num_classes=num_classes,
                   doc=f"MLP {input_dim}-{'-'.join(map(str, hidden))}-{num_classes}",
                   metadata={"model": "mlp", "seed": seed, "input_dim": input_dim,
                             "hidden": list(hidden), "num_classes": num_classes})


def build_deep_mlp(input_dim: int = 64, width: int = 128, depth: int = 6, num_classes: int = 10,
                   *, seed: int = 0) -> onnx.ModelProto:
    """`build_mlp` with `depth` hidden layers of `width` units: the model pipeline stages are
    shown and measured on (many layers of one size cut anywhere into balanced stages).
    Parameters and input are as build_mlp's; the metadata says model "deep_mlp"."""
    _positive(width=width, depth=depth)
    model = build_mlp(input_dim, (width,) * depth, num_classes, seed=seed)
    model.graph.name = "deep_mlp"
    for prop in model.metadata_props:
        if prop.key == "model":
            prop.value = "deep_mlp"
    model.metadata_props.add(key="depth", value=str(depth))
    return model


def build_lenet(input_shape: Sequence[int] = (1, 8, 8), num_classes: int = 10, *,
                channels: Sequence[int] = (8, 16), fc_hidden: int = 64,
                seed: int = 0) -> onnx.ModelProto:
    """A LeNet-style CNN sized for small images such as the 8x8 digits.

    Two blocks of Conv(3x3, same padding) + Relu + MaxPool(2x2, stride 2), then Flatten,
    Gemm + Relu to `fc_hidden`, and a Gemm to the logits. Input "x" is float32
    (batch, C, H, W) with H and W at least 4; output "logits" is (batch, num_classes).
    """
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 3:
        raise ValueError(f"input_shape must be (channels, height, width), got {input_shape!r}")
    in_channels, height, width = shape
    _positive(channels_in=in_channels, height=height, width=width, num_classes=num_classes,
              fc_hidden=fc_hidden)
    if height < 4 or width < 4:
        raise ValueError(f"input_shape {shape} is too small: two 2x2 poolings need height "
                         f"and width of at least 4")
    channels = tuple(int(c) for c in channels)
    if len(channels) != 2:
        raise ValueError(f"channels must name the two conv widths, got {channels!r}")
    _positive(conv1_channels=channels[0], conv2_channels=channels[1])
    g = _Graph(seed)
    h, c_in = "x", in_channels
    for index, c_out in enumerate(channels, start=1):
        fan_in, fan_out = c_in * 9, c_out * 9
        weight = g.param(f"conv{index}.weight",
                         g.weights((c_out, c_in, 3, 3), fan_in, fan_out, init="he"))
        bias = g.param(f"conv{index}.bias", np.zeros(c_out, np.float32))
        h = g.op("Conv", [h, weight, bias], stem=f"conv{index}", kernel_shape=[3, 3],
                 pads=[1, 1, 1, 1], strides=[1, 1])
        h = g.op("Relu", [h], stem=f"conv{index}_relu")
        h = g.op("MaxPool", [h], stem=f"pool{index}", kernel_shape=[2, 2], strides=[2, 2])
        c_in = c_out
    flat_size = c_in * (height // 4) * (width // 4)
    h = g.op("Flatten", [h], stem="flatten", axis=1)
    h = g.op("Relu", [g.dense(h, "fc1", flat_size, fc_hidden, init="he")], stem="fc1_relu")
    logits = g.dense(h, "fc2", fc_hidden, num_classes, init="glorot", out="logits")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH_DIM, *shape])
    return g.model(name="lenet", inputs=[x], logits=logits, num_classes=num_classes,
                   doc=f"LeNet-style CNN for {shape} inputs, {num_classes} classes",
                   metadata={"model": "lenet", "seed": seed, "input_shape": list(shape),
                             "num_classes": num_classes, "channels": list(channels),
                             "fc_hidden": fc_hidden})


def build_embedding_model(vocab_size: int = 1000, dim: int = 16, bag_size: int = 8,
                          num_classes: int = 2, *, seed: int = 0) -> onnx.ModelProto:
    """A bag-of-ids classifier: Gather rows of an embedding table, average them, Gemm.

    Input "ids" is int64 (batch, bag_size) with values in [0, vocab_size); output
    "logits" is (batch, num_classes). The table `embedding.weight` (vocab_size, dim) is
    the sparse parameter (only the gathered rows get a nonzero gradient); it starts as
    N(0, 1/dim) so each row has unit expected norm.
    """
    _positive(vocab_size=vocab_size, dim=dim, bag_size=bag_size, num_classes=num_classes)
    g = _Graph(seed)
    table = g.param("embedding.weight",
                    g.rng.normal(0.0, 1.0 / math.sqrt(dim), size=(vocab_size, dim)))
    rows = g.op("Gather", [table, "ids"], stem="embedded", axis=0)
    pooled = g.op("ReduceMean", [rows, g.const([1], dtype=np.int64, stem="bag_axis")],
                  stem="pooled", keepdims=0)
    logits = g.dense(pooled, "fc", dim, num_classes, init="glorot", out="logits")
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [BATCH_DIM, bag_size])
    return g.model(name="embedding", inputs=[ids], logits=logits, num_classes=num_classes,
                   doc=f"mean-of-embeddings classifier, vocab {vocab_size}, dim {dim}",
                   metadata={"model": "embedding", "seed": seed, "vocab_size": vocab_size,
                             "dim": dim, "bag_size": bag_size, "num_classes": num_classes})


def build_tiny_transformer(seq_len: int = 8, vocab: int = 1000, d_model: int = 32,
                           heads: int = 2, num_classes: int = 2, *, ff_dim: int | None = None,
                           seed: int = 0) -> onnx.ModelProto:
    """A one-block pre-norm transformer encoder classifier.

    Token embedding (Gather) + learned positional embedding, then
    h = x + Attention(LayerNorm(x)) and h = h + FFN(LayerNorm(h)) with an erf-based GELU,
    a final LayerNorm, a mean over the sequence, and a Gemm to the logits. Input "ids" is
    int64 (batch, seq_len); output "logits" is (batch, num_classes). `ff_dim` defaults
    to 2 * d_model.
    """
    ff = 2 * d_model if ff_dim is None else ff_dim
    _positive(seq_len=seq_len, vocab=vocab, d_model=d_model, heads=heads,
              num_classes=num_classes, ff_dim=ff)
    if d_model % heads:
        raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")
    head_dim = d_model // heads
    g = _Graph(seed)
    std = 1.0 / math.sqrt(d_model)
    tokens = g.param("tok_embedding.weight", g.rng.normal(0.0, std, size=(vocab, d_model)))
    positions = g.param("pos_embedding.weight", g.rng.normal(0.0, std, size=(seq_len, d_model)))
    x = g.op("Add", [g.op("Gather", [tokens, "ids"], stem="tok", axis=0), positions],
             stem="embedded")

    # self-attention: (b, s, d) -> heads (b, h, s, dh) -> scores (b, h, s, s)
    normed = g.layer_norm(x, "ln1", d_model)
    split = g.const([0, seq_len, heads, head_dim], dtype=np.int64, stem="split_heads")

    def heads_of(name: str) -> str:
        projected = g.projection(normed, f"attn.{name}", d_model, d_model, init="glorot")
        return g.op("Transpose", [g.op("Reshape", [projected, split], stem=f"{name}_split")],
                    stem=f"{name}_heads", perm=[0, 2, 1, 3])

    q, k, v = heads_of("q"), heads_of("k"), heads_of("v")
    k_t = g.op("Transpose", [k], stem="k_t", perm=[0, 1, 3, 2])
    scores = g.op("Mul", [g.op("MatMul", [q, k_t], stem="qk"),
                          g.const(1.0 / math.sqrt(head_dim), dtype=np.float32, stem="scale")],
                  stem="scores")
    weights = g.op("Softmax", [scores], stem="attention", axis=-1)
    context = g.op("Transpose", [g.op("MatMul", [weights, v], stem="context")],
                   stem="context_t", perm=[0, 2, 1, 3])
    merged = g.op("Reshape", [context, g.const([0, seq_len, d_model], dtype=np.int64,
                                               stem="merge_heads")], stem="merged")
    x = g.op("Add", [x, g.projection(merged, "attn.out", d_model, d_model, init="glorot")],
             stem="residual1")

    # feed-forward
    hidden = g.gelu(g.projection(g.layer_norm(x, "ln2", d_model), "ffn.fc1", d_model, ff,
                                 init="he"))
    x = g.op("Add", [x, g.projection(hidden, "ffn.fc2", ff, d_model, init="glorot")],
             stem="residual2")

    pooled = g.op("ReduceMean", [g.layer_norm(x, "ln_f", d_model),
                                 g.const([1], dtype=np.int64, stem="seq_axis")],
                  stem="pooled", keepdims=0)
    logits = g.dense(pooled, "head", d_model, num_classes, init="glorot", out="logits")
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [BATCH_DIM, seq_len])
    return g.model(name="transformer", inputs=[ids], logits=logits, num_classes=num_classes,
                   doc=f"1-block transformer, seq {seq_len}, d_model {d_model}, {heads} heads",
                   metadata={"model": "transformer", "seed": seed, "seq_len": seq_len,
                             "vocab": vocab, "d_model": d_model, "heads": heads,
                             "num_classes": num_classes, "ff_dim": ff})


#: The bundled models by name.
BUILDERS: dict[str, Callable[..., onnx.ModelProto]] = {
    "mlp": build_mlp,
    "deep_mlp": build_deep_mlp,
    "lenet": build_lenet,
    "embedding": build_embedding_model,
    "transformer": build_tiny_transformer,
}

_INPUT_NAMES = {"mlp": "x", "deep_mlp": "x", "lenet": "x", "embedding": "ids", "transformer": "ids"}


def input_name_of(name: str) -> str:
    """The graph input name of the bundled model `name` ("x" or "ids")."""
    if name not in _INPUT_NAMES:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(BUILDERS)}")
    return _INPUT_NAMES[name]


def write_model(name: str, path: str | Path, **kwargs: object) -> Path:
    """Build the bundled model `name` with `kwargs` and save it to `path` (parents created)."""
    if name not in BUILDERS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(BUILDERS)}")
    model = BUILDERS[name](**kwargs)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(target))
    return target
