"""Commands the core names but PyTorch runs: parse here (framework-free), run ``python -m <module>`` as a child.

::

    pulse cache-latents ARGS  ──▶  python -m pulse_torch.cache_latents ARGS   (its output straight through)
    pulse export ARGS         ──▶  python -m pulse_torch.export ARGS

The argument definitions live here and the torch entries import them, so the
two can never disagree; the child's exit code is the command's (2: it said
what was wrong in one line).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from typing import Callable

from pulse.args.bucket_args import add_bucket_arguments
from pulse.args.parser import int_between, seed_int
from pulse.args.image_set_args import image_set_flags
from pulse.data.captioned_images import BAD_SAMPLES
from pulse.errors import PulseError


def to_argv(args: argparse.Namespace, parser_dests: dict[str, str]) -> list[str]:
    """``args`` back as command-line words: ``{dest: flag}``; a true switch is its flag, None is left out."""
    words: list[str] = []
    for dest, flag in parser_dests.items():
        value = getattr(args, dest)
        if value is None or value is False:
            continue
        words += [flag] if value is True else [flag, str(value)]
    return words


def option_dests(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"}


def run_module(module: str, argv: list[str]) -> int:
    """``python -m module argv`` in this interpreter; its output passes straight to this terminal."""
    if importlib.util.find_spec("pulse_torch") is None or importlib.util.find_spec("torch") is None:
        raise PulseError("this command needs PyTorch, diffusers and pulse_torch: pip install -e '.[torch,diffusers]'")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    try:
        return subprocess.call([sys.executable, "-m", module, *argv], env=env)
    except KeyboardInterrupt:  # the child got the same SIGINT and says its own line
        return 130


def entry_main(prog: str, parser: argparse.ArgumentParser, body: Callable[[argparse.Namespace], int],
               argv: list[str] | None, interrupted: str | None = None) -> int:
    """A torch entry's ``main``: parse, run ``body``; bad input (PulseError, OSError) is one line and 2."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return body(args)
    except PulseError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{prog}: error: {exc.strerror or exc}: '{exc.filename}'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if interrupted is None:
            raise
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="a complete checkpoint step folder (RUN/checkpoints/step-<k>), or the folder holding "
                             "them (the newest complete one is taken)")
    parser.add_argument("--pipeline", required=True, help="the pipeline folder the run's backbone came from")
    parser.add_argument("--out", required=True, help="the new pipeline folder (must not exist)")
    parser.add_argument("--ema", action="store_true", help="export the moving averages of a run with --ema")


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pipeline", required=True, help="a local diffusers pipeline folder (model_index.json)")
    parser.add_argument("--images", required=True,
                        help="images with captions: metadata.jsonl (file_name, text) or NAME.txt beside each; a "
                             "datasets folder or file, kohya N_name folders, WebDataset shards (--dataset-format)")
    for flag, kwargs in image_set_flags(with_defaults=True):
        parser.add_argument(flag, **kwargs)
    parser.add_argument("--out", required=True, help="the cache folder (resumed when it holds the same run)")
    parser.add_argument("--resolution", type=int_between(8, 8192), default=None,
                        help="pixels (default: the backbone's sample_size x the VAE's scale factor)")
    add_bucket_arguments(parser)
    parser.add_argument("--latents", choices=("mean", "sample"), default="mean",
                        help="the VAE's latent distribution: its mean (default) or one seeded sample per image")
    parser.add_argument("--random-flip", action="store_true",
                        help="flip each image left-right with probability 1/2 (seeded per image, fixed in the cache)")
    parser.add_argument("--seed", type=seed_int, default=0, help="for --latents sample, --random-flip and --random-crop")
    parser.add_argument("--bad-samples", choices=BAD_SAMPLES, default="stop",
                        help="an image PIL cannot decode, or a metadata.jsonl line that is not JSON or names no file "
                             "or caption: stop before encoding, in one line naming it (default), or skip it (named "
                             "once, recorded in the manifest's \"skipped\")")
    parser.add_argument("--batch-size", type=int_between(1, 4096), default=1,
                        help="images per encoder call: 1 (default) encodes each image alone, bit for bit what "
                             "`pulse train --images` computes; larger batches are faster on accelerators and "
                             "equal to within float rounding")
    parser.add_argument("--shard-size", type=int_between(1, 1 << 20), default=256, help="images per shard (the resume unit)")
