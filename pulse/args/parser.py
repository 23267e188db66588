"""Argument types shared by the `pulse` commands and the process entries they start.

Each type turns one command-line word into a value or says in one line what is wrong
(``OneLineParser``: exit code 2, no usage block).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Callable, NoReturn

from pulse.atomic_io import check_target
from pulse.errors import PulseError


# -- argument parsing: one line per bad value, exit 2 ------------------------------------------
class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that says a bad argument in one line (no usage block), exit code 2,
    and never expands abbreviations (``--plan`` must not be read as ``--plan-only``).

    Sub-parsers made with ``add_subparsers`` are of the parent's class, so the rule holds for
    every command.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        message = re.sub(r"^argument (--[\w-]+)(?:/\S+)?: must ", r"\1 must ", message)  # "--pp must be >= 1"
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


MAX_COUNT = 100_000  # degrees, microbatches, sizes: more than any job, small enough to plan in memory
MAX_SEED = 2**32 - 1  # numpy's seed range; torch's is wider


def _number(text: str, cast: Callable[[str], float | int], kind: str) -> float | int:
    try:
        return cast(text.strip())
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected {kind}, got '{text[:60]}'") from None


def int_between(low: int, high: int) -> Callable[[str], int]:
    """``type=``: a whole number in [low, high] (bounded, so nothing downstream grows without limit)."""

    def parse(text: str) -> int:
        value = _number(text, int, "a whole number")
        if not low <= value <= high:
            bound = f">= {low}" if value < low else f"<= {high}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text[:60]}")
        return int(value)

    parse.__name__ = f"int in [{low}, {high}]"  # argparse names the type in its messages
    return parse


positive_int = int_between(1, MAX_COUNT)
non_negative_int = int_between(0, MAX_COUNT)
seed_int = int_between(0, MAX_SEED)


def float_between(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """``type=``: a finite number in [low, high] ((low, high] with ``low_open``); NaN and inf refused."""

    def parse(text: str) -> float:
        value = float(_number(text, float, "a number"))
        inside = (low < value if low_open else low <= value) and value <= high
        if not math.isfinite(value) or not inside:
            bracket = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"must be a finite number in {bracket}{low:.10g}, {high:.10g}], "
                                             f"got {text[:60]}")
        return value

    parse.__name__ = "number"
    return parse


finite_positive_float = float_between(0.0, 1e300, low_open=True)
finite_non_negative_float = float_between(0.0, 1e300)
seconds_float = float_between(0.1, 7 * 24 * 3600.0)  # a wait: not instant, not forever (timedelta overflows)
learning_rate = float_between(0.0, 1e6, low_open=True)
memory_gib = float_between(0.0, 2.0**20, low_open=True)  # up to a PiB per device


def int_list(text: str) -> str:
    """``type=``: comma-separated whole numbers >= 1 (``1,2,4``), empty items refused; returned as
    normalised text (the commands split it where they use it)."""
    items = text.split(",")
    if not text.strip() or any(not item.strip() for item in items):
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers like 1,2,4, got '{text[:60]}'")
    return ",".join(str(positive_int(item)) for item in items)


def output_file(text: str) -> str:
    """``type=``: a file to write: a regular file or nothing yet (never a device, pipe, socket or link),
    in a folder that exists (``pulse.atomic_io``'s rule, said before any work)."""
    path = Path(text)
    try:
        if not text or path.is_dir() or text.endswith(("/", "\\")):
            raise argparse.ArgumentTypeError(f"'{text[:120]}' is a directory; name a file to write")
        _check_parents(text, path.parents)
        check_target(path)
    except PulseError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    except OSError as exc:  # a name too long for the filesystem, ...
        raise argparse.ArgumentTypeError(f"cannot write '{text[:120]}': {exc.strerror}") from None
    return text


IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".eps", ".ps")


def image_file(text: str) -> str:
    """``type=``: a picture to write; its suffix says the format (matplotlib's)."""
    if not text.lower().endswith(IMAGE_SUFFIXES):
        raise argparse.ArgumentTypeError(f"'{text[:120]}': name a picture ending in {', '.join(IMAGE_SUFFIXES)}")
    return output_file(text)


def output_dir(text: str) -> str:
    """``type=``: a directory to write into (it may not exist yet, but must not be a file)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a directory, got ''")
    path = Path(text)
    try:
        _check_parents(text, [path, *path.parents])
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write into '{text[:120]}': {exc.strerror}") from None
    return text


def _check_parents(text: str, folders) -> None:
    for folder in folders:
        if folder.exists() and not folder.is_dir():
            raise argparse.ArgumentTypeError(f"'{text[:120]}': '{str(folder)[:120]}' is a file, not a directory")


def host_address(text: str) -> str:
    """``type=``: an IP address (v4 or v6) a store can listen on; names are refused (they may resolve
    to an address on every interface)."""
    import ipaddress

    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an IP address of this machine such as 127.0.0.1 or "
                                         f"10.0.0.5, got '{text[:60]}'") from None
    if address.is_unspecified or address.is_multicast:
        raise argparse.ArgumentTypeError(f"{address} is not one interface's address (every interface is what "
                                         "this avoids); name the address the other nodes reach node 0 at")
    return str(address)


_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def path_safe_name(name: str) -> str:
    """``name`` as one file-name component: no separators, no ``..``, nothing absolute.

    Model names come from spec files users hand in; a run directory is named after them and
    must stay inside ``runs/``.
    """
    safe = _UNSAFE.sub("_", name).strip("._") or "model"
    return safe[:100]
