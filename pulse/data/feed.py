"""Noised microbatches for one replica, the same arrays for every backend.

::

    batch(step, replica, mb):  indices = Sampler(step, replica, mb)      (epochs of seeded permutations)
                               x0, conditions = source[indices]
                               t, eps ~ seeded(seed, "noise", step, replica, mb)
                               -> {"h": x_t, "timesteps": t, conditions..., "target": eps or v}

The target has the latent's channels; a model that predicts more (a DiT's
learned variance) trains those on the loss side (``eps_loss``: zero gradient).
"""
from __future__ import annotations

import numpy as np

from pulse.data.noise import NoiseSchedule
from pulse.data.scheduler_config import noise_settings
from pulse.data.sources import TIMESTEPS, LatentSource
from pulse.plan import Plan
from pulse.runtime.run_config import RunConfig
from pulse.runtime.sampler import Sampler, seeded
from pulse.runtime.wiring import MAIN

TARGET = "target"  # the batch entry the model's output regresses onto


class DiffusionFeed:
    def __init__(self, source: LatentSource, sampler: Sampler, schedule: NoiseSchedule, seed: int,
                 prediction_type: str = "epsilon") -> None:
        self.source, self.sampler, self.schedule, self.seed = source, sampler, schedule, seed
        self.prediction_type = prediction_type

    def batch(self, step: int, replica: int, microbatch: int) -> dict[str, np.ndarray]:
        index = self.sampler.indices(step, replica, microbatch)
        x0 = self.source.latents(index)
        g = seeded(self.seed, "noise", step, replica, microbatch)
        t = g.integers(0, self.schedule.num_steps, size=x0.shape[0], dtype=np.int64)
        eps = g.standard_normal(x0.shape, dtype=np.float32)
        return {MAIN: self.schedule.add_noise(x0, eps, t), TIMESTEPS: t,
                TARGET: self.schedule.target(x0, eps, t, self.prediction_type), **self.source.conditions(index)}


def feed_for(plan: Plan, source: LatentSource, config: RunConfig) -> DiffusionFeed:
    """The feed a rank of ``plan`` trains on: the run's noise schedule and prediction type, else the
    pipeline scheduler's (``pulse.data.scheduler_config``), its samples split over the plan's replicas."""
    noise = noise_settings(plan.model, config.beta_schedule, config.prediction_type)
    sampler = Sampler(source.num_samples, plan.microbatch_size, plan.num_microbatches, plan.dp, config.seed)
    return DiffusionFeed(source, sampler, noise.schedule(), config.seed, noise.prediction_type)
