"""`pulse cache-latents --buckets`: the cache in aspect-ratio buckets, one shape per shard.

::

    image_fits (pulse_torch.pipeline.bucket_images): each image's bucket, resized size, crop
        │ buckets in (width, height) order, each bucket's images in file order, chunked by --shard-size
        ▼
    manifest "buckets": {"settings": {...}, "sizes": [[w, h], ...], "latents": [[C, h/f, w/f], ...]}
    shard entry "bucket": k, "members": the images (file-list positions) it holds, in its row order

Shards per bucket keep every array of a shard one shape, memory-mappable as today;
``pulse.data.shards.ShardLatents`` reads the buckets back (``buckets``, ``shape_of``) and training
draws each step from one bucket (``pulse.train.bucket_sampler``).
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Sequence

import numpy as np

from pulse.data.buckets import BucketSettings, Fit
from pulse.data.captioned_images import Captioned
from pulse.progress import Progress
from pulse_torch.pipeline.bucket_images import load_into_bucket, size_conditions


def bucket_plan(fits: Sequence[Fit], settings: BucketSettings, random_crop: bool, channels: int, factor: int,
                shard_size: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the manifest's "buckets", its shard entries without names): buckets sorted by size."""
    sizes = sorted({f.bucket for f in fits})
    number = {size: k for k, size in enumerate(sizes)}
    shards = []
    for k, size in enumerate(sizes):
        members = [i for i, f in enumerate(fits) if number[f.bucket] == k]
        shards += [{"count": len(members[s:s + shard_size]), "bucket": k, "members": members[s:s + shard_size]}
                   for s in range(0, len(members), shard_size)]
    buckets = {"settings": {**asdict(settings), "random_crop": random_crop},
               "sizes": [list(s) for s in sizes], "latents": [[channels, h // factor, w // factor] for w, h in sizes]}
    return buckets, shards


def encode_members(encoder, items: list[Captioned], fits: Sequence[Fit], flipped: np.ndarray, members: list[int],
                   batch: int, bar: Progress) -> dict[str, np.ndarray]:
    """One shard's arrays: its images loaded into their (one) bucket, latents, text and size conditions."""
    parts: dict[str, list[np.ndarray]] = {}
    for b in range(0, len(members), batch):
        chunk = members[b:b + batch]
        pixels = np.stack([load_into_bucket(items[k], fits[k], bool(flipped[k])) for k in chunk])
        if encoder.mode == "mean":
            latents = encoder.latents(pixels, chunk[0])
        else:  # a sample's noise is seeded by its image's index, which need not follow in a bucket
            latents = np.concatenate([encoder.latents(pixels[j:j + 1], k) for j, k in enumerate(chunk)])
        made = {"latents": latents, **encoder.text([items[k].caption for k in chunk]),
                **size_conditions([fits[k] for k in chunk], encoder.recipe)}
        for name, rows in made.items():
            parts.setdefault(name, []).append(rows)
        bar.update(len(chunk), note=items[chunk[-1]].key)
    return {k: np.concatenate(v) for k, v in parts.items()}

