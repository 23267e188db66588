"""Hunyuan-DiT (Tencent/HunyuanDiT hydit/modules/models.py) as a ModelSpec.

::

    cond_embed ─ patch_embed ─ b0 ─ b1 ─ .. ─ b(h-2) ─ b(h-1) ─ b(h) ─ b(h+1) ─ .. ─ b(D-2) ─ b(D-1) ─ final
                                │    │         └───────── skip ─────────┘             │        │
                                │    └───────────────────── skip ─────────────────────┘        │
                                └──────────────────────────── skip ────────────────────────────┘
    D = depth (even), h = D // 2: block i < h - 1 feeds block D - 1 - i, whose
    skip_norm + skip_linear fold it in; b(h-1) and b(h) take no skip. Every
    block reads the shared c and context.

Each block is two layers (``split_blocks``, the default), so the skip-paired
partitioner can balance at half-block steps; the skip runs from the source
block's output to where the destination fuses it::

    block<i>_attn ─ block<i>_mlp ───── skip ─────▶ block<D-1-i>_attn ─ block<D-1-i>_mlp

    _attn   [skip_linear(skip_norm(cat[x, skip]))] ─ x + attn1(norm1 x + shift(c))
            ─ x + attn2(norm3 x, context)
    _mlp    x + mlp(norm2 x)

``cond_embed`` computes the adaLN-style vector c = t_embedder(t) +
extra_embedder([pool(mT5), size sinusoids, style]) and the cross-attention
context cat[CLIP 77 x 1024, mlp_t5(mT5 256 x 2048) -> 256 x 1024] (padding
positions replaced by a learned table), both read by every block; the
latent passes through it to ``patch_embed``.
"""
from __future__ import annotations

from dataclasses import dataclass

from pulse.spec import Layer, ModelSpec, SharedInput, SkipEdge
from pulse.zoo.common import (ACT_BYTES, attention_flops, config_meta, conv_flops, conv_params,
                              fuse_layers, linear_flops, linear_params, make_layer, norm_params,
                              require)


@dataclass(frozen=True)
class HunyuanDiTConfig:
    name: str
    latent_size: int
    dim: int
    depth: int
    heads: int
    mlp_ratio: float
    in_channels: int = 4
    patch: int = 2
    learn_sigma: bool = True  # predicts noise and variance: 2 x in_channels out
    clip_dim: int = 1024  # cross-attention context width (CLIP); mT5 is projected to it
    clip_len: int = 77
    t5_dim: int = 2048
    t5_len: int = 256
    pooled_dim: int = 1024  # AttentionPool output over the mT5 states
    pooler_heads: int = 8
    freq_dim: int = 256  # sinusoid width of the timestep and of each image-size entry
    size_cond: bool = True  # v1.0 / v1.1: 6 image-size sinusoids in c
    style_cond: bool = True
    split_blocks: bool = True  # each block as two layers, block<i>_attn and block<i>_mlp
    vae_factor: int = 8
    source: str = ""


# HUNYUAN_DIT_CONFIG['DiT-g/2'] with the v1.1 conditioning (size and style), 1024 px.
HUNYUAN_DIT_G2 = HunyuanDiTConfig(
    name="hunyuan-dit", latent_size=128, dim=1408, depth=40, heads=16, mlp_ratio=4.3637,
    source="Tencent/HunyuanDiT hydit/modules/models.py, DiT-g/2 (v1.1 conditioning)",
)
TINY_DIT = HunyuanDiTConfig(
    name="tiny-dit", latent_size=8, dim=64, depth=8, heads=4, mlp_ratio=4.0, clip_dim=32, clip_len=8,
    t5_dim=64, t5_len=8, pooled_dim=32, freq_dim=32, source="tiny test variant of the hunyuan-dit builder",
)


def _tokens(cfg: HunyuanDiTConfig) -> int:
    return (cfg.latent_size // cfg.patch) ** 2


def _out_channels(cfg: HunyuanDiTConfig) -> int:
    return cfg.in_channels * (2 if cfg.learn_sigma else 1)


def cond_embed(cfg: HunyuanDiTConfig) -> Layer:
    d, f, e, p = cfg.dim, cfg.freq_dim, cfg.t5_dim, cfg.pooled_dim
    extra_in = p + (6 * f if cfg.size_cond else 0) + (d if cfg.style_cond else 0)
    pool_tokens = cfg.t5_len + 1  # the mean token is prepended
    params = (linear_params(f, d) + linear_params(d, d)                                   # t_embedder
              + pool_tokens * e + 3 * linear_params(e, e) + linear_params(e, p)           # pooler
              + linear_params(extra_in, 4 * d) + linear_params(4 * d, d)                  # extra_embedder
              + (d if cfg.style_cond else 0)                                              # style_embedder
              + linear_params(e, 4 * e) + linear_params(4 * e, cfg.clip_dim)              # mlp_t5
              + (cfg.clip_len + cfg.t5_len) * cfg.clip_dim)                               # text padding
    flops = (linear_flops(f, d) + linear_flops(d, d)
             + linear_flops(e, e) + 2 * linear_flops(e, e, pool_tokens)
             + attention_flops(1, pool_tokens, e) + linear_flops(e, p)
             + linear_flops(extra_in, 4 * d) + linear_flops(4 * d, d)
             + linear_flops(e, 4 * e, cfg.t5_len) + linear_flops(4 * e, cfg.clip_dim, cfg.t5_len))
    saved = ((f + 2 * d)                                  # t_embedder: linear, SiLU, linear inputs
             + pool_tokens * e * 3 + 2 * e                # pooler input, k, v; q, attention out
             + (extra_in + 8 * d)                         # extra_embedder
             + cfg.t5_len * 9 * e)                        # mlp_t5: input, SiLU input, fc2 input
    return make_layer("cond_embed", "hdit_cond_embed", params, flops,
                      cfg.in_channels * cfg.latent_size ** 2, saved,
                      {"dim": d, "freq_dim": f, "clip_dim": cfg.clip_dim, "clip_len": cfg.clip_len,
                       "t5_dim": e, "t5_len": cfg.t5_len, "pooled_dim": p, "pooler_heads": cfg.pooler_heads,
                       "size_cond": cfg.size_cond, "style_cond": cfg.style_cond, "extra_in_dim": extra_in,
                       "passthrough_channels": cfg.in_channels, "height": cfg.latent_size,
                       "width": cfg.latent_size,
                       "ref_module": "t_embedder,pooler,extra_embedder,style_embedder,mlp_t5,"
                                     "text_embedding_padding"})


def patch_embed(cfg: HunyuanDiTConfig) -> Layer:
    grid = cfg.latent_size // cfg.patch
    return make_layer("patch_embed", "hdit_patch_embed", conv_params(cfg.in_channels, cfg.dim, cfg.patch),
                      conv_flops(cfg.in_channels, cfg.dim, cfg.patch, grid, grid), grid * grid * cfg.dim,
                      cfg.in_channels * cfg.latent_size ** 2,
                      {"in_channels": cfg.in_channels, "dim": cfg.dim, "patch": cfg.patch,
                       "latent_size": cfg.latent_size, "tokens": grid * grid, "ref_module": "x_embedder"})


def block_attn(cfg: HunyuanDiTConfig, index: int, skip: bool) -> Layer:
    """[skip_norm, skip_linear] -> x + attn1(norm1 x + shift(c)) -> x + attn2(norm3 x, context)."""
    d, n, t, lt = cfg.dim, _tokens(cfg), cfg.clip_dim, cfg.clip_len + cfg.t5_len
    hd = d // cfg.heads
    params = (norm_params(d) + linear_params(d, 3 * d) + 2 * norm_params(hd) + linear_params(d, d)  # attn1
              + linear_params(d, d)                                                                # shift(c)
              + norm_params(d) + linear_params(d, d) + linear_params(t, 2 * d) + 2 * norm_params(hd)
              + linear_params(d, d)                                                                # attn2
              + ((norm_params(2 * d) + linear_params(2 * d, d)) if skip else 0))
    flops = (linear_flops(d, 3 * d, n) + attention_flops(n, n, d) + linear_flops(d, d, n)
             + linear_flops(d, d)
             + 2 * linear_flops(d, d, n) + linear_flops(t, 2 * d, lt) + attention_flops(n, lt, d)
             + (linear_flops(2 * d, d, n) if skip else 0))
    # Per token: skip concat and skip_linear input (4 D); norm1, Wqkv input,
    # q k v, normed q k, rotated q k, attention out (10 D); norm3, q_proj input,
    # q, normed q, rotated q, attention out (6 D). Context side: k, v, normed k;
    # and the modulation's SiLU(c) (D).
    saved = ((4 * d if skip else 0) + 16 * d) * n + 3 * lt * d + d
    return make_layer(f"block{index}_attn", "hdit_block_attn", params, flops, n * d, saved,
                      {"dim": d, "heads": cfg.heads, "head_dim": hd, "context_dim": t, "context_len": lt,
                       "c_dim": d, "tokens": n, "grid": cfg.latent_size // cfg.patch, "skip": skip,
                       "qk_norm": True, "qkv_bias": True, "norm": "layer", "norm_eps": 1e-6, "rope": "2d",
                       "ref_module": f"blocks.{index}"})


def block_mlp(cfg: HunyuanDiTConfig, index: int) -> Layer:
    """x + fc2(GELU-tanh(fc1(norm2 x)))."""
    d, n = cfg.dim, _tokens(cfg)
    hidden = int(d * cfg.mlp_ratio)
    params = norm_params(d) + linear_params(d, hidden) + linear_params(hidden, d)
    flops = linear_flops(d, hidden, n) + linear_flops(hidden, d, n)
    saved = (2 * d + 2 * hidden) * n  # per token: norm2 and fc1 inputs, GELU and fc2 inputs
    return make_layer(f"block{index}_mlp", "hdit_block_mlp", params, flops, n * d, saved,
                      {"dim": d, "mlp_hidden": hidden, "tokens": n, "norm": "layer", "norm_eps": 1e-6,
                       "activation": "gelu_tanh", "ref_module": f"blocks.{index}"})


def block(cfg: HunyuanDiTConfig, index: int, skip: bool) -> list[Layer]:
    """One ``HunYuanDiTBlock``: ``block<i>_attn, block<i>_mlp`` (or one ``hdit_block`` unsplit)."""
    halves = [block_attn(cfg, index, skip), block_mlp(cfg, index)]
    return halves if cfg.split_blocks else [fuse_layers(f"block{index}", "hdit_block", halves)]


def final(cfg: HunyuanDiTConfig) -> Layer:
    """adaLN (shift, scale from c) on a non-affine LayerNorm -> linear -> unpatchify."""
    d, n, c = cfg.dim, _tokens(cfg), _out_channels(cfg)
    pix = cfg.patch ** 2 * c
    params = linear_params(d, 2 * d) + linear_params(d, pix)
    flops = linear_flops(d, 2 * d) + linear_flops(d, pix, n)
    return make_layer("final", "hdit_final", params, flops, c * cfg.latent_size ** 2, 2 * d * n + d,
                      {"dim": d, "patch": cfg.patch, "out_channels": c, "latent_size": cfg.latent_size,
                       "tokens": n, "c_dim": d, "norm_eps": 1e-6, "ref_module": "final_layer"})


def _check(cfg: HunyuanDiTConfig) -> None:
    # Odd depths leave the reference's skip stack unbalanced (one pop too many).
    require(cfg.depth >= 4 and cfg.depth % 2 == 0, cfg.name, f"depth must be even and >= 4, got {cfg.depth}")
    require(cfg.latent_size % cfg.patch == 0, cfg.name, "latent_size must be divisible by patch")
    require(cfg.dim % cfg.heads == 0, cfg.name, f"dim {cfg.dim} not divisible by {cfg.heads} heads")
    require(cfg.t5_dim % cfg.pooler_heads == 0, cfg.name, "t5_dim must be divisible by pooler_heads")


def build_hunyuan_dit(cfg: HunyuanDiTConfig) -> ModelSpec:
    _check(cfg)
    half = cfg.depth // 2
    # The reference pushes blocks 0 .. half-2 and gives blocks half+1 .. depth-1 a skip.
    blocks = [block(cfg, i, i > half) for i in range(cfg.depth)]
    # From block i's last layer (its output) to block depth-1-i's first (its skip fusion).
    skips = [SkipEdge(blocks[i][-1].name, blocks[cfg.depth - 1 - i][0].name, blocks[i][-1].out_bytes)
             for i in range(half - 1)]
    layers = [cond_embed(cfg), patch_embed(cfg), *(l for blk in blocks for l in blk), final(cfg)]
    a = ACT_BYTES
    data = [("timesteps", 1), ("text_clip", cfg.clip_len * cfg.clip_dim), ("text_clip_mask", cfg.clip_len),
            ("text_t5", cfg.t5_len * cfg.t5_dim), ("text_t5_mask", cfg.t5_len)]
    data += [("image_meta_size", 6)] if cfg.size_cond else []
    data += [("style", 1)] if cfg.style_cond else []
    shared = [SharedInput(name, elems * a, None) for name, elems in data]
    shared += [SharedInput("c", cfg.dim * a, "cond_embed"),
               SharedInput("context", (cfg.clip_len + cfg.t5_len) * cfg.clip_dim * a, "cond_embed")]
    return ModelSpec(name=cfg.name, layers=tuple(layers), skips=tuple(skips), shared_inputs=tuple(shared),
                     act_bytes=ACT_BYTES,
                     meta={"family": "hunyuan-dit", "source": cfg.source, "config": config_meta(cfg),
                           "image_resolution": cfg.latent_size * cfg.vae_factor})
