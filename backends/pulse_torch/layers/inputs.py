"""Random data inputs of the right shapes for a spec: the latent and every data shared input.

Shapes come from the layers' ``attrs`` (not from ``spec.meta``), so a spec
loaded from YAML works the same as a zoo entry. One maker per shared-input
name, in a table; a spec naming an input this table lacks is an error.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from pulse.errors import SpecError
from pulse.spec import ModelSpec
from pulse.zoo.shapes import NUM_TRAIN_TIMESTEPS, latent_shape
from pulse.zoo.shapes import attrs_of_kind as _attrs

# (spec, batch, generator) -> tensor
Maker = Callable[[ModelSpec, int, torch.Generator], Tensor]


def _text(kind: str, length: str, dim: str) -> Maker:
    return lambda spec, b, g: torch.randn(b, _attrs(spec, kind)[length], _attrs(spec, kind)[dim], generator=g)


def _prefix_mask(kind: str, length: str) -> Maker:
    """1 for the first n tokens, n uniform in [1, L]: padded text as a tokenizer returns it."""
    def make(spec: ModelSpec, b: int, g: torch.Generator) -> Tensor:
        n = _attrs(spec, kind)[length]
        valid = torch.randint(1, n + 1, (b, 1), generator=g)
        return (torch.arange(n)[None, :] < valid).long()
    return make


def _image_meta_size(spec: ModelSpec, b: int, g: torch.Generator) -> Tensor:
    """Hunyuan's (original H, W, target H, W, crop top, left), in pixels: uncropped squares."""
    size = float(spec.meta.get("image_resolution", _attrs(spec, "hdit_cond_embed")["height"] * 8))
    return torch.tensor([size, size, size, size, 0.0, 0.0]).repeat(b, 1)


_MAKERS: dict[str, Maker] = {
    "timesteps": lambda spec, b, g: torch.randint(0, NUM_TRAIN_TIMESTEPS, (b,), generator=g),
    "labels": lambda spec, b, g: torch.randint(0, _attrs(spec, "uvit_embed")["num_classes"], (b,), generator=g),
    "context": _text("transformer2d", "context_len", "context_dim"),
    "text_clip": _text("hdit_cond_embed", "clip_len", "clip_dim"),
    "text_t5": _text("hdit_cond_embed", "t5_len", "t5_dim"),
    "text_clip_mask": _prefix_mask("hdit_cond_embed", "clip_len"),
    "text_t5_mask": _prefix_mask("hdit_cond_embed", "t5_len"),
    "image_meta_size": _image_meta_size,
    "style": lambda spec, b, g: torch.zeros(b, dtype=torch.long),  # Embedding(1, dim): one style
}


def make_inputs(spec: ModelSpec, batch_size: int, generator: torch.Generator | None = None,
                device: torch.device | str | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """(latents (B, C, H, W), {data shared input name: tensor}) drawn from ``generator``.

    Floats are fp32 standard normals; timesteps, labels, masks and style are
    int64. Drawn on the CPU in spec order, then moved, so a seed gives the
    same batch on every device.
    """
    g = generator if generator is not None else torch.default_generator
    latents = torch.randn(batch_size, *latent_shape(spec), generator=g)
    shared = {}
    for item in spec.shared_inputs:
        if item.producer is not None:
            continue
        maker = _MAKERS.get(item.name)
        if maker is None:
            raise SpecError(f"model '{spec.name}': no maker for data input '{item.name}' "
                            f"(known: {', '.join(sorted(_MAKERS))})")
        shared[item.name] = maker(spec, batch_size, g)
    if device is not None:
        latents = latents.to(device)
        shared = {k: v.to(device) for k, v in shared.items()}
    return latents, shared
