"""The batches the checks run a model on: training's own synthetic feed at step 0, in a framework's tensors.

::

    check_batches(spec, b, replica, seed, convert)(mb)
        = {name: convert(array)} of pulse.data.feed.synthetic_feed(...).batch(0, replica, mb)

The same (seed, replica, microbatch) gives the same arrays in every process
and for every backend. ``torch_worker_check.make_batches`` and
``mindspore_worker_check.make_batches`` are this with torch / MindSpore tensors.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from pulse.data.feed import synthetic_feed
from pulse.spec import ModelSpec

# room for this many microbatches of this many replicas (one step of the synthetic source); a
# microbatch past them reads a neighbour's samples, with its own noise
CHECK_MICROBATCHES, CHECK_REPLICAS = 16, 4


def check_batches(spec: ModelSpec, microbatch_size: int, replica: int, seed: int,
                  convert: Callable[[np.ndarray], Any]) -> Callable[[int], dict[str, Any]]:
    """Microbatch -> its batch: "h" (noised latents), "timesteps", the data's shared inputs, "target"
    (the noise; a learned-variance output trains its first half, as ``eps_loss`` does)."""
    feed = synthetic_feed(spec, microbatch_size, CHECK_MICROBATCHES, CHECK_REPLICAS, seed)

    def batch(mb: int) -> dict[str, Any]:
        return {name: convert(np.ascontiguousarray(a)) for name, a in feed.batch(0, replica, mb).items()}

    return batch
