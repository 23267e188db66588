"""A latent source whose samples come in aspect-ratio buckets (``pulse.data.buckets``), one shape per bucket.

::

    samples 0..N-1 ─ buckets[i]: the sample's bucket k, rows[i]: its row in bucket k's array
    by_bucket[k]   (n_k, C, H_k, W_k) float32: every latent of bucket k
    conditions     {name: (N, ...)}: text and size conditions, per sample (their shapes never change)

The feed (``pulse.data.feed``) sees ``buckets`` and samples each step from one bucket
(``pulse.train.bucket_sampler``), so ``latents`` is only ever asked for one bucket at a time;
``shape_of`` says the latent shape of a step's samples without loading them (the noise is drawn
at that shape on ranks that never read a latent).
"""
from __future__ import annotations

import numpy as np

from pulse.data.sources import data_input_names
from pulse.errors import PulseError
from pulse.spec import ModelSpec
from pulse.data.draws import latent_shape, make_inputs
from pulse.train.sampler import seeded


class BucketedLatents:
    def __init__(self, name: str, by_bucket: list[np.ndarray], buckets: np.ndarray,
                 conditions: dict[str, np.ndarray]) -> None:
        self.name, self.by_bucket = name, by_bucket
        self.buckets = np.asarray(buckets, dtype=np.int64)
        self.num_samples = len(self.buckets)
        self.rows = np.zeros(self.num_samples, dtype=np.int64)
        for k, latents in enumerate(by_bucket):
            members = np.flatnonzero(self.buckets == k)
            if len(members) != len(latents):
                raise PulseError(f"{name}: bucket {k} holds {len(latents)} latents but {len(members)} samples "
                                 "name it; the cache is damaged: make it again")
            self.rows[members] = np.arange(len(members))
        self._conditions = conditions
        self.condition_names = tuple(conditions)
        # the largest bucket's shape: what a caller asking one shape of the set (memory, pricing) gets
        self.sample_shape = max((tuple(x.shape[1:]) for x in by_bucket if len(x)), key=lambda s: int(np.prod(s)))

    def _bucket_of(self, index: np.ndarray) -> int:
        found = np.unique(self.buckets[index])
        if len(found) != 1:
            raise PulseError(f"{self.name}: one batch asks for samples of buckets {found.tolist()}; a batch is "
                             "drawn from one bucket (pulse.train.bucket_sampler)")
        return int(found[0])

    def shape_of(self, index: np.ndarray) -> tuple[int, ...]:
        return tuple(self.by_bucket[self._bucket_of(index)].shape[1:])

    def latents(self, index: np.ndarray) -> np.ndarray:
        return self.by_bucket[self._bucket_of(index)][self.rows[index]]

    def conditions(self, index: np.ndarray) -> dict[str, np.ndarray]:
        return {n: table[index] for n, table in self._conditions.items()}

    def has_empty_prompt(self) -> bool:
        return False

    def empty_conditions(self) -> None:
        return None


def synthetic_buckets(spec: ModelSpec, latent_sizes: list[tuple[int, int]], num_samples: int,
                      seed: int = 0) -> BucketedLatents:
    """Seeded normal latents, sample i in bucket i % K at latent (height, width) ``latent_sizes[k]``,
    and the spec's data inputs drawn per sample: what checks and benchmarks train on in buckets."""
    channels = latent_shape(spec)[0]
    buckets = np.arange(num_samples) % len(latent_sizes)
    by_bucket = [seeded(seed, "bucket-latents", k).standard_normal(
        (int((buckets == k).sum()), channels, h, w), dtype=np.float32) for k, (h, w) in enumerate(latent_sizes)]
    drawn = make_inputs(spec, num_samples, seeded(seed, "bucket-conditions"))[1]
    conditions = {n: drawn[n] for n in data_input_names(spec)}
    return BucketedLatents(f"synthetic({num_samples} latents in buckets {latent_sizes}, seed {seed})",
                           by_bucket, buckets, conditions)
