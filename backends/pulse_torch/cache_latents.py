"""``python -m pulse_torch.cache_latents --pipeline DIR --images DIR --out DIR`` (what `pulse cache-latents` runs).

::

    read_pipeline (model_index.json, unet/, vae/, text_encoder[_2]/, tokenizer[_2]/)   list_images (captions)
        │ resolution: the backbone's sample_size x the VAE's scale factor (or --resolution)
        ▼
    OUT/manifest.json (complete: false) ─ per missing shard: images ─ Encoder (no_grad) ─ shard-NNNNN/
        ─ OUT/manifest.json (complete: true)            a progress line per image on stdout

The manifest names every array a shard holds (``arrays``: name -> per-image
shape) and the model input each feeds (``inputs``): SD's context, SDXL's
context, text_embeds and time_ids, Hunyuan-DiT's six (``pulse.data.pipeline_text``).

Bad input (no backbone, VAE or text encoder, an image without caption, a
file PIL cannot read, an --out holding another cache) is one line and exit
code 2; with ``--bad-samples skip`` a bad sample (``pulse.data.captioned_images``) is
left out instead, named once on stdout and listed in the manifest's ``skipped``. Interrupted, the same command again keeps every finished shard.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from pulse.args.parser import OneLineParser
from pulse.args.bucket_args import bucket_settings
from pulse.args.tools import add_cache_arguments, entry_main
from pulse.errors import PulseError
from pulse.progress import Progress
from pulse.data.image_sets import image_set_of
from pulse.data.pipeline_folder import read_pipeline, resolution_of
from pulse_torch.pipeline.images import Captioned, flips, images_hash, load_image, screen_images, size_arrays
from pulse.data.buckets import check_backbone
from pulse_torch.cache_buckets import bucket_plan, encode_members
from pulse_torch.pipeline.bucket_images import image_fits
from pulse.data.shards import FORMAT, prepare, shard_name, shard_sums, write_empty_prompt, write_manifest, write_shard

PROG = "pulse cache-latents"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, allow_abbrev=False,
                           description="encode captioned images once with a pipeline's frozen VAE and text encoder")
    add_cache_arguments(parser)
    return parser


def encode(args: argparse.Namespace) -> int:
    folder = read_pipeline(args.pipeline, need_encoders=True)
    screened = screen_images(image_set_of(args), args.bad_samples)  # --bad-samples stop: one line before anything is made
    items = screened.items
    for bad in screened.skipped:
        print(f"{PROG}: skipped {bad.describe()}", flush=True)
    default, factor = resolution_of(folder)
    resolution = args.resolution or default
    if resolution % factor:
        raise PulseError(f"--resolution {resolution} is not a multiple of the VAE's scale factor {factor}")
    from pulse_torch.pipeline.encode import Encoder

    settings = bucket_settings(args, resolution)  # None without --buckets
    if settings is not None:
        check_backbone(folder, settings, factor)
    encoder = Encoder(folder, args.latents, args.seed)
    recipe = encoder.recipe
    size, n = args.shard_size, len(items)
    latent = [int(encoder.vae.config.latent_channels), resolution // factor, resolution // factor]
    fits, buckets = None, None
    if settings is None:
        shards = [{"name": shard_name(i), "count": min(size, n - s)} for i, s in enumerate(range(0, n, size))]
    else:  # shards per bucket (pulse_torch.cache_buckets)
        fits = image_fits(items, settings, args.seed, args.random_crop)
        buckets, entries = bucket_plan(fits, settings, args.random_crop, latent[0], factor, size)
        shards = [{"name": shard_name(i), **entry} for i, entry in enumerate(entries)]
    empty = encoder.text([""])  # its shapes are every caption's; its rows are what --caption-dropout trains on
    arrays = {"latents": latent, **{k: list(v.shape[1:]) for k, v in empty.items()},
              **{k: list(v.shape[1:]) for k, v in size_arrays(items, [0], resolution, recipe).items()}}
    manifest = {
        "pulse_latent_cache": FORMAT, "complete": False, "resolution": resolution, "latent_shape": latent,
        "arrays": arrays, "inputs": dict(recipe.inputs), "encoding": encoder.describe(),
        "flip": args.seed if args.random_flip else None,
        "pipeline": {"folder": str(folder.root), **folder.identity()},
        "images": {"folder": str(Path(args.images).resolve()), "count": n, "hash": images_hash(items)},
        "skipped": [{"sample": b.key, "reason": b.reason} for b in screened.skipped],
        "shard_size": size, "shards": shards, "files": [[i.key, i.caption] for i in items]}
    if buckets is not None:
        manifest["buckets"] = buckets
    out = Path(args.out)
    done = prepare(out, manifest)
    flipped = flips(n, args.seed, args.random_flip)
    todo = sum(shard["count"] for i, shard in enumerate(shards) if i not in done)
    kept = f", {len(done)} shard(s) kept from an earlier run" if done else ""
    left_out = f", {len(screened.skipped)} bad sample(s) skipped" if screened.skipped else ""
    at = f"in {len(buckets['sizes'])} bucket(s) of {resolution}x{resolution} px area" if buckets else f"at {resolution} px"
    print(f"{PROG}: {n} images {at}{left_out} -> {out} ({len(shards)} shard(s){kept}); latents "
          f"{encoder.describe()}", flush=True)
    sums = {}
    with Progress(todo, "encode", stream=sys.stdout, log_every=0.0) as bar:
        for i, shard in enumerate(shards):
            if i in done:
                continue
            arrays = (encode_shard(encoder, items, flipped, i * size, shard["count"], resolution, args.batch_size, bar)
                      if fits is None else encode_members(encoder, items, fits, flipped, shard["members"],
                                                          args.batch_size, bar))
            sums[i] = write_shard(out, i, arrays)
    write_empty_prompt(out, empty)
    shards = [{**shard, "sha256": sums[i] if i in sums else shard_sums(out, i)}  # kept shards: their own sums
              for i, shard in enumerate(manifest["shards"])]
    write_manifest(out, {**manifest, "shards": shards, "complete": True})
    print(f"{PROG}: wrote {out / 'manifest.json'}", flush=True)
    return 0


def encode_shard(encoder, items: list[Captioned], flipped: np.ndarray, start: int, count: int, resolution: int,
                 batch: int, bar: Progress) -> dict[str, np.ndarray]:
    parts: dict[str, list[np.ndarray]] = {}
    for b in range(start, start + count, batch):
        chunk = range(b, min(b + batch, start + count))
        pixels = np.stack([load_image(items[k].image, resolution, bool(flipped[k])) for k in chunk])
        made = {"latents": encoder.latents(pixels, b), **encoder.text([items[k].caption for k in chunk])}
        made.update(size_arrays(items, chunk, resolution, encoder.recipe))
        for name, rows in made.items():
            parts.setdefault(name, []).append(rows)
        bar.update(len(chunk), note=items[chunk[-1]].key)
    return {k: np.concatenate(v) for k, v in parts.items()}


def main(argv: list[str] | None = None) -> int:
    return entry_main(PROG, build_parser(), encode, argv,
                      "interrupted; the same command resumes (finished shards are kept)")


if __name__ == "__main__":
    sys.exit(main())
