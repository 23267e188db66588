"""Hunyuan-DiT building blocks below the layer level: RoPE, attention, the conditioning parts.

Names and maths as ``pulse_torch.layers.dit_parts`` (Tencent/HunyuanDiT
``hydit/modules``). The RoPE tables are numpy constants, computed in float32
exactly as the torch side computes them.
"""
from __future__ import annotations

import math
from functools import lru_cache

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from pulse_mindspore.layers.basic import Act, LayerNorm, Linear, ParamInit, silu
from pulse_mindspore.layers.common import merge_heads, sdpa, sinusoid, split_heads

# The reference's RoPE positions for a grid resized into a 512 px base (see pulse_torch.layers.dit_parts).
ROPE_BASE_GRID = 32
ROPE_THETA = 10000.0


def _rope_axis(pos: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """``get_1d_rotary_pos_embed(use_real=True)``: (N, dim) cos and sin, each frequency twice."""
    freqs = (1.0 / ROPE_THETA ** (np.arange(0, dim, 2, dtype=np.float32)[: dim // 2] / np.float32(dim)))
    angles = np.outer(pos, freqs.astype(np.float32)).astype(np.float32)
    return np.repeat(np.cos(angles), 2, axis=1), np.repeat(np.sin(angles), 2, axis=1)


def rope_2d(grid: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(grid^2, head_dim) float32 cos and sin tables: first half by column, second half by row."""
    if head_dim % 4:
        raise ValueError(f"2D RoPE needs head_dim divisible by 4, got {head_dim}")
    pos = np.arange(grid, dtype=np.float32) * np.float32(ROPE_BASE_GRID / grid)
    cols, rows = np.tile(pos, grid), np.repeat(pos, grid)
    cos_c, sin_c = _rope_axis(cols, head_dim // 2)
    cos_r, sin_r = _rope_axis(rows, head_dim // 2)
    return (np.concatenate([cos_c, cos_r], axis=1).astype(np.float32),
            np.concatenate([sin_c, sin_r], axis=1).astype(np.float32))


def rotate_half_matrix(dim: int) -> np.ndarray:
    """R with x @ R = rotate_half(x): interleaved pairs (a, b) -> (-b, a), i.e. multiplication by i.

    A constant matrix rather than a stack (``StackExt`` has no CPU kernel);
    its entries are 0 and +-1, so the product is exact.
    """
    r = np.zeros((dim, dim), dtype=np.float32)
    for i in range(0, dim, 2):
        r[i + 1, i] = -1.0
        r[i, i + 1] = 1.0
    return r


class Rope:
    """The cos, sin and rotation tables of a grid's RoPE, as tensors (not parameters, not saved).

    Every block of a model shares one (``rope_for``): the tables depend only on
    the grid and the head width.
    """

    def __init__(self, grid: int, head_dim: int) -> None:
        cos, sin = rope_2d(grid, head_dim)
        self.cos, self.sin = Tensor(cos, ms.float32), Tensor(sin, ms.float32)
        self.rot = Tensor(rotate_half_matrix(head_dim), ms.float32)

    def apply(self, x: Tensor) -> Tensor:
        """Rotate (B, H, N, D) queries or keys."""
        return x * self.cos + ops.matmul(x, self.rot) * self.sin


@lru_cache(maxsize=None)
def rope_for(grid: int, head_dim: int) -> Rope:
    return Rope(grid, head_dim)


class SelfAttention(nn.Cell):
    """``attn_layers.Attention`` with qk-norm and RoPE: Wqkv, q_norm, k_norm, out_proj."""

    def __init__(self, dim: int, heads: int, qkv_bias: bool, eps: float, init: ParamInit) -> None:
        super().__init__()
        self.heads = heads
        head_dim = dim // heads
        self.Wqkv = Linear(dim, 3 * dim, init, bias=qkv_bias)
        self.q_norm = LayerNorm(head_dim, init, eps)
        self.k_norm = LayerNorm(head_dim, init, eps)
        self.out_proj = Linear(dim, dim, init, bias=qkv_bias)

    def construct(self, x: Tensor, rope: Rope) -> Tensor:
        q, k, v = (split_heads(t, self.heads) for t in ops.chunk(self.Wqkv(x), 3, axis=-1))
        q = rope.apply(self.q_norm(q))
        k = rope.apply(self.k_norm(k))
        return self.out_proj(merge_heads(sdpa(q, k, v)))


class CrossAttention(nn.Cell):
    """``attn_layers.CrossAttention``: q_proj, kv_proj over the text, qk-norm, RoPE on q only."""

    def __init__(self, dim: int, context_dim: int, heads: int, qkv_bias: bool, eps: float,
                 init: ParamInit) -> None:
        super().__init__()
        self.heads = heads
        head_dim = dim // heads
        self.q_proj = Linear(dim, dim, init, bias=qkv_bias)
        self.kv_proj = Linear(context_dim, 2 * dim, init, bias=qkv_bias)
        self.q_norm = LayerNorm(head_dim, init, eps)
        self.k_norm = LayerNorm(head_dim, init, eps)
        self.out_proj = Linear(dim, dim, init, bias=qkv_bias)

    def construct(self, x: Tensor, context: Tensor, rope: Rope) -> Tensor:
        q = rope.apply(self.q_norm(split_heads(self.q_proj(x), self.heads)))
        k, v = (split_heads(t, self.heads) for t in ops.chunk(self.kv_proj(context), 2, axis=-1))
        return self.out_proj(merge_heads(sdpa(q, self.k_norm(k), v)))


class TimestepEmbedder(nn.Cell):
    """DiT ``TimestepEmbedder``: sinusoid (cos first) -> mlp = [Linear, SiLU, Linear]."""

    def __init__(self, dim: int, freq_dim: int, init: ParamInit) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.SequentialCell([Linear(freq_dim, dim, init), Act(silu), Linear(dim, dim, init)])

    def construct(self, t: Tensor) -> Tensor:
        return self.mlp(sinusoid(t, self.freq_dim, flip_sin_to_cos=True))


class AttentionPool(nn.Cell):
    """``poolers.AttentionPool`` (CLIP style): the mean token queries [mean, tokens] + positions."""

    def __init__(self, length: int, dim: int, heads: int, out_dim: int, init: ParamInit) -> None:
        super().__init__()
        self.heads = heads
        self.positional_embedding = init.normal((length + 1, dim), 1.0 / math.sqrt(dim))
        self.k_proj = Linear(dim, dim, init)
        self.q_proj = Linear(dim, dim, init)
        self.v_proj = Linear(dim, dim, init)
        self.c_proj = Linear(dim, out_dim, init)

    def construct(self, x: Tensor) -> Tensor:
        """(B, L, dim) -> (B, out_dim)."""
        x = ops.cat([x.mean(axis=1, keep_dims=True), x], axis=1) + self.positional_embedding
        q, k, v = self.q_proj(x[:, :1]), self.k_proj(x), self.v_proj(x)
        out = sdpa(split_heads(q, self.heads), split_heads(k, self.heads), split_heads(v, self.heads))
        return self.c_proj(merge_heads(out))[:, 0]
