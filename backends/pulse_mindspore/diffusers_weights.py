"""A diffusers UNet as MindSpore cells: what can be built, and its weights loaded by diffusers' names, without torch.

::

    plan model "diffusers:<pipeline>/unet"  ─ spec (pulse.zoo.diffusers_config: the zoo's UNet layers)
      check_trainable(spec, model)   a UNet2DConditionModel, every layer kind and variant one MindSpore
                                     builds, and (when the folder has weights) the safetensors names and
                                     shapes equal the cells' reference names and shapes, both ways
      weights_loader(model)          per chunk: only its layers' tensors, read with safetensors' numpy
                                     API (safe_open), cast to the training dtype (fp32 master weights)

The cells' parameter names are diffusers' module paths already
(``pulse.layers.chunk_layout.reference_key``: ``down_blocks.1.attentions.0.proj_in.weight``), so the
pipeline's file maps onto them key for key. A folder holding only ``config.json`` trains from
PULSE's seeded initialisation (the layers' own, as for a zoo model).
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
from mindspore import nn

from pulse.data.backbone_weights import Entry, backbone_weights
from pulse.errors import PulseError, SpecError
from pulse.layers.layer_contract import VARIANT_CHECKS
from pulse.spec import ModelSpec
from pulse.zoo.diffusers_config import PREFIX, UNET
from pulse_mindspore.layers.registry import LAYER_TYPES, build_layer
from pulse_mindspore.weights import load_state, reference_parameters

# safetensors dtypes numpy reads (safetensors.numpy has no bfloat16)
NUMPY_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64}


def model_folder(model: str) -> Path:
    """The backbone folder of a ``diffusers:<folder>`` plan model."""
    return Path(model[len(PREFIX):])


def check_kinds(spec: ModelSpec) -> None:
    """Every layer's kind has a MindSpore cell and passes its variant checks (one line otherwise)."""
    cls = spec.meta.get("diffusers_class")
    if cls != UNET:
        raise PulseError(f"--backend mindspore trains diffusers {UNET} backbones only, not {cls or '?'} "
                         "(its diffusers module names differ from the MindSpore cells'): use --backend torch")
    for layer in spec.layers:
        if layer.kind not in LAYER_TYPES:
            raise PulseError(f"layer '{layer.name}': MindSpore has no cell for kind '{layer.kind}': use --backend torch")
        try:
            for check in VARIANT_CHECKS.get(layer.kind, ()):
                check(layer.attrs)
        except NotImplementedError as exc:
            raise PulseError(f"layer '{layer.name}': {exc} in MindSpore: use --backend torch") from None


def reference_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter's reference name and shape, from cells built lazily (no values drawn)."""
    cells = {layer.name: build_layer(layer, lazy=True) for layer in spec.layers}
    return {k: tuple(p.shape) for k, p in reference_parameters(spec, cells).items()}


def check_names(spec: ModelSpec, entries: Mapping[str, Entry], where: Path) -> None:
    """The file holds exactly the cells' parameters, shapes equal, in a dtype numpy reads."""
    shapes = reference_shapes(spec)
    missing = sorted(set(shapes) - set(entries))
    extra = sorted(set(entries) - set(shapes))
    if missing or extra:
        first = f"lacks '{missing[0]}'" if missing else f"holds '{extra[0]}', which the MindSpore cells have not"
        raise SpecError(f"{where}: {len(missing)} parameter(s) missing, {len(extra)} unknown: the file {first}")
    for key, shape in shapes.items():
        entry = entries[key]
        if entry.shape != shape:
            raise SpecError(f"{entry.file}: '{key}' has shape {entry.shape}, the MindSpore cell's is {shape}")
        if entry.dtype not in NUMPY_DTYPES:
            raise SpecError(f"{entry.file}: '{key}' is stored as {entry.dtype}, which numpy cannot read "
                            f"(only {', '.join(NUMPY_DTYPES)}): save the UNet in float32 or float16")


def check_trainable(spec: ModelSpec, model: str) -> str:
    """Refuse (one line) what MindSpore cannot train; the line saying where the weights come from."""
    check_kinds(spec)
    folder = model_folder(model)
    entries = backbone_weights(folder)
    if entries is None:
        return f"{folder}: no weights (config.json only): PULSE's seeded initialisation"
    check_names(spec, entries, folder)
    return f"weights from {folder} ({len(entries)} tensors)"


def read_tensors(entries: Mapping[str, Entry], keys: list[str]) -> dict[str, np.ndarray]:
    """The named tensors, each file opened once and only those keys read."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = defaultdict(list)
    for key in keys:
        by_file[entries[key].file].append(key)
    out: dict[str, np.ndarray] = {}
    for file, names in by_file.items():
        with safe_open(str(file), framework="numpy") as f:
            for name in names:
                out[name] = f.get_tensor(name)
    return out


def weights_loader(model: str) -> Callable[[ModelSpec, Mapping[str, nn.Cell]], None] | None:
    """What ``MindSporeBackend`` calls on each chunk's new cells: the pipeline's weights for them.

    None when the folder holds no weights (the cells keep their seeded values).
    """
    entries = backbone_weights(model_folder(model))
    if entries is None:
        return None

    def load(spec: ModelSpec, cells: Mapping[str, nn.Cell]) -> None:
        keys = sorted(reference_parameters(spec, cells))
        load_state(spec, cells, read_tensors(entries, keys), strict=True)

    return load


def stored_dtypes(model_or_folder: str | Path) -> dict[str, type]:
    """The numpy dtype each tensor is stored in (export writes the pipeline's own precision back)."""
    folder = model_folder(model_or_folder) if str(model_or_folder).startswith(PREFIX) else Path(model_or_folder)
    entries = backbone_weights(folder) or {}
    return {k: NUMPY_DTYPES.get(e.dtype, np.float32) for k, e in entries.items()}

