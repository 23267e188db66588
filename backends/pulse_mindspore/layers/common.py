"""Pieces every layer family shares: the per-layer base cell and small tensor helpers.

The interface (``cell(h, shared, skips) -> (h_out, made)``; PyNative mode, so
dicts and lists pass through), the skip-count check and ``need`` are
framework-free: ``pulse.layers.layer_contract``.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from pulse.layers.layer_contract import LayerContract, need
from pulse.layers.layer_recipes import TensorOps
from pulse.layers.split_blocks import MlpHalf, mlp_activation
from pulse_mindspore.layers.basic import Conv2d, LayerNorm, Linear, ParamInit, gelu, gelu_tanh

Shared = Mapping[str, Tensor]
LayerOutput = tuple[Tensor, dict[str, Tensor]]

__all__ = ["MINDSPORE_OPS", "BlockMlpHalf", "LayerOutput", "Mlp", "PatchEmbed", "PulseCell", "Shared",
           "attend", "batch_of", "merge_heads", "need", "patch_tokens", "sdpa", "sinusoid", "sinusoid_freqs",
           "split_heads", "unpatchify"]


class PulseCell(LayerContract, nn.Cell):
    """Base of every layer cell: one schedulable unit with the uniform interface."""

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        raise NotImplementedError


def batch_of(t: Tensor, batch: int) -> Tensor:
    """Per-sample values broadcast to ``batch`` (torch's ``t.expand(batch)``)."""
    return ops.broadcast_to(t, (batch,)) if t.shape != (batch,) else t


def sinusoid_freqs(dim: int, freq_shift: float = 0.0, max_period: float = 10000.0) -> np.ndarray:
    """The frequencies of ``sinusoid``, float32, computed in the order torch computes them.

    A numpy constant rather than ``ops.exp``: MindSpore's CPU exp is off by
    ~5e-6 relative, which timesteps up to 999 would magnify in the phases.
    """
    half = dim // 2
    exponent = np.float32(-math.log(max_period)) * np.arange(half, dtype=np.float32)
    return np.exp(exponent / np.float32(half - freq_shift)).astype(np.float32)


def sinusoid(t: Tensor, dim: int, flip_sin_to_cos: bool, freq_shift: float = 0.0) -> Tensor:
    """Sinusoidal embedding of (B,) values -> (B, dim), fp32 (``pulse_torch``'s ``sinusoid``)."""
    freqs = Tensor(sinusoid_freqs(dim, freq_shift), ms.float32)
    args = t.astype(ms.float32)[:, None] * freqs[None, :]
    parts = (ops.cos(args), ops.sin(args)) if flip_sin_to_cos else (ops.sin(args), ops.cos(args))
    emb = ops.cat(parts, axis=-1)
    return ops.pad(emb, (0, 1)) if dim % 2 else emb


def split_heads(x: Tensor, heads: int) -> Tensor:
    """(B, N, H * D) -> (B, H, N, D)."""
    b, n, _ = x.shape
    return x.reshape(b, n, heads, -1).transpose(0, 2, 1, 3)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, N, D) -> (B, N, H * D)."""
    b, h, n, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, n, h * d)


def sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(d)) v on (B, H, N, D): no fused attention kernel runs on the CPU."""
    scores = ops.matmul(q, k.swapaxes(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    return ops.matmul(ops.softmax(scores, axis=-1), v)


def attend(q: Tensor, k: Tensor, v: Tensor, heads: int) -> Tensor:
    """Multi-head attention on (B, N, H * D) tensors."""
    return merge_heads(sdpa(split_heads(q, heads), split_heads(k, heads), split_heads(v, heads)))


def unpatchify(x: Tensor, patch: int, channels: int) -> Tensor:
    """(B, h w, p p C) tokens -> (B, C, h p, w p): U-ViT's and DiT's layout (p1 p2 C)."""
    b, n, _ = x.shape
    grid = math.isqrt(n)
    x = x.reshape(b, grid, grid, patch, patch, channels).transpose(0, 5, 1, 3, 2, 4)
    return x.reshape(b, channels, grid * patch, grid * patch)


def patch_tokens(conv: Conv2d, x: Tensor) -> Tensor:
    """Patch conv then (B, D, h, w) -> (B, h w, D): timm's PatchEmbed."""
    y = conv(x)
    b, d = y.shape[0], y.shape[1]
    return y.reshape(b, d, -1).transpose(0, 2, 1)


class PatchEmbed(nn.Cell):
    """timm / reference ``PatchEmbed``: a strided conv named ``proj``."""

    def __init__(self, in_channels: int, dim: int, patch: int, init: ParamInit) -> None:
        super().__init__()
        self.proj = Conv2d(in_channels, dim, patch, init, stride=patch)

    def construct(self, x: Tensor) -> Tensor:
        return patch_tokens(self.proj, x)


class Mlp(nn.Cell):
    """timm ``Mlp``: fc1 -> act -> fc2, biases (names match the references)."""

    def __init__(self, dim: int, hidden: int, init: ParamInit, act=gelu, std: float | None = None) -> None:
        super().__init__()
        self.fc1 = Linear(dim, hidden, init, std=std)
        self.act = act
        self.fc2 = Linear(hidden, dim, init, std=std)

    def construct(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class BlockMlpHalf(MlpHalf):
    """A transformer block's MLP half: ``norm2`` then a timm ``Mlp`` (GELU exact or tanh), residual.

    ``std``: the linears' trunc_normal init (U-ViT's 0.02); ``None`` is torch's default init.
    """

    def __init__(self, std: float | None = None) -> None:
        self.std = std

    def build(self, layer: nn.Cell, a: Mapping, init: ParamInit) -> None:
        act = gelu_tanh if mlp_activation(a) == "gelu_tanh" else gelu
        layer.norm2 = LayerNorm(a["dim"], init, a["norm_eps"])
        layer.mlp = Mlp(a["dim"], a["mlp_hidden"], init, act=act, std=self.std)


def _feature_tokens(x: Tensor) -> Tensor:
    b, c, height, width = x.shape
    return x.transpose(0, 2, 3, 1).reshape(b, height * width, c)


# The tensor primitives of pulse.layers.layer_recipes, in MindSpore.
MINDSPORE_OPS = TensorOps(
    cat=lambda xs, axis: ops.cat(list(xs), axis=axis),
    batch_of=batch_of,
    cast_like=lambda x, like: x.astype(like.dtype),
    sinusoid=lambda t, dim, flip_sin_to_cos: sinusoid(t, dim, flip_sin_to_cos),
    where_valid=lambda mask, x, fill: ops.where(mask.astype(ms.bool_)[:, :, None], x, fill.astype(x.dtype)),
    to_tokens=_feature_tokens,
    to_map=lambda x, shape: x.reshape(shape[0], shape[2], shape[3], shape[1]).transpose(0, 3, 1, 2),
)
