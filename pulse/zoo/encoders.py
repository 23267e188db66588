"""The frozen encoders of the zoo's latent diffusion models, counted from their hyper-parameters.

Same conventions as the backbones (``pulse.zoo.common``): forward FLOPs of the
matrix products only, a multiply-add is 2 FLOPs, fp16 bytes. Each figure below
is computed from the published configuration named in its ``source``, so a
different resolution or text length recounts instead of reusing a number::

    sd2-unet      text  OpenCLIP ViT-H/14 text tower, 23 of its 24 blocks (SD 2 reads the penultimate)
                  vae   the SD VAE encoder (AutoencoderKL, 128/256/512/512 channels), 512 px -> 4 x 64 x 64
    hunyuan-dit   clip  the bilingual CLIP text encoder (BERT-large shape, 24 x 1024), 77 tokens
                  mt5   the mT5-XL encoder (24 x 2048, gated-GELU 5120), 256 tokens
                  vae   sdxl-vae-fp16-fix's encoder (the SD VAE encoder's shape), 1024 px -> 4 x 128 x 128
    sdxl-unet     text  CLIP ViT-L/14 text (12 x 768) and OpenCLIP ViT-bigG/14 text (32 x 1280, its 1280 x 1280
    (and diffusers     text projection) as one task, 77 tokens each: context (77 x 2048), pooled
     text_time          text_embeds (1280) and the image's time_ids (6), read by cross-attention and time_embed
     UNets)       vae   the SDXL VAE encoder (the SD VAE encoder's shape), 1024 px -> 4 x 128 x 128
"""
from __future__ import annotations

from pulse.encoders import LATENT, Encoder, EncoderSet
from pulse.spec import ModelSpec
from pulse.zoo.common import ACT_BYTES, attention_flops, conv_flops, conv_params, linear_flops, linear_params
from pulse.zoo.unet_blocks import ATTENTION_KINDS

SD2_TEXT_SOURCE = ("stabilityai/stable-diffusion-2 text_encoder/config.json (CLIPTextModel: 23 layers, width 1024, "
                   "FFN 4096, 77 tokens, vocab 49408); the OpenCLIP ViT-H/14 text tower (354M params in the "
                   "open_clip model table) minus its last block, which SD 2 does not run")
SD_VAE_SOURCE = ("stabilityai/stable-diffusion-2 vae/config.json (AutoencoderKL: block_out_channels "
                 "128/256/512/512, 2 ResNets per block, one mid attention, latent_channels 4): 34.2M encoder "
                 "params in diffusers")
HUNYUAN_CLIP_SOURCE = ("Tencent-Hunyuan/HunyuanDiT t2i/clip_text_encoder/config.json (BertModel: 24 layers, hidden "
                       "1024, intermediate 4096, vocab 47020, 512 positions); 77 tokens as hydit's text_len")
HUNYUAN_MT5_SOURCE = ("Tencent-Hunyuan/HunyuanDiT t2i/mt5 (google/mt5-xl encoder: 24 layers, d_model 2048, "
                      "d_ff 5120 gated-gelu, 32 heads x 64, vocab 250112); 256 tokens as hydit's text_len_t5")
# SDXL's text task: the model inputs it makes (message order) and the layer kinds reading them
SDXL_TEXT_FEEDS = ("context", "text_embeds", "time_ids")
SDXL_TEXT_READERS = (*ATTENTION_KINDS, "time_embed")
SDXL_TIME_IDS = 6  # add_time_ids: original (h, w), crop (top, left), target (h, w)
SDXL_TEXT_SOURCE = ("stabilityai/stable-diffusion-xl-base-1.0 text_encoder/config.json (CLIPTextModel: 12 layers, "
                    "width 768, FFN 3072, 77 positions, vocab 49408) and text_encoder_2/config.json "
                    "(CLIPTextModelWithProjection: 32 layers, width 1280, FFN 5120, projection_dim 1280); "
                    "77 tokens (tokenizer*/tokenizer_config.json model_max_length)")
SDXL_VAE_SOURCE = ("stabilityai/stable-diffusion-xl-base-1.0 vae/config.json (AutoencoderKL: block_out_channels "
                   "128/256/512/512, 2 ResNets per block, latent_channels 4, sample_size 1024)")
HUNYUAN_VAE_SOURCE = ("Tencent-Hunyuan/HunyuanDiT t2i/sdxl-vae-fp16-fix (madebyollin/sdxl-vae-fp16-fix: the "
                      "SD VAE encoder's shape) at 1024 px")


def transformer_encoder(name: str, *, layers: int, width: int, ffn: int, tokens: int, vocab: int,
                        positions: int, gated: bool, feeds: str, readers: tuple[str, ...], source: str,
                        out_width: int | None = None) -> Encoder:
    """A text transformer: embeddings, then ``layers`` blocks of attention (q, k, v, out) and an
    MLP (two matrices, three when gated as T5's); LayerNorm/RMSNorm parameters counted, FLOPs not."""
    attn_params = 4 * linear_params(width, width)
    mlp_params = (3 if gated else 2) * width * ffn + (0 if gated else ffn + width)
    block_params = attn_params + mlp_params + 4 * width
    params = vocab * width + positions * width + layers * block_params + 2 * width
    block_flops = (4 * linear_flops(width, width, tokens) + (3 if gated else 2) * linear_flops(width, ffn, tokens)
                   + attention_flops(tokens, tokens, width))
    return Encoder(name=name, params=params, flops=float(layers * block_flops),
                   out_bytes=tokens * (out_width or width) * ACT_BYTES, feeds=feeds, readers=readers,
                   layers=layers, source=source)


def vae_encoder(name: str, *, resolution: int, channels: tuple[int, ...] = (128, 256, 512, 512),
                per_block: int = 2, latent_channels: int = 4, source: str) -> Encoder:
    """The SD AutoencoderKL encoder: conv_in, per level ``per_block`` ResNets (two 3x3 convs, a 1x1
    shortcut when the width changes) and a stride-2 conv but at the last level, a mid block of two
    ResNets around one single-head attention, conv_out to 2 x latent channels (mean, log-variance),
    quant_conv. The pipeline is sent one sample of the latent: latent_channels x (res/8)^2."""
    size, flops, params = resolution, 0, conv_params(3, channels[0], 3)
    flops += conv_flops(3, channels[0], 3, size, size)
    prev = channels[0]

    def resnet(cin: int, cout: int, s: int) -> tuple[int, int]:
        p = conv_params(cin, cout, 3) + conv_params(cout, cout, 3) + 2 * cin + 2 * cout
        f = conv_flops(cin, cout, 3, s, s) + conv_flops(cout, cout, 3, s, s)
        if cin != cout:
            p, f = p + conv_params(cin, cout, 1), f + conv_flops(cin, cout, 1, s, s)
        return p, f

    for level, ch in enumerate(channels):
        for _ in range(per_block):
            p, f = resnet(prev, ch, size)
            params, flops, prev = params + p, flops + f, ch
        if level < len(channels) - 1:
            size //= 2
            params, flops = params + conv_params(ch, ch, 3), flops + conv_flops(ch, ch, 3, size, size)
    top = channels[-1]
    for _ in range(2):
        p, f = resnet(top, top, size)
        params, flops = params + p, flops + f
    tokens = size * size
    params += 4 * linear_params(top, top) + 2 * top
    flops += 4 * linear_flops(top, top, tokens) + attention_flops(tokens, tokens, top)
    params += 2 * top + conv_params(top, 2 * latent_channels, 3) + conv_params(2 * latent_channels,
                                                                                2 * latent_channels, 1)
    flops += conv_flops(top, 2 * latent_channels, 3, size, size)
    blocks = len(channels) * per_block + 3
    return Encoder(name=name, params=params, flops=float(flops), out_bytes=latent_channels * size * size * ACT_BYTES,
                   feeds=LATENT, readers=(), layers=blocks, source=source)


def paired_text_encoder(name: str, first: Encoder, second: Encoder, *, width: int, projection: int,
                        time_ids: int, source: str) -> Encoder:
    """SDXL's text encoders as one encode task: ``first`` and ``second`` run on the same caption;
    ``second``'s pooled token (``width`` wide) goes through its bias-free text projection to ``projection``.
    One output of three model inputs (``SDXL_TEXT_FEEDS``): both hidden states concatenated (context),
    the projection (text_embeds), and the image's ``time_ids`` numbers, read with its caption."""
    return Encoder(name=name, params=first.params + second.params + linear_params(width, projection, bias=False),
                   flops=first.flops + second.flops + linear_flops(width, projection),
                   out_bytes=first.out_bytes + second.out_bytes + (projection + time_ids) * ACT_BYTES,
                   feeds=SDXL_TEXT_FEEDS, readers=SDXL_TEXT_READERS, layers=first.layers + second.layers,
                   source=source)


def sdxl_encoders(spec: ModelSpec) -> tuple[Encoder, ...]:
    resolution = int(spec.meta.get("image_resolution", 1024))
    clip = dict(tokens=77, vocab=49408, positions=77, gated=False, feeds="context", readers=(), source="")
    text = paired_text_encoder(
        "text", transformer_encoder("clip-l", layers=12, width=768, ffn=3072, **clip),
        transformer_encoder("clip-bigg", layers=32, width=1280, ffn=5120, **clip),
        width=1280, projection=1280, time_ids=SDXL_TIME_IDS, source=SDXL_TEXT_SOURCE)
    return text, vae_encoder("vae", resolution=resolution, source=SDXL_VAE_SOURCE)


def sd2_encoders(spec: ModelSpec) -> tuple[Encoder, ...]:
    resolution = int(spec.meta.get("image_resolution", 512))
    return (
        transformer_encoder("text", layers=23, width=1024, ffn=4096, tokens=77, vocab=49408, positions=77,
                            gated=False, feeds="context", readers=ATTENTION_KINDS, source=SD2_TEXT_SOURCE),
        vae_encoder("vae", resolution=resolution, source=SD_VAE_SOURCE),
    )


def hunyuan_encoders(spec: ModelSpec) -> tuple[Encoder, ...]:
    resolution = int(spec.meta.get("image_resolution", 1024))
    return (
        transformer_encoder("clip", layers=24, width=1024, ffn=4096, tokens=77, vocab=47020, positions=512,
                            gated=False, feeds="text_clip", readers=("hdit_cond_embed",), source=HUNYUAN_CLIP_SOURCE),
        transformer_encoder("mt5", layers=24, width=2048, ffn=5120, tokens=256, vocab=250112, positions=0,
                            gated=True, feeds="text_t5", readers=("hdit_cond_embed",), source=HUNYUAN_MT5_SOURCE),
        vae_encoder("vae", resolution=resolution, source=HUNYUAN_VAE_SOURCE),
    )


_FAMILIES = {"unet": sd2_encoders, "hunyuan-dit": hunyuan_encoders}


def _family_encoders(spec: ModelSpec):
    """A UNet reading pooled text (``text_embeds``: addition_embed_type text_time) is SDXL's."""
    if spec.meta.get("family") == "unet" and any(s.name == "text_embeds" for s in spec.shared_inputs):
        return sdxl_encoders
    return _FAMILIES.get(spec.meta.get("family", ""))


def zoo_encoders(spec: ModelSpec, mode: str = "cached") -> EncoderSet | None:
    """The frozen encoders of a zoo model (SD 2 UNet, SDXL UNet, Hunyuan-DiT), or None when the zoo has
    none for it (U-ViT is class-conditional; tiny models get none)."""
    make = _family_encoders(spec)
    if make is None or spec.name.startswith("tiny"):
        return None
    return EncoderSet(make(spec), mode)
