"""``--validation-split``: samples held out of training, and their loss at fixed timesteps and noise.

::

    samples 0 .. N-1 ──split_indices(N, split, seed)──▶ training: the rest, in order   held out: V, sorted
        a pure function of (N, split, seed): the same on every rank, after a restart and a resume
    SampleSubset(source, indices): a source's samples at those indices, renumbered 0 .. n-1 (the feed's
        sampler draws training batches from the training subset only)

    every --validation-every steps (default: --sample-every, else 100) and after the last:
        Validation(): passes = ceil(V / (dp * M * b)); pass p, replica r, microbatch m reads held-out
        positions ((p * dp + r) * M + m) * b ... (HeldOutOrder; the last pass wraps to the first samples),
        their noise and timesteps the feed's at "step" p of a seed of their own: the same at every validation,
        so the number compares across steps and runs
        ─ each pass: the pipeline's forward-only program (pulse.runtime.forward_only), no gradient, no update
        ─ one sum over the world of (loss sum, microbatches) ─ val/loss (log.json, the step line, TensorBoard)

Framework-free, as the rest of ``pulse.train``; the backends build the feed (``pulse.data.held_out``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from pulse.errors import PulseError
from pulse.runtime.forward_only import ForwardOnlyExecutor
from pulse.train.sampler import seeded

DEFAULT_EVERY = 100  # steps between validation losses without --validation-every or --sample-every


def held_out_count(num_samples: int, split: float) -> int:
    """How many of ``num_samples`` a split holds out: a fraction (< 1, at least one sample) or a count."""
    count = max(1, round(split * num_samples)) if split < 1 else int(split)
    if count >= num_samples:
        raise PulseError(f"--validation-split {split:g} holds out {count} of the data's {num_samples} samples, "
                         "leaving none to train on; hold out fewer")
    return count


def split_indices(num_samples: int, split: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training indices, held-out indices), both sorted: a seeded draw of ``held_out_count`` samples."""
    held = np.sort(seeded(seed, "validation-split").permutation(num_samples)[:held_out_count(num_samples, split)])
    return np.setdiff1d(np.arange(num_samples), held), held


class SampleSubset:
    """``source``'s samples at ``indices``, as a source of its own (sample i is ``source``'s ``indices[i]``).
    Everything else (shapes, condition names, the empty prompt) is the source's."""

    def __init__(self, source: Any, indices: np.ndarray, part: str) -> None:
        if getattr(source, "buckets", None) is not None:
            raise PulseError("--validation-split with aspect-ratio buckets is not supported yet; train without one "
                             "of them")
        self.source, self.indices = source, np.asarray(indices, dtype=np.int64)
        self.name = f"{source.name}, {part} ({len(self.indices)} samples)"
        self.num_samples = len(self.indices)

    def latents(self, index: np.ndarray) -> np.ndarray:
        return self.source.latents(self.indices[index])

    def conditions(self, index: np.ndarray) -> dict[str, np.ndarray]:
        return self.source.conditions(self.indices[index])

    def __getattr__(self, name: str) -> Any:  # sample_shape, condition_names, has_empty_prompt, ...
        value = getattr(self.source, name)
        if name in INDEXED:  # it takes sample indices: the subset's, renumbered
            return lambda index: value(self.indices[np.asarray(index)])
        return value


INDEXED = ("shape_of",)  # a source's methods (beyond latents and conditions) that take sample indices


def split_source(source: Any, split: float | None, seed: int) -> tuple[Any, Any | None]:
    """(the samples training draws from, the held-out ones or None without a split)."""
    if split is None:
        return source, None
    train, held = split_indices(source.num_samples, split, seed)
    return SampleSubset(source, train, "training"), SampleSubset(source, held, "held out")


class HeldOutOrder:
    """The feed's sampler over the held-out samples: every one once per validation, in order, split
    over replicas and microbatches as a training step is; "step" p is pass p."""

    def __init__(self, count: int, microbatch_size: int, num_microbatches: int, dp: int) -> None:
        self.count, self.b, self.m, self.dp = count, microbatch_size, num_microbatches, dp
        self.passes = math.ceil(count / (dp * num_microbatches * microbatch_size))

    def indices(self, step: int, replica: int, microbatch: int) -> np.ndarray:
        start = ((step * self.dp + replica) * self.m + microbatch) * self.b
        return np.arange(start, start + self.b, dtype=np.int64) % self.count


def validation_seed(seed: int) -> int:
    """The held-out batches' noise seed: their own stream, not training step p's."""
    return int(seeded(seed, "validation-noise").integers(2**32))


def validation_every(every: int | None, sample_every: int) -> int:
    return every or sample_every or DEFAULT_EVERY


def validation_due(done: int, steps: int, every: int) -> bool:
    """After every ``every`` steps and after the last."""
    return done % every == 0 or done == steps


@dataclass
class Validation:
    """One rank's part of the validation loss: ``passes`` forward-only passes over the held-out batches
    (``batches.step`` set to each pass), then one sum over the world. Every rank must call it."""

    executor: ForwardOnlyExecutor
    batches: Any  # pulse.train.loop.StepBatches over the held-out feed
    passes: int
    sum_values: Callable[..., list[float]]  # the communicator's uncounted sum (StepCommunicator.sum_values)
    wait_sends: Callable[..., None]
    timeout: float | None = None

    def __call__(self) -> float:
        total, count = 0.0, 0
        for p in range(self.passes):
            self.batches.step = p
            losses = self.executor.run_pass().losses.values()
            total, count = total + sum(float(v) for v in losses), count + len(losses)
        self.wait_sends(self.timeout)
        total, count = self.sum_values([total, count], self.timeout)
        return total / max(count, 1.0)
