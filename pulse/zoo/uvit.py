"""U-ViT (Bao et al., CVPR 2023; baofff/U-ViT libs/uvit.py) as a ModelSpec.

::

    embed ─ in0 ─ in1 ─ .. ─ in(k-1) ─ mid ─ out0 ─ .. ─ out(k-2) ─ out(k-1) ─ final
              │     │          └───── skip ────┘           │          │
              │     └──────────────── skip ────────────────┘          │
              └───────────────────────── skip ────────────────────────┘
    out_i = Block(skip_linear(cat[x, in_(k-1-i)])): the mirror, properly nested

Each block is two layers (``split_blocks``, the default), so the skip-paired
partitioner can balance at half-block steps::

    in(k-1-i)_attn ─ in(k-1-i)_mlp ───── skip ─────▶ out(i)_attn ─ out(i)_mlp

    _attn   [skip_linear(cat[x, skip])] ─ x + attn(LN1 x)
    _mlp    x + MLP(LN2 x)

Tokens: [label token,] time token, then the (latent / patch)^2 patch tokens.
``depth`` counts every block: 2k + 1 (the reference config's ``depth=28``
builds 14 in-blocks, a mid block and 14 out-blocks: 29).
"""
from __future__ import annotations

from dataclasses import dataclass

from pulse.spec import Layer, ModelSpec, SharedInput, SkipEdge
from pulse.zoo.common import (ACT_BYTES, attention_flops, config_meta, conv_flops, conv_params,
                              fuse_layers, linear_flops, linear_params, make_layer, norm_params,
                              require)


@dataclass(frozen=True)
class UViTConfig:
    name: str
    latent_size: int
    dim: int
    depth: int  # all blocks: in-blocks + mid + out-blocks (odd)
    heads: int
    in_channels: int = 4
    patch: int = 2
    mlp_ratio: float = 4.0
    qkv_bias: bool = False
    num_classes: int = 1001  # 1000 ImageNet classes + the null class for guidance; 0: no label token
    conv: bool = False  # the final 3x3 conv (off in the ImageNet-256 U-ViT-H/2 config)
    split_blocks: bool = True  # each Block as two layers, <name>_attn and <name>_mlp
    vae_factor: int = 8
    source: str = ""


# configs/imagenet256_uvit_huge.py of baofff/U-ViT (U-ViT-H/2, class-conditional).
UVIT_H2 = UViTConfig(name="uvit", latent_size=32, dim=1152, depth=29, heads=16,
                     source="baofff/U-ViT libs/uvit.py with configs/imagenet256_uvit_huge.py")
TINY_UVIT = UViTConfig(name="tiny-uvit", latent_size=8, dim=64, depth=7, heads=4, num_classes=11,
                       conv=True, source="tiny test variant of the uvit builder")


def _tokens(cfg: UViTConfig) -> tuple[int, int]:
    """(extra tokens, all tokens)."""
    extras = 1 + (1 if cfg.num_classes > 0 else 0)
    return extras, extras + (cfg.latent_size // cfg.patch) ** 2


def embed(cfg: UViTConfig) -> Layer:
    """Patch conv + sinusoidal time token + label embedding + learned positions."""
    extras, n = _tokens(cfg)
    patches = n - extras
    grid = cfg.latent_size // cfg.patch
    params = (conv_params(cfg.in_channels, cfg.dim, cfg.patch) + cfg.num_classes * cfg.dim + n * cfg.dim)
    flops = conv_flops(cfg.in_channels, cfg.dim, cfg.patch, grid, grid)
    return make_layer("embed", "uvit_embed", params, flops, n * cfg.dim,
                      cfg.in_channels * cfg.latent_size ** 2,  # the patch conv's input
                      {"in_channels": cfg.in_channels, "latent_size": cfg.latent_size, "patch": cfg.patch,
                       "dim": cfg.dim, "num_classes": cfg.num_classes, "extras": extras,
                       "tokens": n, "patches": patches, "time_embed": "sinusoid",
                       "ref_module": "patch_embed,label_emb,pos_embed"})


def block_attn(cfg: UViTConfig, name: str, ref: str, skip: bool) -> Layer:
    """First half of a ``Block``: [skip_linear(2D -> D) on cat[x, skip]] -> x + attn(LN1(x))."""
    d, n = cfg.dim, _tokens(cfg)[1]
    params = (norm_params(d) + linear_params(d, 3 * d, cfg.qkv_bias) + linear_params(d, d)
              + (linear_params(2 * d, d) if skip else 0))
    flops = (linear_flops(d, 3 * d, n) + attention_flops(n, n, d) + linear_flops(d, d, n)
             + (linear_flops(2 * d, d, n) if skip else 0))
    # Per token: LN1 input, qkv input, q k v, attention out (the proj input):
    # 6 x D; the skip concat (skip_linear's input): 2 x D.
    saved = (6 * d + (2 * d if skip else 0)) * n
    return make_layer(f"{name}_attn", "uvit_block_attn", params, flops, n * d, saved,
                      {"dim": d, "heads": cfg.heads, "head_dim": d // cfg.heads, "qkv_bias": cfg.qkv_bias,
                       "tokens": n, "skip": skip, "norm_eps": 1e-5, "ref_module": ref})


def block_mlp(cfg: UViTConfig, name: str, ref: str) -> Layer:
    """Second half of a ``Block``: x + fc2(GELU(fc1(LN2(x))))."""
    d, n = cfg.dim, _tokens(cfg)[1]
    hidden = int(d * cfg.mlp_ratio)
    params = norm_params(d) + linear_params(d, hidden) + linear_params(hidden, d)
    flops = linear_flops(d, hidden, n) + linear_flops(hidden, d, n)
    saved = (2 * d + 2 * hidden) * n  # per token: LN2 and fc1 inputs, GELU and fc2 inputs
    return make_layer(f"{name}_mlp", "uvit_block_mlp", params, flops, n * d, saved,
                      {"dim": d, "mlp_hidden": hidden, "tokens": n, "norm_eps": 1e-5, "activation": "gelu",
                       "ref_module": ref})


def block(cfg: UViTConfig, name: str, ref: str, skip: bool) -> list[Layer]:
    """One reference ``Block``: ``<name>_attn, <name>_mlp`` (or one ``uvit_block`` unsplit)."""
    halves = [block_attn(cfg, name, ref, skip), block_mlp(cfg, name, ref)]
    return halves if cfg.split_blocks else [fuse_layers(name, "uvit_block", halves)]


def final(cfg: UViTConfig) -> Layer:
    """LayerNorm -> linear to patch pixels -> drop extra tokens -> unpatchify [-> 3x3 conv]."""
    d, c, s = cfg.dim, cfg.in_channels, cfg.latent_size
    extras, n = _tokens(cfg)
    pix = cfg.patch ** 2 * c
    params = norm_params(d) + linear_params(d, pix) + (conv_params(c, c, 3) if cfg.conv else 0)
    flops = linear_flops(d, pix, n) + (conv_flops(c, c, 3, s, s) if cfg.conv else 0)
    saved = 2 * d * n + (c * s * s if cfg.conv else 0)  # LN and linear inputs, conv input
    return make_layer("final", "uvit_final", params, flops, c * s * s, saved,
                      {"dim": d, "patch": cfg.patch, "out_channels": c, "latent_size": s, "tokens": n,
                       "extras": extras, "conv": cfg.conv, "norm_eps": 1e-5,
                       "ref_module": "norm,decoder_pred" + (",final_layer" if cfg.conv else "")})


def build_uvit(cfg: UViTConfig) -> ModelSpec:
    require(cfg.depth >= 3 and cfg.depth % 2 == 1, cfg.name, f"depth must be odd and >= 3, got {cfg.depth}")
    require(cfg.latent_size % cfg.patch == 0, cfg.name, "latent_size must be divisible by patch")
    require(cfg.dim % cfg.heads == 0, cfg.name, f"dim {cfg.dim} not divisible by {cfg.heads} heads")
    k = cfg.depth // 2
    ins = [block(cfg, f"in{i}", f"in_blocks.{i}", False) for i in range(k)]
    mid = block(cfg, "mid", "mid_block", False)
    outs = [block(cfg, f"out{i}", f"out_blocks.{i}", True) for i in range(k)]
    # A skip leaves its in-block's last layer (the block output) and enters the
    # mirror out-block's first layer (where skip_linear fuses it).
    skips = [SkipEdge(ins[k - 1 - i][-1].name, outs[i][0].name, ins[k - 1 - i][-1].out_bytes) for i in range(k)]
    layers = [embed(cfg), *(l for blk in [*ins, mid, *outs] for l in blk), final(cfg)]
    shared = [SharedInput("timesteps", 1 * ACT_BYTES, None)]
    if cfg.num_classes > 0:
        shared.append(SharedInput("labels", 1 * ACT_BYTES, None))
    return ModelSpec(name=cfg.name, layers=tuple(layers), skips=tuple(skips), shared_inputs=tuple(shared),
                     act_bytes=ACT_BYTES,
                     meta={"family": "uvit", "source": cfg.source, "config": config_meta(cfg),
                           "image_resolution": cfg.latent_size * cfg.vae_factor})
