"""The aspect-ratio bucket flags (kohya-ss sd-scripts' meanings: ``pulse.data.buckets``), defined once for
`pulse cache-latents` (the cache records the buckets; `pulse train --data CACHE` trains in them) and
`pulse train --images`."""
from __future__ import annotations

import argparse
from typing import Any

from pulse.args.parser import int_between
from pulse.data.buckets import BucketSettings
from pulse.errors import PulseError

BUCKET_ONLY = ("min_bucket_reso", "max_bucket_reso", "bucket_reso_steps", "bucket_no_upscale", "random_crop")
DEFAULTS = {"min_bucket_reso": 256, "max_bucket_reso": 1024, "bucket_reso_steps": 64, "bucket_no_upscale": False,
            "random_crop": False}


def bucket_flags(with_defaults: bool) -> list[tuple[str, dict[str, Any]]]:
    """(flag, argparse kwargs) of each, for `pulse cache-latents` and `pulse train`; ``with_defaults``: the
    defaults set here (`pulse cache-latents`), else None (`pulse train`: run.yaml's or RunConfig's)."""
    def default(name: str) -> dict[str, Any]:
        return {"default": DEFAULTS[name]} if with_defaults else {}

    return [
        ("--buckets", dict(action="store_true",
                           help="aspect-ratio buckets (kohya's --enable_bucket) at the resolution's area: each image "
                                "resized to cover the bucket nearest its aspect ratio and cropped into it, instead of "
                                "a center-cropped square; each training step from one bucket")),
        ("--min-bucket-reso", dict(type=int_between(8, 16384), **default("min_bucket_reso"),
                                   help=f"--buckets: the shortest bucket side in pixels "
                                        f"(default {DEFAULTS['min_bucket_reso']})")),
        ("--max-bucket-reso", dict(type=int_between(8, 16384), **default("max_bucket_reso"),
                                   help=f"--buckets: the longest bucket side in pixels "
                                        f"(default {DEFAULTS['max_bucket_reso']})")),
        ("--bucket-reso-steps", dict(type=int_between(8, 4096), **default("bucket_reso_steps"),
                                     help=f"--buckets: every bucket side a multiple of this many pixels (default "
                                          f"{DEFAULTS['bucket_reso_steps']}; a multiple of the VAE's 8)")),
        ("--bucket-no-upscale", dict(action="store_true",
                                     help="--buckets: no bucket list: each image's own size (shrunk to the area if "
                                          "larger) floored to the step, never enlarged")),
        ("--random-crop", dict(action="store_true",
                               help="--buckets: crop at a random offset (seeded per image by --seed) instead of the "
                                    "center")),
    ]


def add_bucket_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, kwargs in bucket_flags(with_defaults=True):
        parser.add_argument(flag, **kwargs)


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
