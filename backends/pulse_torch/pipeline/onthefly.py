"""``pulse train --pipeline DIR --images DIR``: captioned images encoded while training, no cache.

::

    ImageSource.latents(index)     load_image (resize, crop, seeded flip) ─ vae.encode ─ (B, C, h, w)
    ImageSource.conditions(index)  caption ─ tokenizer(s) ─ text encoder(s) ─ the model's text inputs
                                   (SD: "context"; Hunyuan-DiT: text_clip[_mask], text_t5[_mask], image sizes)

A ``pulse.data.sources.LatentSource`` like a cache: the feed reads it lazily,
so a rank encodes only what its chunks read (the VAE where the first chunk
is, and for v-prediction where the loss is; the text encoders where a chunk
reads text). Each image is encoded alone with ``pulse_torch.pipeline.encode``,
exactly as ``pulse cache-latents`` (its default ``--batch-size 1``) encodes it,
so the batches are bit for bit those of the cache made with the same seed. Under ``--precision
bf16|fp16`` the encoders are held in that dtype (``pulse.data.frozen_precision``), as diffusers'
training scripts hold them: the arrays are then diffusers' own encodings in that dtype, not the
(fp32) cache's.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pulse.args.bucket_args import bucket_settings

from pulse.data.draws import make_inputs
from pulse.data.image_sets import ImageSet, as_image_set
from pulse.data.pipeline_folder import PipelineError, part_config, read_pipeline, resolution_of
from pulse.data.pipeline_text import recipe_for
from pulse.data.sources import data_input_names
from pulse.spec import ModelSpec
from pulse.zoo.shapes import latent_shape
from pulse.data.buckets import check_backbone
from pulse_torch.cache_buckets import bucket_plan
from pulse_torch.pipeline.bucket_images import image_fits, load_into_bucket, size_conditions
from pulse_torch.pipeline.images import flips, images_hash, load_image, screen_images, size_arrays


class ImageSource:
    """Captioned images of ``images``, encoded by ``pipeline``'s frozen VAE and text encoder(s) on first read."""

    def __init__(self, pipeline: str, images: "str | ImageSet", spec: ModelSpec, seed: int = 0, random_flip: bool = False,
                 device: str = "cpu", precision: str = "fp32",
                 bad_samples: str = "stop", screened: list[str] | None = None, buckets: Any = None) -> None:
        """``buckets``: the run's settings (a ``RunConfig``: ``buckets``, ``min_bucket_reso``, ...; None or
        ``buckets`` False: one square shape): each image in its aspect-ratio bucket, as ``pulse
        cache-latents --buckets`` (``pulse_torch.cache_buckets``) puts it."""
        self.folder = read_pipeline(pipeline, need_encoders=True)
        self.recipe = recipe_for(self.folder)
        # the same samples on every rank: `pulse train` screened the folder (``screened``: the bad ones' keys)
        self.items = screen_images(images, bad_samples, screened).items
        self.sample_shape = tuple(latent_shape(spec))
        self.resolution = self._resolution(spec)
        self._check_inputs(spec)
        self.condition_names = tuple(data_input_names(spec))
        self.num_samples = len(self.items)
        self._flipped = flips(self.num_samples, seed, random_flip)
        self._seed, self._device, self._precision = seed, device, precision
        self.buckets, at = self._bucket(buckets, seed), f"at {self.resolution} px"
        if self.buckets is not None:
            at = f"in {len(self._latents)} buckets {self._bucketing} of {self.resolution} px area"
        self.name = (f"{Path(as_image_set(images).images).name} (on the fly: {self.num_samples} images {at}, "
                     f"images {images_hash(self.items)}, backbone {self.folder.identity()['backbone']})")

    def _bucket(self, config: Any, seed: int) -> np.ndarray | None:
        """Each image's bucket (numbered by size, as the cache numbers them), or None without buckets."""
        settings = bucket_settings(config, self.resolution) if config is not None else None
        if settings is None:
            return None
        _, factor = resolution_of(self.folder)
        check_backbone(self.folder, settings, factor)
        self._fits = image_fits(self.items, settings, seed, config.random_crop)
        buckets, _ = bucket_plan(self._fits, settings, config.random_crop, self.sample_shape[0], factor, 1)
        self._latents = [tuple(shape) for shape in buckets["latents"]]
        self._bucketing = json.dumps(buckets["settings"], sort_keys=True)
        number = {tuple(size): k for k, size in enumerate(buckets["sizes"])}
        self.sample_shape = max(self._latents, key=lambda s: int(np.prod(s)))  # the largest bucket's
        return np.array([number[f.bucket] for f in self._fits], dtype=np.int64)

    def shape_of(self, index: np.ndarray) -> tuple[int, ...]:
        if self.buckets is None:
            return self.sample_shape
        found = np.unique(self.buckets[index])
        if len(found) != 1:
            raise PipelineError(f"one batch asks for images of buckets {found.tolist()}; a batch is drawn from one")
        return self._latents[int(found[0])]

    def _pixels(self, i: int) -> np.ndarray:
        if self.buckets is None:
            return load_image(self.items[i].image, self.resolution, bool(self._flipped[i]))
        return load_into_bucket(self.items[i], self._fits[i], bool(self._flipped[i]))

    def _resolution(self, spec: ModelSpec) -> int:
        _, factor = resolution_of(self.folder)
        channels, height, width = self.sample_shape
        vae_channels = part_config(self.folder.vae).get("latent_channels")
        if vae_channels != channels or height != width:
            raise PipelineError(f"{self.folder.vae}: makes {vae_channels}-channel latents, but model '{spec.name}' "
                                f"takes {self.sample_shape}: train the pipeline's own backbone (--pipeline)")
        return height * factor

    def _check_inputs(self, spec: ModelSpec) -> None:
        """Every model input has an array of its shape (read from the configs: nothing loads here)."""
        expected = make_inputs(spec, 1, np.random.default_rng(0))[1]
        names = data_input_names(spec)
        missing = [n for n in names if n not in self.recipe.inputs]
        if missing:
            raise PipelineError(f"{self.folder.root}: its encoders make {sorted(self.recipe.inputs)}, but model "
                                f"'{spec.name}' reads {names}: train the pipeline's own backbone (--pipeline)")
        made = self._text_shapes()
        for name in (n for n in names if self.recipe.inputs.get(n) in made):
            if made[self.recipe.inputs[name]] != tuple(expected[name].shape[1:]):
                have, need = made[self.recipe.inputs[name]], tuple(expected[name].shape[1:])
                hint = f"plan with --model-option context_len={have[0]}" if len(have) == 2 and \
                    have[1:] == need[1:] else "train the pipeline's own backbone (--pipeline)"
                raise PipelineError(f"{self.folder.root}: its text encoders make '{self.recipe.inputs[name]}' of "
                                    f"{have} per caption but model '{spec.name}' takes {need} for '{name}': {hint}")

    def _text_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each text array's per-caption shape, from the configs: (tokens, width) of a hidden state (widths
        summed where encodings are concatenated), (projection,) of a pooled one."""
        shapes: dict[str, tuple[int, ...]] = {}
        for enc in self.recipe.texts:
            tokens = enc.max_length or part_config(self.folder.tokenizers[enc.index],
                                                   "tokenizer_config.json").get("model_max_length")
            config = part_config(self.folder.text_encoders[enc.index])
            width = config.get("hidden_size") or config.get("d_model")
            joined = shapes.get(enc.hidden)
            shapes[enc.hidden] = (tokens, width) if joined is None else (joined[0], joined[1] + width)
            if enc.pooled is not None:
                shapes[enc.pooled] = (config.get("projection_dim"),)
        return shapes

    @property
    def encoder(self):
        if not hasattr(self, "_encoder"):
            from pulse_torch.pipeline.encode import Encoder

            self._encoder = Encoder(self.folder, "mean", self._seed, self._device, self._precision)
        return self._encoder

    def latents(self, index: np.ndarray) -> np.ndarray:
        rows = [self.encoder.latents(self._pixels(int(i))[None], int(i)) for i in index]
        return np.concatenate(rows)

    def _as_inputs(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {n: arrays[a] for n, a in self.recipe.inputs.items() if a in arrays and n in self.condition_names}

    def conditions(self, index: np.ndarray) -> dict[str, np.ndarray]:
        per_image = [self.encoder.text([self.items[i].caption]) for i in index]
        arrays = {k: np.concatenate([p[k] for p in per_image]) for k in per_image[0]}
        arrays.update(size_arrays(self.items, index, self.resolution, self.recipe) if self.buckets is None
                      else size_conditions([self._fits[i] for i in index], self.recipe))
        return self._as_inputs(arrays)

    def has_empty_prompt(self) -> bool:
        return True  # the text encoders are there: "" is encoded when first needed

    def empty_conditions(self) -> dict[str, np.ndarray]:
        return self._as_inputs(self.encoder.text([""]))
