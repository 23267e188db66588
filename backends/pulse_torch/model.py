"""The whole model on one device: every spec layer in order, the reference the pipelines are checked against.

::

    h ─▶ layer0 ─▶ layer1 ─▶ ... ─▶ layerN ─▶ output
          │  made shared inputs ("temb", "c", "context") join the shared dict
          └─ a skip source's output is kept until its last consumer has run;
             a consumer gets its skips in the order of the spec's edges

Seeding: ``build_model(spec, seed=s)`` seeds every layer from (s, layer name),
so a pipeline stage that builds only some layers with ``layer_generator``
gets exactly the reference's weights for them, wherever it runs.
"""
from __future__ import annotations

import hashlib
from typing import Mapping

import torch
from torch import Tensor, nn

from pulse.spec import ModelSpec
from pulse_torch.layers import PulseLayer, build_layer, make_inputs
from pulse_torch.layers.common import Shared

MAIN = "h"  # the main-path input's name in an inputs dict (as in pulse.runtime.wiring)

__all__ = ["LayeredModel", "build_model", "layer_generator", "layer_seed", "make_inputs"]


def layer_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one layer, fixed by the model seed and the layer's name."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def layer_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator for building layer ``name`` of a model seeded with ``seed``."""
    return torch.Generator().manual_seed(layer_seed(seed, name))


class LayeredModel(nn.Module):
    """All layers of a spec, in order, in one ``nn.ModuleDict`` keyed by layer name."""

    def __init__(self, spec: ModelSpec, layers: Mapping[str, PulseLayer]) -> None:
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleDict({layer.name: layers[layer.name] for layer in spec.layers})
        # Per consumer, its skip sources in spec edge order; per source, the
        # position of its last consumer (when its tensor can be dropped).
        self._skip_srcs: dict[str, list[str]] = {layer.name: [] for layer in spec.layers}
        self._last_use: dict[str, int] = {}
        for edge in spec.skips:
            self._skip_srcs[edge.dst].append(edge.src)
            self._last_use[edge.src] = max(self._last_use.get(edge.src, -1), spec.index(edge.dst))

    def forward(self, h: Tensor, shared: Shared) -> Tensor:
        """Run every layer; ``shared`` holds the data shared inputs by name."""
        shared = dict(shared)
        kept: dict[str, Tensor] = {}
        for i, (name, module) in enumerate(self.layers.items()):
            h, made = module(h, shared, [kept[src] for src in self._skip_srcs[name]])
            shared.update(made)
            if name in self._last_use:
                kept[name] = h
            for src in self._skip_srcs[name]:
                if self._last_use[src] == i:
                    del kept[src]
        return h

    def forward_reference(self, inputs: Mapping[str, Tensor]) -> Tensor:
        """The single-device reference: ``inputs`` = {"h": latents, data shared inputs by name}."""
        return self(inputs[MAIN], {k: v for k, v in inputs.items() if k != MAIN})

    def layer_params(self) -> dict[str, int]:
        """Parameter count of every layer, by name (compare with ``Layer.params``)."""
        return {name: sum(p.numel() for p in m.parameters()) for name, m in self.layers.items()}


def build_model(spec: ModelSpec, device: torch.device | str | None = None, *, seed: int | None = None,
                dtype: torch.dtype | None = None) -> LayeredModel:
    """Every layer of ``spec`` built by ``build_layer``.

    ``seed=None`` draws from the global RNG in spec order (``torch.manual_seed``
    first for repeatable weights); an int seeds each layer by name (see
    ``layer_generator``). ``device='meta'`` allocates nothing.
    """
    layers = {}
    for layer in spec.layers:
        gen = layer_generator(seed, layer.name) if seed is not None else None
        layers[layer.name] = build_layer(layer, device=device, dtype=dtype, generator=gen)
    return LayeredModel(spec, layers)
