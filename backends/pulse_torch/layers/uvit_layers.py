"""U-ViT layer kinds (baofff/U-ViT ``libs/uvit.py``), one module per layer.

Parameter names follow the reference (``patch_embed.proj``, ``label_emb``,
``pos_embed``, ``attn.qkv``, ``mlp.fc1``, ``skip_linear``, ``decoder_pred``,
``final_layer``) and so does the initialisation (``UViT._init_weights``:
truncated normal 0.02 on linears with zero biases, and on ``pos_embed``)::

    embed   latent ─ patch conv ─▶ [label, time, patches] + pos_embed        (B, N, D)
    block   [skip_linear(cat[x, skip])] ─ x + attn(LN x) ─ x + MLP(LN x)      (B, N, D)
    final   LN ─ decoder_pred ─ drop extras ─ unpatchify [─ 3x3 conv]         (B, C, H, W)
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn

from pulse_torch.layers.common import (LayerOutput, Mlp, PatchEmbed, PulseLayer, Shared, attend, need,
                                       sinusoid, unpatchify)

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
        if a["time_embed"] != "sinusoid":
            raise NotImplementedError("uvit_embed: only the reference's mlp_time_embed=False is implemented")
        self.patch_embed = PatchEmbed(a["in_channels"], a["dim"], a["patch"])
        self.label_emb = nn.Embedding(a["num_classes"], a["dim"]) if a["num_classes"] > 0 else None
        self.pos_embed = nn.Parameter(torch.empty(1, a["tokens"], a["dim"]))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        x = self.patch_embed(h)
        t = need(shared, "timesteps", self.kind).expand(h.shape[0])
        tokens = [sinusoid(t, self.dim, flip_sin_to_cos=True).to(x.dtype)[:, None], x]
        if self.label_emb is not None:
            tokens.insert(0, self.label_emb(need(shared, "labels", self.kind))[:, None])
        return torch.cat(tokens, dim=1) + self.pos_embed, {}


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


class UViTBlock(PulseLayer):
    """Reference ``Block``: optional long-skip linear, then pre-LN attention and MLP."""

    kind = "uvit_block"

    def __init__(self, a: Attrs) -> None:
        super().__init__()
        d, eps = a["dim"], a["norm_eps"]
        if a["activation"] != "gelu":
            raise NotImplementedError(f"uvit_block: activation {a['activation']!r} is not implemented")
        self.num_skips = 1 if a["skip"] else 0
        self.norm1 = nn.LayerNorm(d, eps=eps)
        self.attn = UViTAttention(d, a["heads"], a["qkv_bias"])
        self.norm2 = nn.LayerNorm(d, eps=eps)
        self.mlp = Mlp(d, a["mlp_hidden"])
        self.skip_linear = nn.Linear(2 * d, d) if a["skip"] else None
        init_like_uvit(self)

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        x = self.skip_linear(torch.cat([h, skips[0]], dim=-1)) if self.skip_linear is not None else h
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x)), {}


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


UVIT_LAYERS: dict[str, type[PulseLayer]] = {cls.kind: cls for cls in (UViTEmbed, UViTBlock, UViTFinal)}
