"""The engine's gradients against torch autograd on architectures its rewrites were never tuned on.

Each model below (28) is a small torch module built around the edge cases of the engine's matchers and export paths:
normalizations over one group or one channel a group, activations after them, transposed convolutions with output
padding, groups and dilation, ceil-mode and dilated pools, recurrent layers of several kinds, views and flips as
torch's dynamo exporter writes them, a segmentation map's per-pixel loss, masks and tied weights. Each is
exported (torch.onnx's legacy exporter with the documented recipe, its dynamo exporter with optimize=False, or
both), built into a GradientEngine, and one step is compared with torch's on the same weights and batch.

JSON lines (ps_bench.harness.emit), one per model and exporter: ``grad_sweep_error_NAME``, in millionths, the
largest over the parameters of ||engine - exact|| / max(||exact||, 1e-2 x the largest parameter's ||exact||),
`exact` being torch's gradient in float64 -- each gradient against its own scale, one that is zero in exact
arithmetic (a bias before a BatchNorm or an InstanceNorm, which the normalization cancels) against a hundredth
of the largest --, with the parameter it was found on, torch's own float32 error there, the loss on both sides,
what the engine trains that is not a torch parameter (a buffer the legacy exporter wrote as a weight:
docs/models.md), and ``status``: "ok", "differs" (some parameter's error is above both ``--tolerance`` and ten
times torch's own float32 error, or a parameter got no gradient), "refused" (the engine raised, the message kept)
or "export_failed" (torch could not export the module: not the engine's). A summary goes to stderr; the exit
status is 1 when a model differs or is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as exc:  # torch is a benchmark-only dependency
    raise SystemExit("ps_bench.grad_sweep compares against torch, which is not installed here; run it in an "
                     "environment that has torch and the project (docs/benchmarks.md, the torch environment)") from exc

from ps_bench import harness
from worker_client import GradientEngine

#: The largest error (module docstring) that passes: float32 rounding over a few layers stays near 1e-6.
TOLERANCE = 1e-4
#: The unit of the errors in the records: millionths of the gradient's scale (module docstring).
PPM = "ppm of the gradient's scale"
#: Examples in each model's batch.
BATCH = 8
#: The floor of a gradient's scale, relative to the largest gradient's norm (module docstring): a gradient that is
#: zero in exact arithmetic comes out of both sides as float32 rounding, some 1e-5 of the largest.
ZERO_FLOOR = 1e-2


def images(channels: int, height: int, width: int | None = None) -> Callable[[int, torch.Generator], torch.Tensor]:
    return lambda batch, generator: torch.randn(batch, channels, height, width or height, generator=generator)


def sequences(channels: int, length: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    return lambda batch, generator: torch.randn(batch, channels, length, generator=generator)


def tokens(vocabulary: int, length: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    return lambda batch, generator: torch.randint(1, vocabulary, (batch, length), generator=generator)


def pooled(channels: int, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))


class _Recurrent(nn.Module):
    def __init__(self, kind: type, **options) -> None:
        super().__init__()
        self.embed = nn.Embedding(500, 32)
        self.rnn = kind(32, 48, batch_first=True, **options)
        self.out = nn.Linear(48 * (2 if options.get("bidirectional") else 1), 7)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        states, _ = self.rnn(self.embed(ids))
        return self.out(states[:, -1] + states.mean(1))


class _Inception(nn.Module):   # asymmetric kernels, unequal strides, "same" padding, grouped and stride-2 kernels
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 16, (1, 7), padding=(0, 3)), nn.Conv2d(16, 16, (7, 1), padding=(3, 0))
        self.c, self.d = nn.Conv2d(16, 32, 3, stride=(2, 1), padding=1), nn.Conv2d(32, 64, 3, padding="same", groups=32)
        self.e, self.norm, self.head = nn.Conv2d(64, 64, 2, stride=2), nn.BatchNorm2d(64), pooled(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.c(F.relu(self.b(F.relu(self.a(x))))))
        return self.head(self.norm(self.e(F.relu(self.d(x)))))


class _Tied(nn.Module):   # one Linear used twice, a scalar parameter, the output projection tied to the embedding
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.linear = nn.Embedding(300, 64), nn.Linear(64, 64)
        self.norm, self.scale = nn.LayerNorm(64, elementwise_affine=False), nn.Parameter(torch.tensor(0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.scale * torch.tanh(self.linear(self.linear(h)))
        return self.norm(h).mean(1) @ self.embed.weight.t()


class _Resize(nn.Module):   # bilinear with aligned corners, nearest by 3, pixel unshuffle and shuffle, a channel slice
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)
        self.c = nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(F.relu(self.a(x)), scale_factor=0.5, mode="bilinear", align_corners=True)
        x = F.pixel_shuffle(F.pixel_unshuffle(F.interpolate(F.relu(self.b(x)), scale_factor=3), 2), 2)
        return self.c(x[:, :4])


class _Encoder(nn.Module):
    def __init__(self, **options) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(400, 64), nn.Parameter(torch.randn(16, 64) * 0.1)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True, **options)
        self.encoder, self.out = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(64, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.encoder(self.embed(ids) + self.position).mean(1))


class _Causal(nn.Module):   # scaled_dot_product_attention with is_causal
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.qkv, self.out = nn.Embedding(400, 64), nn.Linear(64, 192), nn.Linear(64, 400)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, 16).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        return self.out(attended[:, -1] + x.mean(1))


class _Windows(nn.Module):   # a Swin-style shifted window: roll, window partition, attention inside each window
    def __init__(self) -> None:
        super().__init__()
        self.patch, self.norm = nn.Conv2d(3, 32, 4, 4), nn.LayerNorm(32)
        self.qkv, self.proj, self.head = nn.Linear(32, 96), nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.roll(self.patch(x).permute(0, 2, 3, 1), shifts=(2, 2), dims=(1, 2))
        b, h, w, c = x.shape
        windows = x.view(b, 2, 4, 2, 4, c).permute(0, 1, 3, 2, 4, 5).reshape(b * 4, 16, c)
        q, k, v = self.qkv(self.norm(windows)).chunk(3, -1)
        windows = windows + self.proj(torch.softmax(q @ k.transpose(1, 2) / math.sqrt(c), -1) @ v)
        return self.head(windows.view(b, 64, c).mean(1))


class _Gated(nn.Module):   # GLU, reflect and replicate padding, repeat
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 16, 3, padding=1, padding_mode="reflect")
        self.b = nn.Conv2d(16, 16, 3, padding=1, padding_mode="replicate")
        self.c = nn.Conv2d(16, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = F.glu(torch.cat([F.relu(self.b(F.relu(self.a(x)))), self.a(x)], 1), 1)
        return self.c(gated.repeat(1, 2, 1, 1)[:, :16])


class _Arithmetic(nn.Module):   # normalize, einsum, cumsum, flip, clamp, abs, sqrt, max, log1p
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.out, self.scale = nn.Linear(16, 16), nn.Linear(32, 8), nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)[:, :16]
        h = F.normalize(self.linear(x), dim=-1) * self.scale
        e = torch.einsum("bi,bj->bij", h, x).sum(-1)
        m = torch.cumsum(e, -1).flip(-1) + torch.clamp(h, -0.5, 0.5) + h.abs().sqrt() * torch.exp(-h.pow(2))
        return self.out(torch.cat([m - m.max(dim=-1, keepdim=True).values, torch.log1p(h.exp())], -1))


class _Segmenter(nn.Module):   # a label per pixel
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.relu(self.a(x)))


class _Squeezed(nn.Module):   # squeeze-excitation, a LayerNorm over C, H, W, a Where, an adaptive pool, BatchNorm1d
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.squeeze, self.excite = nn.Linear(16, 4), nn.Linear(4, 16)
        self.conv2, self.layer_norm = nn.Conv2d(16, 16, 3, padding=1), nn.LayerNorm([16, 12, 12])
        self.fc, self.fc_norm, self.out = nn.Linear(16 * 9, 32), nn.BatchNorm1d(32), nn.Linear(32, 10)
        self.temperature = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu6(self.norm(self.conv(x)))
        h = h + h * torch.sigmoid(self.excite(F.relu(self.squeeze(h.mean([2, 3])))))[:, :, None, None]
        c = self.conv2(h)
        h = F.adaptive_avg_pool2d(self.layer_norm(torch.where(c > 0, c, 0.1 * c)).clamp(min=0), 3)
        return self.out(F.relu(self.fc_norm(self.fc(h.view(h.size(0), -1))))) / self.temperature


class _Buffered(nn.Module):   # a sinusoidal position table and a causal mask, registered buffers
    def __init__(self, length: int = 12, width: int = 32) -> None:
        super().__init__()
        self.embed, self.qkv, self.out = nn.Embedding(300, width), nn.Linear(width, 3 * width), nn.Linear(width, 5)
        angles = torch.arange(length)[:, None] / 10000 ** (torch.arange(0, width, 2) / width)
        self.register_buffer("table", torch.cat([angles.sin(), angles.cos()], -1))
        self.register_buffer("mask", torch.triu(torch.full((length, length), float("-inf")), 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.table
        q, k, v = self.qkv(x).chunk(3, -1)
        attended = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(x.shape[-1]) + self.mask, -1) @ v
        return self.out(attended.mean(1))


class _Indexing(nn.Module):   # gather, index_select, topk, sort, prod, a 2-norm, max, a LayerNorm without bias
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm, self.out = nn.Linear(24, 24), nn.LayerNorm(24, bias=False), nn.Linear(12, 5)
        self.register_buffer("picks", torch.randint(0, 24, (1, 12), generator=torch.Generator().manual_seed(2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.linear(x.flatten(1)[:, :24]))
        pairs = h.view(-1, 12, 2)
        picked = h.gather(1, self.picks.expand(h.shape[0], 12)) + torch.index_select(h, 1, self.picks[0])
        ranked = torch.topk(h, 12, dim=1).values + torch.sort(h, 1).values[:, :12]
        reduced = torch.prod(torch.sigmoid(pairs), -1) + torch.norm(pairs, dim=-1) + torch.max(pairs, -1).values
        mixed = picked + ranked + reduced
        return self.out(mixed * torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + 1e-6))   # an RMSNorm


class _MaskedAttention(nn.Module):   # attention with a float mask, a channel shuffle over the result as an image
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.qkv, self.out = nn.Embedding(100, 16), nn.Linear(16, 48), nn.Linear(16, 3)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.register_buffer("mask", torch.cat([torch.zeros(8, 6), torch.full((8, 2), -1e4)], 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask).transpose(1, 2).reshape(b, t, d)
        image = self.conv(attended.view(b, 4, 4, t))
        shuffled = image.view(b, 2, 2, 4, t).transpose(1, 2).reshape(b, 4, 4, t)
        return self.out(shuffled.flatten(2).mean(-1)[:, :1] * attended.mean(1))


class _Cells(nn.Module):   # LSTMCell and GRUCell unrolled in Python, a weight-normed Linear
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.gru, self.out = nn.LSTMCell(8, 16), nn.GRUCell(16, 16), nn.Linear(16, 4)
        self.normed = nn.utils.parametrizations.weight_norm(nn.Linear(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = g = x.new_zeros(x.shape[0], 16)
        for t in range(x.shape[2]):
            h, c = self.lstm(x[:, :, t], (h, c))
            g = self.gru(h, g)
        return self.out(torch.tanh(self.normed(g)) + torch.cumsum(h, 1))


#: name -> (module factory, batch drawer, loss). "cross_entropy" draws a class per example -- or per position
#: when the output has more axes than (batch, classes) --, "mse" targets of the output's shape.
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, torch.Generator], torch.Tensor], str]] = {
    "group_norm_edges": (lambda: nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(1, 16), nn.SiLU(), nn.Conv2d(16, 16, 3, padding=1),
        nn.GroupNorm(16, 16), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32, affine=False),
        nn.GELU(), nn.Conv2d(32, 32, 3, padding=1), nn.InstanceNorm2d(32, affine=True), nn.SiLU(), pooled(32)),
        images(3, 15), "cross_entropy"),
    "group_norm_1d": (lambda: nn.Sequential(
        nn.Conv1d(8, 32, 5, padding=2), nn.GroupNorm(4, 32), nn.SiLU(), nn.Conv1d(32, 32, 3, padding=1),
        nn.InstanceNorm1d(32, affine=True), nn.Mish(), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(32, 5)),
        sequences(8, 50), "cross_entropy"),
    "transposed_edges": (lambda: nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.ConvTranspose2d(16, 16, 3, 2, 1, output_padding=1), nn.ReLU(),
        nn.ConvTranspose2d(16, 8, 4, 2, 1, groups=2, bias=False), nn.ReLU(),
        nn.ConvTranspose2d(8, 8, 3, 1, 2, dilation=2), nn.Tanh(), nn.ConvTranspose2d(8, 3, 2, 2)),
        images(3, 12), "mse"),
    "unflattened_generator": (lambda: nn.Sequential(
        nn.Flatten(), nn.Unflatten(1, (3, 8, 8)), nn.ConvTranspose2d(3, 64, 4, 1, 0), nn.BatchNorm2d(64), nn.ReLU(),
        nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.ConvTranspose2d(32, 3, 3, 2, 1, output_padding=1), nn.Sigmoid()), images(3, 8), "mse"),
    "transposed_1d": (lambda: nn.Sequential(
        nn.Conv1d(4, 16, 4, 2, 1), nn.ELU(), nn.ConvTranspose1d(16, 8, 4, 2, 1), nn.ELU(0.5),
        nn.ConvTranspose1d(8, 4, 5, 3, 1, output_padding=2)), sequences(4, 30), "mse"),
    "pool_edges": (lambda: nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, ceil_mode=True), nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(), nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False), nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(), nn.MaxPool2d(2, 1, dilation=2), nn.AdaptiveMaxPool2d(2), nn.Flatten(), nn.Linear(128, 10)),
        images(3, 21), "cross_entropy"),
    "activations": (lambda: nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.Hardswish(), nn.Conv2d(16, 16, 3, padding=1), nn.Hardsigmoid(),
        nn.Conv2d(16, 16, 3, padding=1), nn.SELU(), nn.Conv2d(16, 16, 3, padding=1), nn.CELU(0.7),
        nn.Conv2d(16, 16, 3, padding=1), nn.PReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.Softsign(),
        nn.Conv2d(16, 16, 3, padding=1), nn.LogSigmoid(), nn.Conv2d(16, 16, 1), nn.Softplus(beta=2.0),
        nn.Conv2d(16, 16, 1), nn.GELU(approximate="tanh"), nn.Conv2d(16, 16, 1), nn.ReLU6(), pooled(16)),
        images(3, 16), "cross_entropy"),
    "lstm_3_layers": (lambda: _Recurrent(nn.LSTM, num_layers=3), tokens(500, 20), "cross_entropy"),
    "gru_bidirectional_2": (lambda: _Recurrent(nn.GRU, num_layers=2, bidirectional=True), tokens(500, 20),
                            "cross_entropy"),
    "rnn_relu": (lambda: _Recurrent(nn.RNN, nonlinearity="relu"), tokens(500, 20), "cross_entropy"),
    "lstm_without_bias": (lambda: _Recurrent(nn.LSTM, bias=False, bidirectional=True), tokens(500, 20),
                          "cross_entropy"),
    "inception": (_Inception, images(3, 24, 20), "cross_entropy"),
    "tied": (_Tied, tokens(300, 12), "cross_entropy"),
    "resize": (_Resize, images(3, 16), "mse"),
    "encoder_post_gelu": (lambda: _Encoder(activation="gelu"), tokens(400, 16), "cross_entropy"),
    "encoder_pre_norm": (lambda: _Encoder(norm_first=True), tokens(400, 16), "cross_entropy"),
    "causal_attention": (_Causal, tokens(400, 16), "cross_entropy"),
    "shifted_windows": (_Windows, images(3, 32), "cross_entropy"),
    "gated_padding_modes": (_Gated, images(3, 12), "mse"),
    "arithmetic": (_Arithmetic, images(3, 4), "mse"),
    "depthwise_multiplier": (lambda: nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1, groups=8), nn.BatchNorm2d(16), nn.ReLU6(),
        nn.Conv2d(16, 48, 5, stride=2, padding=2, groups=16), nn.BatchNorm2d(48), nn.ReLU(),
        nn.Conv2d(48, 48, 3, padding=2, dilation=2, groups=48), nn.Hardswish(), pooled(48)),
        images(3, 20), "cross_entropy"),
    "conv3d_edges": (lambda: nn.Sequential(
        nn.Conv3d(2, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(), nn.Conv3d(8, 8, (1, 3, 3), padding=(0, 1, 1),
                                                                              groups=2),
        nn.ReLU(), nn.MaxPool3d((1, 2, 2)), nn.ConvTranspose3d(8, 4, (1, 2, 2), stride=(1, 2, 2)), nn.ReLU(),
        nn.AvgPool3d(2), nn.Flatten(), nn.Linear(4 * 2 * 4 * 4, 3)),
        lambda batch, generator: torch.randn(batch, 2, 4, 8, 8, generator=generator), "cross_entropy"),
    "segmentation": (_Segmenter, images(3, 8), "cross_entropy"),
    "squeeze_excitation": (_Squeezed, images(3, 12), "cross_entropy"),
    "unrolled_cells": (_Cells, sequences(8, 6), "cross_entropy"),
    "buffers": (_Buffered, tokens(300, 12), "cross_entropy"),
    "indexing": (_Indexing, images(3, 4), "cross_entropy"),
    "masked_attention": (_MaskedAttention, tokens(100, 8), "cross_entropy"),
}
EXPORTERS = ("legacy", "dynamo")


def export(module: nn.Module, example: torch.Tensor, path: Path, exporter: str) -> None:
    """The documented recipes (docs/models.md): the legacy exporter in training mode without constant folding, or
    the dynamo exporter without its optimizer; the batch axis dynamic."""
    # the dynamo exporter reports its progress on stdout, which carries only the JSON lines here
    with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            torch.onnx.export(module, (example,), str(path), dynamo=False, opset_version=18,
                              training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                              input_names=["x"], output_names=["y"],
                              dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
        else:
            # the dynamic batch by position: a name must be forward()'s argument's (nn.Sequential's is `input`)
            torch.onnx.export(module, (example,), str(path), dynamo=True, optimize=False, input_names=["x"],
                              output_names=["y"], dynamic_shapes=({0: torch.export.Dim("batch")},))


def errors(engine: dict[str, np.ndarray], torch32: dict[str, np.ndarray], exact: dict[str, np.ndarray]
           ) -> dict[str, tuple[float, float]]:
    """Per parameter both sides have: (the engine's error, torch's own float32 error), each ||g - exact|| over
    max(||exact||, ZERO_FLOOR x the largest ||exact||), `exact` being torch's gradient in float64."""
    norms = {name: float(np.linalg.norm(value)) for name, value in exact.items()}
    floor = ZERO_FLOOR * max(norms.values(), default=0.0)
    found = {}
    for name, expected in exact.items():
        if name in engine and name in torch32:
            scale = max(norms[name], floor, 1e-300)
            found[name] = (float(np.linalg.norm(engine[name].astype(np.float64) - expected)) / scale,
                           float(np.linalg.norm(torch32[name].astype(np.float64) - expected)) / scale)
    return found


def _torch_step(build: Callable[[], nn.Module], example: torch.Tensor, labels: torch.Tensor, loss: str,
                dtype: torch.dtype) -> tuple[float, dict[str, np.ndarray]]:
    """torch's loss and gradients on a fresh module (the seeded weights) in `dtype`."""
    torch.manual_seed(0)
    module = build().train().to(dtype)
    x = example.to(dtype) if example.is_floating_point() else example
    target = labels.to(dtype) if labels.is_floating_point() else labels
    value = (F.cross_entropy if loss == "cross_entropy" else F.mse_loss)(module(x), target)
    value.backward()
    return float(value), {n: p.grad.numpy().astype(np.float64) for n, p in module.named_parameters()
                          if p.grad is not None}


def sweep_one(name: str, exporter: str, folder: Path, tolerance: float) -> dict[str, object]:
    build, draw, loss = MODELS[name]
    torch.manual_seed(0)
    module = build().train()
    generator = torch.Generator().manual_seed(1)
    example = draw(BATCH, generator)
    with torch.no_grad():
        out = module(example)
    if loss == "mse":
        labels = torch.randn(out.shape, generator=generator)
    else:
        labels = torch.randint(0, out.shape[1], (out.shape[0], *out.shape[2:]), generator=generator)
    path = folder / f"{name}.{exporter}.onnx"
    fields: dict[str, object] = {"exporter": exporter, "batch": BATCH}
    try:
        export(module, example, path, exporter)
    except Exception as exc:  # noqa: BLE001 -- torch's exporters raise many kinds; the record keeps the message
        cause = exc.__cause__ or exc   # torch.onnx wraps torch.export's error in a generic one
        return harness.emit("onnx-ps", f"grad_sweep_error_{name}", 0.0, float("nan"), PPM, **fields,
                            status="export_failed", message=f"{type(cause).__name__}: {str(cause)[:300]}")
    size_mb = round(sum(p.numel() * 4 for p in module.parameters()) / 1e6, 4)
    try:
        engine = GradientEngine(path, batch_size=BATCH, loss=loss, intra_op_threads=1, cache_dir=folder / "cache")
        result = engine.step({**engine.parameters(), **engine.state()},
                             {"x": example.numpy(), "labels": labels.numpy()})
    except Exception as exc:  # noqa: BLE001 -- a refusal or a failure of the engine: the record says which
        return harness.emit("onnx-ps", f"grad_sweep_error_{name}", size_mb, float("nan"), PPM, **fields,
                            status="refused", message=f"{type(exc).__name__}: {str(exc)[:300]}")
    torch_loss, torch32 = _torch_step(build, example, labels, loss, torch.float32)
    _, exact = _torch_step(build, example, labels, loss, torch.float64)
    found = errors(result.gradients, torch32, exact)
    where = max(found, key=lambda n: found[n][0], default="")
    error, torch_error = found.get(where, (0.0, 0.0))
    # beyond the tolerance and ten times torch's own float32 error on some parameter
    differs = [n for n, (ours, theirs) in found.items() if ours > max(tolerance, 10 * theirs)]
    missing = sorted(set(exact) - set(result.gradients))
    # what the engine trains that torch does not: a buffer the legacy exporter wrote as a weight (docs/models.md)
    extra = sorted(set(result.gradients) - set(exact))
    return harness.emit("onnx-ps", f"grad_sweep_error_{name}", size_mb, error * 1e6, PPM, **fields,
                        status="differs" if differs or missing else "ok", parameter=where,
                        torch_float32_error=round(torch_error * 1e6, 4), differing=differs[:5],
                        loss=round(float(result.loss), 6), torch_loss=round(torch_loss, 6), missing=missing[:5],
                        not_torch_parameters=extra[:5])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ps_bench.grad_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="models [all]")
    parser.add_argument("--exporters", nargs="+", choices=EXPORTERS, default=list(EXPORTERS),
                        help="torch.onnx exporters to run each model through [legacy dynamo]")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help=f"the largest error that passes [{TOLERANCE:g}]")
    parser.add_argument("--export-dir", type=Path, default=None,
                        help="where the exports and the engine's cache go [a fresh temporary folder]")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    folder = args.export_dir or Path(tempfile.mkdtemp(prefix="grad-sweep-"))
    folder.mkdir(parents=True, exist_ok=True)
    harness.log(f"grad_sweep: {len(args.models)} models x {len(args.exporters)} exporters into {folder}, "
                f"{harness.machine()}")
    records = [sweep_one(name, exporter, folder, args.tolerance) for exporter in args.exporters
               for name in args.models]
    by_status: dict[str, list[str]] = {}
    for record in records:
        by_status.setdefault(str(record["status"]), []).append(f"{record['metric'][len('grad_sweep_error_'):]}"
                                                              f"/{record['exporter']}")
    for status, names in sorted(by_status.items()):
        harness.log(f"grad_sweep: {status}: {len(names)}" + ("" if status == "ok" else f" ({', '.join(names)})"))
    return 1 if {"differs", "refused"} & set(by_status) else 0


if __name__ == "__main__":
    sys.exit(main())
