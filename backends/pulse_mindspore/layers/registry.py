"""Build a layer's cell from its spec ``Layer``: one table from kind to cell class.

Parameters are drawn with numpy from an explicit ``ParamInit`` (no global
random state), so a layer's initial weights depend only on the generator it
was built with, never on where it runs or what was built before it.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np

from pulse.errors import SpecError
from pulse.spec import Layer
from pulse_mindspore.layers.basic import ParamInit
from pulse_mindspore.layers.common import PulseCell
from pulse_mindspore.layers.dit_layers import DIT_LAYERS
from pulse_mindspore.layers.unet_layers import UNET_LAYERS
from pulse_mindspore.layers.uvit_layers import UVIT_LAYERS

LAYER_TYPES: dict[str, type[PulseCell]] = {**UNET_LAYERS, **UVIT_LAYERS, **DIT_LAYERS}


def build_layer(layer: Layer, *, rng: np.random.Generator | None = None, dtype: ms.Type = ms.float32,
                lazy: bool = False) -> PulseCell:
    """The cell of one spec layer, with parameters from ``layer.attrs``.

    ``lazy=True`` builds shapes only (MindSpore's deferred initializer, no
    values drawn): parameter counts of the full-size models without memory.
    Parameter names are set to the cell's own paths (``norm1.weight``), which
    ``pulse_mindspore.model`` and the backend prefix with the layer name.
    """
    cls = LAYER_TYPES.get(layer.kind)
    if cls is None:
        raise SpecError(f"layer '{layer.name}': the mindspore backend has no cell for kind "
                        f"'{layer.kind}' (known kinds: {', '.join(sorted(LAYER_TYPES))})")
    try:
        cell = cls(layer.attrs, ParamInit(rng, dtype=dtype, lazy=lazy))
    except KeyError as missing:
        raise SpecError(f"layer '{layer.name}' (kind '{layer.kind}') lacks attribute {missing} "
                        "in its attrs") from None
    name_parameters(cell)
    return cell


def name_parameters(cell: PulseCell, prefix: str = "") -> None:
    """Set every ``Parameter.name`` to ``prefix`` + its path in ``cell``.

    MindSpore's optimizers and autodiff want unique parameter names; the
    automatic ones depend on the order cells were attached, so fix them.
    """
    for path, param in cell.parameters_and_names():
        param.name = prefix + path


def layer_params(cell: PulseCell) -> dict[str, int]:
    """Element count of every parameter of ``cell``, by its path."""
    return {path: int(np.prod(p.shape)) for path, p in cell.parameters_and_names()}


def reference_key(layer: Layer, param_name: str) -> str:
    """The reference checkpoint's name of one of the layer's parameters (as ``pulse_torch``'s).

    A layer owning one reference module (``down_blocks.0.resnets.1``) names
    its parameters as that module does, so the key is prefixed; a layer
    owning several top-level modules (``conv_norm_out,conv_out``) names its
    attributes after them, so the key is the name itself.
    """
    refs = [r for r in str(layer.attrs.get("ref_module", "")).split(",") if r]
    return f"{refs[0]}.{param_name}" if len(refs) == 1 else param_name
