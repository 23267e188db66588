"""The in-process runs the profile times: chunks of a model run by the runtime's own executor.

::

    one_chunk_per_layer(spec, backend, ...)   chunks at ``cuts`` (default: one per layer) on ``on``
                                              (default: round-robin over ``devices``), every forward of
                                              ``microbatches`` microbatches before their backwards
    feed_of(spec, microbatch_size, ...)       the seeded data those runs read, as the training job's feed

Which chunks hold real layers is the backend's business: the profile hands in a
``pulse.profiling.windows.WindowBackend`` whose chunks outside the measured
window replay recorded tensors, so no run needs the whole model.
"""
from __future__ import annotations

from typing import Any

from pulse.data.feed import DiffusionFeed
from pulse.data.noise import noise_schedule
from pulse.data.sources import load_source
from pulse.encoders import EncoderSet
from pulse.placement import from_cuts
from pulse.runtime.protocols import Backend, LossFn
from pulse.schedule.ir import Action, Schedule
from pulse.schedule.lower import lower
from pulse.spec import ModelSpec
from pulse.testing.local import local_run
from pulse.train.loop import StepBatches
from pulse.train.sampler import Sampler


def feed_of(spec: ModelSpec, microbatch_size: int, microbatches: int, seed: int, source: Any = None) -> DiffusionFeed:
    """The seeded microbatches the profile's runs read (synthetic data unless ``source``)."""
    source = source or load_source(None, spec, seed)
    sampler = Sampler(source.num_samples, microbatch_size, microbatches, 1, seed)
    return DiffusionFeed(source, sampler, noise_schedule("linear"), seed)


def one_chunk_per_layer(spec: ModelSpec, backend: Backend, loss: LossFn, microbatch_size: int, split: bool,
                        seed: int, microbatches: int = 1, cuts: list[int] | None = None, source: Any = None,
                        encoders: EncoderSet | None = None, devices: int = 1, on: list[int] | None = None):
    """The model on this rank, one chunk per layer (or per ``cuts``), run by the executor in process;
    with ``encoders``, each microbatch's encodes (E actions on ``source``) run before its forwards.
    ``devices`` > 1: the chunks go round-robin over that many in-process devices, or onto ``on`` (each
    chunk's input then arrives as a message where its device changes, and each device makes its own
    batch, as in a pipeline)."""
    cuts = cuts or list(range(spec.num_layers + 1))
    n = len(cuts) - 1
    on = on or [c % devices for c in range(n)]
    placement = from_cuts("sequential", cuts, on, devices, "direct", "profile")
    actions = []
    for m in range(microbatches):
        actions += [Action(0, None, m, "E", encoder=e) for e in range(len(encoders.encoders) if encoders else 0)]
        actions += [Action(on[c], c, m, "F") for c in range(n)]
    for m in range(microbatches):
        for c in reversed(range(n)):
            actions.append(Action(on[c], c, m, "B"))
            if split:
                actions.append(Action(on[c], c, m, "W"))
    schedule = Schedule("profile", microbatches,
                        {d: tuple(a for a in actions if a.device == d) for d in range(devices)})
    feed = feed_of(spec, microbatch_size, microbatches, seed, source)

    # made when a layer reads it, as the training job's feed: its cost is the reader's
    batches = StepBatches(lambda step, replica, mb: feed.batch(step, replica, mb).map(backend.from_numpy), 0,
                          encoded=lambda step, replica, mb, feeds: backend.from_numpy(
                              feed.encoded(step, replica, mb, feeds)),
                          provide=lambda step, replica, mb, feeds, value: feed.provide(
                              step, replica, mb, feeds, backend.to_numpy(value)))
    return local_run(spec, placement, lower(schedule, spec, placement, encoders), backend, batches, loss,
                     encoders=encoders)
