"""Captioned images in diffusers' ImageFolder convention, as the pipeline's VAE takes them.

::

    DIR/metadata.jsonl    {"file_name": "a.png", "text": "a caption"} per line (diffusers' ImageFolder), or
    DIR/a.png + a.txt     the caption in a same-named .txt beside each image
        │ screen_images (pulse.data.captioned_images): sorted by file name; a bad sample (no caption, a
        │   line that is not JSON, an image PIL cannot decode) stops it in one line, or is skipped
        ▼
    load_image: RGB, shorter side resized to the resolution (bicubic), center-cropped to a square,
                optionally flipped left-right, scaled to [-1, 1] as (3, R, R) float32 (what
                diffusers' train_text_to_image feeds its VAE)
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import BinaryIO

import numpy as np

# the listing is framework-free (`pulse train` screens the folder before launch): these names stay importable here
from pulse.data.captioned_images import (IMAGE_SUFFIXES, METADATA, Captioned, ImageDataError,  # noqa: F401
                                         check_images, list_images, screen_images)


def load_image(path: Path | BinaryIO, resolution: int, flip: bool = False) -> np.ndarray:
    """(3, resolution, resolution) float32 in [-1, 1]; a file PIL cannot decode is one line naming it.
    ``path``: a file, or a sample's bytes (``Captioned.image``: one in a dataset or a tar shard)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            rgb = image.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageDataError(f"{path}: cannot read the image ({type(exc).__name__}: {exc}); replace or remove "
                             "it") from None
    w, h = rgb.size
    scale = resolution / min(w, h)
    size = (max(resolution, round(w * scale)), max(resolution, round(h * scale)))
    rgb = rgb.resize(size, Image.Resampling.BICUBIC)
    left, top = (size[0] - resolution) // 2, (size[1] - resolution) // 2
    rgb = rgb.crop((left, top, left + resolution, top + resolution))
    if flip:
        rgb = rgb.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    pixels = np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1) / 127.5 - 1.0
    return np.ascontiguousarray(pixels)


def images_hash(items: list[Captioned]) -> str:
    """Which image set (names, captions, sizes): part of a cache's and a run's identity."""
    rows = [[i.key, i.caption, i.content_identity()] for i in items]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def flips(count: int, seed: int, enabled: bool) -> np.ndarray:
    """Which images are flipped left-right: seeded per image, so the cache and on-the-fly encoding agree."""
    if not enabled:
        return np.zeros(count, bool)
    return np.array([np.random.default_rng([seed, i]).random() < 0.5 for i in range(count)])


def size_arrays(items: list[Captioned], index, resolution: int, recipe) -> dict[str, np.ndarray]:
    """The per-image size conditions ``recipe`` (a ``pulse.data.pipeline_text.EncodingRecipe``) asks for, from
    each image's original size: Hunyuan-DiT's ``image_meta_size`` (B, 6) float32 and ``style`` (B,) int64 (0),
    SDXL's ``time_ids`` (B, 6) float32; {} for none. Only the file headers are read."""
    from PIL import Image

    from pulse.data.pipeline_text import IMAGE_META, STYLE, TIME_IDS, image_meta, sdxl_time_ids

    if not (recipe.image_meta or recipe.time_ids):
        return {}
    rows = []
    for i in index:
        with Image.open(items[i].image) as image:
            w, h = image.size
        rows.append((image_meta if recipe.image_meta else sdxl_time_ids)((h, w), resolution))
    if recipe.time_ids:
        return {TIME_IDS: np.array(rows, np.float32)}
    return {IMAGE_META: np.array(rows, np.float32), STYLE: np.zeros(len(rows), np.int64)}
