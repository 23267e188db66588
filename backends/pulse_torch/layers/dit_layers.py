"""Hunyuan-DiT layer kinds (Tencent/HunyuanDiT ``hydit/modules/models.py``), one module per layer.

::

    cond_embed   latent ──────────────────────────────────────▶ latent   makes "c", "context"
    patch_embed  latent ─ strided conv ─▶ tokens (B, N, D)
    block_attn   [skip_linear(skip_norm(cat[x, skip]))]
                 ─ x + attn1(norm1 x + shift(c), RoPE) ─ x + attn2(norm3 x, context)
    block_mlp    x + mlp(norm2 x)
    final        adaLN(shift, scale from c) on a plain LN ─ linear ─ unpatchify ─▶ (B, 2C, H, W)

A ``HunYuanDiTBlock`` is two layers, ``block<i>_attn`` then ``block<i>_mlp``,
both with ``ref_module`` ``blocks.<i>`` and the reference's parameter names,
so together they map one checkpoint block; ``hdit_block`` runs both as one
layer (``split_blocks=False`` specs). ``pulse.layers.split_blocks`` makes the
three classes from the two halves.

Initialisation is PyTorch's default for every Linear / Conv and the
reference's for the raw tables (``text_embedding_padding``, the pooler's
positions). The reference's ``initialize_weights`` zeroes the modulation and
final layers, which would make every gradient upstream of ``final`` vanish
at step 0 and the pipeline-vs-reference gradient checks meaningless; a real
training run loads a checkpoint or applies that init itself.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn

from pulse.layers.layer_recipes import hdit_conditions
from pulse.layers.split_blocks import skip_count, split_block_classes
from pulse_torch.layers.common import (TORCH_OPS, BlockMlpHalf, LayerOutput, PulseLayer, Shared, need,
                                       patch_tokens, unpatchify)
from pulse_torch.layers.dit_parts import (AttentionPool, CrossAttention, SelfAttention, TimestepEmbedder,
                                          mlp_silu, rope_2d)

Attrs = dict[str, Any]


class HDiTCondEmbed(PulseLayer):
    """The reference forward's conditioning part: c (B, dim) and the text context (B, L, clip_dim)."""

    kind = "hdit_cond_embed"

    def __init__(self, a: Attrs) -> None:
        super().__init__()
        d, e = a["dim"], a["t5_dim"]
        self.freq_dim, self.size_cond, self.style_cond = a["freq_dim"], a["size_cond"], a["style_cond"]
        self.t_embedder = TimestepEmbedder(d, a["freq_dim"])
        self.pooler = AttentionPool(a["t5_len"], e, a["pooler_heads"], a["pooled_dim"])
        self.extra_embedder = mlp_silu(a["extra_in_dim"], 4 * d, d)
        self.style_embedder = nn.Embedding(1, d) if a["style_cond"] else None
        self.mlp_t5 = mlp_silu(e, 4 * e, a["clip_dim"])
        self.text_embedding_padding = nn.Parameter(torch.randn(a["clip_len"] + a["t5_len"], a["clip_dim"]))

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return h, hdit_conditions(self, TORCH_OPS, h.shape[0], shared)


class HDiTPatchEmbed(PulseLayer):
    """``x_embedder``: timm PatchEmbed (no positional table: the blocks use RoPE)."""

    kind = "hdit_patch_embed"

    def __init__(self, a: Attrs) -> None:
        super().__init__()
        self.proj = nn.Conv2d(a["in_channels"], a["dim"], a["patch"], stride=a["patch"])

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return patch_tokens(self.proj, h), {}


class HDiTAttnHalf:
    """``HunYuanDiTBlock``'s first part: long-skip fusion, shift-modulated self-attention, cross-attention."""

    def build(self, layer: nn.Module, a: Attrs) -> None:
        d, eps, bias = a["dim"], a["norm_eps"], a["qkv_bias"]
        layer.num_skips = skip_count(a)
        layer.norm1 = nn.LayerNorm(d, eps=eps)
        layer.attn1 = SelfAttention(d, a["heads"], bias, eps)
        layer.default_modulation = nn.Sequential(nn.SiLU(), nn.Linear(a["c_dim"], d))
        layer.attn2 = CrossAttention(d, a["context_dim"], a["heads"], bias, eps)
        layer.norm3 = nn.LayerNorm(d, eps=eps)
        layer.skip_norm = nn.LayerNorm(2 * d, eps=eps) if a["skip"] else None
        layer.skip_linear = nn.Linear(2 * d, d) if a["skip"] else None
        # Not parameters (the reference recomputes them per resolution); not saved.
        cos, sin = rope_2d(a["grid"], a["head_dim"])
        layer.register_buffer("rope_cos", cos, persistent=False)
        layer.register_buffer("rope_sin", sin, persistent=False)

    def run(self, layer: nn.Module, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> Tensor:
        x = h
        if layer.skip_linear is not None:
            x = layer.skip_linear(layer.skip_norm(torch.cat([x, skips[0]], dim=-1)))
        c, context = need(shared, "c", layer.kind), need(shared, "context", layer.kind)
        cos, sin = layer.rope_cos.to(x.dtype), layer.rope_sin.to(x.dtype)
        shift = layer.default_modulation(c)[:, None]
        x = x + layer.attn1(layer.norm1(x) + shift, cos, sin)
        return x + layer.attn2(layer.norm3(x), context, cos, sin)


# hdit_block_attn, hdit_block_mlp and hdit_block (see pulse.layers.split_blocks)
HDIT_BLOCKS = split_block_classes("hdit_block", "HDiT", PulseLayer, HDiTAttnHalf(), BlockMlpHalf(), "forward")


class HDiTFinal(PulseLayer):
    """``FinalLayer`` (adaLN shift / scale, non-affine LN, linear) then ``unpatchify``."""

    kind = "hdit_final"

    def __init__(self, a: Attrs) -> None:
        super().__init__()
        d = a["dim"]
        self.patch, self.channels = a["patch"], a["out_channels"]
        self.norm_final = nn.LayerNorm(d, elementwise_affine=False, eps=a["norm_eps"])
        self.linear = nn.Linear(d, a["patch"] ** 2 * a["out_channels"])
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(a["c_dim"], 2 * d))

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        shift, scale = self.adaLN_modulation(need(shared, "c", self.kind)).chunk(2, dim=1)
        x = self.norm_final(h) * (1 + scale[:, None]) + shift[:, None]
        return unpatchify(self.linear(x), self.patch, self.channels), {}


DIT_LAYERS: dict[str, type[PulseLayer]] = {
    **{cls.kind: cls for cls in (HDiTCondEmbed, HDiTPatchEmbed, HDiTFinal)}, **HDIT_BLOCKS,
}
