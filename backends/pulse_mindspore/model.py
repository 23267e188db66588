"""The whole model on one device: every spec layer in order, the reference the pipelines are checked against.

The walk (skips kept until their reader runs, made shared inputs joining the
shared dict) is ``pulse.layers.chunk_layout.run_model``, the same for every
backend.

Seeding: ``build_model(spec, seed=s)`` draws every layer from a numpy
generator seeded by (s, layer name) (``layer_rng``), so a pipeline stage that
builds only some layers gets exactly the reference's weights for them. The
per-layer seed is every backend's (``pulse.layers.chunk_layout.layer_seed``);
the values are not (numpy and torch streams differ), so weights cross
frameworks through ``pulse_mindspore.weights``.
"""
from __future__ import annotations

from typing import Any, Mapping

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn

from pulse.layers.chunk_layout import MAIN, SkipWiring, layer_seed, param_name, run_model, split_main
from pulse.spec import ModelSpec
from pulse_mindspore.layers import PulseCell, build_layer
from pulse_mindspore.layers.common import Shared
from pulse_mindspore.layers.registry import name_parameters

__all__ = ["FLOATS", "MAIN", "LayeredModel", "build_model", "layer_rng", "layer_seed", "qualified_params", "to_tensor"]


def layer_rng(seed: int, name: str) -> np.random.Generator:
    """The numpy generator that draws layer ``name`` of a model seeded with ``seed``."""
    return np.random.default_rng(layer_seed(seed, name))


FLOATS = (ms.float16, ms.bfloat16, ms.float32, ms.float64)


def to_tensor(value: Any, dtype: ms.Type = ms.float32) -> Tensor:
    """A MindSpore tensor from a tensor or array: floating values in ``dtype``, integers kept."""
    if not isinstance(value, Tensor):
        a = np.ascontiguousarray(value)
        return Tensor(a, dtype) if np.issubdtype(a.dtype, np.floating) else Tensor(a)
    return value.astype(dtype) if value.dtype in FLOATS and value.dtype != dtype else value


def qualified_params(layers: Mapping[str, nn.Cell]) -> dict[str, Parameter]:
    """The parameters of ``layers`` by "<layer>.<path>" (``param_name``), in layer then cell order."""
    return {param_name(layer, path): p for layer, cell in layers.items() for path, p in cell.parameters_and_names()}


class LayeredModel(nn.Cell):
    """All layers of a spec, in order, in one ``nn.CellDict`` keyed by layer name."""

    def __init__(self, spec: ModelSpec, layers: Mapping[str, PulseCell]) -> None:
        super().__init__()
        self.spec = spec
        self.layers = nn.CellDict({layer.name: layers[layer.name] for layer in spec.layers})
        for name, cell in self.layers.items():
            name_parameters(cell, name)
        self.wiring = SkipWiring.of(spec, self.layers.keys())

    def construct(self, h: Tensor, shared: Shared) -> Tensor:
        """Run every layer; ``shared`` holds the data shared inputs by name."""
        return run_model(self.layers, self.wiring, h, shared)

    def forward_reference(self, inputs: Mapping[str, Any]) -> Tensor:
        """The single-device reference: ``inputs`` = {"h": latents, data shared inputs by name}."""
        return self(*split_main({k: to_tensor(v) for k, v in inputs.items()}))

    def params_by_name(self) -> dict[str, Parameter]:
        """Parameters by "<layer>.<path>" (the torch backend's names)."""
        return qualified_params(self.layers)

    def layer_params(self) -> dict[str, int]:
        """Parameter count of every layer, by name (compare with ``Layer.params``)."""
        return {name: sum(int(np.prod(p.shape)) for p in cell.get_parameters())
                for name, cell in self.layers.items()}


def build_model(spec: ModelSpec, *, seed: int | None = None, dtype: ms.Type = ms.float32,
                lazy: bool = False) -> LayeredModel:
    """Every layer of ``spec`` built by ``build_layer``.

    ``seed=None`` draws from fresh entropy; an int seeds each layer by name
    (see ``layer_rng``). ``lazy=True`` draws nothing and touches no memory
    for the values (parameter counts of the full-size models).
    """
    layers = {}
    for layer in spec.layers:
        rng = layer_rng(seed, layer.name) if seed is not None else None
        layers[layer.name] = build_layer(layer, rng=rng, dtype=dtype, lazy=lazy)
    return LayeredModel(spec, layers)
