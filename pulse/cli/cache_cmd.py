"""`pulse cache-latents`: encode captioned images once with a pipeline's frozen VAE and text encoder.

::

    pulse cache-latents --pipeline DIR --images DIR --out CACHE
        └─ python -m pulse_torch.cache_latents ... (see backends/pulse_torch/cache_latents.py)
    pulse train --diffusers-config DIR/unet --data CACHE ...
"""
from __future__ import annotations

import argparse

from pulse.args.tools import add_cache_arguments, option_dests, run_module, to_argv

MODULE = "pulse_torch.cache_latents"


add_arguments = add_cache_arguments  # the definition the torch entry parses too


def run(args: argparse.Namespace) -> int:
    probe = argparse.ArgumentParser()
    add_cache_arguments(probe)
    return run_module(MODULE, to_argv(args, option_dests(probe)))
