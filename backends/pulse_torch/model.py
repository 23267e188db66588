"""The whole model on one device: every spec layer in order, the reference the pipelines are checked against.

The walk (skips kept until their reader runs, made shared inputs joining the
shared dict) is ``pulse.layers.chunk_layout.run_model``, the same for every
backend.

Seeding: ``build_model(spec, seed=s)`` seeds every layer from (s, layer name),
so a pipeline stage that builds only some layers with ``layer_generator``
gets exactly the reference's weights for them, wherever it runs.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor, nn

from pulse.layers.chunk_layout import MAIN, SkipWiring, layer_seed, run_model, split_main
from pulse.spec import ModelSpec
from pulse_torch.layers import PulseLayer, build_layer, make_inputs
from pulse_torch.layers.common import Shared

__all__ = ["MAIN", "LayeredModel", "build_model", "layer_generator", "layer_seed", "make_inputs"]


def layer_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator for building layer ``name`` of a model seeded with ``seed``."""
    return torch.Generator().manual_seed(layer_seed(seed, name))


class LayeredModel(nn.Module):
    """All layers of a spec, in order, in one ``nn.ModuleDict`` keyed by layer name."""

    def __init__(self, spec: ModelSpec, layers: Mapping[str, PulseLayer]) -> None:
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleDict({layer.name: layers[layer.name] for layer in spec.layers})
        self.wiring = SkipWiring.of(spec, self.layers)

    def forward(self, h: Tensor, shared: Shared) -> Tensor:
        """Run every layer; ``shared`` holds the data shared inputs by name."""
        return run_model(self.layers, self.wiring, h, shared)

    def forward_reference(self, inputs: Mapping[str, Tensor]) -> Tensor:
        """The single-device reference: ``inputs`` = {"h": latents, data shared inputs by name}."""
        return self(*split_main(inputs))

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
