"""`pulse export`: a diffusers pipeline folder with a checkpoint's trained backbone.

::

    pulse export --checkpoint RUN/checkpoints/step-<k> --pipeline DIR --out NEW
        └─ python -m pulse_torch.export ... (see backends/pulse_torch/export.py)
    DiffusionPipeline.from_pretrained(NEW)
"""
from __future__ import annotations

import argparse

from pulse.cli.torch_tool import option_dests, run_module, to_argv

MODULE = "pulse_torch.export"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="a complete checkpoint step folder (RUN/checkpoints/step-<k>), or the folder holding "
                             "them (the newest complete one is taken)")
    parser.add_argument("--pipeline", required=True, help="the pipeline folder the run's backbone came from")
    parser.add_argument("--out", required=True, help="the new pipeline folder (must not exist)")
    parser.add_argument("--ema", action="store_true", help="export the moving averages of a run with --ema")


def run(args: argparse.Namespace) -> int:
    probe = argparse.ArgumentParser()
    add_arguments(probe)
    return run_module(MODULE, to_argv(args, option_dests(probe)))
