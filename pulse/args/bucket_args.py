"""The aspect-ratio bucket flags (kohya-ss sd-scripts' meanings: ``pulse.data.buckets``), for
`pulse cache-latents` (the cache records the buckets; `pulse train --data CACHE` trains in them)."""
from __future__ import annotations

import argparse

from pulse.args.parser import int_between
from pulse.data.buckets import BucketSettings
from pulse.errors import PulseError


def add_bucket_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--buckets", action="store_true",
                        help="aspect-ratio buckets (kohya's --enable_bucket): each image resized to cover the bucket "
                             "nearest its aspect ratio at the --resolution area and cropped into it, instead of a "
                             "center-cropped square")
    parser.add_argument("--min-bucket-reso", type=int_between(8, 16384), default=256,
                        help="--buckets: the shortest bucket side in pixels (default 256)")
    parser.add_argument("--max-bucket-reso", type=int_between(8, 16384), default=1024,
                        help="--buckets: the longest bucket side in pixels (default 1024)")
    parser.add_argument("--bucket-reso-steps", type=int_between(8, 4096), default=64,
                        help="--buckets: every bucket side a multiple of this many pixels (default 64; a multiple "
                             "of the VAE's 8)")
    parser.add_argument("--bucket-no-upscale", action="store_true",
                        help="--buckets: no bucket list: each image's own size (shrunk to the area if larger) floored "
                             "to the step, never enlarged")
    parser.add_argument("--random-crop", action="store_true",
                        help="--buckets: crop at a random offset (seeded per image by --seed) instead of the center")


BUCKET_ONLY = ("min_bucket_reso", "max_bucket_reso", "bucket_reso_steps", "bucket_no_upscale", "random_crop")
DEFAULTS = {"min_bucket_reso": 256, "max_bucket_reso": 1024, "bucket_reso_steps": 64, "bucket_no_upscale": False,
            "random_crop": False}


def bucket_settings(args: argparse.Namespace, resolution: int) -> BucketSettings | None:
    """The run's buckets (checked: one line for settings that make none), None without --buckets; a bucket
    flag given without --buckets is refused rather than ignored."""
    value = {n: DEFAULTS[n] if getattr(args, n, None) is None else getattr(args, n) for n in BUCKET_ONLY}
    if not getattr(args, "buckets", False):  # (pulse train's flags are None when not given)
        given = [f"--{n.replace('_', '-')}" for n in BUCKET_ONLY if value[n] != DEFAULTS[n]]
        if given:
            raise PulseError(f"{given[0]} applies to aspect-ratio buckets: add --buckets, or leave it out")
        return None
    return BucketSettings(resolution, value["min_bucket_reso"], value["max_bucket_reso"], value["bucket_reso_steps"],
                          value["bucket_no_upscale"]).check()
