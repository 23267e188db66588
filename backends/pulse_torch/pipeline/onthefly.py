"""``pulse train --pipeline DIR --images DIR``: captioned images encoded while training, no cache.

::

    ImageSource.latents(index)     load_image (resize, crop, seeded flip) ─ vae.encode ─ (B, C, h, w)
    ImageSource.conditions(index)  caption ─ tokenizer ─ text_encoder ─ {"context": (B, L, D)}

A ``pulse.data.sources.LatentSource`` like a cache: the feed reads it lazily,
so a rank encodes only what its chunks read (the VAE where the first chunk
is, and for v-prediction where the loss is; the text encoder where a chunk
cross-attends). Each image is encoded alone with ``pulse_torch.pipeline.encode``,
exactly as ``pulse cache-latents`` (its default ``--batch-size 1``) encodes it,
so the batches are bit for bit those of the cache made with the same seed.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pulse.data.pipeline_folder import PipelineError, part_config, read_pipeline, resolution_of
from pulse.data.shards import TEXT_INPUT
from pulse.data.draws import make_inputs
from pulse.data.sources import data_input_names
from pulse.errors import PulseError
from pulse.spec import ModelSpec
from pulse.zoo.shapes import latent_shape
from pulse_torch.pipeline.images import check_images, flips, images_hash, list_images, load_image


class ImageSource:
    """Captioned images of ``images``, encoded by ``pipeline``'s frozen VAE and text encoder on first read."""

    def __init__(self, pipeline: str, images: str, spec: ModelSpec, seed: int = 0, random_flip: bool = False,
                 device: str = "cpu") -> None:
        self.folder = read_pipeline(pipeline, need_encoders=True)
        self.items = list_images(images)
        check_images(self.items)
        self.sample_shape = tuple(latent_shape(spec))
        self.resolution = self._resolution(spec)
        self._check_text(spec)
        self.condition_names = (TEXT_INPUT,)
        self.num_samples = len(self.items)
        self._flipped = flips(self.num_samples, seed, random_flip)
        self._seed, self._device = seed, device
        self.name = (f"{Path(images).name} (on the fly: {self.num_samples} images at {self.resolution} px, "
                     f"images {images_hash(self.items)}, backbone {self.folder.identity()['backbone']})")

    def _resolution(self, spec: ModelSpec) -> int:
        _, factor = resolution_of(self.folder)
        channels, height, width = self.sample_shape
        vae_channels = part_config(self.folder.vae).get("latent_channels")
        if vae_channels != channels or height != width:
            raise PipelineError(f"{self.folder.vae}: makes {vae_channels}-channel latents, but model '{spec.name}' "
                                f"takes {self.sample_shape}: train the pipeline's own backbone (--pipeline)")
        return height * factor

    def _check_text(self, spec: ModelSpec) -> None:
        names = data_input_names(spec)
        if names != [TEXT_INPUT]:
            raise PulseError(f"--images: model '{spec.name}' reads {names}, not a UNet's text '{TEXT_INPUT}': "
                             "on-the-fly encoding supports SD-style UNet pipelines")
        want = tuple(make_inputs(spec, 1, np.random.default_rng(0))[1][TEXT_INPUT].shape[1:])
        tokens = part_config(self.folder.tokenizers[0], "tokenizer_config.json").get("model_max_length")
        width = part_config(self.folder.text_encoders[0]).get("hidden_size")
        if (tokens, width) != want:
            raise PipelineError(f"{self.folder.text_encoders[0]}: encodes captions as ({tokens}, {width}) (tokens, "
                                f"width) but model '{spec.name}' takes {want}: plan with --model-option "
                                f"context_len={tokens}")

    @property
    def encoder(self):
        if not hasattr(self, "_encoder"):
            from pulse_torch.pipeline.encode import Encoder

            self._encoder = Encoder(self.folder, "mean", self._seed, self._device)
        return self._encoder

    def latents(self, index: np.ndarray) -> np.ndarray:
        rows = [self.encoder.latents(load_image(self.items[i].path, self.resolution, bool(self._flipped[i]))[None],
                                     int(i)) for i in index]
        return np.concatenate(rows)

    def conditions(self, index: np.ndarray) -> dict[str, np.ndarray]:
        return {TEXT_INPUT: np.concatenate([self.encoder.text([self.items[i].caption])[0] for i in index])}

    def empty_conditions(self) -> dict[str, np.ndarray]:
        return {TEXT_INPUT: self.encoder.text([""])[0]}

