"""Hunyuan-DiT building blocks below the layer level: RoPE, attention, the conditioning parts.

Names and maths follow Tencent/HunyuanDiT ``hydit/modules`` (``attn_layers.py``,
``posemb_layers.py``, ``poolers.py``, ``embedders.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pulse_torch.layers.common import merge_heads, sinusoid, split_heads

# The reference builds RoPE positions for a grid resized into a 512 px base
# (``base_size = 512 // 8 // patch_size`` = 32 for patch 2): a g x g grid gets
# positions k * 32 / g, so 1024 px (g = 64) steps by 0.5.
ROPE_BASE_GRID = 32
ROPE_THETA = 10000.0


def _rope_axis(pos: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``get_1d_rotary_pos_embed(use_real=True)``: (N, dim) cos and sin, each frequency twice."""
    freqs = 1.0 / ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float32)[: dim // 2] / dim)
    angles = torch.outer(pos, freqs)
    return angles.cos().repeat_interleave(2, dim=1), angles.sin().repeat_interleave(2, dim=1)


def rope_2d(grid: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """(grid^2, head_dim) cos and sin tables: first half by column, second half by row.

    The reference's meshgrid is ``np.meshgrid(grid_w, grid_h)``, whose first
    plane (the one its ``emb_h`` reads) varies along the width; tokens are
    row-major (token r * grid + c), as the patch embedding flattens them.
    """
    if head_dim % 4:
        raise ValueError(f"2D RoPE needs head_dim divisible by 4, got {head_dim}")
    pos = torch.arange(grid, dtype=torch.float32) * (ROPE_BASE_GRID / grid)
    cols, rows = pos.repeat(grid), pos.repeat_interleave(grid)
    cos_c, sin_c = _rope_axis(cols, head_dim // 2)
    cos_r, sin_r = _rope_axis(rows, head_dim // 2)
    return torch.cat([cos_c, cos_r], dim=1), torch.cat([sin_c, sin_r], dim=1)


def rotate_half(x: Tensor) -> Tensor:
    """Interleaved pairs (a, b) -> (-b, a): multiplication by i of a + ib."""
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    return torch.stack([-imag, real], dim=-1).flatten(-2)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, H, N, D) queries or keys by the (N, D) tables."""
    return x * cos + rotate_half(x) * sin


class SelfAttention(nn.Module):
    """``attn_layers.Attention`` with qk-norm and RoPE: Wqkv, q_norm, k_norm, out_proj."""

    def __init__(self, dim: int, heads: int, qkv_bias: bool, eps: float) -> None:
        super().__init__()
        self.heads = heads
        head_dim = dim // heads
        self.Wqkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.q_norm = nn.LayerNorm(head_dim, eps=eps)
        self.k_norm = nn.LayerNorm(head_dim, eps=eps)
        self.out_proj = nn.Linear(dim, dim, bias=qkv_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q, k, v = (split_heads(t, self.heads) for t in self.Wqkv(x).chunk(3, dim=-1))
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)
        return self.out_proj(merge_heads(F.scaled_dot_product_attention(q, k, v)))


class CrossAttention(nn.Module):
    """``attn_layers.CrossAttention``: q_proj, kv_proj over the text, qk-norm, RoPE on q only."""

    def __init__(self, dim: int, context_dim: int, heads: int, qkv_bias: bool, eps: float) -> None:
        super().__init__()
        self.heads = heads
        head_dim = dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv_proj = nn.Linear(context_dim, 2 * dim, bias=qkv_bias)
        self.q_norm = nn.LayerNorm(head_dim, eps=eps)
        self.k_norm = nn.LayerNorm(head_dim, eps=eps)
        self.out_proj = nn.Linear(dim, dim, bias=qkv_bias)

    def forward(self, x: Tensor, context: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q = apply_rope(self.q_norm(split_heads(self.q_proj(x), self.heads)), cos, sin)
        k, v = (split_heads(t, self.heads) for t in self.kv_proj(context).chunk(2, dim=-1))
        out = F.scaled_dot_product_attention(q, self.k_norm(k), v)
        return self.out_proj(merge_heads(out))


class TimestepEmbedder(nn.Module):
    """DiT ``TimestepEmbedder``: sinusoid (cos first) -> mlp = [Linear, SiLU, Linear]."""

    def __init__(self, dim: int, freq_dim: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        return self.mlp(sinusoid(t, self.freq_dim, flip_sin_to_cos=True).to(self.mlp[0].weight.dtype))


class AttentionPool(nn.Module):
    """``poolers.AttentionPool`` (CLIP style): the mean token queries [mean, tokens] + positions."""

    def __init__(self, length: int, dim: int, heads: int, out_dim: int) -> None:
        super().__init__()
        self.heads = heads
        self.positional_embedding = nn.Parameter(torch.randn(length + 1, dim) / dim ** 0.5)
        self.k_proj = nn.Linear(dim, dim)
        self.q_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.c_proj = nn.Linear(dim, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        """(B, L, dim) -> (B, out_dim)."""
        x = torch.cat([x.mean(dim=1, keepdim=True), x], dim=1) + self.positional_embedding.to(x.dtype)
        q, k, v = self.q_proj(x[:, :1]), self.k_proj(x), self.v_proj(x)
        out = F.scaled_dot_product_attention(split_heads(q, self.heads), split_heads(k, self.heads),
                                             split_heads(v, self.heads))
        return self.c_proj(merge_heads(out))[:, 0]


def mlp_silu(fin: int, hidden: int, fout: int) -> nn.Sequential:
    """[Linear, SiLU, Linear]: the reference's ``extra_embedder`` and ``mlp_t5`` layout."""
    return nn.Sequential(nn.Linear(fin, hidden), nn.SiLU(), nn.Linear(hidden, fout))
