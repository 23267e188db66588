"""What ``pulse profile`` makes real on a PyTorch rank: one window of layers at a time, never the whole model.

::

    zoo model        TorchBackend builds a chunk's layers (seeded per layer) with the chunk and frees
                     them with it: nothing to make
    diffusers model  the model's skeleton, once (stage_loading.skeleton_adapter: every parameter on the
                     meta device); per window (pulse.profiling.windows):
                       materialize    its layers real on the rank's device: the folder's saved
                                      weights read by key, else seeded per layer
                       measure        backends over the skeleton's layers (DiffusersBackend)
                       release        their parameters back on the meta device: the bytes go with the
                                      runs' chunks, gradients and optimizer state

Every backend is under ``--precision``'s autocast as training runs it, and on an
accelerator timed as ``--device-timing`` says (``pulse_torch.profiler.device_timed``).
"""
from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from pulse.args.model_args import parse_options
from pulse.profiling.timing import TORCH_DEVICE_TIMING
from pulse.profiling.windows import RealLayers, nothing_to_make
from pulse.zoo.diffusers_config import PREFIX as DIFFUSERS_PREFIX
from pulse_torch.backend import TorchBackend
from pulse_torch.job import AUTOCAST, with_autocast
from pulse_torch.profiler import device_timed


def release(adapter: Any, layers: Sequence[str]) -> None:
    """``layers``' parameters back on the meta device, in every slot that holds them (``ParameterSlots``):
    their bytes are freed once no run, gradient or optimizer state holds the old tensors."""
    from pulse_torch.diffusers_adapter.stage_loading import ParameterSlots

    slots = ParameterSlots(adapter)
    for name in layers:
        for p in list(adapter.layers[name].parameters()):
            if p.device.type != "meta":
                slots.replace(p, torch.empty_like(p, device="meta"), p.requires_grad)


class DiffusersWindows:
    """A user's diffusers model for the profile: its skeleton (built on first use, so a bad folder is the
    profile's one-line refusal), a window's layers made real and released."""

    def __init__(self, model: str, options: dict[str, Any], device: str) -> None:
        self.model, self.options, self.device = model, options, device
        self._adapter: Any = None

    @property
    def adapter(self) -> Any:
        if self._adapter is None:
            from pulse_torch.diffusers_adapter.stage_loading import skeleton_adapter

            self._adapter = skeleton_adapter(self.model, **self.options)
            self._adapter.model.train()
        return self._adapter

    def backend(self) -> TorchBackend:
        """Chunks over the skeleton's layers (only materialized ones can be built), float32 as training holds them."""
        return self.adapter.backend(device=self.device, dtype=torch.float32, lr=1e-12, seed=0)

    @contextlib.contextmanager
    def real(self, layers: Sequence[str]) -> Iterator[None]:
        from pulse_torch.diffusers_adapter.stage_loading import materialize

        materialize(self.adapter, layers, device=self.device, seed=0)
        try:
            yield
        finally:
            release(self.adapter, layers)


@dataclass
class ProfileLayers:
    """Fresh backends for the profile's runs, and how a window's layers are made real for them."""

    backend_of: Callable[[], TorchBackend]
    real_layers: RealLayers


def profile_layers(args: argparse.Namespace, device: str = "cpu", timing: str = TORCH_DEVICE_TIMING) -> ProfileLayers:
    """The profile's layers on ``device``: TorchBackend's zoo layers, or a diffusers model's skeleton
    (``DiffusersWindows``); under ``--precision``'s autocast; on an accelerator, timed as ``timing``
    says (``pulse_torch.profiler.device_timed``)."""
    autocast = AUTOCAST[getattr(args, "precision", "fp32")]
    windows = DiffusersWindows(args.model, parse_options(args.model_option), device) \
        if args.model.startswith(DIFFUSERS_PREFIX) else None

    def fresh() -> TorchBackend:
        backend = windows.backend() if windows is not None else TorchBackend(device=device, seed=0, lr=1e-12)
        if autocast is not None:
            backend = with_autocast(backend, autocast)
        return device_timed(backend, torch.device(device), timing)
    return ProfileLayers(fresh, windows.real if windows is not None else nothing_to_make)
