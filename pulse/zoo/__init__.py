"""The model zoo: ModelSpecs computed from architecture hyper-parameters.

``get_spec("sd2-unet")``, ``get_spec("sd2-unet", resolution=768)``,
``get_spec("tiny-dit", depth=6)`` or ``get_spec("path/to/model.yaml")``.
Options are the entry's config fields (see docs/ZOO.md) plus ``resolution``
in pixels. Each tiny entry runs the same builder as its full-size model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from pulse.errors import SpecError
from pulse.spec import ModelSpec
from pulse.zoo.common import with_options
from pulse.zoo.dit import HUNYUAN_DIT_G2, TINY_DIT, build_hunyuan_dit
from pulse.zoo.unet import SD2_UNET, SDXL_UNET, TINY_UNET, build_unet
from pulse.zoo.uvit import TINY_UVIT, UVIT_H2, build_uvit

# name -> (builder, base config, options the entry fixes)
_ZOO: dict[str, tuple[Callable[[Any], ModelSpec], Any, dict[str, Any]]] = {
    "sd2-unet": (build_unet, SD2_UNET, {}),
    "sd2-unet-768": (build_unet, SD2_UNET, {"resolution": 768}),
    "sdxl-unet": (build_unet, SDXL_UNET, {}),
    "uvit": (build_uvit, UVIT_H2, {}),
    "hunyuan-dit": (build_hunyuan_dit, HUNYUAN_DIT_G2, {}),
    "tiny-unet": (build_unet, TINY_UNET, {}),
    "tiny-uvit": (build_uvit, TINY_UVIT, {}),
    "tiny-dit": (build_hunyuan_dit, TINY_DIT, {}),
}

ZOO_NAMES: tuple[str, ...] = tuple(_ZOO)


def get_spec(name: str, /, **options: Any) -> ModelSpec:
    """The zoo entry ``name`` (with options), or the spec saved at a YAML path."""
    entry = _ZOO.get(name)
    if entry is not None:
        builder, config, fixed = entry
        return builder(with_options(config, {**fixed, **options}, name))
    if str(name).endswith((".yaml", ".yml", ".json")) or Path(name).is_file():
        if options:
            raise SpecError(f"options ({', '.join(sorted(options))}) apply to zoo names only, "
                            f"not to the model file '{name}'")
        from pulse.spec_io import load_spec

        return load_spec(name)
    raise SpecError(f"unknown model '{name}': known models are {', '.join(ZOO_NAMES)} "
                    "(or give the path of a model YAML file)")


__all__ = ["ZOO_NAMES", "get_spec"]
