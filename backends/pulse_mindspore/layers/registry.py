"""Build a layer's cell from its spec ``Layer``: one table from kind to cell class.

Parameters are drawn with numpy from an explicit ``ParamInit`` (no global
random state), so a layer's initial weights depend only on the generator it
was built with, never on where it runs or what was built before it.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np

from pulse.layers.chunk_layout import param_name, reference_key
from pulse.layers.layer_contract import build_checked
from pulse.spec import Layer
from pulse_mindspore.layers.basic import ParamInit
from pulse_mindspore.layers.common import PulseCell
from pulse_mindspore.layers.dit_layers import DIT_LAYERS
from pulse_mindspore.layers.unet_layers import UNET_LAYERS
from pulse_mindspore.layers.uvit_layers import UVIT_LAYERS

LAYER_TYPES: dict[str, type[PulseCell]] = {**UNET_LAYERS, **UVIT_LAYERS, **DIT_LAYERS}

__all__ = ["LAYER_TYPES", "build_layer", "layer_params", "name_parameters", "reference_key"]


def build_layer(layer: Layer, *, rng: np.random.Generator | None = None, dtype: ms.Type = ms.float32,
                lazy: bool = False) -> PulseCell:
    """The cell of one spec layer, with parameters from ``layer.attrs``.

    ``lazy=True`` builds shapes only (MindSpore's deferred initializer, no
    values drawn): parameter counts of the full-size models without memory.
    Parameter names are set to the cell's own paths (``norm1.weight``), which
    ``pulse_mindspore.model`` and the backend prefix with the layer name.
    """
    cell = build_checked(LAYER_TYPES, layer, ParamInit(rng, dtype=dtype, lazy=lazy), backend="mindspore",
                         unit="cell")
    name_parameters(cell)
    return cell


def name_parameters(cell: PulseCell, layer: str | None = None) -> None:
    """Set every ``Parameter.name`` to its path in ``cell``, qualified by ``layer`` when given.

    MindSpore's optimizers and autodiff want unique parameter names; the
    automatic ones depend on the order cells were attached, so fix them
    (``pulse.layers.chunk_layout.param_name``: the torch backend's names).
    """
    for path, param in cell.parameters_and_names():
        param.name = path if layer is None else param_name(layer, path)


def layer_params(cell: PulseCell) -> dict[str, int]:
    """Element count of every parameter of ``cell``, by its path."""
    return {path: int(np.prod(p.shape)) for path, p in cell.parameters_and_names()}

