"""U-ViT layer kinds (baofff/U-ViT ``libs/uvit.py``), one cell per layer.

The same maths, parameter names and initialisation as
``pulse_torch.layers.uvit_layers`` (whose docstring draws each kind):
linears trunc_normal(0.02) with zero biases, ``pos_embed`` trunc_normal(0.02).
"""
from __future__ import annotations

from typing import Any, Sequence

from mindspore import Tensor, nn, ops

from pulse.layers.layer_recipes import uvit_tokens
from pulse.layers.split_blocks import skip_count, split_block_classes
from pulse_mindspore.layers.basic import Conv2d, Embedding, LayerNorm, Linear, ParamInit
from pulse_mindspore.layers.common import (MINDSPORE_OPS, BlockMlpHalf, LayerOutput, PatchEmbed, PulseCell, Shared,
                                           attend, unpatchify)

Attrs = dict[str, Any]
STD = 0.02  # UViT._init_weights: trunc_normal(std=0.02) on every linear, zero biases


class UViTEmbed(PulseCell):
    """Patch tokens, a parameter-free sinusoidal time token and a label token, plus positions."""

    kind = "uvit_embed"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        self.dim, self.extras = a["dim"], a["extras"]
        self.patch_embed = PatchEmbed(a["in_channels"], a["dim"], a["patch"], init)
        self.label_emb = Embedding(a["num_classes"], a["dim"], init) if a["num_classes"] > 0 else None
        self.pos_embed = init.trunc_normal((1, a["tokens"], a["dim"]), STD)

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return uvit_tokens(self, MINDSPORE_OPS, h, shared), {}


class UViTAttention(nn.Cell):
    """Reference ``Attention``: one qkv linear ('B L (K H D)' layout), proj with bias."""

    def __init__(self, dim: int, heads: int, qkv_bias: bool, init: ParamInit) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = Linear(dim, 3 * dim, init, bias=qkv_bias, std=STD)
        self.proj = Linear(dim, dim, init, std=STD)

    def construct(self, x: Tensor) -> Tensor:
        q, k, v = ops.chunk(self.qkv(x), 3, axis=-1)
        return self.proj(attend(q, k, v, self.heads))


class UViTAttnHalf:
    """``Block``'s first half: the long-skip fusion, then ``x + attn(norm1(x))``."""

    def build(self, layer: nn.Cell, a: Attrs, init: ParamInit) -> None:
        d = a["dim"]
        layer.num_skips = skip_count(a)
        layer.norm1 = LayerNorm(d, init, a["norm_eps"])
        layer.attn = UViTAttention(d, a["heads"], a["qkv_bias"], init)
        layer.skip_linear = Linear(2 * d, d, init, std=STD) if a["skip"] else None

    def run(self, layer: nn.Cell, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> Tensor:
        x = layer.skip_linear(ops.cat([h, skips[0]], axis=-1)) if layer.skip_linear is not None else h
        return x + layer.attn(layer.norm1(x))


# uvit_block_attn, uvit_block_mlp and uvit_block (see pulse.layers.split_blocks)
UVIT_BLOCKS = split_block_classes("uvit_block", "UViT", PulseCell, UViTAttnHalf(), BlockMlpHalf(std=STD), "construct")


class UViTFinal(PulseCell):
    """``norm`` -> ``decoder_pred`` -> drop the extra tokens -> unpatchify -> ``final_layer``."""

    kind = "uvit_final"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        d, c = a["dim"], a["out_channels"]
        self.extras, self.patch, self.channels = a["extras"], a["patch"], c
        self.norm = LayerNorm(d, init, a["norm_eps"])
        self.decoder_pred = Linear(d, a["patch"] ** 2 * c, init, std=STD)
        self.final_layer = Conv2d(c, c, 3, init, padding=1) if a["conv"] else None

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        x = unpatchify(self.decoder_pred(self.norm(h))[:, self.extras:], self.patch, self.channels)
        return (self.final_layer(x) if self.final_layer is not None else x), {}


UVIT_LAYERS: dict[str, type[PulseCell]] = {
    **{cls.kind: cls for cls in (UViTEmbed, UViTFinal)}, **UVIT_BLOCKS,
}
