"""U-ViT layer kinds (baofff/U-ViT ``libs/uvit.py``), one cell per layer.

The same maths, parameter names and initialisation as
``pulse_torch.layers.uvit_layers`` (linears trunc_normal(0.02) with zero
biases, ``pos_embed`` trunc_normal(0.02))::

    embed       latent ─ patch conv ─▶ [label, time, patches] + pos_embed    (B, N, D)
    block_attn  [skip_linear(cat[x, skip])] ─ x + attn(norm1 x)                (B, N, D)
    block_mlp   x + mlp(norm2 x)                                             (B, N, D)
    final       LN ─ decoder_pred ─ drop extras ─ unpatchify [─ 3x3 conv]     (B, C, H, W)
"""
from __future__ import annotations

from typing import Any, Sequence

from mindspore import Tensor, nn, ops

from pulse_mindspore.layers.basic import Conv2d, Embedding, LayerNorm, Linear, ParamInit
from pulse_mindspore.layers.common import (LayerOutput, Mlp, PatchEmbed, PulseCell, Shared, attend, batch_of,
                                           need, sinusoid, unpatchify)

Attrs = dict[str, Any]
STD = 0.02  # UViT._init_weights: trunc_normal(std=0.02) on every linear, zero biases


class UViTEmbed(PulseCell):
    """Patch tokens, a parameter-free sinusoidal time token and a label token, plus positions."""

    kind = "uvit_embed"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        self.dim, self.extras = a["dim"], a["extras"]
        if a["time_embed"] != "sinusoid":
            raise NotImplementedError("uvit_embed: only the reference's mlp_time_embed=False is implemented")
        self.patch_embed = PatchEmbed(a["in_channels"], a["dim"], a["patch"], init)
        self.label_emb = Embedding(a["num_classes"], a["dim"], init) if a["num_classes"] > 0 else None
        self.pos_embed = init.trunc_normal((1, a["tokens"], a["dim"]), STD)

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        x = self.patch_embed(h)
        t = batch_of(need(shared, "timesteps", self.kind), h.shape[0])
        tokens = [sinusoid(t, self.dim, flip_sin_to_cos=True).astype(x.dtype)[:, None], x]
        if self.label_emb is not None:
            tokens.insert(0, self.label_emb(need(shared, "labels", self.kind))[:, None])
        return ops.cat(tokens, axis=1) + self.pos_embed, {}


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


class _AttnHalf:
    """``Block``'s first half: the long-skip fusion, then ``x + attn(norm1(x))``."""

    def _build_attn(self, a: Attrs, init: ParamInit) -> None:
        d = a["dim"]
        self.num_skips = 1 if a["skip"] else 0
        self.norm1 = LayerNorm(d, init, a["norm_eps"])
        self.attn = UViTAttention(d, a["heads"], a["qkv_bias"], init)
        self.skip_linear = Linear(2 * d, d, init, std=STD) if a["skip"] else None

    def attn_half(self, h: Tensor, skips: Sequence[Tensor]) -> Tensor:
        x = self.skip_linear(ops.cat([h, skips[0]], axis=-1)) if self.skip_linear is not None else h
        return x + self.attn(self.norm1(x))


class _MlpHalf:
    """``Block``'s second half: ``x + mlp(norm2(x))``."""

    def _build_mlp(self, a: Attrs, init: ParamInit) -> None:
        if a["activation"] != "gelu":
            raise NotImplementedError(f"uvit block: activation {a['activation']!r} is not implemented")
        self.norm2 = LayerNorm(a["dim"], init, a["norm_eps"])
        self.mlp = Mlp(a["dim"], a["mlp_hidden"], init, std=STD)

    def mlp_half(self, x: Tensor) -> Tensor:
        return x + self.mlp(self.norm2(x))


class UViTBlockAttn(_AttnHalf, PulseCell):
    """Layer ``<block>_attn``: [``skip_linear``(cat[x, skip])] then pre-LN attention, residual."""

    kind = "uvit_block_attn"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        self._build_attn(a, init)

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return self.attn_half(h, skips), {}


class UViTBlockMlp(_MlpHalf, PulseCell):
    """Layer ``<block>_mlp``: pre-LN MLP, residual (the block's output)."""

    kind = "uvit_block_mlp"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        self._build_mlp(a, init)

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return self.mlp_half(h), {}


class UViTBlock(_AttnHalf, _MlpHalf, PulseCell):
    """Reference ``Block`` as one layer (specs built with ``split_blocks=False``): both halves."""

    kind = "uvit_block"

    def __init__(self, a: Attrs, init: ParamInit) -> None:
        super().__init__()
        self._build_attn(a, init)
        self._build_mlp(a, init)

    def construct(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return self.mlp_half(self.attn_half(h, skips)), {}


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
    cls.kind: cls for cls in (UViTEmbed, UViTBlockAttn, UViTBlockMlp, UViTBlock, UViTFinal)
}
