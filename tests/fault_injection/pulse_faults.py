"""Fault injection for the fault-tolerance tests: what ``PULSE_FAULT`` names and the hard exit.

::

    PULSE_FAULT=die:rank=2:step=2                  rank 2 exits mid-way through step 2's actions
    PULSE_FAULT=crash-during-checkpoint:step=6     rank 0 (or rank=R) exits after writing its
                                                   step-6 rank file, before the manifest exists
    PULSE_FAULT=hold:rank=1:step=3                 rank 1 stops mid-way through step 3's actions until
                                                   PULSE_FAULT_FLAGS/release-hold exists
    PULSE_FAULT=hold-in-preempt-checkpoint         rank 0 (or rank=R), its file of a preemption's checkpoint
                                                   written, waits before the manifest until
                                                   PULSE_FAULT_FLAGS/release-hold-in-preempt-checkpoint exists
    PULSE_FAULT=hold:rank=0:step=3,hold-in-preempt-checkpoint    both (faults separated by commas)

A hold writes ``PULSE_FAULT_FLAGS/held-<kind>-rank-<R>`` (the process id inside) when it starts: the
test's cue to signal or kill, with no clock involved. It holds once per flags folder (a worker
group torchrun restarted passes on).

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
KINDS = {"die": None, "crash-during-checkpoint": 0, "hold": None,
         "hold-in-preempt-checkpoint": 0}  # kind -> default rank (None: rank= required)
NO_STEP = {"hold-in-preempt-checkpoint"}  # kinds that take no step=
FLAGS = "PULSE_FAULT_FLAGS"  # a hold's folder: held-<kind>-rank-<r> written, release-<kind> awaited


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
    if rank is None or ("step" not in values and kind not in NO_STEP):
        raise PulseError(f"{ENV}={text!r}: '{kind}' needs step=N{'' if rank is not None else ' and rank=N'}")
    if kind.startswith("hold") and not os.environ.get(FLAGS):
        raise PulseError(f"{ENV}={text!r}: a hold needs {FLAGS}=FOLDER (its held and release files)")
    return Fault(kind, rank, values.get("step", 0))


@functools.lru_cache(maxsize=1)
def planned() -> tuple[Fault, ...]:
    text = os.environ.get(ENV, "")
    return tuple(parse(part) for part in text.split(",")) if text else ()


def maybe_fail(kind: str, rank: int, step: int) -> None:
    """Exit the process at once if ``PULSE_FAULT`` names this point."""
    if Fault(kind, rank, step) not in planned():
        return
    print(f"pulse fault injection: rank {rank} exits hard ({kind} at step {step}, t={time.time():.3f})",
          file=sys.stderr, flush=True)
    os._exit(1)


def maybe_hold(kind: str, rank: int, step: int = 0) -> None:
    """Wait here until the flags folder's ``release-<kind>`` exists, if ``PULSE_FAULT`` names this point
    and this folder has not seen the hold yet."""
    if Fault(kind, rank, step) not in planned():
        return
    flags = Path(os.environ[FLAGS])
    held = flags / f"held-{kind}-rank-{rank}"
    if held.exists():
        return
    print(f"pulse fault injection: rank {rank} holds ({kind} at step {step})", file=sys.stderr, flush=True)
    held.write_text(str(os.getpid()))
    while not (flags / f"release-{kind}").exists():
        time.sleep(0.05)


def env_with(env: Mapping[str, str], fault: str, flags: Path | None = None) -> dict[str, str]:
    """``env`` for a child process with ``PULSE_FAULT=fault`` and this folder first on its PYTHONPATH
    (so every Python process it starts, torchrun's and msrun's workers too, installs the hooks);
    ``flags``: a hold's folder."""
    path = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    return {**env, ENV: fault, "PYTHONPATH": path, **({FLAGS: str(flags)} if flags is not None else {})}
