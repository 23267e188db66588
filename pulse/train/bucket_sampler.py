"""Which samples a step trains on when samples come in aspect-ratio buckets (``pulse.data.buckets``).

Every step's global batch (``dp * M * b`` samples) comes from one bucket, so every
microbatch of the step has one shape. Like ``Sampler``, a pure function of
(seed, step, each sample's bucket): every rank computes the same batches without a
message, and a resumed run continues from its step alone::

    epoch e:  each bucket k: seeded(seed, "bucket", e, k) shuffles its samples
              ─ chunked into global batches; the last one filled up from the bucket's own
                shuffled samples again (kohya keeps a short last batch: a plan's shapes
                are fixed, so it is padded, every sample still seen each epoch)
              ─ seeded(seed, "bucket-batches", e) shuffles the list of all buckets' batches
    step s:   epoch s // batches_per_epoch, batch s % batches_per_epoch of that list
              ─ positions inside it run replica, then microbatch, as ``Sampler``'s

The number of batches per epoch depends only on the bucket sizes, so it is the same
every epoch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pulse.errors import PulseError
from pulse.train.sampler import seeded


@dataclass(frozen=True)
class StepBatch:
    bucket: int
    samples: np.ndarray  # (dp * M * b,) int64, replica-major then microbatch


class BucketSampler:
    def __init__(self, buckets: np.ndarray, microbatch_size: int, num_microbatches: int, dp: int, seed: int) -> None:
        """``buckets``: each sample's bucket number (0..K-1; a bucket may be empty)."""
        self.b, self.m, self.dp, self.seed = microbatch_size, num_microbatches, dp, seed
        self.buckets = np.asarray(buckets, dtype=np.int64)
        if self.buckets.ndim != 1 or len(self.buckets) == 0 or self.buckets.min() < 0:
            raise PulseError("bucketed sampling needs one bucket number (>= 0) for each of at least one sample")
        self.members = [np.flatnonzero(self.buckets == k) for k in range(int(self.buckets.max()) + 1)]
        self.global_batch = microbatch_size * num_microbatches * dp
        self.batches_per_epoch = sum(-(-len(m) // self.global_batch) for m in self.members)
        self._epoch: tuple[int, list[StepBatch]] | None = None

    @property
    def num_samples(self) -> int:
        return len(self.buckets)

    def step_batch(self, step: int) -> StepBatch:
        """The step's bucket and global batch."""
        epoch, position = divmod(step, self.batches_per_epoch)
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, self._batches(epoch))
        return self._epoch[1][position]

    def bucket(self, step: int) -> int:
        return self.step_batch(step).bucket

    def indices(self, step: int, replica: int, microbatch: int) -> np.ndarray:
        """Sample indices (int64) of one microbatch: all from the step's bucket."""
        start = (replica * self.m + microbatch) * self.b
        return self.step_batch(step).samples[start:start + self.b].copy()

    def bucket_shares(self) -> np.ndarray:
        """The share of an epoch's steps each bucket takes (what the planner weighs its steps by)."""
        counts = np.array([-(-len(m) // self.global_batch) for m in self.members], dtype=np.float64)
        return counts / counts.sum()

    def _batches(self, epoch: int) -> list[StepBatch]:
        batches = []
        for k, members in enumerate(self.members):
            if len(members) == 0:
                continue
            order = members[seeded(self.seed, "bucket", epoch, k).permutation(len(members))]
            count = -(-len(order) // self.global_batch)
            padded = np.resize(order, count * self.global_batch)  # wraps round the bucket's own order
            batches += [StepBatch(k, padded[i * self.global_batch:(i + 1) * self.global_batch])
                        for i in range(count)]
        order = seeded(self.seed, "bucket-batches", epoch).permutation(len(batches))
        return [batches[i] for i in order]
