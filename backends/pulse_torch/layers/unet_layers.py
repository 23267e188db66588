"""UNet layer kinds: the diffusers ``UNet2DConditionModel`` modules, one per layer.

Parameter names inside each module are diffusers' names below the layer's
``ref_module`` (``norm1.weight``, ``transformer_blocks.0.attn1.to_q.weight``,
...), so a diffusers checkpoint maps straight onto the layers (see
``registry.reference_key``)::

    time_embed    h ───────────────────────────────────────────────▶ h   makes shared "temb"
    resnet        cat[h, skip] ─ GN ─ SiLU ─ conv ─ +temb ─ GN ─ SiLU ─ conv ─ + shortcut ─▶
    resnet_in     cat[h, skip] = x ─ GN ─ SiLU ─ conv1 ─ +temb = y ─▶ cat[y, x]    (split_resnets)
    resnet_out    cat[y, x] ─ y ─ GN ─ SiLU ─ conv2 ─ + shortcut(x) ─▶
    transformer2d h ─ GN ─ proj_in ─ [self-attn, cross-attn(context), GEGLU] ─ proj_out ─ + h ─▶
    transformer2d_part  one block's self-attn, or its cross-attn and GEGLU, on cat[t, h] (split_transformers)
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pulse.layers.layer_recipes import transformer2d, transformer2d_part, transformer_block, transformer_part_ends
from pulse_torch.layers.common import TORCH_OPS, LayerOutput, PulseLayer, Shared, attend, need, sinusoid

Attrs = dict[str, Any]


class TimeEmbed(PulseLayer):
    """diffusers ``Timesteps`` + ``TimestepEmbedding``: sinusoid -> linear -> SiLU -> linear."""

    kind = "time_embed"

    def __init__(self, a: Attrs) -> None:
        super().__init__()
        self.sinusoid_dim = a["sinusoid_dim"]
        self.flip_sin_to_cos = bool(a["flip_sin_to_cos"])
        self.freq_shift = float(a["freq_shift"])
        self.linear_1 = nn.Linear(self.sinusoid_dim, a["temb_channels"])
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(a["temb_channels"], a["temb_channels"])

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        t = need(shared, "timesteps", self.kind).expand(h.shape[0])
        # diffusers casts the fp32 sinusoid to the sample's dtype before the MLP.
        emb = sinusoid(t, self.sinusoid_dim, self.flip_sin_to_cos, self.freq_shift).to(h.dtype)
        return h, {"temb": self.linear_2(self.act(self.linear_1(emb)))}


class ConvIn(PulseLayer, nn.Conv2d):
    """``conv_in``: a bare Conv2d, so its parameters are ``weight`` / ``bias`` as in diffusers."""

    kind = "conv_in"

    def __init__(self, a: Attrs) -> None:
        nn.Conv2d.__init__(self, a["in_channels"], a["out_channels"], a["kernel"], padding=a["padding"])

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return self._conv_forward(h, self.weight, self.bias), {}


class Resnet(PulseLayer):
    """diffusers ``ResnetBlock2D`` (default time-embedding norm, output scale 1).

    A decoder ResNet first concatenates its skip after the main path, as
    ``torch.cat([hidden_states, res_hidden_states], dim=1)`` does.
    """

    kind = "resnet"

    def __init__(self, a: Attrs) -> None:
        super().__init__()
        cin, cout, groups, eps = a["in_channels"], a["out_channels"], a["groups"], a["eps"]
        self.num_skips = 1 if a["skip_channels"] else 0
        self.norm1 = nn.GroupNorm(groups, cin, eps=eps, affine=True)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.time_emb_proj = nn.Linear(a["temb_channels"], cout)
        self.norm2 = nn.GroupNorm(groups, cout, eps=eps, affine=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.nonlinearity = nn.SiLU()
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if a["conv_shortcut"] else None

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        x = torch.cat([h, *skips], dim=1) if skips else h
        y = self.conv1(self.nonlinearity(self.norm1(x)))
        temb = self.time_emb_proj(self.nonlinearity(need(shared, "temb", self.kind)))
        y = y + temb[:, :, None, None]
        y = self.conv2(self.nonlinearity(self.norm2(y)))
        shortcut = self.conv_shortcut(x) if self.conv_shortcut is not None else x
        return shortcut + y, {}


class ResnetIn(PulseLayer):
    """``ResnetBlock2D``'s first half (``split_resnets``): its output carries the block's input behind ``y``."""

    kind = "resnet_in"

    def __init__(self, a: Attrs) -> None:
        super().__init__()
        cin, cout = a["in_channels"], a["out_channels"]
        self.num_skips = 1 if a["skip_channels"] else 0
        self.norm1 = nn.GroupNorm(a["groups"], cin, eps=a["eps"], affine=True)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.time_emb_proj = nn.Linear(a["temb_channels"], cout)
        self.nonlinearity = nn.SiLU()

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        x = torch.cat([h, *skips], dim=1) if skips else h
        y = self.conv1(self.nonlinearity(self.norm1(x)))
        temb = self.time_emb_proj(self.nonlinearity(need(shared, "temb", self.kind)))
        return torch.cat([y + temb[:, :, None, None], x], dim=1), {}


class ResnetOut(PulseLayer):
    """``ResnetBlock2D``'s second half: conv2 on ``y``, plus the shortcut of the input carried behind it."""

    kind = "resnet_out"

    def __init__(self, a: Attrs) -> None:
        super().__init__()
        cin, cout = a["in_channels"], a["out_channels"]
        self.channels = cout
        self.norm2 = nn.GroupNorm(a["groups"], cout, eps=a["eps"], affine=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.nonlinearity = nn.SiLU()
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if a["conv_shortcut"] else None

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        y, x = h[:, :self.channels], h[:, self.channels:]
        y = self.conv2(self.nonlinearity(self.norm2(y)))
        shortcut = self.conv_shortcut(x) if self.conv_shortcut is not None else x
        return shortcut + y, {}


class Attention(nn.Module):
    """diffusers ``Attention`` (AttnProcessor2_0): to_q/k/v without bias, to_out[0] with bias."""

    def __init__(self, dim: int, heads: int, context_dim: int | None = None, qkv_bias: bool = False) -> None:
        super().__init__()
        kv_dim = dim if context_dim is None else context_dim
        self.heads = heads
        self.to_q = nn.Linear(dim, dim, bias=qkv_bias)
        self.to_k = nn.Linear(kv_dim, dim, bias=qkv_bias)
        self.to_v = nn.Linear(kv_dim, dim, bias=qkv_bias)
        # diffusers keeps [Linear, Dropout] here; the dropout has no parameters.
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        kv = x if context is None else context
        out = attend(self.to_q(x), self.to_k(kv), self.to_v(kv), self.heads)
        return self.to_out[1](self.to_out[0](out))


class GEGLU(nn.Module):
    """diffusers ``GEGLU``: one projection to (hidden, gate); hidden * gelu(gate)."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 2 * inner)

    def forward(self, x: Tensor) -> Tensor:
        hidden, gate = self.proj(x).chunk(2, dim=-1)
        return hidden * F.gelu(gate)


class FeedForward(nn.Module):
    """diffusers ``FeedForward`` with GEGLU: net = [GEGLU, Dropout, Linear]."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([GEGLU(dim, inner), nn.Dropout(0.0), nn.Linear(inner, dim)])

    def forward(self, x: Tensor) -> Tensor:
        for module in self.net:
            x = module(x)
        return x


class BasicTransformerBlock(nn.Module):
    """Pre-LN self-attention, cross-attention over the context, GEGLU feed-forward."""

    def __init__(self, dim: int, heads: int, context_dim: int, ff_inner: int, eps: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn1 = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.attn2 = Attention(dim, heads, context_dim=context_dim)
        self.norm3 = nn.LayerNorm(dim, eps=eps)
        self.ff = FeedForward(dim, ff_inner)

    def forward(self, x: Tensor, context: Tensor) -> Tensor:
        return transformer_block(self, x, context)


class Transformer2D(PulseLayer):
    """diffusers ``Transformer2DModel``, continuous input, linear (SD 2) or 1x1-conv (SD 1.x) projections."""

    kind = "transformer2d"

    def __init__(self, a: Attrs) -> None:
        super().__init__()
        c = a["channels"]
        # the variants it refuses: pulse.layers.layer_contract.VARIANT_CHECKS
        self.linear_projection = bool(a["linear_projection"])
        self.norm = nn.GroupNorm(a["groups"], c, eps=a["norm_eps"], affine=True)
        self.proj_in = nn.Linear(c, c) if self.linear_projection else nn.Conv2d(c, c, 1)
        self.transformer_blocks = nn.ModuleList([
            BasicTransformerBlock(c, a["heads"], a["context_dim"], a["ff_inner"], a["ln_eps"])
            for _ in range(a["num_layers"])])
        self.proj_out = nn.Linear(c, c) if self.linear_projection else nn.Conv2d(c, c, 1)

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return transformer2d(self, TORCH_OPS, h, shared), {}


class Transformer2DPart(PulseLayer):
    """One half of one block of a ``Transformer2DModel`` (``split_transformers``): the first part also
    the GroupNorm and proj_in, the last proj_out and the residual. Parameter names as the whole
    model's (``transformer_blocks.<k>.attn1.to_q.weight``), so a checkpoint maps onto the parts."""

    kind = "transformer2d_part"

    def __init__(self, a: Attrs) -> None:
        super().__init__()
        c = a["channels"]
        self.channels, self.half = c, a["half"]
        self.first, self.last = transformer_part_ends(a)
        self.linear_projection = bool(a["linear_projection"])
        if self.first:
            self.norm = nn.GroupNorm(a["groups"], c, eps=a["norm_eps"], affine=True)
            self.proj_in = nn.Linear(c, c) if self.linear_projection else nn.Conv2d(c, c, 1)
        half = nn.Module()
        if self.half == "self":
            half.norm1, half.attn1 = nn.LayerNorm(c, eps=a["ln_eps"]), Attention(c, a["heads"])
        else:
            half.norm2 = nn.LayerNorm(c, eps=a["ln_eps"])
            half.attn2 = Attention(c, a["heads"], context_dim=a["context_dim"])
            half.norm3, half.ff = nn.LayerNorm(c, eps=a["ln_eps"]), FeedForward(c, a["ff_inner"])
        self.block_key = str(a["block"])
        self.transformer_blocks = nn.ModuleDict({self.block_key: half})
        if self.last:
            self.proj_out = nn.Linear(c, c) if self.linear_projection else nn.Conv2d(c, c, 1)

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return transformer2d_part(self, self.transformer_blocks[self.block_key], TORCH_OPS, h, shared), {}


class Downsample(PulseLayer):
    """diffusers ``Downsample2D`` with a conv: 3x3, stride 2, padding 1."""

    kind = "downsample"

    def __init__(self, a: Attrs) -> None:
        super().__init__()
        c = a["channels"]
        self.conv = nn.Conv2d(c, c, a["kernel"], stride=a["stride"], padding=a["padding"])

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return self.conv(h), {}


class Upsample(PulseLayer):
    """diffusers ``Upsample2D`` with a conv: nearest 2x, then 3x3."""

    kind = "upsample"

    def __init__(self, a: Attrs) -> None:
        super().__init__()
        c = a["channels"]
        self.mode = a["mode"]
        self.conv = nn.Conv2d(c, c, a["kernel"], padding=a["padding"])

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return self.conv(F.interpolate(h, scale_factor=2.0, mode=self.mode)), {}


class ConvOut(PulseLayer):
    """``conv_norm_out`` -> SiLU -> ``conv_out`` (two top-level diffusers modules)."""

    kind = "conv_out"

    def __init__(self, a: Attrs) -> None:
        super().__init__()
        self.conv_norm_out = nn.GroupNorm(a["groups"], a["in_channels"], eps=a["eps"], affine=True)
        self.conv_act = nn.SiLU()
        self.conv_out = nn.Conv2d(a["in_channels"], a["out_channels"], a["kernel"], padding=a["padding"])

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return self.conv_out(self.conv_act(self.conv_norm_out(h))), {}


UNET_LAYERS: dict[str, type[PulseLayer]] = {
    cls.kind: cls for cls in (TimeEmbed, ConvIn, Resnet, ResnetIn, ResnetOut, Transformer2D, Transformer2DPart,
                              Downsample, Upsample, ConvOut)
}
