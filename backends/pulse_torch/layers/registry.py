"""Build a layer's module from its spec ``Layer``: one table from kind to module class.

Every module is built on the CPU (or on the meta device, which allocates
nothing) and then moved, so its initial weights depend only on the random
state it was built under, never on the device it will run on.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch

from pulse.layers.chunk_layout import reference_key
from pulse.layers.layer_contract import build_checked
from pulse.spec import Layer
from pulse_torch.layers.common import PulseLayer
from pulse_torch.layers.dit_layers import DIT_LAYERS
from pulse_torch.layers.unet_layers import UNET_LAYERS
from pulse_torch.layers.uvit_layers import UVIT_LAYERS

LAYER_TYPES: dict[str, type[PulseLayer]] = {**UNET_LAYERS, **UVIT_LAYERS, **DIT_LAYERS}

__all__ = ["LAYER_TYPES", "build_layer", "reference_key", "seeded_init"]


@contextmanager
def seeded_init(generator: torch.Generator | None) -> Iterator[None]:
    """Run the block with the CPU RNG seeded from ``generator``; the global RNG is left as it was.

    ``None`` uses the global RNG as is (so ``torch.manual_seed`` governs).
    Only the CPU generator is touched: modules are always initialised on
    the CPU or the meta device.
    """
    if generator is None:
        yield
        return
    seed = int(torch.randint(0, 2**62, (), generator=generator))
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


def build_layer(layer: Layer, *, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None, generator: torch.Generator | None = None) -> PulseLayer:
    """The module of one spec layer, with parameters from ``layer.attrs``.

    ``device='meta'`` builds shapes only (parameter counts of the full-size
    models without memory); otherwise the module is built on the CPU and moved.
    """
    target = torch.device(device) if device is not None else torch.device("cpu")
    place = torch.device("meta") if target.type == "meta" else nullcontext()
    with seeded_init(generator), place:
        module = build_checked(LAYER_TYPES, layer, backend="torch", unit="module")
    if target.type not in ("meta", "cpu"):
        module = module.to(target)
    return module.to(dtype=dtype) if dtype is not None else module

