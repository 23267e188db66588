"""Parameters to and from a .npz keyed by the reference checkpoint's names.

The key of a layer's parameter is ``reference_key(layer, path)``
(``down_blocks.0.resnets.1.norm1.weight``, ``blocks.3.attn1.Wqkv.bias``), the
same on the torch side, so a file written by either framework loads into the
other::

    torch:      {reference_key: tensor.numpy()}  ──np.savez──▶  weights.npz
    mindspore:  weights.npz ──import_weights──▶ Parameter.set_data, by key

Works on any set of built layers (the whole ``LayeredModel`` or one pipeline
chunk's cells); a chunk takes only the keys of its own layers.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np
from mindspore import Parameter, Tensor, nn

from pulse.errors import SpecError
from pulse.spec import ModelSpec
from pulse_mindspore.layers.registry import reference_key

Cells = Mapping[str, nn.Cell]  # layer name -> its cell


def reference_parameters(spec: ModelSpec, cells: Cells) -> dict[str, Parameter]:
    """The parameters of ``cells`` by reference checkpoint name; two layers claiming one name is an error."""
    out: dict[str, Parameter] = {}
    for name, cell in cells.items():
        layer = spec.layers[spec.index(name)]
        for path, param in cell.parameters_and_names():
            key = reference_key(layer, path)
            if key in out:
                raise SpecError(f"layer '{name}': parameter '{path}' maps to checkpoint key '{key}', "
                                "which another layer already claims")
            out[key] = param
    return out


def state_dict(spec: ModelSpec, cells: Cells) -> dict[str, np.ndarray]:
    """Every parameter's value as numpy, by reference name."""
    return {k: p.asnumpy() for k, p in reference_parameters(spec, cells).items()}


def export_weights(spec: ModelSpec, cells: Cells, path: str | Path) -> None:
    """Write every parameter of ``cells`` to ``path`` (.npz), keyed by reference name."""
    np.savez(path, **state_dict(spec, cells))


def load_state(spec: ModelSpec, cells: Cells, state: Mapping[str, np.ndarray], strict: bool = True) -> list[str]:
    """Set the parameters of ``cells`` from ``state`` (cast to each parameter's dtype).

    ``strict``: every parameter of ``cells`` must be in ``state`` (extra keys
    are fine: a chunk loads its share of a whole-model file). Returns the
    keys that were loaded. Shapes must match exactly.
    """
    params = reference_parameters(spec, cells)
    missing = sorted(k for k in params if k not in state)
    if strict and missing:
        raise SpecError(f"weights lack {len(missing)} parameter(s) of these layers, e.g. {missing[:4]}")
    loaded = []
    for key, param in params.items():
        if key not in state:
            continue
        value = np.asarray(state[key])
        if tuple(value.shape) != tuple(param.shape):
            raise SpecError(f"weights: '{key}' has shape {tuple(value.shape)}, the layer's parameter "
                            f"{tuple(param.shape)}")
        param.set_data(Tensor(np.ascontiguousarray(value), param.dtype))
        loaded.append(key)
    return loaded


def import_weights(spec: ModelSpec, cells: Cells, path: str | Path, strict: bool = True) -> list[str]:
    """Load ``path`` (.npz keyed by reference name) into ``cells``; see ``load_state``."""
    with np.load(path) as data:
        return load_state(spec, cells, {k: data[k] for k in data.files}, strict)
