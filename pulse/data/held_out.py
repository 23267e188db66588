"""The held-out samples' feed and a rank's ``Validation`` (``--validation-split``: ``pulse.train.validation``).

::

    source ──split_source──▶ training samples ──feed_for──▶ the training feed     (every backend's build_job)
                        └──▶ held-out samples ──validation_feed──▶ fixed noise and timesteps per pass,
                                                    no caption dropout, no noise offset, plain MSE
    validation_for(job, held, config): the held-out feed's batches (converted by the backend's from_numpy)
        through the rank's forward-only executor (pulse.runtime.forward_only)
"""
from __future__ import annotations

from typing import Any

from pulse.data.feed import DiffusionFeed
from pulse.data.scheduler_config import noise_settings
from pulse.plan import Plan
from pulse.runtime.forward_only import ForwardOnlyExecutor
from pulse.train.loop import StepBatches, TrainingJob
from pulse.train.run_config import RunConfig
from pulse.train.validation import HeldOutOrder, Validation, split_source, validation_seed

__all__ = ["split_source", "validation_feed", "validation_for"]


def validation_feed(plan: Plan, held: Any, config: RunConfig) -> DiffusionFeed:
    """The held-out samples as the plan's microbatches: the run's noise schedule and prediction type, the
    same noise and timesteps at every validation; no caption dropout, noise offset or min-SNR weights
    (the number is the plain diffusion loss, comparable from run to run)."""
    noise = noise_settings(plan.model, config.beta_schedule, config.prediction_type)
    order = HeldOutOrder(held.num_samples, plan.microbatch_size, plan.num_microbatches, plan.dp)
    return DiffusionFeed(held, order, noise.schedule(), validation_seed(config.seed), noise.prediction_type)


def validation_for(job: TrainingJob, held: Any | None, config: RunConfig) -> Validation | None:
    """This rank's ``Validation`` of ``held`` (None without held-out samples)."""
    if held is None:
        return None
    feed = validation_feed(job.plan, held, config)
    convert = job.backend.from_numpy
    batches = StepBatches(lambda step, replica, mb: feed.batch(step, replica, mb).map(convert), job.layout.replica)
    executor = ForwardOnlyExecutor(job.executor, batches)
    return Validation(executor, batches, feed.sampler.passes, job.comm.sum_values, job.comm.wait_sends, job.timeout)
