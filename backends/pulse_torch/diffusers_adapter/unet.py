"""Layers over a diffusers ``UNet2DConditionModel``: each calls the model's own module.

::

    time_embed     model.get_time_embed(h, t) ─ model.time_embedding ─ [time_embed_act]   makes "temb"
                   [+ model.get_aug_embed(text_embeds, time_ids)]  SDXL's add_embedding, before the act
    conv_in        model.conv_in(h)                       ([2h - 1] if center_input_sample)
    resnet         model.<ref>(cat[h, skip], temb)        down_blocks.i.resnets.j, mid_block.resnets.j, up_...
    resnet_in      y = <ref>.conv1(act(<ref>.norm1(x))) + <ref>.time_emb_proj(act(temb)) ─▶ cat[y, x]
    resnet_out     (<ref>.conv_shortcut(x) + <ref>.conv2(dropout(act(<ref>.norm2(y))))) / output_scale_factor
                   (the two halves of a ResnetBlock2D, split_resnets=true)
    transformer2d  model.<ref>(h, encoder_hidden_states=context).sample
    transformer2d_part  one block's norm1, attn1 (the first part: <ref>.norm, .proj_in before), or its norm2,
                   attn2, norm3, ff (the last: <ref>.proj_out and the residual after); split_transformers=true
    downsample     model.down_blocks.i.downsamplers.0(h)
    upsample       model.up_blocks.k.upsamplers.0(h)
    conv_out       model.conv_out(model.conv_act(model.conv_norm_out(h)))

The only code of the model's forward repeated here is the glue between
those calls (the decoder's concatenation, the time embedding's activation,
``ResnetBlock2D.forward`` cut in two for ``split_resnets``, ``Transformer2DModel.forward`` cut at its
blocks' halves for ``split_transformers``), which ``tests/test_diffusers.py`` checks against ``model(...)`` over every
plan it runs.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor, nn

from pulse.spec import Layer, ModelSpec
from pulse.zoo.diffusers_config import UnsupportedDiffusersModel
from pulse_torch.diffusers_adapter.common import DiffusersLayer, ref, submodule
from pulse.layers.layer_recipes import transformer2d_part, transformer_part_ends
from pulse_torch.layers.common import TORCH_OPS, LayerOutput, Shared, need


class TimeEmbedCall(DiffusersLayer):
    kind = "time_embed"

    def __init__(self, model: nn.Module, layer: Layer) -> None:
        text_time = model.config.addition_embed_type == "text_time"  # SDXL
        owned = {"time_embedding": model.time_embedding}
        if text_time:  # add_time_proj is a parameter-free sinusoid
            owned["add_embedding"] = model.add_embedding
        super().__init__(model, layer, owned)
        self.text_time = text_time

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        t_emb = self.model.get_time_embed(sample=h, timestep=need(shared, "timesteps", self.kind))
        emb = self.time_embedding(t_emb, None)
        if self.text_time:  # diffusers' forward: emb + aug_emb, then the activation
            emb = emb + self.model.get_aug_embed(emb=emb, encoder_hidden_states=None,
                                                 added_cond_kwargs=added_conditions(shared, self.kind))
        if self.model.time_embed_act is not None:
            emb = self.model.time_embed_act(emb)
        return h, {"temb": emb}


class ConvInCall(DiffusersLayer):
    kind = "conv_in"

    def __init__(self, model: nn.Module, layer: Layer) -> None:
        super().__init__(model, layer, {"conv_in": model.conv_in})

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        if self.model.config.center_input_sample:
            h = 2 * h - 1.0
        return self.conv_in(h), {}


class ResnetCall(DiffusersLayer):
    """A ``ResnetBlock2D``; a decoder one first concatenates its skip after ``h``, as the up blocks do."""

    kind = "resnet"

    def __init__(self, model: nn.Module, layer: Layer) -> None:
        super().__init__(model, layer, {"resnet": submodule(model, ref(layer))})
        self.num_skips = 1 if layer.attrs["skip_channels"] else 0

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        x = torch.cat([h, *skips], dim=1) if skips else h
        return self.resnet(x, need(shared, "temb", self.kind)), {}


def _plain_resnet(block: nn.Module, layer: Layer) -> nn.Module:
    """``block`` if its forward is the one the halves repeat (no resampling, additive time embedding)."""
    plain = (block.upsample is None and block.downsample is None and block.time_embedding_norm == "default"
             and block.time_emb_proj is not None and not block.skip_time_act)
    if not plain:
        raise UnsupportedDiffusersModel(f"layer '{layer.name}' ({ref(layer)}): split_resnets=true splits only a "
                                        "plain ResnetBlock2D (pass split_resnets=false)")
    return block


class ResnetHalf(DiffusersLayer):
    """One half of a ``ResnetBlock2D`` (``split_resnets``): the block's modules named ``parts`` as its own."""

    parts: tuple[str, ...] = ()

    def __init__(self, model: nn.Module, layer: Layer) -> None:
        block = _plain_resnet(submodule(model, ref(layer)), layer)
        super().__init__(model, layer, {n: getattr(block, n) for n in self.parts})
        self.__dict__["block"] = block  # its parameter-free parts (activation, dropout, output scale)

    def rebind(self) -> None:
        """Hold the block's parts again: peft's ``add_adapter`` swaps a targeted conv for its LoRA wrapper
        in the block, and the wrapper (with its adapters) belongs to this half."""
        for name in self.parts:
            if getattr(self.block, name) is not None:
                self._modules[name] = getattr(self.block, name)


class ResnetInCall(ResnetHalf):
    """A ``ResnetBlock2D`` up to its time embedding; the block's input goes on behind ``y``."""

    kind = "resnet_in"
    parts = ("norm1", "conv1", "time_emb_proj")

    def __init__(self, model: nn.Module, layer: Layer) -> None:
        super().__init__(model, layer)
        self.num_skips = 1 if layer.attrs["skip_channels"] else 0

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        x = torch.cat([h, *skips], dim=1) if skips else h
        y = self.conv1(self.block.nonlinearity(self.norm1(x)))
        temb = self.time_emb_proj(self.block.nonlinearity(need(shared, "temb", self.kind)))
        return torch.cat([y + temb[:, :, None, None], x], dim=1), {}


class ResnetOutCall(ResnetHalf):
    """The rest of the ``ResnetBlock2D``: conv2 on ``y`` and the shortcut of the input carried behind it."""

    kind = "resnet_out"
    parts = ("norm2", "conv2", "conv_shortcut")

    def __init__(self, model: nn.Module, layer: Layer) -> None:
        super().__init__(model, layer)
        self.channels = int(layer.attrs["out_channels"])
        self.has_shortcut = self.block.conv_shortcut is not None  # a None part is not registered

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        block = self.block
        y, x = h[:, :self.channels], h[:, self.channels:]
        y = self.conv2(block.dropout(block.nonlinearity(self.norm2(y))))
        if self.has_shortcut:
            x = self.conv_shortcut(x.contiguous())
        return (x + y) / block.output_scale_factor, {}


class Transformer2DCall(DiffusersLayer):
    kind = "transformer2d"

    def __init__(self, model: nn.Module, layer: Layer) -> None:
        super().__init__(model, layer, {"attention": submodule(model, ref(layer))})

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        out = self.attention(h, encoder_hidden_states=need(shared, "context", self.kind), return_dict=False)
        return out[0], {}


def _plain_transformer(model: nn.Module, layer: Layer) -> nn.Module:
    """The ``Transformer2DModel`` if its forward is the one the parts repeat (continuous input, pre-LayerNorm
    blocks of self-attention, cross-attention and a feed-forward, no chunked feed-forward)."""
    t = submodule(model, ref(layer))
    blocks_plain = all(b.norm_type == "layer_norm" and not b.only_cross_attention and b.attn2 is not None
                       and b.pos_embed is None and not hasattr(b, "fuser") and b._chunk_size is None
                       for b in t.transformer_blocks)
    if not (t.is_input_continuous and blocks_plain):
        raise UnsupportedDiffusersModel(f"layer '{layer.name}' ({ref(layer)}): split_transformers=true splits only a "
                                        "continuous Transformer2DModel of layer-norm blocks (pass "
                                        "split_transformers=false)")
    return t


class Transformer2DPartCall(DiffusersLayer):
    """One half of one of the model's blocks (``split_transformers``): the block's own modules, and the glue of
    ``Transformer2DModel.forward`` and ``BasicTransformerBlock.forward`` between them
    (``pulse.layers.layer_recipes.transformer2d_part``)."""

    kind = "transformer2d_part"

    def __init__(self, model: nn.Module, layer: Layer) -> None:
        t, a = _plain_transformer(model, layer), layer.attrs
        self.first, self.last = transformer_part_ends(a)
        block = t.transformer_blocks[int(a["block"])]
        self.parts = (("norm", "proj_in") if self.first else ()) + (("proj_out",) if self.last else ())
        halves = ("norm1", "attn1") if a["half"] == "self" else ("norm2", "attn2", "norm3", "ff")
        super().__init__(model, layer, {**{n: getattr(t, n) for n in self.parts},
                                        **{n: getattr(block, n) for n in halves}})
        self.__dict__["transformer"] = t
        self.channels, self.half = int(a["channels"]), a["half"]
        self.linear_projection = bool(t.use_linear_projection)

    def rebind(self) -> None:
        """Hold the projections again: peft's ``add_adapter`` swaps a targeted proj_in / proj_out for its
        LoRA wrapper in the model (the attention and feed-forward modules keep theirs inside)."""
        for name in self.parts:
            self._modules[name] = getattr(self.transformer, name)

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return transformer2d_part(self, self, TORCH_OPS, h, shared), {}


class SamplerCall(DiffusersLayer):
    """``Downsample2D`` / ``Upsample2D``: the spec's latent is divisible by 2^levels, so no output size."""

    def __init__(self, model: nn.Module, layer: Layer) -> None:
        super().__init__(model, layer, {"sampler": submodule(model, ref(layer))})
        self.kind = layer.kind

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return self.sampler(h), {}


class ConvOutCall(DiffusersLayer):
    kind = "conv_out"

    def __init__(self, model: nn.Module, layer: Layer) -> None:
        super().__init__(model, layer, {"conv_norm_out": model.conv_norm_out, "conv_out": model.conv_out})

    def forward(self, h: Tensor, shared: Shared, skips: Sequence[Tensor]) -> LayerOutput:
        self.check_skips(skips)
        return self.conv_out(self.model.conv_act(self.conv_norm_out(h))), {}


UNET_CALLS: dict[str, type[DiffusersLayer]] = {
    "time_embed": TimeEmbedCall, "conv_in": ConvInCall, "resnet": ResnetCall,
    "resnet_in": ResnetInCall, "resnet_out": ResnetOutCall,
    "transformer2d": Transformer2DCall, "transformer2d_part": Transformer2DPartCall,
    "downsample": SamplerCall, "upsample": SamplerCall,
    "conv_out": ConvOutCall,
}


def added_conditions(shared: Mapping[str, Tensor], kind: str) -> dict[str, Tensor]:
    """SDXL's ``added_cond_kwargs`` from the data inputs (a pipeline's ``add_text_embeds``, ``add_time_ids``)."""
    return {"text_embeds": need(shared, "text_embeds", kind), "time_ids": need(shared, "time_ids", kind)}


def call_unet(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """The plain diffusers call a pipeline over this model reproduces: ``model(h, t, context).sample``."""
    added = added_conditions(batch, "unet") if model.config.addition_embed_type == "text_time" else None
    return model(batch["h"], batch["timesteps"], encoder_hidden_states=batch["context"],
                 added_cond_kwargs=added, return_dict=False)[0]


def check_unet(model: nn.Module) -> list[str]:
    """Runtime switches the spec cannot see (they live on modules, not in the config): problems found."""
    problems = []
    for k, block in enumerate(model.up_blocks):
        if all(getattr(block, name, None) for name in ("s1", "s2", "b1", "b2")):
            problems.append(f"up_blocks.{k} has FreeU enabled (call model.disable_freeu())")
    return problems


def unet_layers(model: nn.Module, spec: ModelSpec) -> dict[str, DiffusersLayer]:
    """One call layer per spec layer, in spec order."""
    return {layer.name: UNET_CALLS[layer.kind](model, layer) for layer in spec.layers}
