"""Fault injection for the fault-tolerance tests: what ``PULSE_FAULT`` names and the hard exit.

::

    PULSE_FAULT=die:rank=2:step=2                  rank 2 exits mid-way through step 2's actions
    PULSE_FAULT=crash-during-checkpoint:step=6     rank 0 (or rank=R) exits after writing its
                                                   step-6 rank file, before the manifest exists

Steps count from 1, as checkpoint directories do (``step-6`` holds the state
after 6 optimizer steps). The process leaves with ``os._exit(1)``: no
``finally``, no atexit, no flushed buffers but the one line it prints first,
as a killed or crashed process would.

The product knows nothing of this: ``sitecustomize.py`` beside this file, on
the PYTHONPATH of a test's child processes (``env_with``), wraps the training
loop's microbatch fetch and both backends' checkpoint writers as they are
imported, and calls ``maybe_fail`` there.
"""
from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from pulse.errors import PulseError

ENV = "PULSE_FAULT"
HERE = Path(__file__).resolve().parent  # on a child's PYTHONPATH: its sitecustomize.py runs there
KINDS = {"die": None, "crash-during-checkpoint": 0}  # kind -> default rank (None: rank= required)


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int


def parse(text: str) -> Fault:
    """``kind:key=value:...``; a typo is an error (a silently inert fault would pass its test)."""
    kind, *pairs = text.strip().split(":")
    if kind not in KINDS:
        raise PulseError(f"{ENV}={text!r}: unknown fault '{kind}' (known: {', '.join(KINDS)})")
    values: dict[str, int] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in ("rank", "step") or not value.isdigit():
            raise PulseError(f"{ENV}={text!r}: expected rank=N or step=N, got '{pair}'")
        values[key] = int(value)
    rank = values.get("rank", KINDS[kind])
    if rank is None or "step" not in values:
        raise PulseError(f"{ENV}={text!r}: '{kind}' needs step=N{'' if rank is not None else ' and rank=N'}")
    return Fault(kind, rank, values["step"])


@functools.lru_cache(maxsize=1)
def planned() -> Fault | None:
    text = os.environ.get(ENV, "")
    return parse(text) if text else None


def maybe_fail(kind: str, rank: int, step: int) -> None:
    """Exit the process at once if ``PULSE_FAULT`` names this point."""
    fault = planned()
    if fault is None or (fault.kind, fault.rank, fault.step) != (kind, rank, step):
        return
    print(f"pulse fault injection: rank {rank} exits hard ({kind} at step {step}, t={time.time():.3f})",
          file=sys.stderr, flush=True)
    os._exit(1)


def env_with(env: Mapping[str, str], fault: str) -> dict[str, str]:
    """``env`` for a child process with ``PULSE_FAULT=fault`` and this folder first on its PYTHONPATH
    (so every Python process it starts, torchrun's and msrun's workers too, installs the hooks)."""
    path = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    return {**env, ENV: fault, "PYTHONPATH": path}
