"""Random data inputs of the right shapes for a spec: the latent and every data shared input (numpy).

Which inputs a spec has, their shapes and laws are ``pulse.zoo.shapes.data_draws``'; this module
draws them with a numpy generator, for every backend's synthetic data (``pulse.data.sources``).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from pulse.spec import ModelSpec
from pulse.zoo.shapes import (INTEGERS, NORMAL, NUM_TRAIN_TIMESTEPS, PREFIX_MASK, ROWS, ZEROS, DataDraw, data_draws,
                              latent_shape)

__all__ = ["NUM_TRAIN_TIMESTEPS", "latent_shape", "make_inputs"]


def _prefix_mask(d: DataDraw, g: np.random.Generator) -> np.ndarray:
    b, n = d.shape
    valid = g.integers(1, n + 1, size=(b, 1))
    return (np.arange(n)[None, :] < valid).astype(np.int64)


_DRAW: dict[str, Callable[[DataDraw, np.random.Generator], np.ndarray]] = {
    NORMAL: lambda d, g: g.standard_normal(d.shape, dtype=np.float32),
    INTEGERS: lambda d, g: g.integers(0, d.high, size=d.shape, dtype=np.int64),
    PREFIX_MASK: _prefix_mask,
    ROWS: lambda d, g: np.tile(np.array(d.row, dtype=np.float32), (d.shape[0], 1)),
    ZEROS: lambda d, g: np.zeros(d.shape, dtype=np.int64),
}


def make_inputs(spec: ModelSpec, batch_size: int,
                rng: np.random.Generator | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(latents (B, C, H, W), {data shared input name: array}) drawn from ``rng``.

    Floats are float32 standard normals; timesteps, labels, masks and style
    are int64, as on the torch side.
    """
    g = rng if rng is not None else np.random.default_rng()
    latents = g.standard_normal((batch_size, *latent_shape(spec)), dtype=np.float32)
    return latents, {d.name: _DRAW[d.law](d, g) for d in data_draws(spec, batch_size)}
