"""Training data for a MindSpore job: synthetic latents, which samples a step reads, per-microbatch noise.

The recipe of ``pulse_torch.data`` in numpy (the values differ: numpy and
torch random streams are not the same)::

    SyntheticLatents: sample i = prototype[i % K] + 0.5 * its own smooth field, unit variance;
                      conditioning (context, labels, ...) per class
    Sampler:          (step, replica, microbatch) -> sample indices, epochs of seeded permutations
    DiffusionFeed:    noise and timesteps seeded by (seed, step, replica, microbatch)
        batch(step, replica, mb) = {"h": x_t, "timesteps": t, conditions..., "target": eps}

Every worker of one replica gets bit-identical arrays without talking to the
others; replicas get different samples and noise. Arrays stay numpy: the
backend places them (``MindSporeBackend.place``) when a chunk reads them.
"""
from __future__ import annotations


import numpy as np

from pulse.errors import PulseError
from pulse.runtime.sampler import Sampler, seeded
from pulse.spec import ModelSpec
from pulse_mindspore.diffusion import TARGET, linear_alphas_cumprod, output_shape, q_sample
from pulse_mindspore.layers.inputs import NUM_TRAIN_TIMESTEPS, latent_shape, make_inputs
from pulse_mindspore.model import MAIN

TIMESTEPS = "timesteps"  # drawn with the noise, never read from the data


def upsample_bilinear(grid: np.ndarray, height: int, width: int) -> np.ndarray:
    """(N, C, h, w) -> (N, C, height, width), half-pixel centres (torch's ``align_corners=False``)."""
    def weights(size_in: int, size_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src = np.maximum((np.arange(size_out) + 0.5) * (size_in / size_out) - 0.5, 0.0)
        lo = np.minimum(np.floor(src).astype(np.int64), size_in - 1)
        hi = np.minimum(lo + 1, size_in - 1)
        return lo, hi, (src - lo).astype(np.float32)

    lo, hi, w = weights(grid.shape[2], height)
    rows = grid[:, :, lo, :] * (1 - w)[:, None] + grid[:, :, hi, :] * w[:, None]
    lo, hi, w = weights(grid.shape[3], width)
    return rows[..., lo] * (1 - w) + rows[..., hi] * w


def smooth_fields(count: int, shape: tuple[int, int, int], rng: np.random.Generator,
                  coarse: int = 4) -> np.ndarray:
    """(count, C, H, W) unit-variance fields: coarse Gaussian grids upsampled bilinearly.

    Smooth, so neighbouring pixels predict each other: a denoiser can learn to
    tell them from white noise.
    """
    c, h, w = shape
    grid = rng.standard_normal((count, c, max(h // coarse, 1), max(w // coarse, 1)), dtype=np.float32)
    up = upsample_bilinear(grid, h, w)
    std = up.reshape(count, -1).std(axis=1).clip(min=1e-6)
    return (up / std[:, None, None, None]).astype(np.float32)


class SyntheticLatents:
    """Class-structured smooth latents with per-class conditioning (as a caption carries information)."""

    def __init__(self, spec: ModelSpec, num_samples: int = 1024, num_classes: int = 8, seed: int = 0) -> None:
        if num_samples < 1 or num_classes < 1:
            raise PulseError(f"synthetic data needs >= 1 sample and class, got {num_samples} and {num_classes}")
        self.name = f"synthetic({num_samples} smooth latents, {num_classes} classes, seed {seed})"
        self.num_samples = num_samples
        shape = latent_shape(spec)
        protos = smooth_fields(num_classes, shape, seeded(seed, "prototypes"))
        own = smooth_fields(num_samples, shape, seeded(seed, "samples"))
        self.classes = np.arange(num_samples) % num_classes
        self._x0 = ((protos[self.classes] + 0.5 * own) / np.float32(1.25 ** 0.5)).astype(np.float32)
        per_class = [make_inputs(spec, 1, seeded(seed, "class", k))[1] for k in range(num_classes)]
        names = [n for n in per_class[0] if n != TIMESTEPS] if per_class else []
        self._cond = {n: np.concatenate([c[n] for c in per_class]) for n in names}

    def latents(self, index: np.ndarray) -> np.ndarray:
        return self._x0[index]

    def conditions(self, index: np.ndarray) -> dict[str, np.ndarray]:
        return {n: table[self.classes[index]] for n, table in self._cond.items()}


class DiffusionFeed:
    """Noised microbatches: ``batch(step, replica, mb)``, DDPM linear betas 1e-4..0.02 over 1000 steps."""

    def __init__(self, spec: ModelSpec, source: SyntheticLatents, sampler: Sampler, seed: int) -> None:
        self.spec, self.source, self.sampler, self.seed = spec, source, sampler, seed
        self.alphas_cumprod = linear_alphas_cumprod(NUM_TRAIN_TIMESTEPS)

    def batch(self, step: int, replica: int, microbatch: int) -> dict[str, np.ndarray]:
        index = self.sampler.indices(step, replica, microbatch)
        x0 = self.source.latents(index)
        g = seeded(self.seed, "noise", step, replica, microbatch)
        t = g.integers(0, NUM_TRAIN_TIMESTEPS, size=x0.shape[0], dtype=np.int64)
        eps = g.standard_normal(x0.shape, dtype=np.float32)
        target = eps
        out_shape = output_shape(self.spec, x0.shape[0])
        if out_shape[1] > eps.shape[1]:  # learned variance (DiT): no signal for the extra channels
            extra = g.standard_normal((out_shape[0], out_shape[1] - eps.shape[1], *out_shape[2:]), dtype=np.float32)
            target = np.concatenate([eps, extra], axis=1)
        return {MAIN: q_sample(x0, t, eps, self.alphas_cumprod), TIMESTEPS: t, TARGET: target,
                **self.source.conditions(index)}
