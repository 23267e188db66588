"""The signals `pulse train` passes on to a running launch, to whom, and how long it then waits.

::

    SIGINT, SIGTERM, the run's --preempt-signals ──▶ pulse train (launchers.launch)
      torchrun:  to the launcher's process group: its agent passes each on to the ranks
                 (pulse_torch.launch: once per stop, --stop-timeout before SIGKILL)
      msrun:     a stop signal straight to the workers (the processes running pulse_mindspore.train
                 with this run's --config: msrun passes no signal on, and SIGTERM or SIGUSR1 would end
                 msrun itself); SIGINT to msrun's group, which stops everything at once
    then:        wait for the launcher, and after a stop for those workers too, the grace period +
                 STOP_MARGIN_S; past it, SIGKILL what is left

The ranks do the rest (``pulse.train.preemption``): the step, its checkpoint, exit 128 + the signal.
Framework-free, as all of ``pulse.cli``: processes are found in /proc, not through a framework.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

STOP_GRACE_SECONDS = 40.0  # torchrun gives its ranks 30 s after SIGTERM before SIGKILL
STOP_MARGIN_S = 15.0  # beyond the ranks' grace: the launcher's own teardown


@dataclass
class Stopping:
    """How one launch is stopped: the stop signals the ranks checkpoint on, their grace, and (msrun)
    the command-line words of the processes that get those signals directly."""

    preempt: tuple[int, ...] = ()
    grace: float = 0.0
    # msrun: how a worker's command line starts ("-m pulse_mindspore.train", after the interpreter) and
    # what else it holds ("--config RUN/run.yaml"); empty: the launcher passes signals on itself
    workers: tuple[str, ...] = ()
    stopped: bool = False  # a stop signal went to the workers: wait for them

    def signals(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys((signal.SIGTERM, signal.SIGINT, *self.preempt)))

    def wait_s(self) -> float:
        """How long the launcher may take to leave after a signal before its group is SIGKILLed."""
        return max(STOP_GRACE_SECONDS, self.grace + STOP_MARGIN_S)

    def forward(self, process: subprocess.Popen, signum: int) -> None:
        if self.workers and signum in self.preempt:
            self.stopped = True
            for pid in processes_with(self.workers):
                _kill(pid, signum)
            return
        kill_group(process, signum)

    def wait_for_workers(self) -> None:
        """After a stop signal to the workers: until they have left, at most ``wait_s``. Found by their
        command line, not as msrun's children: Slurm signals every process of a step, and msrun, which
        dies of SIGTERM and SIGUSR1, may be gone while its workers still write their checkpoint (a step
        whose task has ended loses its other processes)."""
        if not self.stopped:
            return
        deadline = time.monotonic() + self.wait_s()
        while (left := processes_with(self.workers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:
            _kill(pid, signal.SIGKILL)


def kill_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def processes_with(words: tuple[str, ...]) -> list[int]:
    """The live processes of this host running ``words[0]`` ("-m pulse_mindspore.train": their first
    arguments after the interpreter, so msrun's own command line, which ends with the workers', is not
    one) whose arguments hold every other word run ("--config RUN/run.yaml"), this process aside."""
    first, *rest = [w.split(" ") for w in words]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        argv = _cmdline(int(entry.name)).split("\0")
        if argv[1:1 + len(first)] == first and all(_holds(argv, w) for w in rest) and running(int(entry.name)):
            found.append(int(entry.name))
    return found


def _holds(argv: list[str], run: list[str]) -> bool:
    return any(argv[i:i + len(run)] == run for i in range(len(argv)))


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:
        return ""
