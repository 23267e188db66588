"""Hunyuan-DiT layer kinds (Tencent/HunyuanDiT ``hydit/modules/models.py``), one cell per layer.

The same maths and parameter names as ``pulse_torch.layers.dit_layers``
(whose docstring draws each kind), including its choice of PyTorch default
inits instead of the reference's zeroed modulation and final layers, so no
gradient vanishes at step 0.
"""
from __future__ import annotations

from typing import Any, Sequence

from mindspore import Tensor, nn, ops

from pulse.layers.layer_recipes import hdit_conditions
from pulse.layers.split_blocks import skip_count, split_block_classes
from pulse_mindspore.layers.basic import Act, Conv2d, Embedding, LayerNorm, Linear, ParamInit, mlp_silu, silu
from pulse_mindspore.layers.common import (MINDSPORE_OPS, BlockMlpHalf, LayerOutput, PulseCell, Shared, need,
                                           patch_tokens, unpatchify)
from pulse_mindspore.layers.dit_parts import AttentionPool, CrossAttention, SelfAttention, TimestepEmbedder, rope_for

Attrs = dict[str, Any]


class HDiTCondEmbed(PulseCell):
    """The reference forward's conditioning part: c (B, dim) and the text context (B, L, clip_dim)."""

    kind = "hdit_cond_embed"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        d, e = a["dim"], a["t5_dim"]
        self.freq_dim, self.size_cond = a["freq_dim"], a["size_cond"]
        self.t_embedder = TimestepEmbedder(d, a["freq_dim"], init)
        self.pooler = AttentionPool(a["t5_len"], e, a["pooler_heads"], a["pooled_dim"], init)
        self.extra_embedder = mlp_silu(a["extra_in_dim"], 4 * d, d, init)
        self.style_embedder = Embedding(1, d, init) if a["style_cond"] else None
        self.mlp_t5 = mlp_silu(e, 4 * e, a["clip_dim"], init)
        self.text_embedding_padding = init.normal((a["clip_len"] + a["t5_len"], a["clip_dim"]), 1.0)

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return h, hdit_conditions(self, MINDSPORE_OPS, h.shape[0], shared)


class HDiTPatchEmbed(PulseCell):
    """``x_embedder``: timm PatchEmbed (no positional table: the blocks use RoPE)."""

    kind = "hdit_patch_embed"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        self.proj = Conv2d(a["in_channels"], a["dim"], a["patch"], init, stride=a["patch"])

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return patch_tokens(self.proj, h), {}


class HDiTAttnHalf:
    """``HunYuanDiTBlock``'s first part: long-skip fusion, shift-modulated self-attention, cross-attention."""

    def build(self, layer: nn.Cell, a: Attrs, init: ParamInit) -> None:
        d, eps, bias = a["dim"], a["norm_eps"], a["qkv_bias"]
        layer.num_skips = skip_count(a)
        layer.norm1 = LayerNorm(d, init, eps)
        layer.attn1 = SelfAttention(d, a["heads"], bias, eps, init)
        layer.default_modulation = nn.SequentialCell([Act(silu), Linear(a["c_dim"], d, init)])
        layer.attn2 = CrossAttention(d, a["context_dim"], a["heads"], bias, eps, init)
        layer.norm3 = LayerNorm(d, init, eps)
        layer.skip_norm = LayerNorm(2 * d, init, eps) if a["skip"] else None
        layer.skip_linear = Linear(2 * d, d, init) if a["skip"] else None
        layer.rope = rope_for(a["grid"], a["head_dim"])  # shared constants, not parameters

    def run(self, layer: nn.Cell, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> Tensor:
        x = h
        if layer.skip_linear is not None:
            x = layer.skip_linear(layer.skip_norm(ops.cat([x, skips[0]], axis=-1)))
        c, context = need(shared, "c", layer.kind), need(shared, "context", layer.kind)
        shift = layer.default_modulation(c)[:, None]
        x = x + layer.attn1(layer.norm1(x) + shift, layer.rope)
        return x + layer.attn2(layer.norm3(x), context, layer.rope)


# hdit_block_attn, hdit_block_mlp and hdit_block (see pulse.layers.split_blocks)
HDIT_BLOCKS = split_block_classes("hdit_block", "HDiT", PulseCell, HDiTAttnHalf(), BlockMlpHalf(), "construct")


class HDiTFinal(PulseCell):
    """``FinalLayer`` (adaLN shift / scale, non-affine LN, linear) then ``unpatchify``."""

    kind = "hdit_final"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        d = a["dim"]
        self.patch, self.channels = a["patch"], a["out_channels"]
        self.norm_final = LayerNorm(d, init, a["norm_eps"], affine=False)
        self.linear = Linear(d, a["patch"] ** 2 * a["out_channels"], init)
        self.adaLN_modulation = nn.SequentialCell([Act(silu), Linear(a["c_dim"], 2 * d, init)])

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        shift, scale = ops.chunk(self.adaLN_modulation(need(shared, "c", self.kind)), 2, axis=1)
        x = self.norm_final(h) * (1 + scale[:, None]) + shift[:, None]
        return unpatchify(self.linear(x), self.patch, self.channels), {}


DIT_LAYERS: dict[str, type[PulseCell]] = {
    **{cls.kind: cls for cls in (HDiTCondEmbed, HDiTPatchEmbed, HDiTFinal)}, **HDIT_BLOCKS,
}
