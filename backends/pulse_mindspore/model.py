"""The whole model on one device: every spec layer in order, the reference the pipelines are checked against.

::

    h ─▶ layer0 ─▶ layer1 ─▶ ... ─▶ layerN ─▶ output
          │  made shared inputs ("temb", "c", "context") join the shared dict
          └─ a skip source's output is kept until its last consumer has run;
             a consumer gets its skips in the order of the spec's edges

Seeding: ``build_model(spec, seed=s)`` draws every layer from a numpy
generator seeded by (s, layer name) (``layer_rng``), so a pipeline stage that
builds only some layers gets exactly the reference's weights for them. The
per-layer seed is the torch backend's (``pulse_torch.model.layer_seed``);
the values are not (numpy and torch streams differ), so weights cross
frameworks through ``pulse_mindspore.weights``.
"""
from __future__ import annotations

import hashlib
from typing import Any, Mapping

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn

from pulse.spec import ModelSpec
from pulse_mindspore.layers import PulseCell, build_layer
from pulse_mindspore.layers.common import Shared
from pulse_mindspore.layers.registry import name_parameters

MAIN = "h"  # the main-path input's name in an inputs dict (as in pulse.runtime.wiring)

__all__ = ["FLOATS", "LayeredModel", "build_model", "layer_rng", "layer_seed", "to_tensor"]


def layer_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one layer, fixed by the model seed and the layer's name (as pulse_torch's)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


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


class LayeredModel(nn.Cell):
    """All layers of a spec, in order, in one ``nn.CellDict`` keyed by layer name."""

    def __init__(self, spec: ModelSpec, layers: Mapping[str, PulseCell]) -> None:
        super().__init__()
        self.spec = spec
        self.layers = nn.CellDict({layer.name: layers[layer.name] for layer in spec.layers})
        for name, cell in self.layers.items():
            name_parameters(cell, prefix=f"{name}.")
        # Per consumer, its skip sources in spec edge order; per source, the
        # position of its last consumer (when its tensor can be dropped).
        self._skip_srcs: dict[str, list[str]] = {layer.name: [] for layer in spec.layers}
        self._last_use: dict[str, int] = {}
        for edge in spec.skips:
            self._skip_srcs[edge.dst].append(edge.src)
            self._last_use[edge.src] = max(self._last_use.get(edge.src, -1), spec.index(edge.dst))

    def construct(self, h: Tensor, shared: Shared) -> Tensor:
        """Run every layer; ``shared`` holds the data shared inputs by name."""
        shared = dict(shared)
        kept: dict[str, Tensor] = {}
        for i, (name, cell) in enumerate(self.layers.items()):
            h, made = cell(h, shared, [kept[src] for src in self._skip_srcs[name]])
            shared.update(made)
            if name in self._last_use:
                kept[name] = h
            for src in self._skip_srcs[name]:
                if self._last_use[src] == i:
                    del kept[src]
        return h

    def forward_reference(self, inputs: Mapping[str, Any]) -> Tensor:
        """The single-device reference: ``inputs`` = {"h": latents, data shared inputs by name}."""
        t = {k: to_tensor(v) for k, v in inputs.items()}
        return self(t[MAIN], {k: v for k, v in t.items() if k != MAIN})

    def params_by_name(self) -> dict[str, Parameter]:
        """Parameters by "<layer>.<path>" (the torch backend's names)."""
        return {f"{layer}.{path}": p for layer, cell in self.layers.items()
                for path, p in cell.parameters_and_names()}

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
