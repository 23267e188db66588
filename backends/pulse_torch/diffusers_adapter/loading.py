"""Load a user's diffusers model from local disk (never the Hub) and adapt it.

::

    load_diffusers("path/to/unet")             weights present: Class.from_pretrained(folder, local_files_only)
    load_diffusers("path/to/unet/config.json") config only:     Class.from_config(config)  (random weights)
    load_diffusers("diffusers:path/to/unet")   the form a plan records (``pulse plan --diffusers-config``)
    load_diffusers(..., device="meta")         shapes only: plan or count FLOPs without memory

The class comes from the config's ``_class_name``, read by the core
(``pulse.zoo.diffusers_config``), so the spec a plan was made from and the
module a rank trains are built from the same file.
"""
from __future__ import annotations

import importlib.util

from pathlib import Path
from typing import Any

import torch
from torch import nn

from pulse.errors import SpecError
from pulse.zoo.diffusers_config import (HUNYUAN_DIT, PREFIX, UNET, UnsupportedDiffusersModel, config_path,
                                        read_config)
from pulse_torch.diffusers_adapter.adapter import DiffusersAdapter, from_diffusers

WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin",
                "diffusion_pytorch_model.safetensors.index.json", "diffusion_pytorch_model.bin.index.json")


def _model_class(name: str) -> type[nn.Module]:
    import diffusers

    if name not in (UNET, HUNYUAN_DIT):
        raise UnsupportedDiffusersModel(f"diffusers model class '{name}' is not supported "
                                        f"(supported: {UNET}, {HUNYUAN_DIT})")
    if not hasattr(diffusers, name):  # HunyuanDiT2DModel arrived in diffusers 0.29
        raise SpecError(f"diffusers {diffusers.__version__} has no {name}: upgrade diffusers")
    return getattr(diffusers, name)


def has_weights(path: str | Path) -> bool:
    folder = config_path(path).parent
    return any((folder / f).is_file() for f in WEIGHT_FILES)


def load_model(path: str | Path, *, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> nn.Module:
    """The diffusers model at ``path``: its saved weights if the folder has them, else from its config."""
    path = str(path)[len(PREFIX):] if str(path).startswith(PREFIX) else str(path)
    config = read_config(path)
    cls = _model_class(str(config["_class_name"]))
    device = torch.device(device)
    if device.type == "meta":
        with torch.device("meta"):
            model = cls.from_config(config)
    elif has_weights(path):
        try:
            # without accelerate, diffusers would print advice to install it on every rank
            low_memory = importlib.util.find_spec("accelerate") is not None
            model = cls.from_pretrained(str(config_path(path).parent), local_files_only=True,
                                        low_cpu_mem_usage=low_memory)
        except (OSError, ValueError) as exc:
            raise SpecError(f"{path}: cannot load the saved weights ({exc})") from None
    else:
        model = cls.from_config(config)
    # from_pretrained records where the model came from; the spec is named after it either way.
    model.register_to_config(_name_or_path=str(config_path(path).parent))
    if dtype is not None or device.type not in ("cpu", "meta"):
        model = model.to(device=device if device.type != "meta" else None, dtype=dtype)
    return model


def load_diffusers(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                   **options: Any) -> DiffusersAdapter:
    """``from_diffusers(load_model(path))``: what a rank runs for a plan made with ``--diffusers-config``.

    ``options`` are the plan's ``model_options`` (resolution, name, context_len, split_blocks).
    """
    model = load_model(path, device=device, dtype=dtype)
    model.train()
    return from_diffusers(model, **options)
