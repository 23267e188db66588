"""One function per UNet layer kind (diffusers UNet2DConditionModel modules).

Each returns a Layer whose params count exactly the parameters of the module
it names, so a backend that builds the module from ``attrs`` gets the same
count. Spatial maps are square: ``size`` is the height and the width.
"""
from __future__ import annotations

from dataclasses import dataclass

from pulse.spec import Layer
from pulse.zoo.common import (attention_flops, conv_flops, conv_params, linear_flops,
                              linear_params, make_layer, norm_params)


# A Transformer2DModel whole or in parts (``split_transformers``): the layers reading the text context.
ATTENTION_KINDS = ("transformer2d", "transformer2d_part")
# The option that cuts a block of each kind in two, by the kinds of its layers whole and in parts.
SPLIT_OPTIONS = {"resnet": "split_resnets", "resnet_in": "split_resnets", "resnet_out": "split_resnets",
                 "transformer2d": "split_transformers", "transformer2d_part": "split_transformers"}


def block_of(layer: Layer) -> str | None:
    """The ResnetBlock2D or Transformer2DModel ``layer`` is, or is a part of, by the name it has whole
    ("up1_res0" for "up1_res0_in", "up3_attn0" for "up3_attn0_cross0"): what the split options name.
    None for a layer of another kind."""
    if layer.kind not in SPLIT_OPTIONS:
        return None
    return layer.name if layer.kind in ("resnet", "transformer2d") else layer.name.rsplit("_", 1)[0]


def time_embed(sinusoid_dim: int, temb_dim: int, latent_channels: int, size: int,
               added: AddedTimeText | None = None) -> Layer:
    """Sinusoid(t) -> linear -> SiLU -> linear; the latent passes through untouched.

    ``added`` (SDXL's ``addition_embed_type="text_time"``): diffusers' ``get_aug_embed`` adds
    ``add_embedding(cat[text_embeds, sinusoid(time_ids)])`` to the embedding, so this layer
    also reads the data inputs "text_embeds" (pooled text) and "time_ids" (original size, crop,
    target size) and holds ``add_embedding``'s two linears.
    """
    params = linear_params(sinusoid_dim, temb_dim) + linear_params(temb_dim, temb_dim)
    flops = linear_flops(sinusoid_dim, temb_dim) + linear_flops(temb_dim, temb_dim)
    saved = sinusoid_dim + 2 * temb_dim  # linear_1 input, SiLU input, linear_2 input
    attrs = {"sinusoid_dim": sinusoid_dim, "temb_channels": temb_dim,
             "flip_sin_to_cos": True, "freq_shift": 0,
             "passthrough_channels": latent_channels, "height": size, "width": size,
             "ref_module": "time_embedding"}
    if added is not None:
        params += linear_params(added.projection_dim, temb_dim) + linear_params(temb_dim, temb_dim)
        flops += linear_flops(added.projection_dim, temb_dim) + linear_flops(temb_dim, temb_dim)
        saved += added.projection_dim + 2 * temb_dim
        attrs.update(text_embeds_dim=added.text_embeds_dim, time_ids=added.time_ids,
                     addition_time_embed_dim=added.time_embed_dim, ref_module="time_embedding,add_embedding")
    return make_layer("time_embed", "time_embed", params, flops, latent_channels * size * size, saved, attrs)


@dataclass(frozen=True)
class AddedTimeText:
    """SDXL's added conditioning: pooled text embeds and ``time_ids`` sinusoids, projected to the embedding."""

    text_embeds_dim: int  # text_encoder_2's pooled output (1280 for SDXL)
    time_embed_dim: int  # diffusers' addition_time_embed_dim: sinusoid width per time id
    time_ids: int = 6  # original (h, w), crop (top, left), target (h, w)

    @property
    def projection_dim(self) -> int:
        """diffusers' projection_class_embeddings_input_dim."""
        return self.text_embeds_dim + self.time_ids * self.time_embed_dim


def conv_in(cin: int, cout: int, size: int) -> Layer:
    return make_layer("conv_in", "conv_in", conv_params(cin, cout, 3), conv_flops(cin, cout, 3, size, size),
                      cout * size * size, cin * size * size,
                      {"in_channels": cin, "out_channels": cout, "kernel": 3, "padding": 1,
                       "height": size, "width": size, "ref_module": "conv_in"})


def resnet(name: str, ref: str, main_c: int, skip_c: int, cout: int, temb_dim: int,
           groups: int, eps: float, size: int) -> Layer:
    """ResnetBlock2D on cat([main, skip], channels); a 1x1 shortcut conv iff in != out."""
    cin = main_c + skip_c
    hw = size * size
    shortcut = cin != cout
    params = (norm_params(cin) + conv_params(cin, cout, 3) + linear_params(temb_dim, cout)
              + norm_params(cout) + conv_params(cout, cout, 3)
              + (conv_params(cin, cout, 1) if shortcut else 0))
    flops = (conv_flops(cin, cout, 3, size, size) + linear_flops(temb_dim, cout)
             + conv_flops(cout, cout, 3, size, size) + (conv_flops(cin, cout, 1, size, size) if shortcut else 0))
    # norm1 / SiLU / conv1 inputs, norm2 / SiLU / conv2 inputs, SiLU(temb).
    saved = 3 * cin * hw + 3 * cout * hw + temb_dim
    return make_layer(name, "resnet", params, flops, cout * hw, saved,
                      {"in_channels": cin, "skip_channels": skip_c, "out_channels": cout,
                       "temb_channels": temb_dim, "groups": groups, "eps": eps,
                       "conv_shortcut": shortcut, "height": size, "width": size, "ref_module": ref})


def resnet_halves(name: str, ref: str, main_c: int, skip_c: int, cout: int, temb_dim: int,
                  groups: int, eps: float, size: int) -> list[Layer]:
    """ResnetBlock2D as two layers, finer cuts for the partitioner (``split_resnets``)::

        <name>_in   cat[main, skip] = x ─ GN ─ SiLU ─ conv1 ─ + temb = y   ─▶ cat[y, x]  (cout + cin)
        <name>_out  cat[y, x] ─ y ─ GN ─ SiLU ─ conv2 ─ + shortcut(x)       ─▶ cout

    The block's input must reach its shortcut, so the first half passes it on behind ``y`` in
    the one main-path tensor: a cut between the halves sends both. The second half's GroupNorm
    and shortcut conv save views of ``cat[y, x]``, keeping all of it alive; GroupNorm copies its
    ``y`` slice first where that is strided (microbatches over 1), so the count is the larger of
    the two cases: exact at one sample without a shortcut and at several with one.
    """
    cin, hw = main_c + skip_c, size * size
    shortcut = cin != cout
    attrs = {"in_channels": cin, "skip_channels": skip_c, "out_channels": cout, "temb_channels": temb_dim,
             "groups": groups, "eps": eps, "conv_shortcut": shortcut, "height": size, "width": size,
             "ref_module": ref}
    first = make_layer(f"{name}_in", "resnet_in",
                       norm_params(cin) + conv_params(cin, cout, 3) + linear_params(temb_dim, cout),
                       conv_flops(cin, cout, 3, size, size) + linear_flops(temb_dim, cout),
                       (cout + cin) * hw, 3 * cin * hw + temb_dim, attrs)  # norm1 / SiLU / conv1 inputs, SiLU(temb)
    shortcut_params = conv_params(cin, cout, 1) if shortcut else 0
    shortcut_flops = conv_flops(cin, cout, 1, size, size) if shortcut else 0
    second = make_layer(f"{name}_out", "resnet_out",
                        norm_params(cout) + conv_params(cout, cout, 3) + shortcut_params,
                        conv_flops(cout, cout, 3, size, size) + shortcut_flops,
                        cout * hw, (cout + cin) * hw + (3 if shortcut else 2) * cout * hw,  # + SiLU / conv2 inputs
                        {**attrs, "skip_channels": 0})
    return [first, second]


def transformer2d(name: str, ref: str, channels: int, heads: int, context_dim: int, context_len: int,
                  groups: int, size: int, ff_mult: int = 4, num_layers: int = 1) -> Layer:
    """Transformer2DModel, linear projection, ``num_layers`` BasicTransformerBlocks (self, cross, GEGLU)."""
    c, n, ctx = channels, size * size, context_dim
    ff = ff_mult * c
    halves = _block_halves(c, ctx, context_len, ff, n)
    params = norm_params(c) + 2 * linear_params(c, c) + num_layers * sum(p for p, _ in halves.values())
    flops = 2 * linear_flops(c, c, n) + num_layers * sum(f for _, f in halves.values())  # + proj_in, proj_out
    # Per token: GN, proj_in, LN1, attn1 input, q k v, attn1 out, LN2, attn2 input,
    # q, attn2 out, LN3, FF input, proj_out input (15 x C), plus GEGLU's
    # hidden, gate, gelu(gate) and product (4 x ff); cross-attention k and v.
    # Each further block saves its own 12 x C, 4 x ff and k, v (GN, proj_in, proj_out are once).
    per_block = (12 * c + 4 * ff) * n + 2 * context_len * c
    saved = 3 * c * n + num_layers * per_block
    return make_layer(name, "transformer2d", params, flops, c * n, saved,
                      {"channels": c, "heads": heads, "head_dim": c // heads,
                       "context_dim": ctx, "context_len": context_len, "groups": groups,
                       "norm_eps": 1e-6, "ln_eps": 1e-5, "ff_inner": ff, "activation": "geglu",
                       "linear_projection": True, "qkv_bias": False, "num_layers": num_layers,
                       "height": size, "width": size, "ref_module": ref})


def _block_halves(c: int, ctx: int, context_len: int, ff: int, n: int) -> dict[str, tuple[int, int]]:
    """(parameters, FLOPs) of a BasicTransformerBlock's two halves: "self" (LN1, attn1) and "cross" (LN2,
    attn2 over the context, LN3, GEGLU feed-forward); the whole block is their sum."""
    return {"self": (norm_params(c) + 3 * linear_params(c, c, bias=False) + linear_params(c, c),
                     4 * linear_flops(c, c, n) + attention_flops(n, n, c)),
            "cross": (norm_params(c) + linear_params(c, c, bias=False) + 2 * linear_params(ctx, c, bias=False)
                      + linear_params(c, c) + norm_params(c) + linear_params(c, 2 * ff) + linear_params(ff, c),
                      2 * linear_flops(c, c, n) + 2 * linear_flops(ctx, c, context_len)
                      + attention_flops(n, context_len, c) + linear_flops(c, 2 * ff, n) + linear_flops(ff, c, n))}


def transformer2d_parts(name: str, ref: str, channels: int, heads: int, context_dim: int, context_len: int,
                        groups: int, size: int, ff_mult: int = 4, num_layers: int = 1) -> list[Layer]:
    """Transformer2DModel as two layers per BasicTransformerBlock, finer cuts (``split_transformers``)::

        <name>_self<k>   t ─ + attn1(LN1(t))                              ─▶ cat[t, x]   (H, W, 2C)
        <name>_cross<k>  t ─ + attn2(LN2(t), context) ─ + ff(LN3(t))      ─▶ cat[t, x]
        the first part starts with GN ─ proj_in on the model's input x; the last ends with
        proj_out and the residual + x

    The model's input must reach the final residual, so every part but the last passes it on,
    as tokens, behind the block's tokens ``t``, both on their (H, W) grid so that a part reads the
    grid from its input: a cut inside the model sends both. Parameters and FLOPs sum to
    ``transformer2d``'s. Saved bytes: the whole model's, split where its tensors are made.
    """
    whole = transformer2d(name, ref, channels, heads, context_dim, context_len, groups, size, ff_mult, num_layers)
    c, n, ctx, ff = channels, size * size, context_dim, ff_mult * channels
    proj = linear_params(c, c)  # a 1x1 conv (SD 1.x) counts the same
    halves = _block_halves(c, ctx, context_len, ff, n)
    parts: list[Layer] = []
    for k in range(num_layers):
        first, last = k == 0, k == num_layers - 1
        for half in ("self", "cross"):
            head, tail = first and half == "self", last and half == "cross"
            params = halves[half][0] + (norm_params(c) + proj if head else 0) + (proj if tail else 0)
            flops = halves[half][1] + (linear_flops(c, c, n) if head or tail else 0)
            # self: LN1 input, attn1 input, q k v, attn1 out (6 C); cross: LN2 input, attn2 input, q, attn2
            # out, LN3 input, FF input (6 C), GEGLU's 4 x ff, the context's k and v; the first adds GN and
            # proj_in inputs, the last proj_out's (the layout changes between parts are copies: nothing saved)
            saved = 6 * c * n + (0 if half == "self" else 4 * ff * n + 2 * context_len * c)
            saved += (2 * c * n if head else 0) + (c * n if tail else 0)
            parts.append(make_layer(f"{name}_{half}{k}", "transformer2d_part", params, flops,
                                    c * n if tail else 2 * c * n, saved,
                                    {**whole.attrs, "block": k, "half": half}))
    return parts


def downsample(name: str, ref: str, channels: int, size: int) -> Layer:
    """3x3 conv, stride 2, padding 1: size -> size / 2."""
    out = size // 2
    return make_layer(name, "downsample", conv_params(channels, channels, 3),
                      conv_flops(channels, channels, 3, out, out), channels * out * out,
                      channels * size * size,
                      {"channels": channels, "kernel": 3, "stride": 2, "padding": 1,
                       "height": size, "width": size, "ref_module": ref})


def upsample(name: str, ref: str, channels: int, size: int) -> Layer:
    """Nearest 2x interpolation then a 3x3 conv: size -> 2 * size."""
    out = 2 * size
    return make_layer(name, "upsample", conv_params(channels, channels, 3),
                      conv_flops(channels, channels, 3, out, out), channels * out * out,
                      channels * out * out,  # the conv's (interpolated) input
                      {"channels": channels, "kernel": 3, "padding": 1, "mode": "nearest",
                       "height": size, "width": size, "ref_module": ref})


def conv_out(cin: int, cout: int, groups: int, eps: float, size: int) -> Layer:
    """GroupNorm -> SiLU -> 3x3 conv."""
    hw = size * size
    return make_layer("conv_out", "conv_out", norm_params(cin) + conv_params(cin, cout, 3),
                      conv_flops(cin, cout, 3, size, size), cout * hw, 3 * cin * hw,
                      {"in_channels": cin, "out_channels": cout, "groups": groups, "eps": eps,
                       "kernel": 3, "padding": 1, "height": size, "width": size,
                       "ref_module": "conv_norm_out,conv_out"})
