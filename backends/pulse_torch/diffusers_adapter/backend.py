"""``DiffusersBackend``: the ``TorchBackend`` whose chunks are an adapter's layers over a user's model.

::

    build_chunk(spec, io) ─▶ TorchChunk({name: adapter.layers[name] for the chunk's layers})
                              (moved to the backend's device: the model's own modules move)
    parameters(chunk)     ─▶ {"down_blocks.0.resnets.1.conv1.weight": p, ...}  the model's names

Everything else (autograd per chunk, split backward, AdamW, clipping) is
``TorchBackend``'s. Training steps the model's own tensors, so after a step
``model.save_pretrained`` writes the trained weights of the chunks this
process ran. Nothing is seeded or initialised here: the weights are the
model's.

One model per pipeline replica: in-process runs (``local_run``) with
``dp > 1`` would make replicas share parameters, so they are refused.

This module knows the adapter only by what it reads (``AdaptedModel``), so
``adapter.py`` imports it and not the other way round.
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol

import torch
from torch import Tensor, nn

from pulse.errors import PlanError, SpecError
from pulse.runtime.wiring import ChunkIO
from pulse.spec import ModelSpec
from pulse_torch.backend import TorchBackend, TorchChunk


class AdaptedModel(Protocol):
    """What the backend reads of a ``DiffusersAdapter``."""

    spec: ModelSpec
    layers: Mapping[str, nn.Module]

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def parameter_names(self) -> dict[int, str]: ...


class DiffusersBackend(TorchBackend):
    """``TorchBackend`` over ``adapter``'s layers; ``dtype`` and ``device`` default to the model's."""

    def __init__(self, adapter: AdaptedModel, **kwargs: Any) -> None:
        kwargs.setdefault("dtype", adapter.dtype)
        kwargs.setdefault("device", adapter.device)
        super().__init__(**kwargs)
        self.adapter = adapter
        self._built: set[int] = set()  # chunk starts already handed out (one model = one replica)

    def build_chunk(self, spec: ModelSpec, io: ChunkIO) -> TorchChunk:
        mine = self.adapter.spec
        if [l.name for l in spec.layers] != [l.name for l in mine.layers]:
            raise SpecError(f"model '{spec.name}' is not the spec of this diffusers model ('{mine.name}'): "
                            "plan with the adapter's spec")
        if io.start in self._built:
            raise PlanError("a diffusers model backs one pipeline replica: build one adapter (and backend) "
                            "per data-parallel replica")
        self._built.add(io.start)
        layers = {layer.name: self.adapter.layers[layer.name] for layer in spec.layers[io.start:io.end]}
        chunk = TorchChunk(spec, io, layers)
        if self.device.type != "meta" and any(p.device.type == "meta" for p in chunk.parameters()):
            raise PlanError(f"chunk {io.start}..{io.end - 1} of '{mine.name}' was not materialized on this rank: "
                            "load the rank's stage with its layers (stage_loading.load_stage)")
        # a frozen base (LoRA) may be held in a lower precision; what trains is in the backend's dtype
        wrong = {p.dtype for p in chunk.parameters() if p.is_floating_point() and p.requires_grad} - {self.dtype}
        if wrong:  # inputs are cast to the backend's dtype; the model's weights are not (they are the user's)
            raise PlanError(f"the model's weights are {sorted(map(str, wrong))} but the backend trains in "
                            f"{self.dtype}: cast the model first (model.to(dtype)) or use autocast")
        if self.device.type != "meta":
            chunk.to(self.device)  # in place: the model's modules themselves move
        return self.remember(chunk)  # a shared optimizer's chunks (TorchBackend.optimizer_of)

    def parameters(self, chunk: TorchChunk) -> dict[str, Tensor]:
        """The chunk's trainable parameters by the model's names: all of them, or with LoRA
        (``diffusers_adapter.lora``) only its adapters, the frozen base being no part of the training."""
        names = self.adapter.parameter_names()
        return {names[id(p)]: p for p in chunk.parameters() if p.requires_grad}
