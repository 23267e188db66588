"""Noised microbatches for one replica, the same arrays for every backend.

::

    batch(step, replica, mb):  indices = Sampler(step, replica, mb)      (epochs of seeded permutations)
                               x0, conditions = source[indices]
                               t, eps ~ seeded(seed, "noise", step, replica, mb)
                               (--noise-offset: eps += offset * N(0, 1) per sample and channel, same stream)
                               dropped ~ seeded(seed, "caption-dropout", ...) < P: the empty prompt's conditions
                               -> {"h": x_t, "timesteps": t, conditions..., "target": eps or v
                                   [, "loss_weight": min-SNR weights per sample (--snr-gamma)]}
    encoded(step, replica, mb, feeds) / provide(...): an encode action (pulse.encoders) makes the
                               latents or a condition ahead of time, here or on another rank; the
                               batch then reads that instead of encoding

A batch is lazy (``LazyBatch``): an entry is computed when a rank first reads
it, so a rank whose chunks never read the latents never loads (or encodes) an
image, and one that never reads the text never runs a text encoder. Every
entry is a pure function of (seed, step, replica, microbatch): computed on
any rank it is the same array.

The target has the latent's channels; a model that predicts more (a DiT's
learned variance) trains those on the loss side (``eps_loss``: zero gradient).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import numpy as np

from pulse.data.noise import NoiseSchedule, noise_schedule
from pulse.encoders import LATENT
from pulse.data.scheduler_config import noise_settings
from pulse.data.sources import TIMESTEPS, LatentSource, SyntheticLatents
from pulse.errors import PulseError
from pulse.plan import Plan
from pulse.train.run_config import RunConfig
from pulse.train.bucket_sampler import BucketSampler
from pulse.train.sampler import Sampler, seeded
from pulse.runtime.wiring import MAIN
from pulse.spec import ModelSpec

TARGET = "target"  # the batch entry the model's output regresses onto
LOSS_WEIGHT = "loss_weight"  # per-sample weights of the MSE (min-SNR); absent: every sample weighs 1


class LazyBatch(Mapping[str, Any]):
    """A microbatch whose entries are made on first read and kept (``map``: converted lazily too)."""

    def __init__(self, makers: Mapping[str, Callable[[], Any]]) -> None:
        self._makers = dict(makers)
        self._made: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._made:
            self._made[name] = self._makers[name]()
        return self._made[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def made(self) -> list[str]:
        """The entries read so far."""
        return sorted(self._made)

    def map(self, convert: Callable[[Any], Any]) -> "LazyBatch":
        return LazyBatch({name: (lambda name=name: convert(self[name])) for name in self._makers})


class DiffusionFeed:
    def __init__(self, source: LatentSource, sampler: Sampler | BucketSampler, schedule: NoiseSchedule, seed: int,
                 prediction_type: str = "epsilon", caption_dropout: float = 0.0, noise_offset: float = 0.0,
                 snr_gamma: float | None = None) -> None:
        self.source, self.sampler, self.schedule, self.seed = source, sampler, schedule, seed
        self.prediction_type, self.caption_dropout = prediction_type, caption_dropout
        self.noise_offset, self.snr_gamma = noise_offset, snr_gamma
        self._empty: dict[str, np.ndarray] | None = None  # made on first use: it may run a text encoder
        # (step, replica, microbatch) -> {feeds: array}: what an encode action made or received for it
        self._provided: dict[tuple[int, int, int], dict[str, np.ndarray]] = {}
        # the last microbatch's conditions an encode made, until its other inputs are asked for: an
        # encode making several (SDXL's text: context, text_embeds, time_ids) runs the encoders once
        self._encoding: tuple[tuple[int, int, int], dict[str, np.ndarray]] | None = None
        if caption_dropout > 0 and not source.has_empty_prompt():
            raise PulseError(f"--caption-dropout needs the empty prompt's text embedding, which {source.name} does "
                             "not hold: train on --images with --pipeline, or on a cache from `pulse cache-latents`")

    def encoded(self, step: int, replica: int, microbatch: int, feeds: str) -> np.ndarray:
        """What the encoder feeding ``feeds`` makes for this microbatch (an encode action):
        ``LATENT`` the clean latents (the VAE), else that condition (a text encoder's output).
        An encode making several conditions asks for each in turn: the source encodes them once."""
        index = self.sampler.indices(step, replica, microbatch)
        if feeds == LATENT:
            return self.source.latents(index)
        key = (step, replica, microbatch)
        if self._encoding is None or self._encoding[0] != key or feeds not in self._encoding[1]:
            self._encoding = (key, self._conditions(index, step, replica, microbatch))
        return self._encoding[1].pop(feeds)

    def provide(self, step: int, replica: int, microbatch: int, feeds: str, value: np.ndarray) -> None:
        """An encode's output for this microbatch (made here or received): its batch reads it, encodes nothing."""
        # earlier steps' are read by now (a prefetch provides the next step's while this one reads)
        for key in [k for k in self._provided if k[0] < step - 1]:
            del self._provided[key]
        self._provided.setdefault((step, replica, microbatch), {})[feeds] = value

    def batch(self, step: int, replica: int, microbatch: int) -> LazyBatch:
        index = self.sampler.indices(step, replica, microbatch)
        g = seeded(self.seed, "noise", step, replica, microbatch)
        t = g.integers(0, self.schedule.num_steps, size=len(index), dtype=np.int64)
        sample_shape = self.sample_shape(index)  # a bucketed source: the step's bucket's latent
        eps = g.standard_normal((len(index), *sample_shape), dtype=np.float32)
        if self.noise_offset:  # diffusers: noise += offset * randn(batch, channels, 1, 1): the target too
            shape = (len(index), sample_shape[0]) + (1,) * (len(sample_shape) - 1)
            eps = eps + np.float32(self.noise_offset) * g.standard_normal(shape, dtype=np.float32)
        made: dict[str, Any] = {}
        key = (step, replica, microbatch)

        def x0() -> np.ndarray:  # an encode's output is looked up when the entry is made, not before
            if "x0" not in made:
                provided = self._provided.get(key, {})
                made["x0"] = provided[LATENT] if LATENT in provided else self.source.latents(index)
            return made["x0"]

        def condition(name: str) -> np.ndarray:
            # per name: an encode provides one array (the text encoder's hidden states); reading it must
            # not re-run the encoder for an array nobody reads (its attention mask, for SD)
            provided = self._provided.get(key, {})
            if name in provided:
                return provided[name]
            if "conditions" not in made:
                made["conditions"] = self._conditions(index, step, replica, microbatch)
            return made["conditions"][name]

        def target() -> np.ndarray:  # epsilon needs no latents: the loss rank of a pipeline skips the VAE
            return eps if self.prediction_type == "epsilon" else self.schedule.target(x0(), eps, t, self.prediction_type)

        weights = {} if self.snr_gamma is None else \
            {LOSS_WEIGHT: lambda: self.schedule.min_snr_weights(t, self.snr_gamma, self.prediction_type)}
        return LazyBatch({MAIN: lambda: self.schedule.add_noise(x0(), eps, t), TIMESTEPS: lambda: t,
                          TARGET: target, **weights,
                          **{n: (lambda n=n: condition(n)) for n in self.source.condition_names}})

    def sample_shape(self, index: np.ndarray) -> tuple[int, ...]:
        """One latent's shape for these samples: the source's, or (buckets) that of their one bucket."""
        shape_of = getattr(self.source, "shape_of", None)
        return tuple(shape_of(index)) if shape_of is not None else tuple(self.source.sample_shape)

    def shapes_key(self, step: int) -> int | None:
        """What a step's shapes depend on besides the plan: its bucket (None: a source without buckets)."""
        return self.sampler.bucket(step) if isinstance(self.sampler, BucketSampler) else None

    def _conditions(self, index: np.ndarray, step: int, replica: int, microbatch: int) -> dict[str, np.ndarray]:
        out = self.source.conditions(index)
        if self.caption_dropout <= 0:
            return out
        if self._empty is None:
            self._empty = self.source.empty_conditions()
        dropped = seeded(self.seed, "caption-dropout", step, replica, microbatch).random(len(index)) < self.caption_dropout
        for name, row in self._empty.items():
            out[name] = np.where(dropped.reshape(-1, *[1] * (row.ndim - 1)), row, out[name]).astype(out[name].dtype)
        return out


def feed_for(plan: Plan, source: LatentSource, config: RunConfig) -> DiffusionFeed:
    """The feed a rank of ``plan`` trains on: the run's noise schedule and prediction type, else the
    pipeline scheduler's (``pulse.data.scheduler_config``), its samples split over the plan's replicas."""
    noise = noise_settings(plan.model, config.beta_schedule, config.prediction_type)
    sampler = sampler_for(source, plan.microbatch_size, plan.num_microbatches, plan.dp, config.seed)
    return DiffusionFeed(source, sampler, noise.schedule(), config.seed, noise.prediction_type,
                         config.caption_dropout, config.noise_offset, config.snr_gamma)


def sampler_for(source: LatentSource, microbatch_size: int, num_microbatches: int, dp: int,
                seed: int) -> Sampler | BucketSampler:
    """A source in aspect-ratio buckets (``buckets``: each sample's) gets each step's global batch from
    one bucket; any other source the plain epochs of permutations."""
    buckets = getattr(source, "buckets", None)
    if buckets is not None:
        return BucketSampler(buckets, microbatch_size, num_microbatches, dp, seed)
    return Sampler(source.num_samples, microbatch_size, num_microbatches, dp, seed)


def synthetic_feed(spec: ModelSpec, microbatch_size: int, num_microbatches: int, dp: int = 1,
                   seed: int = 0, steps: int = 1) -> DiffusionFeed:
    """The feed ``pulse train`` gives a zoo model without ``--data`` (synthetic latents, DDPM's linear
    schedule, epsilon targets), holding ``steps`` steps' samples (steps x dp x M x b) instead of the
    default set (a later step starts the next epoch: the same samples, other noise).

    For checks and benchmarks that run a model on batches drawn as training draws them:
    ``synthetic_feed(...).batch(step, replica, microbatch)`` (numpy arrays, lazily made).
    """
    samples = steps * dp * num_microbatches * microbatch_size
    sampler = Sampler(samples, microbatch_size, num_microbatches, dp, seed)
    return DiffusionFeed(SyntheticLatents(spec, num_samples=samples, seed=seed), sampler, noise_schedule("linear"),
                         seed)
