"""Conditional latent-diffusion UNet (diffusers UNet2DConditionModel) as a ModelSpec.

::

    time_embed ─ conv_in ─ down0 ─ .. ─ down(L-1) ─ mid ─ up0 ─ .. ─ up(L-1) ─ conv_out
                    │         │            │                  │          │
                    │         │            └─ skips ──────────┘          │
                    │         └────────────── skips ──────────────────────┤
                    └──────────────────────── skip ───────────────────────┘
    every encoder output is pushed, every decoder ResNet pops one and
    concatenates it (LIFO, so the edges nest); up_k mirrors down_(L-1-k)

Level ``i`` of the encoder has ``layers_per_block`` (ResNet[, attention])
pairs and, except at the last level, a downsampler; the decoder mirrors it
with one more ResNet per level, each concatenating a skip. The skips are
exactly diffusers' ``down_block_res_samples``. ``split_resnets``: each ResNet as two layers
(``<name>_in``, ``<name>_out``, see ``unet_blocks.resnet_halves``), so the partitioner can cut
inside a block; a decoder's skip goes to the first half. ``split_transformers``: each attention
as two layers per transformer block (``<name>_self<k>``, ``<name>_cross<k>``,
``unet_blocks.transformer2d_parts``). The skip stack pushes a block's last layer either way.
"""
from __future__ import annotations

from dataclasses import dataclass

from pulse.spec import Layer, ModelSpec, SharedInput, SkipEdge
from pulse.zoo import unet_blocks as blocks
from pulse.zoo.unet_blocks import block_of
from pulse.zoo.common import ACT_BYTES, BLOCK_NAME_OPTIONS, config_meta, require


@dataclass(frozen=True)
class UNetConfig:
    name: str
    latent_size: int  # latent height = width
    block_channels: tuple[int, ...]
    cross_attn: tuple[bool, ...]  # per level: CrossAttn{Down,Up}Block2D, else {Down,Up}Block2D
    heads: tuple[int, ...]  # per level (diffusers' ``attention_head_dim`` of SD2 is the head count)
    layers_per_block: int
    context_dim: int
    context_len: int
    norm_groups: int
    temb_dim: int
    in_channels: int = 4
    out_channels: int = 4
    norm_eps: float = 1e-5
    ff_mult: int = 4
    vae_factor: int = 8
    # BasicTransformerBlocks per attention, per level (diffusers' transformer_layers_per_block;
    # the mid block takes the last level's); () = one everywhere (SD 1.x / 2.x).
    transformer_layers: tuple[int, ...] = ()
    # SDXL's addition_embed_type="text_time" when text_embeds_dim > 0: pooled text (text_embeds_dim)
    # and time_ids sinusoids (time_ids x addition_time_embed_dim) added to the time embedding.
    text_embeds_dim: int = 0
    addition_time_embed_dim: int = 0
    time_ids: int = 6
    # Each ResnetBlock2D as two layers (conv1 half, conv2 + shortcut half): finer cuts to balance.
    # True: every one; names ("up1_res0", ...): those alone (pulse.partition.fitted_splits: where a cut falls).
    split_resnets: bool | tuple[str, ...] = False
    # Each Transformer2DModel as two layers per BasicTransformerBlock (self-attention; cross-attention
    # and feed-forward): the largest SD layers (4,096-token self-attention) in two. True or names ("up3_attn0").
    split_transformers: bool | tuple[str, ...] = False
    source: str = ""


# stabilityai/stable-diffusion-2 unet/config.json; context = OpenCLIP-H, 77 tokens x 1024.
SD2_UNET = UNetConfig(
    name="sd2-unet", latent_size=64, block_channels=(320, 640, 1280, 1280),
    cross_attn=(True, True, True, False), heads=(5, 10, 20, 20), layers_per_block=2,
    context_dim=1024, context_len=77, norm_groups=32, temb_dim=1280,
    source="diffusers UNet2DConditionModel, config of stabilityai/stable-diffusion-2 (unet/config.json)",
)

# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json: block_out_channels [320, 640, 1280],
# down DownBlock2D, CrossAttnDownBlock2D x2, transformer_layers_per_block [1, 2, 10],
# attention_head_dim [5, 10, 20], cross_attention_dim 2048 (CLIP-L 768 + OpenCLIP-bigG 1280, 77
# tokens), addition_embed_type "text_time", addition_time_embed_dim 256,
# projection_class_embeddings_input_dim 2816 (= 1280 pooled + 6 time ids x 256), sample_size 128.
SDXL_UNET = UNetConfig(
    name="sdxl-unet", latent_size=128, block_channels=(320, 640, 1280),
    cross_attn=(False, True, True), heads=(5, 10, 20), layers_per_block=2,
    context_dim=2048, context_len=77, norm_groups=32, temb_dim=1280, transformer_layers=(1, 2, 10),
    text_embeds_dim=1280, addition_time_embed_dim=256,
    source="diffusers UNet2DConditionModel, config of stabilityai/stable-diffusion-xl-base-1.0 (unet/config.json)",
)

# The same builder at toy size: < 1M parameters, a CPU step in milliseconds.
TINY_UNET = UNetConfig(
    name="tiny-unet", latent_size=16, block_channels=(32, 64), cross_attn=(True, False),
    heads=(2, 4), layers_per_block=1, context_dim=32, context_len=8, norm_groups=8, temb_dim=128,
    source="tiny test variant of the sd2-unet builder",
)


def _check(cfg: UNetConfig) -> None:
    levels = len(cfg.block_channels)
    require(levels >= 1 and len(cfg.cross_attn) == levels and len(cfg.heads) == levels, cfg.name,
            "block_channels, cross_attn and heads need one entry per level")
    require(cfg.latent_size % (2 ** (levels - 1)) == 0, cfg.name,
            f"latent_size {cfg.latent_size} must be divisible by 2^{levels - 1}")
    for c, h in zip(cfg.block_channels, cfg.heads):
        require(c % cfg.norm_groups == 0, cfg.name, f"{c} channels not divisible by {cfg.norm_groups} groups")
        require(c % h == 0, cfg.name, f"{c} channels not divisible by {h} heads")
    require(cfg.layers_per_block >= 1, cfg.name, "layers_per_block must be >= 1")
    require(not cfg.transformer_layers or (len(cfg.transformer_layers) == levels
                                           and min(cfg.transformer_layers) >= 1), cfg.name,
            "transformer_layers needs one entry >= 1 per level (or none)")
    require(cfg.text_embeds_dim >= 0 and (cfg.text_embeds_dim == 0) == (cfg.addition_time_embed_dim == 0),
            cfg.name, "text_embeds_dim and addition_time_embed_dim are both set (SDXL) or both 0")


def _check_split_names(cfg: UNetConfig, layers: tuple[Layer, ...]) -> None:
    """Every block a split option names is one of the model's blocks of that kind."""
    for option in BLOCK_NAME_OPTIONS:
        named = getattr(cfg, option)
        if isinstance(named, bool):
            continue
        known = list(dict.fromkeys(block_of(l) for l in layers if blocks.SPLIT_OPTIONS.get(l.kind) == option))
        unknown = [b for b in named if b not in known]
        require(not unknown, cfg.name, f"{option}: the model has no block '{unknown[0] if unknown else ''}' of "
                f"that kind (give true, false, or names among {', '.join(known)})")


def _encoder(cfg: UNetConfig) -> tuple[list[Layer], list[Layer]]:
    """Encoder layers (after conv_in) and the skip stack (sources in push order)."""
    layers: list[Layer] = []
    stack: list[Layer] = []
    size, prev = cfg.latent_size, cfg.block_channels[0]
    for i, ch in enumerate(cfg.block_channels):
        for j in range(cfg.layers_per_block):
            ref = f"down_blocks.{i}"
            layers += _resnet(cfg, f"down{i}_res{j}", f"{ref}.resnets.{j}", prev, 0, ch, size)
            if cfg.cross_attn[i]:
                layers += _attn(cfg, f"down{i}_attn{j}", f"{ref}.attentions.{j}", i, size)
            stack.append(layers[-1])
            prev = ch
        if i < len(cfg.block_channels) - 1:
            layers.append(blocks.downsample(f"down{i}_down", f"down_blocks.{i}.downsamplers.0", ch, size))
            stack.append(layers[-1])
            size //= 2
    return layers, stack


def _mid(cfg: UNetConfig, size: int) -> list[Layer]:
    ch = cfg.block_channels[-1]
    res = [_resnet(cfg, f"mid_res{j}", f"mid_block.resnets.{j}", ch, 0, ch, size) for j in range(2)]
    return [*res[0], *_attn(cfg, "mid_attn", "mid_block.attentions.0", len(cfg.block_channels) - 1, size), *res[1]]


def _decoder(cfg: UNetConfig, stack: list[Layer], size: int) -> tuple[list[Layer], list[SkipEdge]]:
    """Decoder layers; each ResNet pops the newest skip (diffusers' res_samples[-1])."""
    layers: list[Layer] = []
    skips: list[SkipEdge] = []
    prev = cfg.block_channels[-1]
    levels = len(cfg.block_channels)
    for k in range(levels):
        i = levels - 1 - k  # the encoder level this decoder level mirrors
        ch, ref = cfg.block_channels[i], f"up_blocks.{k}"
        for j in range(cfg.layers_per_block + 1):
            src = stack.pop()
            skip_c = src.attrs.get("out_channels", src.attrs.get("channels"))
            res = _resnet(cfg, f"up{k}_res{j}", f"{ref}.resnets.{j}", prev, skip_c, ch, size)
            layers += res
            skips.append(SkipEdge(src.name, res[0].name, src.out_bytes))  # the first half concatenates it
            if cfg.cross_attn[i]:
                layers += _attn(cfg, f"up{k}_attn{j}", f"{ref}.attentions.{j}", i, size)
            prev = ch
        if k < levels - 1:
            layers.append(blocks.upsample(f"up{k}_up", f"{ref}.upsamplers.0", ch, size))
            size *= 2
    return layers, skips


def _resnet(cfg: UNetConfig, name: str, ref: str, main_c: int, skip_c: int, cout: int, size: int) -> list[Layer]:
    """One ResnetBlock2D: one layer, or two halves where ``split_resnets`` says so."""
    make = blocks.resnet_halves if splits(cfg.split_resnets, name) else lambda *a: [blocks.resnet(*a)]
    return make(name, ref, main_c, skip_c, cout, cfg.temb_dim, cfg.norm_groups, cfg.norm_eps, size)


def _attn(cfg: UNetConfig, name: str, ref: str, level: int, size: int) -> list[Layer]:
    """One Transformer2DModel: one layer, or two per BasicTransformerBlock with ``split_transformers``."""
    depth = cfg.transformer_layers[level] if cfg.transformer_layers else 1
    args = (name, ref, cfg.block_channels[level], cfg.heads[level], cfg.context_dim, cfg.context_len,
            cfg.norm_groups, size, cfg.ff_mult, depth)
    return blocks.transformer2d_parts(*args) if splits(cfg.split_transformers, name) else [blocks.transformer2d(*args)]


def splits(option: bool | tuple[str, ...], block: str) -> bool:
    """Whether a split option (True, False or block names) cuts ``block`` in two."""
    return option is True or (not isinstance(option, bool) and block in option)


def _added(cfg: UNetConfig) -> blocks.AddedTimeText | None:
    if not cfg.text_embeds_dim:
        return None
    return blocks.AddedTimeText(cfg.text_embeds_dim, cfg.addition_time_embed_dim, cfg.time_ids)


def build_unet(cfg: UNetConfig) -> ModelSpec:
    _check(cfg)
    c0, size = cfg.block_channels[0], cfg.latent_size
    added = _added(cfg)
    head = [blocks.time_embed(c0, cfg.temb_dim, cfg.in_channels, size, added),
            blocks.conv_in(cfg.in_channels, c0, size)]
    encoder, stack = _encoder(cfg)
    stack.insert(0, head[1])  # conv_in's output is the first (outermost) skip
    bottom = size // 2 ** (len(cfg.block_channels) - 1)
    decoder, skips = _decoder(cfg, stack, bottom)
    tail = [blocks.conv_out(c0, cfg.out_channels, cfg.norm_groups, cfg.norm_eps, size)]
    shared = (
        SharedInput("timesteps", 1 * ACT_BYTES, None),
        SharedInput("context", cfg.context_len * cfg.context_dim * ACT_BYTES, None),
        SharedInput("temb", cfg.temb_dim * ACT_BYTES, "time_embed"),
    )
    if added is not None:  # read by time_embed only (diffusers' get_aug_embed)
        shared += (SharedInput("text_embeds", added.text_embeds_dim * ACT_BYTES, None),
                   SharedInput("time_ids", added.time_ids * ACT_BYTES, None))
    layers = tuple(head + encoder + _mid(cfg, bottom) + decoder + tail)
    _check_split_names(cfg, layers)
    return ModelSpec(name=cfg.name, layers=layers,
                     skips=tuple(skips), shared_inputs=shared, act_bytes=ACT_BYTES,
                     meta={"family": "unet", "source": cfg.source, "config": config_meta(cfg),
                           "image_resolution": size * cfg.vae_factor})
