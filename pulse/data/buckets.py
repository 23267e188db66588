"""Aspect-ratio buckets: which (width, height) an image trains at, and how it is resized and cropped into it.

kohya-ss sd-scripts' meanings (``library/model_util.py make_bucket_resolutions``,
``library/train_util.py BucketManager.select_bucket`` / ``trim_and_resize_if_required``)::

    --resolution R        the target area R*R pixels (kohya's max_reso (R, R))
    --min-bucket-reso     the shortest side a bucket may have (default 256)
    --max-bucket-reso     the longest side a bucket may have (default 1024)
    --bucket-reso-steps   every side a multiple of it (default 64)
    --bucket-no-upscale   no list: an image's own size, shrunk to the area if larger, floored to the step

    image (w, h) ──select──▶ bucket (bw, bh): the listed bucket nearest w/h (a listed size itself first)
                 ──resize──▶ (rw, rh) covering the bucket, aspect kept (bicubic)
                 ──crop────▶ (bw, bh) at (left, top): centered (trim // 2) or seeded per image

The conditions SDXL and Hunyuan-DiT read come from the real sizes and this crop, as diffusers'
``train_text_to_image_sdxl.py`` computes them (original size, the crop's top-left in the resized
image, target size); kohya's own ``get_crop_ltrb`` reports a different box (the image fitted inside
the bucket), which is not what the pixels went through. Framework-free: the planner, the cache and
on-the-fly encoding share it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pulse.data.pipeline_folder import part_config
from pulse.errors import PulseError

VAE_FACTOR = 8  # pixels per latent: every bucket side must divide into latents


class BucketError(PulseError):
    """Bucket settings that cannot make buckets."""


@dataclass(frozen=True)
class BucketSettings:
    resolution: int  # target area resolution**2 pixels
    min_reso: int = 256
    max_reso: int = 1024
    step: int = 64
    no_upscale: bool = False

    def check(self) -> "BucketSettings":
        """Refuse settings that make no buckets or buckets the VAE cannot encode, in one line."""
        if min(self.resolution, self.min_reso, self.max_reso, self.step) <= 0:
            raise BucketError(f"buckets: resolution {self.resolution}, --min-bucket-reso {self.min_reso}, "
                              f"--max-bucket-reso {self.max_reso} and --bucket-reso-steps {self.step} must all be "
                              "positive")
        if self.step % VAE_FACTOR:
            raise BucketError(f"--bucket-reso-steps {self.step}: every bucket side must be a multiple of the VAE's "
                              f"{VAE_FACTOR} pixels; give a multiple of {VAE_FACTOR} (kohya's default is 64)")
        if self.min_reso > self.max_reso:
            raise BucketError(f"--min-bucket-reso {self.min_reso} is above --max-bucket-reso {self.max_reso}; "
                              "give a minimum at most the maximum")
        if not self.min_reso <= self.resolution <= self.max_reso:
            raise BucketError(f"resolution {self.resolution} does not fit between --min-bucket-reso {self.min_reso} "
                              f"and --max-bucket-reso {self.max_reso}; widen them or change the resolution")
        if self.resolution < self.step:
            raise BucketError(f"resolution {self.resolution} is below --bucket-reso-steps {self.step}: no bucket "
                              "side fits; give a smaller step")
        return self

    @property
    def area(self) -> int:
        return self.resolution * self.resolution


@dataclass(frozen=True)
class Fit:
    """One image's way into its bucket: sizes are (width, height) as PIL gives them."""

    original: tuple[int, int]
    bucket: tuple[int, int]
    resized: tuple[int, int]
    crop: tuple[int, int]  # (left, top) in the resized image

    def sdxl_time_ids(self) -> list[float]:
        """SDXL's add_time_ids: original (h, w), crop (top, left), target (h, w)."""
        (w, h), (left, top), (bw, bh) = self.original, self.crop, self.bucket
        return [float(h), float(w), float(top), float(left), float(bh), float(bw)]

    def image_meta(self) -> list[float]:
        """Hunyuan-DiT's image_meta_size: original (h, w), target (h, w), crop (top, left)."""
        (w, h), (left, top), (bw, bh) = self.original, self.crop, self.bucket
        return [float(h), float(w), float(bh), float(bw), float(top), float(left)]


def bucket_resolutions(settings: BucketSettings) -> list[tuple[int, int]]:
    """kohya's ``make_bucket_resolutions``: the square at the area, then every width from the minimum side
    in steps with the height filling the area (capped at the maximum side), both ways round; sorted."""
    div, area = settings.step, settings.area
    side = int(math.sqrt(area) // div) * div
    resos = {(side, side)}
    width = settings.min_reso
    while width <= settings.max_reso:
        height = min(settings.max_reso, int((area // width) // div) * div)
        if height >= settings.min_reso:
            resos.update({(width, height), (height, width)})
        width += div
    return sorted(resos)


def _round_to_step(x: float, step: int) -> int:
    rounded = int(x + 0.5)
    return rounded - rounded % step


def _covering_resize(size: tuple[int, int], bucket: tuple[int, int]) -> tuple[int, int]:
    """The aspect-keeping size whose shorter fit matches the bucket (kohya: match height when wider)."""
    w, h = size
    scale = bucket[1] / h if w / h > bucket[0] / bucket[1] else bucket[0] / w
    return int(w * scale + 0.5), int(h * scale + 0.5)


def _shrunk_to_area(size: tuple[int, int], settings: BucketSettings) -> tuple[int, int]:
    """--bucket-no-upscale: an image larger than the area shrunk to it, one side on the step, whichever
    rounding keeps the aspect ratio closer (kohya's rule)."""
    w, h = size
    if w * h <= settings.area:
        return size
    aspect = w / h
    width = math.sqrt(settings.area * aspect)
    height = settings.area / width
    by_width = _round_to_step(width, settings.step)
    ar_by_width = by_width / _round_to_step(by_width / aspect, settings.step)
    by_height = _round_to_step(height, settings.step)
    ar_by_height = _round_to_step(by_height * aspect, settings.step) / by_height
    if abs(ar_by_width - aspect) < abs(ar_by_height - aspect):
        return by_width, int(by_width / aspect + 0.5)
    return int(by_height * aspect + 0.5), by_height


def select_bucket(size: tuple[int, int], settings: BucketSettings,
                  resos: list[tuple[int, int]] | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
    """(bucket, resized size) of an image of ``size`` (kohya's ``select_bucket``)."""
    if settings.no_upscale:
        resized = _shrunk_to_area(size, settings)
        bucket = (resized[0] - resized[0] % settings.step, resized[1] - resized[1] % settings.step)
        if min(bucket) == 0:
            raise BucketError(f"an image of {size[0]}x{size[1]} is smaller than --bucket-reso-steps "
                              f"{settings.step} on a side: with --bucket-no-upscale it fits no bucket; remove it "
                              "or give a smaller step")
        return bucket, resized
    resos = resos if resos is not None else bucket_resolutions(settings)
    if size in resos:
        bucket = size
    else:
        errors = np.abs(np.array([w / h for w, h in resos]) - size[0] / size[1])
        bucket = resos[int(errors.argmin())]
    return bucket, _covering_resize(size, bucket)


def crop_offsets(resized: tuple[int, int], bucket: tuple[int, int], draw: np.random.Generator | None) -> tuple[int, int]:
    """(left, top) of the bucket in the resized image: centered (kohya's ``trim // 2``), or drawn
    uniformly from every offset (kohya's ``random.randint(0, trim)``) with ``draw``, width first."""
    offsets = []
    for have, want in zip(resized, bucket):
        trim = have - want
        offsets.append(0 if trim <= 0 else int(draw.integers(0, trim + 1)) if draw is not None else trim // 2)
    return offsets[0], offsets[1]


def fit_image(size: tuple[int, int], settings: BucketSettings, draw: np.random.Generator | None = None,
              resos: list[tuple[int, int]] | None = None) -> Fit:
    """Where an image of ``size`` (width, height) trains: its bucket, resized size and crop."""
    bucket, resized = select_bucket(size, settings, resos)
    return Fit(size, bucket, resized, crop_offsets(resized, bucket, draw))


def check_backbone(folder, settings: BucketSettings, factor: int) -> None:
    """Buckets train UNets (their layers take any grid whose sides halve down every level); a DiT's
    position tables are for one square grid."""
    if folder.backbone_name != "unet":
        raise PulseError(f"--buckets: {folder.root}'s backbone is {folder.backbone_name}/, whose position tables "
                         "are for one square grid; aspect-ratio buckets train UNet pipelines (SD, SDXL)")
    levels = len(part_config(folder.backbone)["block_out_channels"]) - 1
    need = factor * 2 ** levels
    if settings.step % need:
        raise PulseError(f"--bucket-reso-steps {settings.step}: this UNet halves its latent {levels} time(s) after "
                         f"the VAE's {factor}x, so every bucket side must be a multiple of {need} pixels; give a "
                         f"multiple of {need}")
