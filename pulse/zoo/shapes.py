"""Data-input shapes read off a spec's layer attrs: framework-free, shared by every backend.

Shapes come from the layers' ``attrs`` (not from ``spec.meta``), so a spec
loaded from YAML works the same as a zoo entry. ``data_draws`` says how each
data shared input of a random batch is drawn (shape, law, range); a backend
only turns each ``DataDraw`` into its framework's random call, so every
backend knows the same inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from pulse.errors import SpecError
from pulse.spec import ModelSpec
from pulse.zoo.unet_blocks import ATTENTION_KINDS

NUM_TRAIN_TIMESTEPS = 1000  # DDPM's T: timesteps are ints in [0, 1000)


def attrs_of_kind(spec: ModelSpec, kind: str | tuple[str, ...]) -> dict[str, Any]:
    """The attrs of the first layer of ``kind`` (or of any of the kinds): where a data input's size is written."""
    kinds = (kind,) if isinstance(kind, str) else kind
    for layer in spec.layers:
        if layer.kind in kinds:
            return layer.attrs
    raise SpecError(f"model '{spec.name}': no layer of kind '{'/'.join(kinds)}' to size the data inputs from")


def latent_shape(spec: ModelSpec) -> tuple[int, int, int]:
    """(channels, height, width) of the main-path input (the first layer's)."""
    a = spec.layers[0].attrs
    channels = a.get("passthrough_channels", a.get("in_channels"))
    height = a.get("height", a.get("latent_size"))
    width = a.get("width", a.get("latent_size"))
    if channels is None or height is None:
        raise SpecError(f"model '{spec.name}': first layer '{spec.layers[0].name}' does not say the "
                        "latent's channels and size in its attrs")
    return int(channels), int(height), int(width)


# The laws a backend must implement for ``DataDraw.law``.
NORMAL = "normal"  # float32 standard normals of ``shape``
INTEGERS = "integers"  # int64 uniform in [0, high) of ``shape``
PREFIX_MASK = "prefix_mask"  # int64 (B, L): 1 for the first n tokens, n uniform in [1, L] per row
ROWS = "rows"  # float32 (B, len(row)): ``row`` on every sample, no randomness
ZEROS = "zeros"  # int64 zeros of ``shape``, no randomness


@dataclass(frozen=True)
class DataDraw:
    """How one data shared input of a batch is drawn."""

    name: str  # the shared input's
    law: str
    shape: tuple[int, ...]  # the whole batch's
    high: int = 0  # INTEGERS: one past the largest value
    row: tuple[float, ...] = ()  # ROWS: every sample's values


def _text(kind: str | tuple[str, ...], length: str, dim: str) -> Callable[[ModelSpec, int], DataDraw]:
    return lambda spec, b: DataDraw("", NORMAL, (b, attrs_of_kind(spec, kind)[length], attrs_of_kind(spec, kind)[dim]))


def _prefix_mask(kind: str, length: str) -> Callable[[ModelSpec, int], DataDraw]:
    """Padded text as a tokenizer returns it."""
    return lambda spec, b: DataDraw("", PREFIX_MASK, (b, attrs_of_kind(spec, kind)[length]))


def _image_meta_size(spec: ModelSpec, b: int) -> DataDraw:
    """Hunyuan's (original H, W, target H, W, crop top, left), in pixels: uncropped squares."""
    size = float(spec.meta.get("image_resolution", attrs_of_kind(spec, "hdit_cond_embed")["height"] * 8))
    return DataDraw("", ROWS, (b, 6), row=(size, size, size, size, 0.0, 0.0))


def _sdxl_time_ids(spec: ModelSpec, b: int) -> DataDraw:
    """SDXL's add_time_ids (original h, w, crop top, left, target h, w) in pixels: uncropped squares."""
    size = float(spec.meta.get("image_resolution", attrs_of_kind(spec, "time_embed")["height"] * 8))
    return DataDraw("", ROWS, (b, 6), row=(size, size, 0.0, 0.0, size, size))


_DRAWS: dict[str, Callable[[ModelSpec, int], DataDraw]] = {
    "timesteps": lambda spec, b: DataDraw("", INTEGERS, (b,), high=NUM_TRAIN_TIMESTEPS),
    "labels": lambda spec, b: DataDraw("", INTEGERS, (b,), high=attrs_of_kind(spec, "uvit_embed")["num_classes"]),
    "context": _text(ATTENTION_KINDS, "context_len", "context_dim"),
    "text_clip": _text("hdit_cond_embed", "clip_len", "clip_dim"),
    "text_t5": _text("hdit_cond_embed", "t5_len", "t5_dim"),
    "text_clip_mask": _prefix_mask("hdit_cond_embed", "clip_len"),
    "text_t5_mask": _prefix_mask("hdit_cond_embed", "t5_len"),
    "image_meta_size": _image_meta_size,
    "style": lambda spec, b: DataDraw("", ZEROS, (b,)),  # Embedding(1, dim): one style
    "text_embeds": lambda spec, b: DataDraw("", NORMAL, (b, attrs_of_kind(spec, "time_embed")["text_embeds_dim"])),
    "time_ids": _sdxl_time_ids,
}


def data_draws(spec: ModelSpec, batch_size: int) -> list[DataDraw]:
    """One ``DataDraw`` per data shared input of ``spec`` (those no layer makes), in spec order."""
    draws = []
    for item in spec.shared_inputs:
        if item.producer is not None:
            continue
        make = _DRAWS.get(item.name)
        if make is None:
            raise SpecError(f"model '{spec.name}': no maker for data input '{item.name}' "
                            f"(known: {', '.join(sorted(_DRAWS))})")
        draws.append(replace(make(spec, batch_size), name=item.name))
    return draws
