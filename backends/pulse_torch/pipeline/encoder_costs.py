"""`pulse profile --pipeline DIR`: the frozen encoders' forward seconds per microbatch, for the cost table.

What an encode action runs (``pulse_torch.pipeline.onthefly``): each sample alone through the
text encoder and the VAE, ``microbatch_size`` of them; median over repeats after one warm-up.
Image decoding is not included (synthetic pixels). Names are ``pipeline_encoders``' ("text", "vae").
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from pulse.data.pipeline_folder import MODEL_INDEX, read_pipeline, resolution_of
from pulse.data.pipeline_text import SD_RECIPE, recipe_for
from pulse.zoo.diffusers_config import PREFIX


def encoder_seconds(model: str, microbatch_size: int, repeats: int) -> tuple[tuple[str, float], ...]:
    """(("text", s), ("vae", s)) for a UNet inside an SD-style pipeline folder; () for any other model."""
    if not model.startswith(PREFIX):
        return ()
    root = Path(model[len(PREFIX):]).parent
    if not (root / MODEL_INDEX).is_file():
        return ()
    folder = read_pipeline(root)
    if folder.vae is None or not folder.text_encoders or recipe_for(folder) is not SD_RECIPE:
        return ()
    from pulse_torch.pipeline.encode import Encoder

    encoder = Encoder(folder)
    resolution, _ = resolution_of(folder)
    pixels = np.random.default_rng(0).uniform(-1, 1, (1, 3, resolution, resolution)).astype(np.float32)

    def median_time(run) -> float:
        run()  # loads the encoder, warms its kernels
        times = []
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    text = median_time(lambda: [encoder.text(["a photo of a cat"]) for _ in range(microbatch_size)])
    vae = median_time(lambda: [encoder.latents(pixels, i) for i in range(microbatch_size)])
    return (("text", text), ("vae", vae))
