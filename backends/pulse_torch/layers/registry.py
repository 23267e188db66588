"""Build a layer's module from its spec ``Layer``: one table from kind to module class.

Every module is built on the CPU (or on the meta device, which allocates
nothing) and then moved, so its initial weights depend only on the random
state it was built under, never on the device it will run on.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch

from pulse.errors import SpecError
from pulse.spec import Layer
from pulse_torch.layers.common import PulseLayer
from pulse_torch.layers.dit_layers import DIT_LAYERS
from pulse_torch.layers.unet_layers import UNET_LAYERS
from pulse_torch.layers.uvit_layers import UVIT_LAYERS

LAYER_TYPES: dict[str, type[PulseLayer]] = {**UNET_LAYERS, **UVIT_LAYERS, **DIT_LAYERS}


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
    cls = LAYER_TYPES.get(layer.kind)
    if cls is None:
        raise SpecError(f"layer '{layer.name}': the torch backend has no module for kind "
                        f"'{layer.kind}' (known kinds: {', '.join(sorted(LAYER_TYPES))})")
    target = torch.device(device) if device is not None else torch.device("cpu")
    place = torch.device("meta") if target.type == "meta" else nullcontext()
    with seeded_init(generator), place:
        try:
            module = cls(layer.attrs)
        except KeyError as missing:
            raise SpecError(f"layer '{layer.name}' (kind '{layer.kind}') lacks attribute {missing} "
                            "in its attrs") from None
    if target.type not in ("meta", "cpu"):
        module = module.to(target)
    return module.to(dtype=dtype) if dtype is not None else module


def reference_key(layer: Layer, param_name: str) -> str:
    """The reference checkpoint's name of one of the layer's parameters.

    A layer owning one reference module (``down_blocks.0.resnets.1``) names
    its parameters as that module does, so the key is prefixed; a layer
    owning several top-level modules (``conv_norm_out,conv_out``) names its
    attributes after them, so the key is the name itself.
    """
    refs = [r for r in str(layer.attrs.get("ref_module", "")).split(",") if r]
    return f"{refs[0]}.{param_name}" if len(refs) == 1 else param_name
