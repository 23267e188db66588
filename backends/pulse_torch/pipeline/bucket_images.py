"""Captioned images into aspect-ratio buckets (``pulse.data.buckets``), as the pipeline's VAE takes them.

::

    image_fits:        each image's header size ─ fit_image: bucket, resized size, crop (center, or
                       seeded per image: seeded(seed, "crop", i), so the cache and on-the-fly agree)
    load_into_bucket:  RGB ─ resize to fit.resized (bicubic) ─ crop fit.bucket at fit.crop ─ flip?
                       ─ (3, bucket h, bucket w) float32 in [-1, 1]
    size_conditions:   SDXL's time_ids / Hunyuan-DiT's image_meta_size and style from each fit
                       (the real original size, crop and bucket), as ``images.size_arrays`` does for squares
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from pulse.data.buckets import BucketSettings, Fit, bucket_resolutions, fit_image
from pulse.data.captioned_images import Captioned, ImageDataError
from pulse.train.sampler import seeded


def _source(item: Captioned) -> Any:
    """What PIL opens: the item's file, or its bytes where it lives in a dataset or tar shard."""
    return item.image if hasattr(type(item), "image") else item.path


def image_size(item: Captioned) -> tuple[int, int]:
    """(width, height) from the image's header alone."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(_source(item)) as image:
            return image.size
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise ImageDataError(f"{getattr(item, 'where', item.path)}: cannot read the image "
                             f"({type(exc).__name__}: {exc}); replace or remove it") from None


def image_fits(items: Sequence[Captioned], settings: BucketSettings, seed: int, random_crop: bool) -> list[Fit]:
    """Each image's bucket, resized size and crop (kohya's rules), the crop seeded per image."""
    settings.check()
    resos = None if settings.no_upscale else bucket_resolutions(settings)
    return [fit_image(image_size(item), settings, seeded(seed, "crop", i) if random_crop else None, resos)
            for i, item in enumerate(items)]


def load_into_bucket(item: Captioned, fit: Fit, flip: bool = False) -> np.ndarray:
    """(3, bucket height, bucket width) float32 in [-1, 1]: resized to cover the bucket, cropped into it."""
    from PIL import Image

    path = getattr(item, "where", item.path)
    with Image.open(_source(item)) as image:
        image.load()
        rgb = image.convert("RGB")
    if rgb.size != fit.original:
        raise ImageDataError(f"{path}: the image is {rgb.size[0]}x{rgb.size[1]} now, but was "
                             f"{fit.original[0]}x{fit.original[1]} when its bucket was chosen; start again")
    if rgb.size != fit.resized:
        rgb = rgb.resize(fit.resized, Image.Resampling.BICUBIC)
    left, top = fit.crop
    rgb = rgb.crop((left, top, left + fit.bucket[0], top + fit.bucket[1]))
    if flip:
        rgb = rgb.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.ascontiguousarray(np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1) / 127.5 - 1.0)


def size_conditions(fits: Sequence[Fit], recipe) -> dict[str, np.ndarray]:
    """The per-image size conditions ``recipe`` (``pulse.data.pipeline_text.EncodingRecipe``) asks for."""
    from pulse.data.pipeline_text import IMAGE_META, STYLE, TIME_IDS

    if recipe.time_ids:
        return {TIME_IDS: np.array([f.sdxl_time_ids() for f in fits], np.float32)}
    if recipe.image_meta:
        return {IMAGE_META: np.array([f.image_meta() for f in fits], np.float32),
                STYLE: np.zeros(len(fits), np.int64)}
    return {}
