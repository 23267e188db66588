"""Data-input shapes read off a spec's layer attrs: framework-free, shared by every backend.

Shapes come from the layers' ``attrs`` (not from ``spec.meta``), so a spec
loaded from YAML works the same as a zoo entry.
"""
from __future__ import annotations

from typing import Any

from pulse.errors import SpecError
from pulse.spec import ModelSpec

NUM_TRAIN_TIMESTEPS = 1000  # DDPM's T: timesteps are ints in [0, 1000)


def attrs_of_kind(spec: ModelSpec, kind: str) -> dict[str, Any]:
    """The attrs of the first layer of ``kind``: where a data input's size is written."""
    for layer in spec.layers:
        if layer.kind == kind:
            return layer.attrs
    raise SpecError(f"model '{spec.name}': no layer of kind '{kind}' to size the data inputs from")


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
