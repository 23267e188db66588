"""Aspect-ratio buckets against kohya-ss sd-scripts' own code (tests/kohya_buckets_reference.py, verbatim)."""
import random

import numpy as np
import pytest

from pulse.data.buckets import BucketError, BucketSettings, bucket_resolutions, crop_offsets, fit_image, select_bucket
from pulse.train.sampler import seeded

import kohya_buckets_reference as kohya  # noqa: E402  (tests/ is on the path)

SETTINGS = [BucketSettings(1024), BucketSettings(512), BucketSettings(768, 320, 1536, 32),
            BucketSettings(1024, 512, 2048, 128), BucketSettings(256, 64, 512, 8)]


def _sizes(count: int, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return [(int(w), int(h)) for w, h in rng.integers(40, 3000, size=(count, 2))]


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
def test_bucket_list_is_kohyas(settings):
    expected = kohya.make_bucket_resolutions((settings.resolution, settings.resolution), settings.min_reso,
                                             settings.max_reso, settings.step)
    assert bucket_resolutions(settings) == expected
    assert all(w % settings.step == 0 and h % settings.step == 0 for w, h in expected)


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
@pytest.mark.parametrize("no_upscale", [False, True])
def test_selection_and_resize_are_kohyas(settings, no_upscale):
    settings = BucketSettings(settings.resolution, settings.min_reso, settings.max_reso, settings.step, no_upscale)
    manager = kohya.BucketManager(no_upscale, (settings.resolution,) * 2, settings.min_reso, settings.max_reso,
                                  settings.step)
    manager.make_buckets()
    resos = bucket_resolutions(settings)
    sizes = _sizes(300, settings.resolution) + resos[:5] + [(settings.resolution,) * 2]  # listed sizes too
    for size in sizes:
        try:
            bucket, resized, _ = manager.select_bucket(*size)
        except ZeroDivisionError:  # kohya makes a zero-height bucket and fails; PULSE refuses the image
            bucket = resized = (0, 0)
        if min(bucket) == 0:  # a zero-sized bucket: PULSE refuses the image in one line
            with pytest.raises(BucketError, match="smaller than --bucket-reso-steps"):
                select_bucket(size, settings, resos)
            continue
        assert select_bucket(size, settings, resos) == (tuple(bucket), tuple(resized)), size
        # the resized image covers its bucket: a crop, never padding
        assert resized[0] >= bucket[0] and resized[1] >= bucket[1]


def test_center_crop_is_kohyas_trim():
    settings = BucketSettings(512)
    for size in _sizes(200, 1):
        fit = fit_image(size, settings)
        assert fit.crop == kohya.trim_offsets(False, fit.resized, fit.bucket)


def test_random_crop_is_seeded_and_covers_every_offset():
    resized, bucket = (520, 384), (512, 384)
    offsets = {crop_offsets(resized, bucket, seeded(7, "crop", i)) for i in range(400)}
    assert offsets == {(x, 0) for x in range(9)}  # kohya's randint(0, trim): both ends included
    random.seed(0)
    assert {kohya.trim_offsets(True, resized, bucket) for _ in range(400)} == offsets
    again = [crop_offsets(resized, bucket, seeded(7, "crop", i)) for i in range(20)]
    assert again == [crop_offsets(resized, bucket, seeded(7, "crop", i)) for i in range(20)]


def test_time_ids_and_image_meta_from_real_sizes_and_crop():
    # 1200 x 600 at 512: the nearest bucket (704, 320) is wider than 2:1, so the width is matched and
    # the height cropped
    fit = fit_image((1200, 600), BucketSettings(512))
    assert fit.bucket == (704, 320) and fit.resized == (704, 352)  # kohya's numbers (checked above too)
    assert fit.crop == (0, 16)
    assert fit.sdxl_time_ids() == [600.0, 1200.0, 16.0, 0.0, 320.0, 704.0]  # (h, w), (top, left), (h, w)
    assert fit.image_meta() == [600.0, 1200.0, 320.0, 704.0, 16.0, 0.0]  # (h, w), target (h, w), (top, left)


@pytest.mark.parametrize("settings, words", [
    (BucketSettings(512, 768, 640), "above --max-bucket-reso"),
    (BucketSettings(512, step=60), "multiple of the VAE's 8"),
    (BucketSettings(2048), "does not fit"),
    (BucketSettings(128), "does not fit"),
    (BucketSettings(512, step=0), "positive"),
])
def test_bad_settings_are_one_line(settings, words):
    with pytest.raises(BucketError, match=words) as caught:
        settings.check()
    assert "\n" not in str(caught.value)


def test_no_upscale_refuses_an_image_below_the_step():
    with pytest.raises(BucketError, match="smaller than --bucket-reso-steps"):
        select_bucket((40, 300), BucketSettings(512, no_upscale=True))
