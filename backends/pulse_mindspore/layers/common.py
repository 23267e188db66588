"""Pieces every layer family shares: the per-layer interface and small tensor helpers.

The interface the stage executor drives, for every layer kind (as in
``pulse_torch.layers.common``; PyNative mode, so dicts and lists pass through)::

    cell(h, shared, skips) -> (h_out, made)

    h       main-path input (latent, feature map or tokens)
    shared  shared inputs by name: data ones ("timesteps", "context", ...) and
            those earlier layers made ("temb", "c", ...)
    skips   the tensors of the skip edges whose dst is this layer, in spec order
    made    the shared inputs this layer produces ({} for most layers)
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from pulse.errors import SpecError
from pulse_mindspore.layers.basic import Conv2d, Linear, ParamInit, gelu

Shared = Mapping[str, Tensor]
LayerOutput = tuple[Tensor, dict[str, Tensor]]


class PulseCell(nn.Cell):
    """Base of every layer cell: one schedulable unit with the uniform interface."""

    kind: str = ""
    num_skips: int = 0  # how many skip tensors construct expects

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        raise NotImplementedError

    def check_skips(self, skips: Sequence[Tensor]) -> None:
        """Fail loudly when the walker hands the wrong number of skips (a wiring bug)."""
        if len(skips) != self.num_skips:
            raise SpecError(f"layer kind '{self.kind}' expects {self.num_skips} skip tensor(s), "
                            f"got {len(skips)}")


def need(shared: Shared, name: str, kind: str) -> Tensor:
    """``shared[name]`` with an error naming the layer kind when it is missing."""
    try:
        return shared[name]
    except KeyError:
        raise SpecError(f"layer kind '{kind}' reads shared input '{name}', which is missing "
                        f"(have: {', '.join(sorted(shared)) or 'none'})") from None


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
