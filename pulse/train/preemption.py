"""Stopping for a preemption: every rank finishes the step, checkpoints it, and leaves with 128 + the signal.

::

    Slurm, Kubernetes ── SIGTERM (Slurm's --signal=USR1@120: SIGUSR1 first) ──▶ pulse train ─▶ torchrun ─▶ ranks
    a rank:      the signal is noted (a thread reads it at once, whatever the main thread is blocked in);
                 the step in progress goes on
    train_step:  a vote per preemption signal rides in the step's one sum_values all-reduce (no extra
                 collective): a nonzero sum stops every rank after that same step, however the signal
                 reached them (at different moments, or only some of them)
    run_steps:   log.json, the checkpoint of that step (its manifest: "preempted": "SIGTERM"), then
                 ``Preempted`` ─▶ every rank exits 128 + the signal (143 for SIGTERM, 138 for SIGUSR1),
                 and so do torchrun's launcher and `pulse train`
    at once:     a second signal, or the grace period's end (``--preempt-grace``, 25 s: under Slurm's
                 30 s KillWait) ─▶ os._exit(128 + signal). Rank files and manifests are written atomically
                 and a step folder without its manifest is never loaded, so the newest complete
                 checkpoint stays the newest.

A signal reaches a rank twice for one stop when Slurm signals every process of a job step and the
launchers pass it on as well: a repeat within ``DUPLICATE_S`` of the first is the same request.
The last step is not preempted: the run is finishing anyway (a stop voted there ends it normally).
"""
from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from pulse.errors import PulseError

# the signals a run may stop for (by their names without SIG); INT is Ctrl-C, HUP a closed terminal
SIGNALS = {"TERM": signal.SIGTERM, "USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2, "HUP": signal.SIGHUP,
           "INT": signal.SIGINT}
DEFAULT_SIGNALS = "TERM,USR1"
DEFAULT_GRACE_S = 25.0  # Slurm's default KillWait is 30 s: the checkpoint must be on disk before SIGKILL
DUPLICATE_S = 2.0  # one stop delivered twice (Slurm to every process, and the launcher passing it on)


def signal_names(text: str) -> tuple[str, ...]:
    """``--preempt-signals``: 'TERM,USR1' (SIG prefixes allowed) -> ('TERM', 'USR1'); 'none' or '' -> ()."""
    if text.strip().lower() in ("", "none"):
        return ()
    names = [part.strip().upper().removeprefix("SIG") for part in text.split(",")]
    unknown = [n for n in names if n not in SIGNALS]
    if unknown or len(set(names)) != len(names):
        what = f"unknown signal '{unknown[0]}'" if unknown else "a signal named twice"
        raise PulseError(f"--preempt-signals {text!r}: {what}; name some of {', '.join(SIGNALS)} separated by "
                         "commas, or 'none'")
    return tuple(names)


def signal_numbers(text: str) -> tuple[int, ...]:
    return tuple(int(SIGNALS[name]) for name in signal_names(text))


def exit_code(signum: int) -> int:
    """What a preempted rank, its launcher and `pulse train` exit with: 128 + the signal, as shells say it."""
    return 128 + int(signum)


class Preempted(Exception):
    """Every rank agreed to stop after step ``step`` for ``signum``; the checkpoint of that step is written
    (``checkpointed``: a run without a checkpoint hook writes none)."""

    def __init__(self, signum: int, step: int, checkpointed: bool) -> None:
        super().__init__(f"preempted by {signal.Signals(signum).name} after step {step}")
        self.signum, self.step, self.checkpointed = signum, step, checkpointed


@dataclass
class Preemption:
    """One rank's side of a preemption: what it heard, and what every rank agreed on.

    ``note`` and ``agree`` are the logic (plain numbers, testable); ``start`` installs the signal
    handling: a no-op Python handler per signal and a wake-up pipe that a watcher thread reads, so a
    second signal or the grace's end leaves even while the main thread waits in a collective.
    """

    signals: tuple[int, ...]  # in the order given: one vote each in the step's sum
    grace: float = DEFAULT_GRACE_S
    speaks: bool = True  # says the first signal (rank 0; the rank entries set it once they know)
    leave: Callable[[int], None] = os._exit  # tests pass a recorder
    received: int | None = None  # the first stop signal this rank heard
    first_at: float | None = None  # its moment (time.monotonic)
    agreed: int | None = None  # the signal every rank stops for, once a step's sum said so
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _wakeup: int | None = field(default=None, repr=False)  # the pipe's write end, once started

    def note(self, signum: int, now: float) -> str:
        """A stop signal arrived: 'stop' (the first), 'duplicate' (the same one again within DUPLICATE_S)
        or 'leave' (a second one: exit now)."""
        with self._lock:
            if self.received is None:
                self.received, self.first_at = signum, now
                return "stop"
            return "duplicate" if now - self.first_at < DUPLICATE_S else "leave"

    def deadline(self) -> float | None:
        """When the grace period ends (time.monotonic), or None before any signal."""
        return None if self.first_at is None else self.first_at + self.grace

    def votes(self) -> list[float]:
        """This rank's share of the step's sum: 1 in the slot of the signal it heard."""
        heard = self.received
        return [1.0 if s == heard else 0.0 for s in self.signals]

    def agree(self, sums: Sequence[float]) -> int | None:
        """The step's summed votes: the first signal (in the given order) any rank heard stops every rank."""
        chosen = next((s for s, n in zip(self.signals, sums) if n > 0.5), None)
        if chosen is not None and self.agreed is None:
            self.agreed = chosen
        return self.agreed

    # -- the process's signal handling --------------------------------------------------------------------
    @classmethod
    def for_run(cls, config: Any, speaks: bool = False) -> "Preemption":
        """A rank's, from its run configuration (``preempt_signals``, ``preempt_grace``), not started."""
        return cls(signal_numbers(config.preempt_signals), float(config.preempt_grace), speaks)

    def start(self) -> "Preemption":
        """Handle the signals from now on, for the rest of the process (a rank entry's main thread); without
        signals, nothing changes. Again after the job's join takes them back: a framework's set-up may
        install handlers of its own (MindSpore's cluster library calls signal and sigaction)."""
        if not self.signals:
            return self
        if self._wakeup is None:
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._wakeup = write
            threading.Thread(target=self._watch, args=(read,), name="pulse-preemption", daemon=True).start()
        signal.set_wakeup_fd(self._wakeup, warn_on_full_buffer=False)
        for signum in self.signals:  # the C handler writes the number to the pipe; Python's does nothing
            signal.signal(signum, _noted_by_the_watcher)
        return self

    def _watch(self, read: int) -> None:
        while True:
            deadline = self.deadline()
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([read], [], [], wait)
            if not ready:
                self._exit(self.received, f"the {self.grace:g} s grace period ended before the checkpoint did")
                return
            for signum in os.read(read, 64):
                if signum not in self.signals:
                    continue  # another handler's signal (Ctrl-C's own exit, ...)
                action = self.note(signum, time.monotonic())
                if action == "stop" and self.speaks:
                    print(f"pulse: {signal.Signals(signum).name}: finishing this step, then a checkpoint of it "
                          f"(a second signal or {self.grace:g} s: exit at once)", file=sys.stderr, flush=True)
                elif action == "leave":
                    self._exit(signum, "a second stop signal")
                    return

    def _exit(self, signum: int, why: str) -> None:
        print(f"pulse: {why}: leaving at once with {exit_code(signum)} (the newest complete checkpoint stays "
              "the newest)", file=sys.stderr, flush=True)
        self.leave(exit_code(signum))


def _noted_by_the_watcher(signum: int, frame: object) -> None:
    """Python's half of a stop signal: nothing (the wake-up pipe carries it to ``Preemption._watch``)."""


def ignore_signals(text: str) -> None:
    """A process the ranks need until they leave (msrun's scheduler) lets the stop signals pass: Slurm
    signals every process of a step, and the ranks' checkpoint needs the scheduler alive."""
    for signum in signal_numbers(text):
        signal.signal(signum, signal.SIG_IGN)
