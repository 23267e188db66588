"""The base of every adapter layer: a ``PulseLayer`` that runs modules of the user's model.

::

    DiffusersLayer(model, spec layer)
        registers the model's submodules it runs as its own children
        (the same objects: no copy, the optimizer steps the model's tensors)
        keeps the model itself unregistered (its other parts belong to other layers)

So ``layer.parameters()`` is exactly the layer's share of the model, and the
parameters of all layers together are the model's, each once (the adapter
checks both).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from pulse.spec import Layer
from pulse_torch.layers.common import PulseLayer


class DiffusersLayer(PulseLayer):
    """A spec layer over modules of a diffusers model; ``owned`` are registered under their own names."""

    def __init__(self, model: nn.Module, layer: Layer, owned: dict[str, nn.Module | nn.Parameter]) -> None:
        super().__init__()
        self.__dict__["model"] = model  # a plain attribute: not a child, so not part of parameters()
        self.layer_name = layer.name
        for name, part in owned.items():
            if isinstance(part, nn.Parameter):
                self.register_parameter(name, part)
            elif part is not None:
                self.add_module(name, part)

    def extra_repr(self) -> str:
        return f"layer={self.layer_name!r}"


def ref(layer: Layer, index: int = 0) -> str:
    """The layer's ``index``-th ``ref_module`` path (``down_blocks.0.resnets.1``)."""
    return str(layer.attrs["ref_module"]).split(",")[index]


def submodule(model: nn.Module, path: str) -> Any:
    """``model.<path>``, a module or a parameter."""
    head, _, last = path.rpartition(".")
    parent = model.get_submodule(head) if head else model
    return getattr(parent, last)
