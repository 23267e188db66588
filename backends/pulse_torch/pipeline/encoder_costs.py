"""`pulse profile --pipeline DIR`: the frozen encoders' seconds per microbatch, for the cost table.

Timed as the runtime runs an encode action: an E action of the ``StageExecutor``
(``pulse.runtime.encode_actions``) on an ``ImageSource``, each microbatch's encodes
followed by the whole model's forward and backward, one chunk per layer::

    step:  E text m0, E vae m0 | F layer 0 .. F layer n-1 | B layer n-1 .. B layer 0

so each figure holds what the action really does (image decoding and resizing,
tokenizing, the encoder's forward, the array conversions) and runs with the
caches the backbone's work leaves behind, on every rank at once like the
layers. Medians over repeats after warm-ups. Images: ``--images DIR`` (the
user's own, decoded as in training), else synthetic PNGs at the pipeline's
resolution. Names are ``pipeline_encoders``' ("text", "vae").
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pulse.data.pipeline_folder import MODEL_INDEX, read_pipeline, resolution_of
from pulse.data.pipeline_text import SD_RECIPE, SDXL_RECIPE, pipeline_encoders, recipe_for
from pulse.encoders import EncoderSet
from pulse.spec import ModelSpec
from pulse.zoo.diffusers_config import PREFIX

CAPTION = "a photo of a cat sitting on a wooden table"  # padded to the tokenizer's length either way


def pipeline_root(model: str) -> Path | None:
    """The SD-style or SDXL pipeline folder whose UNet ``model`` is (in-pipeline encoding's case), else None."""
    if not model.startswith(PREFIX):
        return None
    root = Path(model[len(PREFIX):]).parent
    if not (root / MODEL_INDEX).is_file():
        return None
    folder = read_pipeline(root)
    if folder.vae is None or not folder.text_encoders or recipe_for(folder) not in (SD_RECIPE, SDXL_RECIPE):
        return None
    return root


def synthetic_images(folder: Path, resolution: int, count: int = 4) -> Path:
    """``count`` random RGB PNGs of ``resolution`` px, captioned (``metadata.jsonl``)."""
    import json

    from PIL import Image

    rng = np.random.default_rng(0)
    rows = []
    for i in range(count):
        name = f"profile{i}.png"
        Image.fromarray(rng.integers(0, 256, (resolution, resolution, 3), dtype=np.uint8)).save(folder / name)
        rows.append(json.dumps({"file_name": name, "text": CAPTION}))
    (folder / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    return folder


def encoder_seconds(model: str, spec: ModelSpec, images: str | None,
                    time_encodes: Callable[[Any, EncoderSet], dict[int, float]]) -> tuple[tuple[str, float], ...]:
    """(("text", s), ("vae", s)) for a UNet inside an SD-style or SDXL pipeline folder; () for any other model.
    ``time_encodes(source, encoders)``: seconds per encoder index, timed on that source."""
    root = pipeline_root(model)
    if root is None:
        return ()
    from pulse_torch.pipeline.onthefly import ImageSource

    encoders = EncoderSet(pipeline_encoders(read_pipeline(root)), "before")
    with tempfile.TemporaryDirectory(prefix="pulse-profile-images-") as tmp:
        folder = images or str(synthetic_images(Path(tmp), resolution_of(read_pipeline(root))[0]))
        seconds = time_encodes(ImageSource(str(root), folder, spec), encoders)
    return tuple((enc.name, seconds[e]) for e, enc in enumerate(encoders.encoders))
