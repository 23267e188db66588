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
