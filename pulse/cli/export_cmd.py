"""`pulse export`: a diffusers pipeline folder with a checkpoint's trained backbone.

::

    pulse export --checkpoint RUN/checkpoints/step-<k> --pipeline DIR --out NEW
        └─ python -m pulse_torch.export ... (see backends/pulse_torch/export.py)
    DiffusionPipeline.from_pretrained(NEW)
"""
from __future__ import annotations

import argparse

from pulse.args.tools import add_export_arguments, option_dests, run_module, to_argv

MODULE = "pulse_torch.export"


add_arguments = add_export_arguments  # the definition the torch entry parses too


def run(args: argparse.Namespace) -> int:
    probe = argparse.ArgumentParser()
    add_export_arguments(probe)
    return run_module(MODULE, to_argv(args, option_dests(probe)))
