"""Images into their buckets: pixels resized to cover the bucket and cropped at the fit's offsets, and the
size conditions SDXL and Hunyuan-DiT read taken from that same crop."""
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

from pulse.data.buckets import BucketSettings, fit_image  # noqa: E402
from pulse.data.captioned_images import Captioned  # noqa: E402
from pulse.data.pipeline_text import SD_RECIPE, SDXL_RECIPE  # noqa: E402
from pulse_torch.pipeline.bucket_images import image_fits, load_into_bucket, size_conditions  # noqa: E402

SETTINGS = BucketSettings(64, 32, 128, 8)  # target area 64x64 px, sides 32..128 in steps of 8


def picture(folder: Path, name: str, size: tuple[int, int], seed: int) -> Captioned:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(folder / name)
    return Captioned(folder / name, name)


def test_pixels_are_the_covering_resize_cropped_at_the_fit(tmp_path):
    items = [picture(tmp_path, "wide.png", (150, 61), 0), picture(tmp_path, "tall.png", (40, 97), 1),
             picture(tmp_path, "square.png", (64, 64), 2)]
    for random_crop in (False, True):
        fits = image_fits(items, SETTINGS, seed=3, random_crop=random_crop)
        assert fits == image_fits(items, SETTINGS, seed=3, random_crop=random_crop)  # seeded: cache = on the fly
        for item, fit in zip(items, fits):
            assert fit.bucket == fit_image(fit.original, SETTINGS).bucket
            got = load_into_bucket(item, fit)
            bw, bh = fit.bucket
            assert got.shape == (3, bh, bw) and got.dtype == np.float32
            resized = np.asarray(Image.open(item.path).convert("RGB").resize(fit.resized, Image.Resampling.BICUBIC))
            left, top = fit.crop
            want = resized[top:top + bh, left:left + bw].transpose(2, 0, 1).astype(np.float32) / 127.5 - 1.0
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(load_into_bucket(item, fit, flip=True), got[:, :, ::-1])
    wide = image_fits(items[:1], SETTINGS, 0, False)[0]
    assert wide.bucket[0] > wide.bucket[1] and wide.crop[0] > 0  # the wide image lost columns, centered


def test_size_conditions_come_from_each_fit(tmp_path):
    items = [picture(tmp_path, "a.png", (150, 61), 0), picture(tmp_path, "b.png", (40, 97), 1)]
    fits = image_fits(items, SETTINGS, seed=0, random_crop=True)
    time_ids = size_conditions(fits, SDXL_RECIPE)["time_ids"]
    for row, fit in zip(time_ids, fits):  # diffusers: original (h, w) + crop (top, left) + target (h, w)
        (w, h), (left, top), (bw, bh) = fit.original, fit.crop, fit.bucket
        assert row.tolist() == [h, w, top, left, bh, bw]
    assert size_conditions(fits, SD_RECIPE) == {}
