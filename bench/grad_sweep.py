"""The engine's gradients against torch autograd on architectures its rewrites were never tuned on.

Each model below (57) is a small torch module built around the edge cases of the engine's matchers and export paths:
normalizations over one group or one channel a group, activations after them, transposed convolutions with output
padding, groups and dilation, ceil-mode and dilated pools, recurrent layers of several kinds, views and flips as
torch's dynamo exporter writes them, a segmentation map's per-pixel loss, masks and tied weights, BatchNorms
without running statistics, learned exponents and clipping levels, detach() (straight-through estimators),
spatial transformers, attention modules, routing by argmax and scatters, resampling, unpooling, bags, roots at
exactly zero, modules shared by two branches, buffers named like torch ops, padding indices, statistics, bilinear
and spectral layers, learned frequencies and temperatures, slice assignment, many-operand products, padding modes,
volumes, timestep conditioning, attention masks and weights, relative position biases. Each is exported
(torch.onnx's legacy exporter with the documented recipe, its dynamo exporter with optimize=False, or both), built
into a GradientEngine, and one step is compared with torch's on the same weights and batch.

JSON lines (ps_bench.harness.emit), one per model and exporter: ``grad_sweep_error_NAME``, in millionths, the
largest over the parameters of ||engine - exact|| / max(||exact||, 1e-2 x the largest parameter's ||exact||),
`exact` being torch's gradient in float64 -- each gradient against its own scale, one that is zero in exact
arithmetic (a bias before a BatchNorm or an InstanceNorm, which the normalization cancels) against a hundredth
of the largest --, with the parameter it was found on, torch's own float32 error there, the loss on both sides,
what the engine trains that is not a torch parameter (a buffer the legacy exporter wrote as a weight:
docs/models.md), and ``status``: "ok", "differs" (some parameter's error is above both ``--tolerance`` and ten
times torch's own float32 error, or is not finite, or a parameter got no gradient), "refused" (the engine raised,
the message kept), "export_failed" (torch could not export the module: not the engine's) or "known_limit" (it
differs or is refused where docs/models.md says it must: `KNOWN_LIMITS`, the reason kept). A summary goes to
stderr; the exit status is 1 when a model differs or is refused.
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


class _Normalizations(nn.Module):   # BatchNorms without affine or running statistics, a tracked InstanceNorm, LRN
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, affine=False)
        self.b, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8, track_running_stats=False)
        self.c, self.instance = nn.Conv2d(8, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True,
                                                                                 track_running_stats=True)
        self.layer_norm, self.lrn = nn.LayerNorm([12, 12], elementwise_affine=False), nn.LocalResponseNorm(5)
        self.conv1d, self.bn3, self.out = nn.Conv1d(8, 8, 3, padding=1), nn.BatchNorm1d(8), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn2(self.b(F.relu(self.bn1(self.a(x))))))
        h = F.max_pool2d(self.lrn(F.relu(self.instance(self.c(self.layer_norm(h))))), 3, 2)
        return self.out(F.relu(self.bn3(self.conv1d(h.flatten(2)))).mean(-1))


class _Learned(nn.Module):   # a learned exponent (generalized-mean pool), clipping level, divisor and fill value
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.linear = nn.Conv2d(3, 16, 3, padding=1), nn.Linear(16, 16)
        self.p, self.level = nn.Parameter(torch.full((1,), 3.0)), nn.Parameter(torch.tensor(0.8))
        self.divisor, self.fill = nn.Parameter(torch.linspace(1, 2, 16)), nn.Parameter(torch.zeros(16))
        self.frequencies, self.out = nn.Parameter(torch.randn(16, 8)), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(x))
        pooled = h.clamp(min=1e-6).pow(self.p).mean([2, 3]).pow(1.0 / self.p) + torch.clamp(h, max=self.level).mean(
            [2, 3])
        g = self.linear(pooled)
        g = torch.where(g > 0, (g.abs() + 1) / self.divisor + torch.erf(g), self.fill)
        f = g @ self.frequencies
        return self.out(torch.cat([g, torch.sin(f), torch.cos(f)], -1))


class _StraightThrough(nn.Module):   # a rounding straight-through estimator, a VQ codebook, a detached scale
    def __init__(self) -> None:
        super().__init__()
        self.a, self.codebook, self.out = nn.Linear(24, 16), nn.Parameter(torch.randn(8, 16)), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x.flatten(1)[:, :24])
        q = h + (torch.round(h * 4) / 4 - h).detach()
        code = self.codebook[(h.unsqueeze(1) - self.codebook.unsqueeze(0)).pow(2).sum(-1).argmin(-1)]
        z = h + (code - h).detach() + 0.25 * (code - h.detach()).pow(2)
        return self.out(q * z / h.abs().mean().detach().clamp(min=0.1))


class _SpatialTransformer(nn.Module):   # affine_grid and grid_sample, a transform built from literals
    def __init__(self) -> None:
        super().__init__()
        self.locate, self.theta = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 6)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = torch.tensor([[1.0, 0, 0], [0, 1.0, 0]], dtype=x.dtype)
        theta = self.theta(F.relu(self.locate(x)).mean([2, 3])).view(-1, 2, 3) + identity
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return F.relu(self.conv(F.grid_sample(x, grid, align_corners=False))).mean([2, 3])


class _Attention(nn.Module):   # nn.MultiheadAttention with a key padding mask, and with its own key and value sizes
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.attention = nn.Embedding(100, 32), nn.MultiheadAttention(32, 4, batch_first=True)
        self.cross = nn.MultiheadAttention(32, 2, kdim=16, vdim=24)
        self.k, self.v, self.out = nn.Linear(32, 16), nn.Linear(32, 24), nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        h, _ = self.attention(x, x, x, key_padding_mask=ids < 10, need_weights=False)
        c, weights = self.cross(h.transpose(0, 1), self.k(x).transpose(0, 1), self.v(x).transpose(0, 1))
        return self.out(c.mean(0) + weights.mean(1) @ x.new_ones(x.shape[1], 32))


class _Decoder(nn.Module):   # a transformer decoder layer: causal self-attention, cross-attention to a memory
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(200, 32), nn.Linear(32, 7)
        self.layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        mask = nn.Transformer.generate_square_subsequent_mask(8, dtype=x.dtype)
        return self.out(self.layer(x[:, :8], x[:, 8:], tgt_mask=mask, tgt_is_causal=True).mean(1))


class _Routing(nn.Module):   # hard attention by argmax, a masked fill, top-2 experts by einsum, a scatter_add
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.score, self.value = nn.Embedding(100, 16), nn.Linear(16, 1), nn.Linear(16, 16)
        self.experts, self.gate = nn.Parameter(torch.randn(4, 16, 16) * 0.2), nn.Linear(16, 4)
        self.out = nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).masked_fill((ids == 0).unsqueeze(-1), 0.0)
        best = self.score(x).squeeze(-1).argmax(-1)
        picked = self.value(x).gather(1, best[:, None, None].expand(-1, 1, 16)).squeeze(1)
        g = torch.softmax(self.gate(picked), -1)
        mask = torch.zeros_like(g).scatter(1, g.topk(2, -1).indices, 1.0)
        mixed = torch.einsum("be,eij,bj->bi", g * mask, self.experts, picked)
        return self.out(mixed + x.new_zeros(ids.shape[0], 16).scatter_add(1, ids[:, :16] % 16, picked))


class _Pieces(nn.Module):   # a class token, uneven splits, stack and unbind, narrow, tile, a negative pad, tril, bmm
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 6)
        self.cls, self.bias = nn.Parameter(torch.randn(1, 1, 16)), nn.Parameter(torch.zeros(1, 12, 1))
        self.left, self.right = nn.Parameter(torch.randn(12, 16) * 0.3), nn.Parameter(torch.randn(6, 6) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.a(x.transpose(1, 2))], 1)
        p, q, r = torch.split(h, [3, 5, 8], -1)
        u = torch.unbind(torch.stack([p.sum(-1), q.sum(-1), r.sum(-1)], 0), 0)
        n = h.narrow(1, 1, 4).tile(1, 2, 1) + F.pad(h, (0, 0, -1, 0))[:, :8]
        side = torch.baddbmm(torch.tanh(self.left @ n[:, :6].transpose(1, 2) + self.bias)[:, :6],
                             n[:, :6, :6], self.right.expand(x.shape[0], 6, 6))
        return self.b((n + torch.tril(n @ n.transpose(1, 2)) @ n).mean(1) + side.mean(1)[:, :1] + u[0].mean(
            -1, keepdim=True) * u[1][:, :1] + u[2][:, :1])


class _Resampling(nn.Module):   # bilinear to an odd size, bicubic, area, unfold and fold, circular and "same" padding
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1, padding_mode="circular"), nn.Conv2d(8, 8, 4, padding="same")
        self.unfold, self.fold = nn.Unfold(3, padding=1, stride=2), nn.Fold((12, 12), 3, padding=1, stride=2)
        self.mix, self.c = nn.Linear(72, 27), nn.Conv1d(3, 3, 4, padding="same", padding_mode="circular")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.interpolate(F.relu(self.a(x)), size=(13, 7), mode="bilinear", align_corners=False)
        h = F.interpolate(F.relu(self.b(h)), scale_factor=2, mode="bicubic", align_corners=False)
        h = F.interpolate(h, size=(12, 12), mode="area")
        y = self.fold(self.mix(self.unfold(h).transpose(1, 2)).transpose(1, 2))
        return self.c(y.mean(2))


class _Shrinks(nn.Module):   # Tanhshrink, Softshrink, Hardshrink, Hardtanh, LeakyReLU, Softmax2d, LogSoftmax, softmin
    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1) for i in range(6)])
        self.activations = [nn.Tanhshrink(), nn.Softshrink(0.1), nn.Hardshrink(0.05), nn.Hardtanh(-0.3, 0.3),
                            nn.LeakyReLU(0.2), nn.Softmax2d()]
        self.out = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, activation in zip(self.convs, self.activations):
            x = activation(conv(x))
        return self.out(torch.log_softmax(x, 1).mean([2, 3]) + F.softmin(x.mean([2, 3]), -1))


class _Unpooling(nn.Module):   # max pooling's indices into MaxUnpool (SegNet's decoder)
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, indices = F.max_pool2d(F.relu(self.a(x)), 2, return_indices=True)
        return self.b(F.max_unpool2d(h * 2, indices, 2))


class _Bags(nn.Module):   # EmbeddingBags of equal-length bags: mean, sum and max
    def __init__(self) -> None:
        super().__init__()
        self.mean, self.sum = nn.EmbeddingBag(300, 16, mode="mean"), nn.EmbeddingBag(300, 16, mode="sum")
        self.max, self.out = nn.EmbeddingBag(300, 16, mode="max"), nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.mean(ids) + 0.1 * self.sum(ids) + self.max(ids))


class _Roots(nn.Module):   # roots at exactly zero: an LPPool after a ReLU, sqrt and x ** 0.3 of a ReLU, zero norms
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.lp, self.linear = nn.Conv2d(3, 8, 3, padding=1), nn.LPPool2d(2, 2), nn.Linear(48, 24)
        self.out = nn.Linear(8 + 24 + 24 + 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = self.lp(F.relu(self.conv(x) - 0.5)).mean([2, 3])
        h = F.relu(self.linear(x.flatten(1)[:, :48]) - 0.5)
        return self.out(torch.cat([pooled, torch.sqrt(h), h.pow(0.3), h.view(-1, 6, 4).norm(dim=-1)], -1))


class _Siamese(nn.Module):   # one encoder over two views: shared BatchNorm, GroupNorm, grouped and transposed Convs
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.grouped = nn.Conv2d(16, 16, 3, padding=1, groups=4)
        self.up, self.out = nn.ConvTranspose2d(16, 8, 4, 2, 1), nn.Linear(8, 5)
        self.norm, self.group_norm = nn.BatchNorm2d(16), nn.GroupNorm(4, 16)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        h = self.group_norm(self.grouped(F.relu(self.norm(self.depthwise(F.relu(self.stem(x)))))))
        return F.relu(self.up(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out((self.encode(x) - self.encode(x.flip(-1))).pow(2).mean([2, 3]))


class _SharedSequence(nn.Module):   # one embedding, LayerNorm, LSTM and attention over two halves of a sequence
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm = nn.Embedding(100, 32), nn.LayerNorm(32)
        self.lstm, self.attention = nn.LSTM(32, 32, batch_first=True), nn.MultiheadAttention(32, 4, batch_first=True)
        self.out = nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        a, _ = self.lstm(self.norm(self.embed(ids[:, :6])))
        b, _ = self.lstm(self.norm(self.embed(ids[:, 6:])))
        c, _ = self.attention(a, b, b, need_weights=False)
        d, _ = self.attention(b, a, a, need_weights=False)
        return self.out(c.mean(1) * d.mean(1))


class _Normalized(nn.Module):   # input normalization by top-level buffers named "mean" and "std", .mean() and .std()
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))
        self.conv, self.out = nn.Conv2d(3, 8, 3), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv((x - self.mean) / self.std)
        return self.out(h.mean((2, 3)) + h.std((2, 3)))


class _PaddedEmbedding(nn.Module):   # an Embedding's padding_idx, the padding written into the ids
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(100, 16, padding_idx=0), nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.clone()
        ids[:, :3] = 0
        return self.out(self.embed(ids).mean(1))


class _Statistics(nn.Module):   # var, std, logsumexp, amax and amin, maximum, a product by cumsum of logs
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.out = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(40, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        products = torch.sigmoid(h.mean((2, 3))).log().cumsum(1).exp()
        return self.out(torch.cat([h.var((2, 3)), h.std((2, 3)), torch.logsumexp(h.flatten(2), 2),
                                   torch.maximum(h.amax((2, 3)), h.amin((2, 3)).abs()), products], 1))


class _Bilinear(nn.Module):   # nn.Bilinear of a hidden layer and the input
    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.bilinear = nn.Linear(12, 8), nn.Bilinear(8, 12, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bilinear(torch.tanh(self.hidden(x)), x)


class _Fourier(nn.Module):   # learned frequencies through sin and cos, a learned temperature through exp (CLIP)
    def __init__(self) -> None:
        super().__init__()
        self.frequencies, self.logit_scale = nn.Parameter(torch.randn(12, 16)), nn.Parameter(torch.tensor(2.0))
        self.project, self.classes = nn.Linear(32, 8), nn.Parameter(torch.randn(5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x @ self.frequencies
        features = F.normalize(self.project(torch.cat([torch.sin(z), torch.cos(z)], -1)), dim=-1)
        return self.logit_scale.exp() * features @ F.normalize(self.classes, dim=-1).t()


class _RMSSwiGLU(nn.Module):   # nn.RMSNorm, a LayerNorm over two axes, a SwiGLU feed-forward
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.rms, self.norm = nn.Embedding(100, 32), nn.RMSNorm(32), nn.LayerNorm([10, 32])
        self.gate, self.up = nn.Linear(32, 64, bias=False), nn.Linear(32, 64, bias=False)
        self.down, self.out = nn.Linear(64, 32, bias=False), nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(ids))
        g = self.rms(h)
        return self.out((h + self.down(F.silu(self.gate(g)) * self.up(g))).mean(1))


class _SliceAssign(nn.Module):   # in-place assignment to slices, to a column, to rows by an index tensor
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(48, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x.transpose(1, 2))
        g = h.clone()
        g[:, 1:3] = self.b(h[:, 1:3])
        g[:, :, 0] = h[:, :, 0] * 2
        rows = torch.tensor([5, 0])
        g[:, rows] = g[:, rows] + 1
        return self.out(g.flatten(1))


class _ManyOperands(nn.Module):   # a three-operand einsum, baddbmm with alpha and beta, cdist, cosine similarity
    def __init__(self) -> None:
        super().__init__()
        self.w, self.v = nn.Parameter(torch.randn(8, 8) * 0.3), nn.Parameter(torch.randn(8, 4) * 0.3)
        self.centres, self.bias = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(10, 4) * 0.1)
        self.out = nn.Linear(70, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        h = torch.einsum("bil,ij,jk->blk", x, self.w, self.v)
        h = torch.baddbmm(self.bias.expand(n, -1, -1), h, torch.eye(4, dtype=x.dtype).expand(n, -1, -1),
                          alpha=0.5, beta=2.0)
        distances = torch.cdist(h, self.centres.expand(n, -1, -1))
        cosines = F.cosine_similarity(h, self.bias.unsqueeze(0), dim=-1)
        return self.out(torch.cat([distances.flatten(1), cosines], 1))


class _PaddingModes(nn.Module):   # Convs padding by reflection, replication and wrapping; a dilated depthwise Conv1d
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect")
        self.b = nn.Conv2d(8, 8, 3, padding=2, padding_mode="replicate", dilation=2)
        self.c = nn.Conv2d(8, 8, 3, padding=1, padding_mode="circular")
        self.d, self.out = nn.Conv1d(8, 8, 3, padding=2, dilation=2, groups=8), nn.Linear(40, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c(F.relu(self.b(F.relu(self.a(x)))))).flatten(2)
        return self.out(F.adaptive_avg_pool1d(F.avg_pool1d(F.relu(self.d(h)), 4), 5).flatten(1))


class _Volumes(nn.Module):   # ConvTranspose3d, a ceil-mode AvgPool3d, trilinear upsampling, AdaptiveAvgPool3d
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv3d(2, 6, 3, stride=2, padding=1), nn.ConvTranspose3d(6, 4, 2, stride=2)
        self.out = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.avg_pool3d(F.relu(self.a(x)), 3, 2, ceil_mode=True)
        h = torch.tanh(self.b(F.interpolate(h, scale_factor=2, mode="trilinear", align_corners=False)))
        return self.out(F.adaptive_avg_pool3d(h, 2).flatten(1))


class _Spectral(nn.Module):   # mixing by the magnitudes of an rfft along the sequence (FNet)
    def __init__(self) -> None:
        super().__init__()
        self.a, self.out = nn.Linear(8, 16), nn.Linear(96, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.fft.rfft(self.a(x.transpose(1, 2)), dim=1).abs().flatten(1))


class _Timestep(nn.Module):   # a diffusion model's sinusoidal embedding of a number per example, FiLM conditioning
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.conv, self.out = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angles = (x[:, 0, 0, 0] * 100)[:, None] * torch.exp(-torch.arange(8, dtype=x.dtype) * 0.5)[None]
        scale, shift = self.embed(torch.cat([angles.sin(), angles.cos()], 1)).chunk(2, 1)
        return self.out(F.silu(self.conv(x) * (1 + scale[:, :, None, None]) + shift[:, :, None, None]))


class _Masks(nn.Module):   # a key padding mask from the ids, attention weights used, masked mean, a Where of parameters
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.attention = nn.Embedding(50, 16), nn.MultiheadAttention(16, 2)
        self.above, self.below = nn.Parameter(torch.randn(16)), nn.Parameter(torch.randn(16))
        self.out = nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.clone()
        ids[:, -2:] = 0
        padding = ids == 0
        h = self.embed(ids).transpose(0, 1)
        h, weights = self.attention(h, h, h, key_padding_mask=padding, need_weights=True)
        h = h.transpose(0, 1) * weights.sum(1, keepdim=True).transpose(1, 2)
        keep = (~padding).unsqueeze(-1).float()
        pooled = (h * keep).sum(1) / keep.sum(1).clamp(min=1)
        return self.out(pooled + torch.where(pooled > 0, self.above, self.below))


class _RelativeBias(nn.Module):   # a Swin relative position bias: a parameter table gathered by a buffer "index"
    def __init__(self, side: int = 4) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn((2 * side - 1) ** 2, 2) * 0.1)
        coords = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")).flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + side - 1
        self.register_buffer("index", relative[..., 0] * (2 * side - 1) + relative[..., 1])
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.flatten(2).transpose(1, 2)
        n, length = t.shape[0], t.shape[1]
        q, k, v = self.qkv(t).reshape(n, length, 3, 2, 4).permute(2, 0, 3, 1, 4)
        bias = self.table[self.index.view(-1)].view(length, length, 2).permute(2, 0, 1)
        h = ((q @ k.transpose(-2, -1)) * 0.5 + bias).softmax(-1) @ v
        return self.out(h.transpose(1, 2).reshape(n, length, 8).mean(1))


def volumes(channels: int, side: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    return lambda batch, generator: torch.randn(batch, channels, side, side, side, generator=generator)


def vectors(features: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    return lambda batch, generator: torch.randn(batch, features, generator=generator)


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
    "normalizations": (_Normalizations, images(3, 12), "cross_entropy"),
    "learned_exponent": (_Learned, images(3, 6), "cross_entropy"),
    "straight_through": (_StraightThrough, images(3, 4), "cross_entropy"),
    "spatial_transformer": (_SpatialTransformer, images(3, 12), "mse"),
    "multihead_attention": (_Attention, tokens(100, 10), "cross_entropy"),
    "decoder": (_Decoder, tokens(200, 16), "cross_entropy"),
    "routing": (_Routing, tokens(100, 20), "cross_entropy"),
    "pieces": (_Pieces, sequences(16, 10), "cross_entropy"),
    "resampling": (_Resampling, images(3, 10), "mse"),
    "shrinks": (_Shrinks, images(3, 8), "cross_entropy"),
    "max_unpool": (_Unpooling, images(3, 8), "mse"),
    "embedding_bags": (_Bags, tokens(300, 10), "cross_entropy"),
    "roots_at_zero": (_Roots, images(3, 8), "cross_entropy"),
    "siamese": (_Siamese, images(3, 8), "cross_entropy"),
    "shared_sequence": (_SharedSequence, tokens(100, 12), "cross_entropy"),
    "normalized_input": (_Normalized, images(3, 8), "cross_entropy"),
    "padded_embedding": (_PaddedEmbedding, tokens(100, 10), "cross_entropy"),
    "statistics": (_Statistics, images(3, 8), "cross_entropy"),
    "bilinear": (_Bilinear, vectors(12), "cross_entropy"),
    "fourier": (_Fourier, vectors(12), "cross_entropy"),
    "rms_swiglu": (_RMSSwiGLU, tokens(100, 10), "cross_entropy"),
    "slice_assign": (_SliceAssign, sequences(8, 6), "cross_entropy"),
    "many_operands": (_ManyOperands, sequences(8, 10), "cross_entropy"),
    "padding_modes": (_PaddingModes, images(3, 10), "cross_entropy"),
    "volumes": (_Volumes, volumes(2, 8), "cross_entropy"),
    "spectral": (_Spectral, sequences(8, 10), "cross_entropy"),
    "timestep": (_Timestep, images(3, 8), "mse"),
    "masks": (_Masks, tokens(50, 9), "cross_entropy"),
    "relative_bias": (_RelativeBias, images(8, 4), "cross_entropy"),
}
#: (model, exporter) -> why the engine cannot match torch there: a limit docs/models.md states ("Known limits"). The
#: record's status is "known_limit" with the reason, unless the pair passes after all.
KNOWN_LIMITS = {
    ("straight_through", "legacy"): "the legacy exporter drops detach() without a trace",
    ("embedding_bags", "dynamo"): "the dynamo exporter writes an EmbeddingBag as a Loop over sequences",
    ("padded_embedding", "legacy"): "the legacy exporter drops an Embedding's padding_idx",
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
    # a parameter no gradient reaches in torch (a score read only through an argmax) has a zero one
    return float(value), {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().numpy().astype(np.float64)
                          for n, p in module.named_parameters()}


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
        limit = KNOWN_LIMITS.get((name, exporter))
        return harness.emit("onnx-ps", f"grad_sweep_error_{name}", size_mb, float("nan"), PPM, **fields,
                            status="known_limit" if limit else "refused", **({"reason": limit} if limit else {}),
                            message=f"{type(exc).__name__}: {str(exc)[:300]}")
    torch_loss, torch32 = _torch_step(build, example, labels, loss, torch.float32)
    _, exact = _torch_step(build, example, labels, loss, torch.float64)
    found = errors(result.gradients, torch32, exact)
    where = max(found, key=lambda n: found[n][0] if math.isfinite(found[n][0]) else math.inf, default="")
    error, torch_error = found.get(where, (0.0, 0.0))
    # beyond the tolerance and ten times torch's own float32 error on some parameter
    differs = [n for n, (ours, theirs) in found.items() if not ours <= max(tolerance, 10 * theirs)]   # NaN too
    missing = sorted(set(exact) - set(result.gradients))
    # what the engine trains that torch does not: a buffer the legacy exporter wrote as a weight (docs/models.md)
    extra = sorted(set(result.gradients) - set(exact))
    status = "differs" if differs or missing else "ok"
    if status != "ok" and (name, exporter) in KNOWN_LIMITS:
        status, fields["reason"] = "known_limit", KNOWN_LIMITS[name, exporter]
    return harness.emit("onnx-ps", f"grad_sweep_error_{name}", size_mb, error * 1e6, PPM, **fields,
                        status=status, parameter=where,
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
