"""U-ViT layer kinds (baofff/U-ViT ``libs/uvit.py``), one module per layer.

Parameter names follow the reference (``patch_embed.proj``, ``label_emb``,
``pos_embed``, ``attn.qkv``, ``mlp.fc1``, ``skip_linear``, ``decoder_pred``,
``final_layer``) and so does the initialisation (``UViT._init_weights``:
truncated normal 0.02 on linears with zero biases, and on ``pos_embed``)::

    embed       latent ─ patch conv ─▶ [label, time, patches] + pos_embed    (B, N, D)
    block_attn  [skip_linear(cat[x, skip])] ─ x + attn(norm1 x)                (B, N, D)
    block_mlp   x + mlp(norm2 x)                                             (B, N, D)
    final       LN ─ decoder_pred ─ drop extras ─ unpatchify [─ 3x3 conv]     (B, C, H, W)

A reference ``Block`` is two layers, ``<block>_attn`` then ``<block>_mlp``;
both carry the block's ``ref_module`` (``in_blocks.3``) and name their
parameters as ``Block`` does, so together they map one checkpoint block.
``uvit_block`` runs both halves as one layer (``split_blocks=False`` specs);
``pulse.layers.split_blocks`` makes the three classes from the two halves.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn

from pulse.layers.layer_recipes import uvit_tokens
from pulse.layers.split_blocks import skip_count, split_block_classes
from pulse_torch.layers.common import (TORCH_OPS, BlockMlpHalf, LayerOutput, PatchEmbed, PulseLayer, Shared, attend,
                                       unpatchify)

Attrs = dict[str, Any]


def init_like_uvit(module: nn.Module) -> None:
    """``UViT._init_weights``: linears ~ trunc_normal(0.02) with zero bias (LayerNorms stay 1 / 0)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class UViTEmbed(PulseLayer):
    """Patch tokens, a parameter-free sinusoidal time token and a label token, plus positions."""

    kind = "uvit_embed"

    def __init__(self, a: Attrs) -> None:
        super().__init__()
        self.dim, self.extras = a["dim"], a["extras"]
        self.patch_embed = PatchEmbed(a["in_channels"], a["dim"], a["patch"])
        self.label_emb = nn.Embedding(a["num_classes"], a["dim"]) if a["num_classes"] > 0 else None
        self.pos_embed = nn.Parameter(torch.empty(1, a["tokens"], a["dim"]))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return uvit_tokens(self, TORCH_OPS, h, shared), {}


class UViTAttention(nn.Module):
    """Reference ``Attention``: one qkv linear ('B L (K H D)' layout), proj with bias."""

    def __init__(self, dim: int, heads: int, qkv_bias: bool) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(attend(q, k, v, self.heads))


class UViTAttnHalf:
    """``Block``'s first half: the long-skip fusion, then ``x + attn(norm1(x))``."""

    def build(self, layer: nn.Module, a: Attrs) -> None:
        d = a["dim"]
        layer.num_skips = skip_count(a)
        layer.norm1 = nn.LayerNorm(d, eps=a["norm_eps"])
        layer.attn = UViTAttention(d, a["heads"], a["qkv_bias"])
        layer.skip_linear = nn.Linear(2 * d, d) if a["skip"] else None

    def run(self, layer: nn.Module, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> Tensor:
        x = layer.skip_linear(torch.cat([h, skips[0]], dim=-1)) if layer.skip_linear is not None else h
        return x + layer.attn(layer.norm1(x))


# uvit_block_attn, uvit_block_mlp and uvit_block (see pulse.layers.split_blocks)
UVIT_BLOCKS = split_block_classes("uvit_block", "UViT", PulseLayer, UViTAttnHalf(), BlockMlpHalf(), "forward",
                                  finish=init_like_uvit)


class UViTFinal(PulseLayer):
    """``norm`` -> ``decoder_pred`` -> drop the extra tokens -> unpatchify -> ``final_layer``."""

    kind = "uvit_final"

    def __init__(self, a: Attrs) -> None:
        super().__init__()
        d, c = a["dim"], a["out_channels"]
        self.extras, self.patch, self.channels = a["extras"], a["patch"], c
        self.norm = nn.LayerNorm(d, eps=a["norm_eps"])
        self.decoder_pred = nn.Linear(d, a["patch"] ** 2 * c)
        self.final_layer = nn.Conv2d(c, c, 3, padding=1) if a["conv"] else nn.Identity()
        init_like_uvit(self)

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        x = self.decoder_pred(self.norm(h))[:, self.extras:]
        return self.final_layer(unpatchify(x, self.patch, self.channels)), {}


UVIT_LAYERS: dict[str, type[PulseLayer]] = {
    **{cls.kind: cls for cls in (UViTEmbed, UViTFinal)}, **UVIT_BLOCKS,
}
