"""UNet layer kinds: the diffusers ``UNet2DConditionModel`` modules, one cell per layer.

The same maths and parameter names as ``pulse_torch.layers.unet_layers``
(whose docstring draws each kind): ``norm1.weight``,
``transformer_blocks.0.attn1.to_q.weight``, ...
"""
from __future__ import annotations

from typing import Any, Sequence

from mindspore import Tensor, nn, ops

from pulse_mindspore.layers.basic import (Conv2d, GroupNorm, Identity, LayerNorm, Linear, ParamInit, gelu,
                                          silu)
from pulse.layers.layer_recipes import transformer2d, transformer2d_part, transformer_block, transformer_part_ends
from pulse_mindspore.layers.common import (MINDSPORE_OPS, LayerOutput, PulseCell, Shared, attend, batch_of, need,
                                           sinusoid)

Attrs = dict[str, Any]


class TimeEmbed(PulseCell):
    """diffusers ``Timesteps`` + ``TimestepEmbedding``: sinusoid -> linear -> SiLU -> linear."""

    kind = "time_embed"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        self.sinusoid_dim = a["sinusoid_dim"]
        self.flip_sin_to_cos = bool(a["flip_sin_to_cos"])
        self.freq_shift = float(a["freq_shift"])
        self.linear_1 = Linear(self.sinusoid_dim, a["temb_channels"], init)
        self.linear_2 = Linear(a["temb_channels"], a["temb_channels"], init)

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        t = batch_of(need(shared, "timesteps", self.kind), h.shape[0])
        emb = sinusoid(t, self.sinusoid_dim, self.flip_sin_to_cos, self.freq_shift).astype(h.dtype)
        return h, {"temb": self.linear_2(silu(self.linear_1(emb)))}


class ConvIn(PulseCell):
    """``conv_in``: a bare conv, so its parameters are ``weight`` / ``bias`` as in diffusers."""

    kind = "conv_in"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        conv = Conv2d(a["in_channels"], a["out_channels"], a["kernel"], init, padding=a["padding"])
        # Own the conv's parameters directly (no "conv." prefix), reuse its maths.
        self.padding = a["padding"]
        self.weight, self.bias = conv.weight, conv.bias

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        y = ops.conv2d(h, self.weight, pad_mode="pad", padding=self.padding)
        return y + self.bias.reshape(1, -1, 1, 1), {}


class Resnet(PulseCell):
    """diffusers ``ResnetBlock2D``; a decoder ResNet first concatenates its skip after the main path."""

    kind = "resnet"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        cin, cout, groups, eps = a["in_channels"], a["out_channels"], a["groups"], a["eps"]
        self.num_skips = 1 if a["skip_channels"] else 0
        self.norm1 = GroupNorm(groups, cin, init, eps)
        self.conv1 = Conv2d(cin, cout, 3, init, padding=1)
        self.time_emb_proj = Linear(a["temb_channels"], cout, init)
        self.norm2 = GroupNorm(groups, cout, init, eps)
        self.conv2 = Conv2d(cout, cout, 3, init, padding=1)
        self.conv_shortcut = Conv2d(cin, cout, 1, init) if a["conv_shortcut"] else None

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        x = ops.cat([h, *skips], axis=1) if skips else h
        y = self.conv1(silu(self.norm1(x)))
        temb = self.time_emb_proj(silu(need(shared, "temb", self.kind)))
        y = y + temb[:, :, None, None]
        y = self.conv2(silu(self.norm2(y)))
        shortcut = self.conv_shortcut(x) if self.conv_shortcut is not None else x
        return shortcut + y, {}


class ResnetIn(PulseCell):
    """``ResnetBlock2D``'s first half (``split_resnets``): its output carries the block's input behind ``y``."""

    kind = "resnet_in"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        cin, cout = a["in_channels"], a["out_channels"]
        self.num_skips = 1 if a["skip_channels"] else 0
        self.norm1 = GroupNorm(a["groups"], cin, init, a["eps"])
        self.conv1 = Conv2d(cin, cout, 3, init, padding=1)
        self.time_emb_proj = Linear(a["temb_channels"], cout, init)

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        x = ops.cat([h, *skips], axis=1) if skips else h
        y = self.conv1(silu(self.norm1(x)))
        temb = self.time_emb_proj(silu(need(shared, "temb", self.kind)))
        return ops.cat([y + temb[:, :, None, None], x], axis=1), {}


class ResnetOut(PulseCell):
    """``ResnetBlock2D``'s second half: conv2 on ``y``, plus the shortcut of the input carried behind it."""

    kind = "resnet_out"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        cin, cout = a["in_channels"], a["out_channels"]
        self.channels = cout
        self.norm2 = GroupNorm(a["groups"], cout, init, a["eps"])
        self.conv2 = Conv2d(cout, cout, 3, init, padding=1)
        self.conv_shortcut = Conv2d(cin, cout, 1, init) if a["conv_shortcut"] else None

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        y, x = h[:, :self.channels], h[:, self.channels:]
        y = self.conv2(silu(self.norm2(y)))
        shortcut = self.conv_shortcut(x) if self.conv_shortcut is not None else x
        return shortcut + y, {}


class Attention(nn.Cell):
    """diffusers ``Attention``: to_q/k/v without bias, to_out[0] with bias (to_out[1] is a dropout slot)."""

    def __init__(self, dim: int, heads: int, init: ParamInit, context_dim: int | None = None) -> None:
        super().__init__()
        kv_dim = dim if context_dim is None else context_dim
        self.heads = heads
        self.to_q = Linear(dim, dim, init, bias=False)
        self.to_k = Linear(kv_dim, dim, init, bias=False)
        self.to_v = Linear(kv_dim, dim, init, bias=False)
        self.to_out = nn.CellList([Linear(dim, dim, init), Identity()])

    def construct(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        kv = x if context is None else context
        return self.to_out[0](attend(self.to_q(x), self.to_k(kv), self.to_v(kv), self.heads))


class GEGLU(nn.Cell):
    """diffusers ``GEGLU``: one projection to (hidden, gate); hidden * gelu(gate)."""

    def __init__(self, dim: int, inner: int, init: ParamInit) -> None:
        super().__init__()
        self.proj = Linear(dim, 2 * inner, init)

    def construct(self, x: Tensor) -> Tensor:
        hidden, gate = ops.chunk(self.proj(x), 2, axis=-1)
        return hidden * gelu(gate)


class FeedForward(nn.Cell):
    """diffusers ``FeedForward`` with GEGLU: net = [GEGLU, Dropout slot, Linear]."""

    def __init__(self, dim: int, inner: int, init: ParamInit) -> None:
        super().__init__()
        self.net = nn.CellList([GEGLU(dim, inner, init), Identity(), Linear(inner, dim, init)])

    def construct(self, x: Tensor) -> Tensor:
        for cell in self.net:
            x = cell(x)
        return x


class BasicTransformerBlock(nn.Cell):
    """Pre-LN self-attention, cross-attention over the context, GEGLU feed-forward."""

    def __init__(self, dim: int, heads: int, context_dim: int, ff_inner: int, eps: float,
                 init: ParamInit) -> None:
        super().__init__()
        self.norm1 = LayerNorm(dim, init, eps)
        self.attn1 = Attention(dim, heads, init)
        self.norm2 = LayerNorm(dim, init, eps)
        self.attn2 = Attention(dim, heads, init, context_dim=context_dim)
        self.norm3 = LayerNorm(dim, init, eps)
        self.ff = FeedForward(dim, ff_inner, init)

    def construct(self, x: Tensor, context: Tensor) -> Tensor:
        return transformer_block(self, x, context)


class Transformer2D(PulseCell):
    """diffusers ``Transformer2DModel``, continuous input, linear (SD 2) or 1x1-conv (SD 1.x) projections."""

    kind = "transformer2d"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        c = a["channels"]
        # the variants it refuses: pulse.layers.layer_contract.VARIANT_CHECKS
        self.linear_projection = bool(a["linear_projection"])
        self.norm = GroupNorm(a["groups"], c, init, a["norm_eps"])
        self.proj_in = Linear(c, c, init) if self.linear_projection else Conv2d(c, c, 1, init)
        self.transformer_blocks = nn.CellList([
            BasicTransformerBlock(c, a["heads"], a["context_dim"], a["ff_inner"], a["ln_eps"], init)
            for _ in range(a["num_layers"])])
        self.proj_out = Linear(c, c, init) if self.linear_projection else Conv2d(c, c, 1, init)

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return transformer2d(self, MINDSPORE_OPS, h, shared), {}


class Transformer2DPart(PulseCell):
    """One half of one block of a ``Transformer2DModel`` (``split_transformers``), the same parameter names
    as the whole model's (``pulse_torch.layers.unet_layers.Transformer2DPart``)."""

    kind = "transformer2d_part"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        c = a["channels"]
        self.channels, self.half = c, a["half"]
        self.first, self.last = transformer_part_ends(a)
        self.linear_projection = bool(a["linear_projection"])
        if self.first:
            self.norm = GroupNorm(a["groups"], c, init, a["norm_eps"])
            self.proj_in = Linear(c, c, init) if self.linear_projection else Conv2d(c, c, 1, init)
        self.transformer_blocks = nn.CellDict({str(a["block"]): _TransformerHalf(a, init)})
        self.block_key = str(a["block"])
        if self.last:
            self.proj_out = Linear(c, c, init) if self.linear_projection else Conv2d(c, c, 1, init)

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return transformer2d_part(self, self.transformer_blocks[self.block_key], MINDSPORE_OPS, h, shared), {}


class _TransformerHalf(nn.Cell):
    """A BasicTransformerBlock's self-attention (norm1, attn1) or the rest (norm2, attn2, norm3, ff)."""

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        c, eps = a["channels"], a["ln_eps"]
        if a["half"] == "self":
            self.norm1, self.attn1 = LayerNorm(c, init, eps), Attention(c, a["heads"], init)
        else:
            self.norm2 = LayerNorm(c, init, eps)
            self.attn2 = Attention(c, a["heads"], init, context_dim=a["context_dim"])
            self.norm3, self.ff = LayerNorm(c, init, eps), FeedForward(c, a["ff_inner"], init)


class Downsample(PulseCell):
    """diffusers ``Downsample2D`` with a conv: 3x3, stride 2, padding 1."""

    kind = "downsample"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        c = a["channels"]
        self.conv = Conv2d(c, c, a["kernel"], init, stride=a["stride"], padding=a["padding"])

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return self.conv(h), {}


def nearest_2x(x: Tensor) -> Tensor:
    """Nearest-neighbour 2x upsampling of (B, C, H, W) by broadcasting (exact, and its gradient a sum)."""
    b, c, height, width = x.shape
    x = ops.broadcast_to(x.reshape(b, c, height, 1, width, 1), (b, c, height, 2, width, 2))
    return x.reshape(b, c, 2 * height, 2 * width)


class Upsample(PulseCell):
    """diffusers ``Upsample2D`` with a conv: nearest 2x, then 3x3."""

    kind = "upsample"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        c = a["channels"]
        if a["mode"] != "nearest":
            raise NotImplementedError(f"upsample: mode {a['mode']!r} is not implemented (nearest is)")
        self.conv = Conv2d(c, c, a["kernel"], init, padding=a["padding"])

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return self.conv(nearest_2x(h)), {}


class ConvOut(PulseCell):
    """``conv_norm_out`` -> SiLU -> ``conv_out`` (two top-level diffusers modules)."""

    kind = "conv_out"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        self.conv_norm_out = GroupNorm(a["groups"], a["in_channels"], init, a["eps"])
        self.conv_out = Conv2d(a["in_channels"], a["out_channels"], a["kernel"], init, padding=a["padding"])

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return self.conv_out(silu(self.conv_norm_out(h))), {}


UNET_LAYERS: dict[str, type[PulseCell]] = {
    cls.kind: cls for cls in (TimeEmbed, ConvIn, Resnet, ResnetIn, ResnetOut, Transformer2D, Transformer2DPart,
                              Downsample, Upsample, ConvOut)
}
