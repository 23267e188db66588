"""``from_diffusers(model)``: a user's diffusers model as a PULSE spec plus layers over its own modules.

::

    model (UNet2DConditionModel | HunyuanDiT2DModel, any device, meta included)
      │ model.config ─▶ pulse.zoo.diffusers_config ─▶ ModelSpec     (the planner's view)
      │ model's submodules ─▶ one call layer per spec layer         (the runtime's view)
      ▼
    DiffusersAdapter(model, spec, layers)
      .backend(...)       a TorchBackend whose chunks are those layers (train them in place)
      .call_model(batch)  the equivalent plain ``model(...)`` call

Checked on construction, so a spec never silently disagrees with the model:
every layer holds exactly its spec's parameter count, and every parameter of
the model belongs to exactly one layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from pulse.spec import ModelSpec
from pulse.zoo.diffusers_config import (HUNYUAN_DIT, UNET, UnsupportedDiffusersModel, default_name,
                                        pipeline_text_tokens, spec_from_config)
from pulse_torch.diffusers_adapter.backend import DiffusersBackend
from pulse_torch.diffusers_adapter.common import DiffusersLayer
from pulse_torch.diffusers_adapter.hunyuan import Rope, call_hunyuan, hunyuan_layers, rotary_embedding
from pulse_torch.diffusers_adapter.unet import call_unet, check_unet, unet_layers
from pulse_torch.model import LayeredModel


@dataclass
class DiffusersAdapter:
    """A diffusers model, its spec, and one layer module per spec layer over the model's own modules."""

    model: nn.Module
    spec: ModelSpec
    layers: dict[str, DiffusersLayer]
    rope: Rope | None = None  # Hunyuan-DiT's rotary tables for the spec's latent size

    @property
    def class_name(self) -> str:
        return str(self.spec.meta["diffusers_class"])

    def _real_parameter(self) -> Tensor:
        """A parameter that holds bytes: a stage-only model (``stage_loading``) keeps the other stages' on
        the meta device; a trainable one where there is one (a LoRA base may be held in a lower precision)."""
        params = list(self.model.parameters())
        real = [p for p in params if p.device.type != "meta"] or params
        return next((p for p in real if p.requires_grad), real[0])

    @property
    def dtype(self) -> torch.dtype:
        return self._real_parameter().dtype

    @property
    def device(self) -> torch.device:
        return self._real_parameter().device

    def parameter_names(self) -> dict[int, str]:
        """id(parameter) -> the model's name for it. Recomputed: moving a module may replace its Parameters."""
        return {id(p): n for n, p in self.model.named_parameters()}

    def backend(self, **kwargs: Any) -> DiffusersBackend:
        """A ``TorchBackend`` over these layers; dtype and device default to the model's."""
        return DiffusersBackend(self, **kwargs)

    def layered(self) -> LayeredModel:
        """Every layer in order on one device: the spec-walk the pipeline splits into chunks."""
        return LayeredModel(self.spec, self.layers)

    def call_model(self, batch: Mapping[str, Tensor]) -> Tensor:
        """``model(...)`` on a PULSE batch ({"h", data shared inputs}): the output a pipeline must equal.

        Floating inputs are cast to the model's dtype, as the backend casts them.
        """
        dtype, device = self.dtype, self.device
        batch = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in batch.items()}
        if self.class_name == UNET:
            return call_unet(self.model, batch)
        assert self.rope is not None
        return call_hunyuan(self.model, batch, self.rope)


def _class_name(model: nn.Module) -> str:
    for cls in type(model).__mro__:  # a user's subclass of a supported class maps like its base
        if cls.__name__ in (UNET, HUNYUAN_DIT):
            return cls.__name__
    raise UnsupportedDiffusersModel(f"{type(model).__name__} is not a supported diffusers model "
                                    f"(supported: {UNET}, {HUNYUAN_DIT})")


def from_diffusers(model: nn.Module, **options: Any) -> DiffusersAdapter:
    """Map a ``UNet2DConditionModel`` or ``HunyuanDiT2DModel`` onto PULSE.

    Options as for ``--diffusers-config`` (``resolution``, ``name``,
    ``context_len`` for the UNet, ``split_blocks`` for Hunyuan-DiT). Raises
    ``UnsupportedDiffusersModel`` (a ``SpecError``) naming the block it cannot map.
    """
    cls = _class_name(model)
    config = dict(model.config)
    where = str(config.get("_name_or_path") or "")
    spec = spec_from_config(config, cls, source=f"diffusers {cls} {where or '(in memory)'}".strip(),
                            base_name=default_name(where) if where else None,
                            text_tokens=pipeline_text_tokens(where) if where else None, **options)
    rope = None
    if cls == UNET:
        problems = check_unet(model)
        if problems:
            raise UnsupportedDiffusersModel(f"diffusers {cls}: {problems[0]}")
        layers = unet_layers(model, spec)
    else:
        latent = int(spec.layers[spec.index("patch_embed")].attrs["latent_size"])
        rope = rotary_embedding(model, latent)
        layers = hunyuan_layers(model, spec, rope)
    check_ownership(model, spec, layers)
    return DiffusersAdapter(model, spec, layers, rope)


def check_ownership(model: nn.Module, spec: ModelSpec, layers: Mapping[str, nn.Module]) -> None:
    """Each layer holds its spec's parameter count; each model parameter is in exactly one layer."""
    names = {id(p): n for n, p in model.named_parameters()}
    owner: dict[int, str] = {}
    for layer in spec.layers:
        params = list(layers[layer.name].parameters())
        held = sum(p.numel() for p in params)
        if held != layer.params:
            raise UnsupportedDiffusersModel(
                f"layer '{layer.name}' ({layer.attrs.get('ref_module')}) has {held:,} parameters in the model "
                f"but {layer.params:,} in the spec: the module differs from what its config says "
                "(adapters such as LoRA, or a modified block, are not supported)")
        for p in params:
            if id(p) in owner:
                raise UnsupportedDiffusersModel(f"parameter '{names.get(id(p), '?')}' is used by layers "
                                                f"'{owner[id(p)]}' and '{layer.name}'")
            owner[id(p)] = layer.name
    unused = [n for i, n in names.items() if i not in owner]
    if unused:
        raise UnsupportedDiffusersModel(f"{len(unused)} model parameter(s) belong to no layer, "
                                        f"e.g. '{unused[0]}': PULSE would not train them")
