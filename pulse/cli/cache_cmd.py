"""`pulse cache-latents`: encode captioned images once with a pipeline's frozen VAE and text encoder.

::

    pulse cache-latents --pipeline DIR --images DIR --out CACHE
        └─ python -m pulse_torch.cache_latents ... (see backends/pulse_torch/cache_latents.py)
    pulse train --diffusers-config DIR/unet --data CACHE ...
"""
from __future__ import annotations

import argparse

from pulse.cli.common import int_between, seed_int
from pulse.cli.torch_tool import option_dests, run_module, to_argv

MODULE = "pulse_torch.cache_latents"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pipeline", required=True, help="a local diffusers pipeline folder (model_index.json)")
    parser.add_argument("--images", required=True,
                        help="images with captions: metadata.jsonl (file_name, text) or NAME.txt beside each")
    parser.add_argument("--out", required=True, help="the cache folder (resumed when it holds the same run)")
    parser.add_argument("--resolution", type=int_between(8, 8192), default=None,
                        help="pixels (default: the backbone's sample_size x the VAE's scale factor)")
    parser.add_argument("--latents", choices=("mean", "sample"), default="mean",
                        help="the VAE's latent distribution: its mean (default) or one seeded sample per image")
    parser.add_argument("--random-flip", action="store_true",
                        help="flip each image left-right with probability 1/2 (seeded per image, fixed in the cache)")
    parser.add_argument("--seed", type=seed_int, default=0, help="for --latents sample and --random-flip")
    parser.add_argument("--batch-size", type=int_between(1, 4096), default=1,
                        help="images per encoder call: 1 (default) encodes each image alone, bit for bit what "
                             "`pulse train --images` computes; larger batches are faster on accelerators and "
                             "equal to within float rounding")
    parser.add_argument("--shard-size", type=int_between(1, 1 << 20), default=256, help="images per shard (the resume unit)")


def run(args: argparse.Namespace) -> int:
    probe = argparse.ArgumentParser()
    add_arguments(probe)
    return run_module(MODULE, to_argv(args, option_dests(probe)))
