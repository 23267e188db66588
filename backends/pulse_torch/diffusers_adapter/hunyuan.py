"""Layers over a diffusers ``HunyuanDiT2DModel``: each calls the model's own modules.

::

    cond_embed   model.time_extra_emb(t, t5, sizes, style) -> "c"          latent passes through
                 cat[clip, model.text_embedder(t5)], masked -> model.text_embedding_padding -> "context"
    patch_embed  model.pos_embed(h)                                        (B, N, D) tokens
    block_attn   blocks.i: [skip_linear(skip_norm(cat[x, skip]))]
                 x + attn1(norm1(x, c), rope) ; x + attn2(norm2(x), context, rope)
    block_mlp    blocks.i: x + ff(norm3(x))                                 (split_blocks, the default)
    block        blocks.i(x, context, c, rope, skip)                       (split_blocks=False)
    final        proj_out(norm_out(x, c)) ─ unpatchify                     (B, 2C, H, W)

``HunyuanDiTBlock.forward`` is one call; splitting it in two layers repeats
its five lines of glue around the block's own submodules (the two halves
own disjoint submodules). The top-level forward's conditioning and
unpatchify glue is repeated likewise. ``tests/test_diffusers.py`` checks
both layouts against ``model(...)``.

RoPE: diffusers takes ``image_rotary_emb`` as an argument its pipeline
computes; the adapter computes the same tables once for the spec's latent
(``rotary_embedding``), and ``call_hunyuan`` passes them to the model.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor, nn

from pulse.layers.split_blocks import skip_count
from pulse.spec import Layer, ModelSpec
from pulse_torch.diffusers_adapter.common import DiffusersLayer, ref, submodule
from pulse_torch.layers.common import LayerOutput, Shared, need

Rope = tuple[Tensor, Tensor]


def rotary_embedding(model: nn.Module, latent_size: int) -> Rope:
    """(cos, sin) for a square latent, as ``HunyuanDiTPipeline`` builds them.

    The pipeline fits the token grid into a 512 px base grid
    (``get_resize_crop_region_for_grid``); a square grid fills it:
    crop ((0, 0), (base, base)).
    """
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    patch = int(model.config.patch_size)
    grid, base = latent_size // patch, 512 // 8 // patch
    # derived tables, small: on the host when the model's parameters are still on the meta device (a
    # stage-only rank's skeleton, a shapes-only model), and they move with the chunk that holds them
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    # Positional arguments only: the keywords (device, output_type) came and went across diffusers versions.
    with torch.device("cpu"):
        cos, sin = get_2d_rotary_pos_embed(model.inner_dim // model.num_heads, ((0, 0), (base, base)), (grid, grid))
    return cos.to(device), sin.to(device)


class _RopeLayer(DiffusersLayer):
    """Holds the RoPE tables as buffers, so they move with the chunk (not saved: derived)."""

    def set_rope(self, rope: Rope) -> None:
        self.register_buffer("rope_cos", rope[0], persistent=False)
        self.register_buffer("rope_sin", rope[1], persistent=False)

    @property
    def rope(self) -> Rope:
        return self.rope_cos, self.rope_sin


class CondEmbedCall(DiffusersLayer):
    kind = "hdit_cond_embed"

    def __init__(self, model: nn.Module, layer: Layer) -> None:
        super().__init__(model, layer, {"time_extra_emb": model.time_extra_emb, "text_embedder": model.text_embedder,
                                        "text_embedding_padding": model.text_embedding_padding})
        self.conditioned = bool(layer.attrs["size_cond"])

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        # The pipeline hands timesteps in the latent's dtype; the embedding casts to it.
        t = need(shared, "timesteps", self.kind).to(h.dtype).expand(h.shape[0])
        t5 = need(shared, "text_t5", self.kind)
        sizes = need(shared, "image_meta_size", self.kind) if self.conditioned else None
        style = need(shared, "style", self.kind) if self.conditioned else None
        c = self.time_extra_emb(t, t5, sizes, style, hidden_dtype=t.dtype)
        t5 = self.text_embedder(t5.reshape(-1, t5.shape[-1])).view(t5.shape[0], t5.shape[1], -1)
        text = torch.cat([need(shared, "text_clip", self.kind), t5], dim=1)
        mask = torch.cat([need(shared, "text_clip_mask", self.kind), need(shared, "text_t5_mask", self.kind)], dim=-1)
        return h, {"c": c, "context": torch.where(mask.unsqueeze(2).bool(), text, self.text_embedding_padding)}


class PatchEmbedCall(DiffusersLayer):
    kind = "hdit_patch_embed"

    def __init__(self, model: nn.Module, layer: Layer) -> None:
        super().__init__(model, layer, {"pos_embed": model.pos_embed})

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return self.pos_embed(h), {}


_ATTN_PARTS = ("skip_norm", "skip_linear", "norm1", "attn1", "norm2", "attn2")
_MLP_PARTS = ("norm3", "ff")


class BlockAttnCall(_RopeLayer):
    """The first half of ``blocks.i``: long-skip fusion, self-attention, cross-attention."""

    kind = "hdit_block_attn"

    def __init__(self, model: nn.Module, layer: Layer, rope: Rope) -> None:
        block = submodule(model, ref(layer))
        super().__init__(model, layer, {n: getattr(block, n, None) for n in _ATTN_PARTS})
        self.num_skips = skip_count(layer.attrs)
        self.set_rope(rope)

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        x = self.skip_linear(self.skip_norm(torch.cat([h, skips[0]], dim=-1))) if skips else h
        x = x + self.attn1(self.norm1(x, need(shared, "c", self.kind)), image_rotary_emb=self.rope)
        context = need(shared, "context", self.kind)
        return x + self.attn2(self.norm2(x), encoder_hidden_states=context, image_rotary_emb=self.rope), {}


class BlockMlpCall(DiffusersLayer):
    """The second half of ``blocks.i``: the feed-forward with its residual (the block's output)."""

    kind = "hdit_block_mlp"

    def __init__(self, model: nn.Module, layer: Layer) -> None:
        block = submodule(model, ref(layer))
        super().__init__(model, layer, {n: getattr(block, n) for n in _MLP_PARTS})

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return h + self.ff(self.norm3(h)), {}


class BlockCall(_RopeLayer):
    """All of ``blocks.i`` in one call (``split_blocks=False`` specs)."""

    kind = "hdit_block"

    def __init__(self, model: nn.Module, layer: Layer, rope: Rope) -> None:
        super().__init__(model, layer, {"block": submodule(model, ref(layer))})
        self.num_skips = skip_count(layer.attrs)
        self.set_rope(rope)

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        out = self.block(h, encoder_hidden_states=need(shared, "context", self.kind), temb=need(shared, "c", self.kind),
                         image_rotary_emb=self.rope, skip=skips[0] if skips else None)
        return out, {}


class FinalCall(DiffusersLayer):
    """``norm_out`` (adaLN from c), ``proj_out``, then the forward's unpatchify."""

    kind = "hdit_final"

    def __init__(self, model: nn.Module, layer: Layer) -> None:
        super().__init__(model, layer, {"norm_out": model.norm_out, "proj_out": model.proj_out})
        self.patch, self.channels = int(layer.attrs["patch"]), int(layer.attrs["out_channels"])

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        x = self.proj_out(self.norm_out(h, need(shared, "c", self.kind).to(torch.float32)))
        b, n, p = x.shape[0], x.shape[1], self.patch
        grid = int(round(n ** 0.5))
        x = torch.einsum("nhwpqc->nchpwq", x.reshape(b, grid, grid, p, p, self.channels))
        return x.reshape(b, self.channels, grid * p, grid * p), {}


HUNYUAN_CALLS: dict[str, type[DiffusersLayer]] = {
    "hdit_cond_embed": CondEmbedCall, "hdit_patch_embed": PatchEmbedCall, "hdit_block_attn": BlockAttnCall,
    "hdit_block_mlp": BlockMlpCall, "hdit_block": BlockCall, "hdit_final": FinalCall,
}


def call_hunyuan(model: nn.Module, batch: Mapping[str, Tensor], rope: Rope) -> Tensor:
    """The plain diffusers call a pipeline over this model reproduces."""
    h = batch["h"]
    return model(h, batch["timesteps"].to(h.dtype), encoder_hidden_states=batch["text_clip"],
                 text_embedding_mask=batch["text_clip_mask"], encoder_hidden_states_t5=batch["text_t5"],
                 text_embedding_mask_t5=batch["text_t5_mask"], image_meta_size=batch.get("image_meta_size"),
                 style=batch.get("style"), image_rotary_emb=rope, return_dict=False)[0]


def hunyuan_layers(model: nn.Module, spec: ModelSpec, rope: Rope) -> dict[str, DiffusersLayer]:
    """One call layer per spec layer, in spec order; the attention layers share ``rope``."""
    layers: dict[str, DiffusersLayer] = {}
    for layer in spec.layers:
        cls = HUNYUAN_CALLS[layer.kind]
        layers[layer.name] = cls(model, layer, rope) if issubclass(cls, _RopeLayer) else cls(model, layer)
    return layers
