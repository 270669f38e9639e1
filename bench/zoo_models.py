"""Small torch models of the architectures users train beside the benchmark's two, for ps_bench.grad_bench.

Benchmark-only: it needs torch, which the project never does. ``ps_bench.torch_models`` holds the
two models the training benchmarks run (ResNet-18, the transformer classifier); these are the
others a user brings -- a model the engine was not tuned on is where a slow adjoint shows first:

``vgg``        3 x 3 Convs with BatchNorm, ReLU and max-pooling, 32 x 32 images, 10 classes
``mobilenet``  inverted residual blocks: 1 x 1 Convs around a depthwise 3 x 3, ReLU6, Hardswish, SiLU
``lstm``       token embedding, a 2-layer LSTM (hidden 128) over 40 tokens, the last state classified
``gru``        the same with a GRU
``conv1d``     audio: Conv1d layers over 4,000 samples (strided, dilated with padding="same"), GELU
``prenorm``    a 3-layer pre-norm transformer encoder with GELU and dropout 0.0 (d 256, 48 tokens)
``vit``        a vision transformer: 4 x 4 patches of 32 x 32 images, a class token, 4 pre-norm layers
``unet``       an encoder-decoder with a ConvTranspose and a skip connection; mean squared error
``wide_mlp``   Linear 512-2048-2048-100 with LayerNorm, SiLU and GELU
``effnet``     EfficientNet-style MBConv blocks: 1 x 1 expansion, strided depthwise 3 x 3, squeeze-and-excitation,
               SiLU, BatchNorm, widths 16-24-40
``bilstm``     token embedding, one bidirectional LSTM (hidden 96) over 40 tokens, its states averaged
``pixelshuffle`` super-resolution style: 3 x 3 Convs to 3 x 2 x 2 channels and a PixelShuffle by 2; mean squared error
``convnext``   ConvNeXt-style blocks: a 4 x 4 patch stem, depthwise 7 x 7 Convs, LayerNorm and GELU MLPs channels-last
``groupnorm``  3 x 3 Convs (strided every other) with GroupNorm(8) and SiLU, as diffusion and detection nets have them
``gpt``        a causal 2-layer pre-norm transformer (d 128, 64 tokens) predicting the next of 2,000 tokens
``densenet``   DenseNet-style: six BatchNorm-ReLU-Conv layers, each concatenating 16 channels to its input
``tcn``        a temporal convolution network: six Conv1d layers dilated 1 to 32 over 2,000 samples, leaky ReLU
``mixer``      MLP-Mixer: 4 x 4 patches, token- and channel-mixing MLPs with LayerNorm and GELU
``autoencoder`` strided 4 x 4 Convs down, InstanceNorm, strided 4 x 4 ConvTransposes back up, Tanh; mean squared error
``generator``  DCGAN-style: a Linear to 128 x 4 x 4, three strided 4 x 4 ConvTransposes with BatchNorm to 3 x 32 x 32
``conv3d``     volumes (video, medical scans): Conv3d-BatchNorm3d-ReLU, a 2 x 2 x 2 MaxPool3d, 16^3 voxels
``unet3d``     a 3-D encoder-decoder: a strided Conv3d down, a 2 x 2 x 2 ConvTranspose3d up, a skip; mean squared error
``video``      R(2+1)D-style: each Conv3d split into a (1, 3, 3) spatial and a (3, 1, 1) temporal one, BatchNorm3d,
               ReLU, strided in both once; clips of 8 frames of 3 x 32 x 32
``llama``      a LLaMA-style decoder: RMSNorm, rotary position embeddings, causal attention, SwiGLU MLPs (d 128)
``unet_attn``  a diffusion-style UNet: GroupNorm-SiLU residual blocks, self-attention at 8 x 8; mean squared error

``case(name, batch, folder) -> (onnx path, module, input, labels, loss)`` builds the model with
fixed weights, exports it with the documented recipe (docs/models.md, "Exporter recipes") into
`folder` once, and draws a batch.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

try:
    import torch
    from torch import nn
except ImportError as exc:  # torch is a benchmark-only dependency
    raise SystemExit("ps_bench.zoo_models needs torch, which is not installed here; use an environment of its "
                     "own with torch and the project (docs/benchmarks.md, \"The torch environment\")") from exc

__all__ = ["MODELS", "case"]

#: Part of every exported file's name: bumped whenever a model's definition or its export changes.
VERSION = 1


class _Flat(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)


def _vgg() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 24, 3, padding=1), nn.BatchNorm2d(24), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(24, 48, 3, padding=1), nn.BatchNorm2d(48), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(48, 96, 3, padding=1, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), _Flat(),
                         nn.Linear(96, 10))


class _InvertedResidual(nn.Module):
    def __init__(self, channels: int, expand: int = 4) -> None:
        super().__init__()
        hidden = channels * expand
        self.body = nn.Sequential(
            nn.Conv2d(channels, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
            nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False), nn.BatchNorm2d(hidden), nn.Hardswish(),
            nn.Conv2d(hidden, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def _mobilenet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.SiLU(),
                         _InvertedResidual(32), _InvertedResidual(32), nn.Conv2d(32, 64, 3, stride=2, padding=1),
                         _InvertedResidual(64), nn.AdaptiveAvgPool2d(1), _Flat(), nn.Linear(64, 10))


class _Recurrent(nn.Module):
    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        self.rnn = cell(64, 128, batch_first=True, num_layers=2)
        self.out = nn.Linear(128, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        states, _ = self.rnn(self.embed(ids))
        return self.out(states[:, -1])


def _conv1d() -> nn.Module:
    return nn.Sequential(nn.Conv1d(1, 16, 9, stride=2, padding=4), nn.BatchNorm1d(16), nn.GELU(),
                         nn.Conv1d(16, 32, 5, dilation=2, padding="same"), nn.GELU(), nn.MaxPool1d(4),
                         nn.Conv1d(32, 64, 3), nn.ReLU(), nn.AdaptiveAvgPool1d(1), _Flat(), nn.Linear(64, 6))


def _encoder(d_model: int, heads: int, feed_forward: int, layers: int) -> nn.TransformerEncoder:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch's note that norm_first disables its fast path
        layer = nn.TransformerEncoderLayer(d_model, heads, feed_forward, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


class _PreNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5000, 256)
        self.position = nn.Parameter(torch.randn(1, 48, 256) * 0.02)
        self.encoder = _encoder(256, 4, 1024, 3)
        self.norm = nn.LayerNorm(256)
        self.out = nn.Linear(256, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.encoder(self.embed(ids) + self.position)).mean(1))


class _ViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 192, 4, stride=4)
        self.cls = nn.Parameter(torch.zeros(1, 1, 192))
        self.position = nn.Parameter(torch.randn(1, 65, 192) * 0.02)
        self.encoder = _encoder(192, 3, 768, 4)
        self.out = nn.Linear(192, 10)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        patches = self.patch(image).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(image.shape[0], -1, -1), patches], 1) + self.position
        return self.out(self.encoder(tokens)[:, 0])


class _UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.down2 = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.head = nn.Conv2d(32, 3, 1)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        skip = self.down1(image)
        return self.head(torch.cat([self.up(self.down2(skip)), skip], 1))


def _wide_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 2048), nn.LayerNorm(2048), nn.SiLU(), nn.Linear(2048, 2048), nn.GELU(),
                         nn.Linear(2048, 100))


class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int, reduce: int = 4) -> None:
        super().__init__()
        self.gate = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(channels, channels // reduce, 1), nn.SiLU(),
                                  nn.Conv2d(channels // reduce, channels, 1), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(x)


class _MBConv(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int, expand: int = 4) -> None:
        super().__init__()
        hidden = inputs * expand
        self.body = nn.Sequential(
            nn.Conv2d(inputs, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.SiLU(),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden), nn.SiLU(),
            _SqueezeExcite(hidden), nn.Conv2d(hidden, outputs, 1, bias=False), nn.BatchNorm2d(outputs))
        self.residual = stride == 1 and inputs == outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return x + y if self.residual else y


def _effnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.SiLU(),
                         _MBConv(16, 24, 2), _MBConv(24, 24, 1), _MBConv(24, 40, 2), _MBConv(40, 40, 1),
                         nn.AdaptiveAvgPool2d(1), _Flat(), nn.Linear(40, 10))


class _BiLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        self.rnn = nn.LSTM(64, 96, batch_first=True, bidirectional=True)
        self.out = nn.Linear(192, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        states, _ = self.rnn(self.embed(ids))
        return self.out(states.mean(1))


def _pixelshuffle() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 12, 3, padding=1),
                         nn.PixelShuffle(2))


class _ConvNeXtBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.expand = nn.Linear(channels, 4 * channels)
        self.project = nn.Linear(4 * channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.depthwise(x).permute(0, 2, 3, 1)                     # channels last, as ConvNeXt writes it
        y = self.project(nn.functional.gelu(self.expand(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


class _ConvNeXt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 64, 4, stride=4), _ConvNeXtBlock(64), nn.Conv2d(64, 128, 2, stride=2),
                                  _ConvNeXtBlock(128))
        self.norm = nn.LayerNorm(128)
        self.out = nn.Linear(128, 10)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.body(image).mean((2, 3))))


def _groupnorm() -> nn.Module:
    layers: list[nn.Module] = []
    for inputs, outputs in ((3, 32), (32, 64), (64, 128)):
        layers += [nn.Conv2d(inputs, outputs, 3, padding=1), nn.GroupNorm(8, outputs), nn.SiLU(),
                   nn.Conv2d(outputs, outputs, 3, stride=2, padding=1), nn.GroupNorm(8, outputs), nn.SiLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), _Flat(), nn.Linear(128, 10))


class _GPT(nn.Module):
    def __init__(self, vocabulary: int = 2000, width: int = 128, length: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(torch.randn(length, width) * 0.02)
        self.layers = nn.ModuleList([_encoder(width, 4, 4 * width, 1).layers[0] for _ in range(2)])
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocabulary)
        self.register_buffer("causal", torch.triu(torch.full((length, length), float("-inf")), 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        states = self.embed(ids) + self.position
        for layer in self.layers:
            states = layer(states, src_mask=self.causal)
        return self.out(self.norm(states[:, -1]))                   # the next token after the window


class _Dense(nn.Module):
    def __init__(self, growth: int = 16, layers: int = 6) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.MaxPool2d(2))
        self.layers = nn.ModuleList([
            nn.Sequential(nn.BatchNorm2d(32 + k * growth), nn.ReLU(), nn.Conv2d(32 + k * growth, growth, 3, padding=1))
            for k in range(layers)])
        self.out = nn.Linear(32 + layers * growth, 10)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.stem(image)
        for layer in self.layers:
            x = torch.cat([x, layer(x)], 1)
        return self.out(x.mean((2, 3)))


class _TCN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Conv1d(1 if k == 0 else 32, 32, 3, dilation=2 ** k, padding=2 ** k)
                                     for k in range(6)])
        self.out = nn.Linear(32, 10)

    def forward(self, signal: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            signal = nn.functional.leaky_relu(layer(signal), 0.1)
        return self.out(signal.amax(2))


class _Mixer(nn.Module):
    def __init__(self, patches: int = 64, width: int = 128, depth: int = 3) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, width, 4, stride=4)

        def mlp(size: int, hidden: int) -> nn.Module:
            return nn.Sequential(nn.Linear(size, hidden), nn.GELU(), nn.Linear(hidden, size))

        self.tokens = nn.ModuleList([mlp(patches, 2 * patches) for _ in range(depth)])
        self.channels = nn.ModuleList([mlp(width, 4 * width) for _ in range(depth)])
        self.norms = nn.ModuleList([nn.LayerNorm(width) for _ in range(2 * depth)])
        self.out = nn.Linear(width, 10)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.patch(image).flatten(2).transpose(1, 2)
        for k, (tokens, channels) in enumerate(zip(self.tokens, self.channels)):
            x = x + tokens(self.norms[2 * k](x).transpose(1, 2)).transpose(1, 2)
            x = x + channels(self.norms[2 * k + 1](x))
        return self.out(x.mean(1))


def _autoencoder() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(32, 64, 4, 2, 1),
                         nn.InstanceNorm2d(64, affine=True), nn.LeakyReLU(0.2),
                         nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(32, 3, 4, 2, 1), nn.Tanh())


class _Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(100, 128 * 4 * 4)
        self.body = nn.Sequential(
            nn.BatchNorm2d(128), nn.ReLU(), nn.ConvTranspose2d(128, 64, 4, 2, 1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.BatchNorm2d(32), nn.ReLU(), nn.ConvTranspose2d(32, 3, 4, 2, 1),
            nn.Tanh())

    def forward(self, noise: torch.Tensor) -> torch.Tensor:
        return self.body(self.project(noise).view(-1, 128, 4, 4))


def _conv3d() -> nn.Module:
    return nn.Sequential(nn.Conv3d(1, 16, 3, padding=1), nn.BatchNorm3d(16), nn.ReLU(), nn.MaxPool3d(2),
                         nn.Conv3d(16, 32, 3, padding=1), nn.BatchNorm3d(32), nn.ReLU(), nn.AdaptiveAvgPool3d(1),
                         _Flat(), nn.Linear(32, 10))


class _UNet3d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Sequential(nn.Conv3d(1, 16, 3, padding=1), nn.BatchNorm3d(16), nn.ReLU())
        self.down = nn.Sequential(nn.Conv3d(16, 32, 3, 2, 1), nn.BatchNorm3d(32), nn.ReLU())
        self.up = nn.ConvTranspose3d(32, 16, 2, 2)
        self.out = nn.Conv3d(32, 1, 3, padding=1)

    def forward(self, volume: torch.Tensor) -> torch.Tensor:
        skip = self.encode(volume)
        return self.out(torch.cat([self.up(self.down(skip)), skip], 1))


def _video() -> nn.Module:
    def factorized(inputs: int, outputs: int, stride: int = 1) -> list[nn.Module]:
        return [nn.Conv3d(inputs, outputs, (1, 3, 3), (1, stride, stride), (0, 1, 1)), nn.BatchNorm3d(outputs),
                nn.ReLU(), nn.Conv3d(outputs, outputs, (3, 1, 1), (stride, 1, 1), (1, 0, 0)),
                nn.BatchNorm3d(outputs), nn.ReLU()]
    return nn.Sequential(*factorized(3, 32), *factorized(32, 64, 2), *factorized(64, 64), nn.AdaptiveAvgPool3d(1),
                         _Flat(), nn.Linear(64, 10))


class _RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Llama(nn.Module):
    def __init__(self, vocabulary: int = 2000, width: int = 128, heads: int = 4, length: int = 64) -> None:
        super().__init__()
        self.embed, self.heads, self.head_width = nn.Embedding(vocabulary, width), heads, width // heads
        self.blocks = nn.ModuleList([nn.ModuleDict({
            "attention_norm": _RMSNorm(width), "qkv": nn.Linear(width, 3 * width, bias=False),
            "project": nn.Linear(width, width, bias=False), "mlp_norm": _RMSNorm(width),
            "gate": nn.Linear(width, 344, bias=False), "up": nn.Linear(width, 344, bias=False),
            "down": nn.Linear(344, width, bias=False)}) for _ in range(2)])
        self.norm, self.out = _RMSNorm(width), nn.Linear(width, vocabulary, bias=False)
        inverse = 1.0 / (10000 ** (torch.arange(0, self.head_width, 2).float() / self.head_width))
        angles = torch.outer(torch.arange(length).float(), inverse)
        self.register_buffer("cos", torch.cat((angles, angles), -1).cos())
        self.register_buffer("sin", torch.cat((angles, angles), -1).sin())
        self.register_buffer("causal", torch.triu(torch.full((length, length), float("-inf")), 1))

    def _rotated(self, x: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)
        return x * self.cos + torch.cat((-second, first), dim=-1) * self.sin

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        batch, length, width = x.shape
        for block in self.blocks:
            q, k, v = block["qkv"](block["attention_norm"](x)).view(
                batch, length, 3, self.heads, self.head_width).permute(2, 0, 3, 1, 4)
            scores = self._rotated(q) @ self._rotated(k).transpose(-1, -2) / self.head_width ** 0.5
            attended = torch.softmax(scores + self.causal, -1) @ v
            x = x + block["project"](attended.transpose(1, 2).reshape(batch, length, width))
            h = block["mlp_norm"](x)
            x = x + block["down"](nn.functional.silu(block["gate"](h)) * block["up"](h))
        return self.out(self.norm(x)[:, -1])


class _UNetAttention(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        def block(channels: int) -> nn.Module:
            return nn.Sequential(nn.GroupNorm(8, channels), nn.SiLU(), nn.Conv2d(channels, channels, 3, padding=1))
        self.stem, self.first = nn.Conv2d(3, width, 3, padding=1), block(width)
        self.down, self.second = nn.Conv2d(width, 2 * width, 3, 2, 1), block(2 * width)
        self.attention_norm = nn.GroupNorm(8, 2 * width)
        self.attention = nn.MultiheadAttention(2 * width, 4, batch_first=True)
        self.up = nn.ConvTranspose2d(2 * width, width, 2, 2)
        self.out = nn.Sequential(nn.GroupNorm(8, width), nn.SiLU(), nn.Conv2d(width, 3, 3, padding=1))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        h = self.stem(image)
        h = h + self.first(h)
        d = self.down(h)
        d = d + self.second(d)
        batch, channels, height, width = d.shape
        tokens = self.attention_norm(d).flatten(2).transpose(1, 2)
        attended = self.attention(tokens, tokens, tokens, need_weights=False)[0]
        d = d + attended.transpose(1, 2).reshape(batch, channels, height, width)
        return self.out(self.up(d) + h)


def _volumes(batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, 1, 16, 16, 16, generator=generator)


def _clips(batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, 3, 8, 32, 32, generator=generator)


def _images(batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=generator)


def _tokens(vocabulary: int, length: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    return lambda batch, generator: torch.randint(0, vocabulary, (batch, length), generator=generator)


#: name -> (builder, input of a batch, loss)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, torch.Generator], torch.Tensor], str]] = {
    "vgg": (_vgg, _images, "cross_entropy"),
    "mobilenet": (_mobilenet, _images, "cross_entropy"),
    "lstm": (lambda: _Recurrent(nn.LSTM), _tokens(1000, 40), "cross_entropy"),
    "gru": (lambda: _Recurrent(nn.GRU), _tokens(1000, 40), "cross_entropy"),
    "conv1d": (_conv1d, lambda batch, generator: torch.randn(batch, 1, 4000, generator=generator), "cross_entropy"),
    "prenorm": (_PreNorm, _tokens(5000, 48), "cross_entropy"),
    "vit": (_ViT, _images, "cross_entropy"),
    "unet": (_UNet, _images, "mse"),
    "wide_mlp": (_wide_mlp, lambda batch, generator: torch.randn(batch, 512, generator=generator), "cross_entropy"),
    "effnet": (_effnet, _images, "cross_entropy"),
    "bilstm": (_BiLSTM, _tokens(1000, 40), "cross_entropy"),
    "pixelshuffle": (_pixelshuffle, _images, "mse"),
    "convnext": (_ConvNeXt, _images, "cross_entropy"),
    "groupnorm": (_groupnorm, _images, "cross_entropy"),
    "gpt": (_GPT, _tokens(2000, 64), "cross_entropy"),
    "densenet": (_Dense, _images, "cross_entropy"),
    "tcn": (_TCN, lambda batch, generator: torch.randn(batch, 1, 2000, generator=generator), "cross_entropy"),
    "mixer": (_Mixer, _images, "cross_entropy"),
    "autoencoder": (_autoencoder, _images, "mse"),
    "generator": (_Generator, lambda batch, generator: torch.randn(batch, 100, generator=generator), "mse"),
    "conv3d": (_conv3d, _volumes, "cross_entropy"),
    "unet3d": (_UNet3d, _volumes, "mse"),
    "video": (_video, _clips, "cross_entropy"),
    "llama": (_Llama, _tokens(2000, 64), "cross_entropy"),
    "unet_attn": (_UNetAttention, _images, "mse"),
}


def case(name: str, batch: int, folder: str | os.PathLike[str], seed: int = 0
         ) -> tuple[Path, nn.Module, torch.Tensor, torch.Tensor, str]:
    """(the exported ONNX file, the module in training mode with the same weights, a batch's input, its labels, the
    loss) of model `name`; the file is written once under `folder` (atomically), then reused."""
    build, draw, loss = MODELS[name]
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        module = build().train()
    finally:
        torch.random.set_rng_state(state)
    generator = torch.Generator().manual_seed(seed + 1)
    example = draw(batch, generator)
    with torch.no_grad():
        out = module(example)
    labels = (torch.randn(out.shape, generator=generator) if loss == "mse"
              else torch.randint(0, out.shape[1], (batch,), generator=generator))
    target = Path(folder) / f"zoo_{name}.v{VERSION}.onnx"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(module, (example,), str(temporary), dynamo=False, opset_version=18,
                                  training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                                  input_names=["x"], output_names=["y"],
                                  dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
            os.replace(temporary, target)
        finally:
            temporary.unlink(missing_ok=True)
    return target, module, example, labels, loss
