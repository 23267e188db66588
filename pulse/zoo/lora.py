"""LoRA adapters priced from a UNet spec: which Linear / Conv2d modules ``--lora-targets`` names, and
the parameters peft gives each (framework-free: the planner prices LoRA before any rank loads torch).

::

    spec layer (kind + attrs + ref_module) ─▶ its projections: (full module name, fan in, fan out)
        transformer2d  {ref}.proj_in, .proj_out, .transformer_blocks.{i}.attn1/attn2.to_q/to_k/to_v/to_out.0,
                       .ff.net.0.proj, .ff.net.2
        resnet         {ref}.conv1, .conv2, .time_emb_proj[, .conv_shortcut]
        transformer2d_part  one block's attn1 (the first part: proj_in too) or attn2 and ff (the last: proj_out)
        resnet_in      {ref}.conv1, .time_emb_proj          resnet_out  {ref}.conv2[, .conv_shortcut]
        ...
    --lora-targets (peft's rule: a module name equal to a target or ending in ".target")
        ─▶ adapter_params(spec, rank, targets): rank x (fan in + fan out) per matched module, per layer

peft's adapters are ``lora_A`` (Linear(in, R) or Conv2d(in, R, k x k)) and ``lora_B`` (Linear(R, out)
or a 1 x 1 Conv2d(R, out)), both without bias, hence R x (in x k x k + out) each. The torch side
(``pulse_torch.diffusers_adapter.lora.add_lora``) checks these counts against the real peft model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from pulse.errors import SpecError
from pulse.spec import Layer, ModelSpec

DEFAULT_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # diffusers' train_text_to_image_lora.py


@dataclass(frozen=True)
class Projection:
    """One module peft can give an adapter: its name in the diffusers model and its widths."""

    name: str
    fan_in: int  # a Linear's in_features; a Conv2d's in_channels x kernel x kernel
    fan_out: int

    def adapter_params(self, rank: int) -> int:
        return rank * (self.fan_in + self.fan_out)


def target_names(text: str | None) -> tuple[str, ...]:
    """``--lora-targets a,b`` as names (None or empty: diffusers' defaults)."""
    return tuple(t.strip() for t in (text or ",".join(DEFAULT_TARGETS)).split(",") if t.strip())


def matches(name: str, targets: Iterable[str]) -> bool:
    """peft's ``check_target_module_exists`` for a list of targets: the name or its dotted suffix."""
    return any(name == t or name.endswith(f".{t}") for t in targets)


def _attention(prefix: str, c: int, ctx: int) -> list[Projection]:
    """BasicTransformerBlock's self- (attn1) and cross-attention (attn2) projections."""
    out = []
    for attn, kv in (("attn1", c), ("attn2", ctx)):
        out += [Projection(f"{prefix}.{attn}.to_q", c, c), Projection(f"{prefix}.{attn}.to_k", kv, c),
                Projection(f"{prefix}.{attn}.to_v", kv, c), Projection(f"{prefix}.{attn}.to_out.0", c, c)]
    return out


def _transformer2d(layer: Layer, ref: str) -> list[Projection]:
    a = layer.attrs
    c, ff = int(a["channels"]), int(a["ff_inner"])
    out = [Projection(f"{ref}.proj_in", c, c), Projection(f"{ref}.proj_out", c, c)]  # a 1x1 conv has c in too
    for i in range(int(a.get("num_layers", 1))):
        block = f"{ref}.transformer_blocks.{i}"
        out += _attention(block, c, int(a["context_dim"]))
        out += [Projection(f"{block}.ff.net.0.proj", c, 2 * ff), Projection(f"{block}.ff.net.2", ff, c)]  # GEGLU
    return out


def _transformer2d_part(layer: Layer, ref: str) -> list[Projection]:
    """One half of one block (``split_transformers``): attn1's or attn2's and the feed-forward's projections,
    the first part proj_in too, the last proj_out."""
    a = layer.attrs
    k, c, ff = int(a["block"]), int(a["channels"]), int(a["ff_inner"])
    block = f"{ref}.transformer_blocks.{k}"
    attention = _attention(block, c, int(a["context_dim"]))
    attn1, attn2 = attention[:4], attention[4:]
    if a["half"] == "self":
        return ([Projection(f"{ref}.proj_in", c, c)] if k == 0 else []) + attn1
    last = k == int(a.get("num_layers", 1)) - 1
    return (attn2 + [Projection(f"{block}.ff.net.0.proj", c, 2 * ff), Projection(f"{block}.ff.net.2", ff, c)]
            + ([Projection(f"{ref}.proj_out", c, c)] if last else []))


def _resnet(layer: Layer, ref: str) -> list[Projection]:
    a = layer.attrs
    cin, cout = int(a["in_channels"]), int(a["out_channels"])
    out = [Projection(f"{ref}.conv1", cin * 9, cout), Projection(f"{ref}.time_emb_proj", int(a["temb_channels"]), cout),
           Projection(f"{ref}.conv2", cout * 9, cout)]
    return out + ([Projection(f"{ref}.conv_shortcut", cin, cout)] if a.get("conv_shortcut") else [])


def _resnet_in(layer: Layer, ref: str) -> list[Projection]:
    """The first half of a split ResnetBlock2D (``split_resnets``): conv1 and the time projection."""
    return _resnet(layer, ref)[:2]


def _resnet_out(layer: Layer, ref: str) -> list[Projection]:
    """The second half: conv2 and the shortcut."""
    return _resnet(layer, ref)[2:]


def _time_embed(layer: Layer, ref: str) -> list[Projection]:
    a = layer.attrs
    temb = int(a["temb_channels"])
    out = [Projection("time_embedding.linear_1", int(a["sinusoid_dim"]), temb),
           Projection("time_embedding.linear_2", temb, temb)]
    if "text_embeds_dim" in a:  # SDXL's add_embedding (pulse.zoo.unet_blocks.AddedTimeText)
        width = int(a["text_embeds_dim"]) + int(a["time_ids"]) * int(a["addition_time_embed_dim"])
        out += [Projection("add_embedding.linear_1", width, temb), Projection("add_embedding.linear_2", temb, temb)]
    return out


def _conv(name: str, cin_key: str, cout_key: str) -> Callable[[Layer, str], list[Projection]]:
    def projections(layer: Layer, ref: str) -> list[Projection]:
        a = layer.attrs
        return [Projection(name.format(ref=ref), int(a[cin_key]) * int(a["kernel"]) ** 2, int(a[cout_key]))]
    return projections


_BY_KIND: dict[str, Callable[[Layer, str], list[Projection]]] = {
    "transformer2d": _transformer2d, "transformer2d_part": _transformer2d_part,
    "resnet": _resnet, "resnet_in": _resnet_in, "resnet_out": _resnet_out,
    "time_embed": _time_embed,
    "conv_in": _conv("conv_in", "in_channels", "out_channels"),
    "conv_out": _conv("conv_out", "in_channels", "out_channels"),
    "downsample": _conv("{ref}.conv", "channels", "channels"),
    "upsample": _conv("{ref}.conv", "channels", "channels"),
}


def projections(layer: Layer) -> list[Projection]:
    """The Linear and Conv2d modules of a UNet spec layer (``pulse.zoo.unet_blocks``), by their model names."""
    make = _BY_KIND.get(layer.kind)
    if make is None:
        raise SpecError(f"--lora-rank: PULSE prices LoRA on UNet2DConditionModel layers, not a '{layer.kind}' "
                        f"layer ('{layer.name}')")
    return make(layer, str(layer.attrs.get("ref_module", "")).split(",")[0])


def adapter_params(spec: ModelSpec, rank: int, targets: Iterable[str] = DEFAULT_TARGETS) -> tuple[int, ...]:
    """Parameters of the LoRA adapters peft adds to each layer of ``spec`` (rank ``rank``, modules ``targets``)."""
    names = tuple(targets)
    return tuple(sum(p.adapter_params(rank) for p in projections(layer) if matches(p.name, names))
                 for layer in spec.layers)
