"""Pieces every layer family shares: the per-layer base module and small tensor helpers.

The interface (``module(h, shared, skips) -> (h_out, made)``), the skip-count
check and ``need`` are framework-free: ``pulse.layers.layer_contract``.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pulse.layers.layer_contract import LayerContract, need
from pulse.layers.layer_recipes import TensorOps
from pulse.layers.split_blocks import MlpHalf, mlp_activation

Shared = Mapping[str, Tensor]
LayerOutput = tuple[Tensor, dict[str, Tensor]]

__all__ = ["TORCH_OPS", "BlockMlpHalf", "LayerOutput", "Mlp", "PatchEmbed", "PulseLayer", "Shared", "attend",
           "merge_heads", "need", "patch_tokens", "sinusoid", "split_heads", "unpatchify"]


class PulseLayer(LayerContract, nn.Module):
    """Base of every layer module: one schedulable unit with the uniform interface."""

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        raise NotImplementedError


def sinusoid(t: Tensor, dim: int, flip_sin_to_cos: bool, freq_shift: float = 0.0,
             max_period: float = 10000.0) -> Tensor:
    """Sinusoidal embedding of (B,) values -> (B, dim), fp32.

    ``freq_shift=0, flip_sin_to_cos=True`` is diffusers' SD2 ``Timesteps`` and
    also the DiT / U-ViT ``timestep_embedding`` (cos first, frequencies / half).
    """
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device)
    freqs = torch.exp(exponent / (half - freq_shift))
    args = t.float()[:, None] * freqs[None, :]
    parts = (torch.cos(args), torch.sin(args)) if flip_sin_to_cos else (torch.sin(args), torch.cos(args))
    emb = torch.cat(parts, dim=-1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


def split_heads(x: Tensor, heads: int) -> Tensor:
    """(B, N, H * D) -> (B, H, N, D)."""
    b, n, _ = x.shape
    return x.view(b, n, heads, -1).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, N, D) -> (B, N, H * D)."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


def attend(q: Tensor, k: Tensor, v: Tensor, heads: int) -> Tensor:
    """Multi-head softmax(q k^T / sqrt(d)) v on (B, N, H * D) tensors."""
    out = F.scaled_dot_product_attention(split_heads(q, heads), split_heads(k, heads),
                                         split_heads(v, heads))
    return merge_heads(out)


def unpatchify(x: Tensor, patch: int, channels: int) -> Tensor:
    """(B, h w, p p C) tokens -> (B, C, h p, w p): U-ViT's and DiT's layout (p1 p2 C)."""
    b, n, _ = x.shape
    grid = math.isqrt(n)
    x = x.reshape(b, grid, grid, patch, patch, channels)
    return torch.einsum("nhwpqc->nchpwq", x).reshape(b, channels, grid * patch, grid * patch)


def patch_tokens(conv: nn.Conv2d, x: Tensor) -> Tensor:
    """Patch conv then (B, D, h, w) -> (B, h w, D): timm's PatchEmbed."""
    return conv(x).flatten(2).transpose(1, 2)


class PatchEmbed(nn.Module):
    """timm / reference ``PatchEmbed``: a strided conv named ``proj``."""

    def __init__(self, in_channels: int, dim: int, patch: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, patch, stride=patch)

    def forward(self, x: Tensor) -> Tensor:
        return patch_tokens(self.proj, x)


class Mlp(nn.Module):
    """timm ``Mlp``: fc1 -> act -> fc2, biases (names match the references)."""

    def __init__(self, dim: int, hidden: int, approximate: str = "none") -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate=approximate)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class BlockMlpHalf(MlpHalf):
    """A transformer block's MLP half: ``norm2`` then a timm ``Mlp`` (GELU exact or tanh), residual."""

    def build(self, layer: nn.Module, a: Mapping) -> None:
        approximate = "tanh" if mlp_activation(a) == "gelu_tanh" else "none"
        layer.norm2 = nn.LayerNorm(a["dim"], eps=a["norm_eps"])
        layer.mlp = Mlp(a["dim"], a["mlp_hidden"], approximate=approximate)


def _feature_tokens(x: Tensor) -> Tensor:
    b, c, height, width = x.shape
    return x.permute(0, 2, 3, 1).reshape(b, height * width, c)


def _feature_map(x: Tensor, shape: tuple[int, int, int, int]) -> Tensor:
    b, c, height, width = shape
    # contiguous, as diffusers' Transformer2DModel does: a channels-last view here makes the
    # next convolution's weight gradient crash (SIGSEGV, torch 2.13 CPU) when the backward is
    # split into input and weight halves (zero-bubble schedules)
    return x.reshape(b, height, width, c).permute(0, 3, 1, 2).contiguous()


# The tensor primitives of pulse.layers.layer_recipes, in torch.
TORCH_OPS = TensorOps(
    cat=lambda xs, axis: torch.cat(list(xs), dim=axis),
    batch_of=lambda t, batch: t.expand(batch),
    cast_like=lambda x, like: x.to(like.dtype),
    sinusoid=lambda t, dim, flip_sin_to_cos: sinusoid(t, dim, flip_sin_to_cos),
    where_valid=lambda mask, x, fill: torch.where(mask.bool()[:, :, None], x, fill.to(x.dtype)),
    to_tokens=_feature_tokens,
    to_map=_feature_map,
)
