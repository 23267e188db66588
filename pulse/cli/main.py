"""`pulse` entry point: subcommands, and the one rule for bad input.

Any PulseError becomes one line on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from pulse.args.parser import OneLineParser
from pulse.errors import PulseError

# subcommand -> module defining add_arguments(parser) and run(args) -> int
COMMANDS = {
    "plan": ("pulse.cli.plan_cmd", "partition a model over pipeline devices and compare partitioners"),
    "simulate": ("pulse.cli.simulate_cmd", "schedule a plan and simulate it against the baselines"),
    "tune": ("pulse.cli.tune_cmd", "search pipeline/data-parallel degrees and microbatching"),
    "train": ("pulse.cli.train_cmd", "plan and launch training (torchrun or msrun)"),
    "profile": ("pulse.cli.profile_cmd", "measure layer costs and links on the ranks a job runs on"),
    "cache-latents": ("pulse.cli.cache_cmd", "encode captioned images with a diffusers pipeline's VAE and text encoder"),
    "export": ("pulse.cli.export_cmd", "write a diffusers pipeline folder with a checkpoint's trained backbone"),
}


def build_parser(commands: set[str] | None = None) -> argparse.ArgumentParser:
    """Every command's parser, or only those in ``commands`` with their flags (the others listed, so
    that ``pulse --help`` and a misspelt command still name them all): `pulse train` neither imports
    nor builds the other commands' hundreds of flags."""
    # OneLineParser: one line per bad argument, and `--plan` never read as an abbreviation of `--plan-only`
    parser = OneLineParser(prog="pulse", description="Skip-local pipeline parallelism for diffusion models.",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.subcommands = {}  # type: ignore[attr-defined]  # name -> its parser (a run file re-parses one)
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        if commands is None or name in commands:
            importlib.import_module(module_name).add_arguments(command)
            parser.subcommands[name] = command  # type: ignore[attr-defined]
    return parser


def command_named(argv: list[str] | None) -> set[str]:
    """The command ``argv`` runs (its first word; `pulse` itself takes no flag but --help), if any."""
    words = sys.argv[1:] if argv is None else argv
    return {words[0]} if words and words[0] in COMMANDS else set()


def with_run_file(parser: argparse.ArgumentParser, args: argparse.Namespace,
                  argv: list[str] | None) -> argparse.Namespace:
    """``pulse train --config FILE``: the command's flags parsed again over the file's values."""
    if args.command != "train" or getattr(args, "config", None) is None:
        return args
    from pulse.args.run_file import parse_with_file

    words = list(sys.argv[1:] if argv is None else argv)
    again = parse_with_file(parser.subcommands["train"], words[words.index("train") + 1:], args.config)
    again.command = "train"
    return again




def main(argv: list[str] | None = None) -> int:
    parser = build_parser(command_named(argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # bad arguments (one line said so) or --help: a code, also for in-process callers
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        args = with_run_file(parser, args, argv)
        return int(module.run(args) or 0)
    except SystemExit as exc:  # a run file's value the flag's own parser refused (one line said so)
        return exc.code if isinstance(exc.code, int) else 2
    except PulseError as exc:
        print(f"pulse {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file that cannot be written or read: say which, in one line
        print(f"pulse {args.command}: error: {exc.strerror or exc}: '{exc.filename}'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pulse {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
