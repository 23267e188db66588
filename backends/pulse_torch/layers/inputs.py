"""Random data inputs of the right shapes for a spec: the latent and every data shared input.

Which inputs a spec has, their shapes and laws are framework-free
(``pulse.zoo.shapes.data_draws``); this module only draws them with torch.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from pulse.spec import ModelSpec
from pulse.zoo.shapes import (INTEGERS, NORMAL, NUM_TRAIN_TIMESTEPS, PREFIX_MASK, ROWS, ZEROS, DataDraw, data_draws,
                              latent_shape)

__all__ = ["NUM_TRAIN_TIMESTEPS", "latent_shape", "make_inputs"]


def _prefix_mask(d: DataDraw, g: torch.Generator) -> Tensor:
    b, n = d.shape
    valid = torch.randint(1, n + 1, (b, 1), generator=g)
    return (torch.arange(n)[None, :] < valid).long()


_DRAW: dict[str, Callable[[DataDraw, torch.Generator], Tensor]] = {
    NORMAL: lambda d, g: torch.randn(*d.shape, generator=g),
    INTEGERS: lambda d, g: torch.randint(0, d.high, d.shape, generator=g),
    PREFIX_MASK: _prefix_mask,
    ROWS: lambda d, g: torch.tensor(d.row).repeat(d.shape[0], 1),
    ZEROS: lambda d, g: torch.zeros(d.shape, dtype=torch.long),
}


def make_inputs(spec: ModelSpec, batch_size: int, generator: torch.Generator | None = None,
                device: torch.device | str | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """(latents (B, C, H, W), {data shared input name: tensor}) drawn from ``generator``.

    Floats are fp32 standard normals; timesteps, labels, masks and style are
    int64. Drawn on the CPU in spec order, then moved, so a seed gives the
    same batch on every device.
    """
    g = generator if generator is not None else torch.default_generator
    latents = torch.randn(batch_size, *latent_shape(spec), generator=g)
    shared = {d.name: _DRAW[d.law](d, g) for d in data_draws(spec, batch_size)}
    if device is not None:
        latents = latents.to(device)
        shared = {k: v.to(device) for k, v in shared.items()}
    return latents, shared
