"""``pulse train --config FILE``: a run kept in a YAML file, every flag by its name, the command line on top.

::

    FILE = RUN/run.yaml (what `pulse train` wrote: ``pulse_run: 1`` + the RunConfig)
           ─▶ its settings, and RUN/plan.yaml beside it as ``--plan``: the same run again
    FILE = a hand-written mapping {flag name: value} (``lr: 1e-4`` or ``--lr: 1e-4``, dashes or
           underscores) ─▶ those flags
    both ─▶ the parser's defaults, then the command line is parsed again: a flag given there wins

Values are converted as the flag's own ``type`` converts its text (YAML reads ``1e-4`` as a
string), so a file says no more and no less than the same flags typed out; a key that is
no flag of `pulse train` is refused in one line, as accelerate's and kohya's config files
are used to being checked.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pulse.errors import PulseError
from pulse.yamlio import load_mapping

RUN_MARK = "pulse_run"  # the key RunConfig.save writes first
NOT_IN_FILES = {"config", "help", "command"}  # flags a run file cannot set
# what `pulse train` works out itself and writes into run.yaml beside the flags; training again works it out
# again (the bad samples of --images: pulse.cli.bad_samples screens the folder as it is now)
DERIVED = {"skipped_samples"}


def flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every flag of ``parser`` by its destination name."""
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in NOT_IN_FILES}


def _convert(action: argparse.Action, value: Any, key: str, where: Path) -> Any:
    """``value`` as the command line would have given it (``type`` applied to text, choices checked)."""
    def one(item: Any) -> Any:
        if isinstance(item, str) and action.type is not None:
            try:
                item = action.type(item)
            except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
                raise PulseError(f"{where}: {key}: {exc}") from None
        if action.choices is not None and item not in action.choices:
            raise PulseError(f"{where}: {key}: {item!r} is not one of {', '.join(map(str, action.choices))}")
        return item

    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise PulseError(f"{where}: {key}: expected true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*"):
        return [one(v) for v in (value if isinstance(value, list) else [value])]
    if isinstance(value, list):
        raise PulseError(f"{where}: {key}: takes one value, got a list")
    return one(value)


def file_defaults(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The flag values ``path`` sets, by destination, converted and checked (one line when wrong)."""
    data = dict(load_mapping(path))
    actions = flag_actions(parser)
    values: dict[str, Any] = {}
    written_by_pulse = data.pop(RUN_MARK, None) is not None
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if written_by_pulse and dest in DERIVED:
            continue
        if dest not in actions:
            raise PulseError(f"{path}: unknown setting '{key}': not a flag of `pulse train` (see pulse train --help)")
        values[dest] = None if value is None else _convert(actions[dest], value, str(key), path)
    if written_by_pulse and "plan" not in values and (path.parent / "plan.yaml").is_file():
        values["plan"] = str(path.parent / "plan.yaml")  # the run that wrote it: its plan, unchanged
    return values


def parse_with_file(parser: argparse.ArgumentParser, argv: list[str], config: str | None) -> argparse.Namespace:
    """``argv`` parsed with ``config``'s values as the defaults (the command line wins)."""
    namespace = parser.parse_args(argv)
    if config is None:
        return namespace
    path = Path(config)
    if not path.is_file():
        raise PulseError(f"--config: no file '{config}' (a run.yaml `pulse train` wrote, or a YAML of flags)")
    parser.set_defaults(**file_defaults(path, parser))
    return parser.parse_args(argv)
