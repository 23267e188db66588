"""How `pulse train` starts the ranks: one ``Launcher`` per backend, and one way to run and watch it.

::

    Launcher.command(plan, plan.yaml, run.yaml, where)  ─▶  torchrun ... -m pulse_torch.train --plan --config
                                                         or msrun ... python -m pulse_mindspore.train --plan --config
    launch(command, launcher.output(), launcher.env(where))  ─▶  exit code (128 + signal when stopped)

The ranks read everything they need from plan.yaml and run.yaml
(``pulse.train.run_config``); no setting crosses as a command-line string.
This module stays framework-free: whether a framework is installed is asked
of importlib, never by importing it.
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from pulse import device_check
from pulse.backend_traits import traits_module
from pulse.cli import msrun_launch
from pulse.cli.oom_note import RunMemory, oom_note
from pulse.cli.stop_signals import STOP_MARGIN_S, Stopping, kill_group
from pulse.errors import PulseError
from pulse.oom_kills import OomKills
from pulse.plan import Plan
from pulse.train.preemption import signal_names, signal_numbers
from pulse.train.run_config import RunConfig


@dataclass(frozen=True)
class Where:
    """Which node of how many, where node 0's rendezvous store listens (torchrun), and how the launcher
    watches the ranks: restarts of a failed worker group, the stop signals the ranks checkpoint on."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    max_restarts: int = 0  # torchrun's --max-restarts: the restarted group resumes by itself
    preempt_signals: str = "none"  # the run's --preempt-signals ("TERM,USR1")
    preempt_grace: float = 0.0  # the run's --preempt-grace (seconds)


class OutputFilter(Protocol):
    def feed(self, line: str) -> list[str]: ...

    def flush(self) -> list[str]: ...

    def failed(self) -> dict[int, int]: ...

    def exit_code(self, launcher_code: int) -> int: ...

    def failure_note(self) -> str: ...


class Launcher(Protocol):
    """One backend's launcher: the command line, its output filter, its environment, what it refuses."""

    def check(self, config: RunConfig, where: Where) -> None:
        """Refuse (one line) the settings this backend's ranks cannot honour."""
        ...

    def command(self, plan: Plan, plan_path: Path, config_path: Path, where: Where) -> list[str]: ...

    def output(self) -> OutputFilter: ...

    def env(self, where: Where) -> dict[str, str] | None:
        """The launch environment (None: this process's, one thread per rank)."""
        ...

    def stopping(self, where: Where, config_path: Path) -> Stopping:
        """How the signals `pulse train` receives reach the ranks (``pulse.cli.stop_signals``)."""
        ...


class TorchrunLauncher:
    """torchrun (its store on loopback, or on --master-addr) with one process per rank of this node."""

    def check(self, config: RunConfig, where: Where) -> None:
        require_torch()
        traits_module("torch").check_options(config)
        device_check.check_precision(config.precision, "pulse_torch.device_support")  # bf16 on a V100 / 910A

    def command(self, plan: Plan, plan_path: Path, config_path: Path, where: Where) -> list[str]:
        prefix = launcher_prefix(plan.world_size // where.nnodes, where.master_addr, where.master_port,
                                 where.nnodes, where.node_rank)
        agent = ["--preempt-signals", where.preempt_signals, "--stop-timeout",
                 str(math.ceil(where.preempt_grace + STOP_MARGIN_S))] if signal_names(where.preempt_signals) else []
        restarts = ["--max-restarts", str(where.max_restarts)] if where.max_restarts else []
        split = prefix.index("--", prefix.index("pulse_torch.launch"))  # the launcher's own flags, then torchrun's
        return prefix[:split] + agent + prefix[split:] + restarts + \
            ["-m", "pulse_torch.train", "--plan", str(plan_path), "--config", str(config_path)]

    def output(self) -> OutputFilter:
        return LauncherOutput()

    def env(self, where: Where) -> dict[str, str] | None:
        return None

    def stopping(self, where: Where, config_path: Path) -> Stopping:
        return Stopping(signal_numbers(where.preempt_signals), where.preempt_grace)


class MsrunLauncher:
    """msrun: a scheduler (on node 0) and one worker per rank of this node (``pulse.cli.msrun_launch``);
    what MindSpore refuses, its ``pulse_mindspore.traits`` says (the workers ask it again)."""

    def check(self, config: RunConfig, where: Where) -> None:
        traits_module("mindspore").check_options(config)
        if where.max_restarts:
            raise PulseError("--max-restarts: msrun restarts no worker (MindSpore 2.10's msrun has no such option); "
                             "run without it (a requeued job resumes with --resume), or use --backend torch")

    def command(self, plan: Plan, plan_path: Path, config_path: Path, where: Where) -> list[str]:
        traits_module("mindspore").check_model(plan.model)
        return msrun_launch.msrun_command(plan, plan_path, config_path, where)

    def output(self) -> OutputFilter:
        return msrun_launch.MsrunOutput()

    def env(self, where: Where) -> dict[str, str] | None:
        return msrun_launch.msrun_env(nodes=where.nnodes)

    def stopping(self, where: Where, config_path: Path) -> Stopping:
        return Stopping(signal_numbers(where.preempt_signals), where.preempt_grace,
                        workers=(f"-m {msrun_launch.ENTRY}", f"--config {config_path}"))


LAUNCHERS: dict[str, Launcher] = {"torch": TorchrunLauncher(), "mindspore": MsrunLauncher()}


LAUNCH_WRAPPER = "PULSE_LAUNCH_WRAPPER"  # a command the torch launcher runs under


def launcher_prefix(nproc: int, master_addr: str = "127.0.0.1", master_port: int = 0, nnodes: int = 1,
                    node_rank: int = 0) -> list[str]:
    """torchrun for ``nproc`` processes on this node, its store listening on ``master_addr`` only.

    ``pulse_torch.launch`` binds the store's socket itself (torchrun's own store would listen
    on every interface); port 0 picks a free one, so single-node runs never collide.
    ``PULSE_LAUNCH_WRAPPER`` (a command line: ``numactl --interleave=all``, ``nsys profile -o trace``)
    runs the launcher, and with it every forked rank, under that command.
    """
    require_torch()
    wrapper = shlex.split(os.environ.get(LAUNCH_WRAPPER, ""))
    return [*wrapper, sys.executable, "-m", "pulse_torch.launch", "--bind", master_addr, "--port", str(master_port),
            "--node-rank", str(node_rank), "--", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc)]




def require_torch() -> None:
    if importlib.util.find_spec("pulse_torch") is None or importlib.util.find_spec("torch") is None:
        raise PulseError("--backend torch needs PyTorch and pulse_torch: pip install -e '.[torch]'")


class LauncherOutput:
    """Filters torchrun's stderr: the ranks' own lines pass, torchrun's echo of their failure does not.

    When a rank fails, torchrun adds a Python traceback of itself and a
    ChildFailedError summary, and exits 1 whatever the rank's code. A rank
    that failed on bad input has printed its one line already: this keeps that
    line, drops torchrun's block (remembering each rank's exit code from it)
    and lets every other line, a rank's own traceback included, through.
    """

    _RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
    _CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
    _AGENT = re.compile(r"^[EW]\d{4} .*torch/distributed/elastic/.*\] (failed \(exitcode|Sending process)")
    # pulse_torch.launch's own summary of torchrun's failure: `pulse train` says it again, with more (launch)
    _JOB_FAILED = re.compile(r"^python -m pulse_torch\.launch: the job failed \((.*)\)\s*$")
    _RANK_CODE = re.compile(r"rank (\d+): (exit code|signal) (\d+)")

    def __init__(self) -> None:
        self.exit_codes: dict[int, int] = {}
        self._held: list[str] = []  # a traceback, until its exception line says whose it is
        self._summary = False
        self._rank: int | None = None

    def feed(self, line: str) -> list[str]:
        """The lines to show now."""
        if self._summary:
            self._parse_summary(line)
            return []
        if line.startswith("Traceback (most recent call last):"):
            out, self._held = self._held, [line]
            return out
        if self._held:
            self._held.append(line)
            if line[:1] in (" ", "\t"):
                return []
            held, self._held = self._held, []
            if "ChildFailedError" in line:
                self._summary = True
                return []
            return held
        if (match := self._JOB_FAILED.match(line)) and (codes := self._RANK_CODE.findall(match.group(1))):
            for rank, kind, value in codes:
                self.exit_codes[int(rank)] = int(value) if kind == "exit code" else -int(value)
            return []
        return [] if self._AGENT.match(line) else [line]

    def flush(self) -> list[str]:
        held, self._held = self._held, []
        return held

    def _parse_summary(self, line: str) -> None:
        if match := self._RANK.match(line):
            self._rank = int(match.group(1))
        elif (match := self._CODE.match(line)) and self._rank is not None:
            self.exit_codes[self._rank] = int(match.group(1))

    def failed(self) -> dict[int, int]:
        """Ranks that failed by themselves: SIGTERM (-15) is torchrun stopping the rest after one failed."""
        return {r: c for r, c in self.exit_codes.items() if c not in (0, -15)}

    def exit_code(self, launcher_code: int) -> int:
        """The failed ranks' exit code when they agree on a positive one (2: bad input), else the launcher's."""
        codes = set(self.failed().values())
        return codes.pop() if len(codes) == 1 and min(codes) > 0 and launcher_code != 0 else launcher_code

    def failure_note(self) -> str:
        how = {r: f"exit code {c}" if c >= 0 else f"signal {-c}" for r, c in sorted(self.failed().items())}
        return ", ".join(f"rank {r}: {h}" for r, h in how.items())


def launch(command: list[str], output: OutputFilter | None = None, env: dict[str, str] | None = None,
           memory: RunMemory | None = None, stopping: Stopping | None = None, name: str = "pulse train") -> int:
    """Run the launcher: stdout straight to this terminal (through ``output.feed_stdout`` where the filter
    has one: msrun's, which drops MindSpore's own log lines), stderr through ``output``.

    The launcher gets a process group of its own and dies with this process
    (``die_with_parent``); SIGTERM, SIGINT and ``stopping``'s stop signals sent here
    are passed on to it (msrun: a stop signal to its workers), and it stops its ranks;
    on a stop signal they checkpoint first. Ranks die with their launcher (``pulse_torch.train``).
    A failed run's closing line names an out-of-memory kill when the memory cgroups'
    kill counters rose meanwhile (``pulse.oom_kills``), with each SIGKILLed rank's last
    logged peak beside its predicted one (``memory``: ``pulse.cli.oom_note``). ``name`` starts the
    launch's own lines: the command that launched.
    """
    if env is None:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")  # N ranks share the host's cores; torchrun would warn otherwise
    # no MALLOC_* here: a CPU rank sets its own heap when it pins itself (pulse.host_heap), and leaves
    # one the user or a benchmark set in this environment alone (memory_scale.py's 64 KiB threshold)
    output = LauncherOutput() if output is None else output
    kills_before = OomKills.read()
    feed_stdout = getattr(output, "feed_stdout", None)  # msrun's: the workers' logs carry MindSpore's own lines
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, bufsize=1,
                               stdout=subprocess.PIPE if feed_stdout is not None else None,
                               start_new_session=True, preexec_fn=_die_with_parent)
    assert process.stderr is not None
    pump = _pump(process.stdout, feed_stdout, sys.stdout) if feed_stdout is not None else None
    received: list[int] = []
    stopping = Stopping() if stopping is None else stopping
    previous = {sig: signal.signal(sig, _forward_to(process, received, stopping)) for sig in stopping.signals()}
    try:
        for line in process.stderr:
            sys.stderr.writelines(output.feed(line))
            sys.stderr.flush()
        sys.stderr.writelines(output.flush())
        if pump is not None:  # every line of the ranks' output shown (or dropped) before the launch's own
            pump.join()
        code = output.exit_code(_wait(process, received, stopping))
        stopping.wait_for_workers()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if process.poll() is None:  # this process is leaving for another reason: take the launcher along
            kill_group(process, signal.SIGKILL)
    if received:
        why = (" (a stop signal: the ranks checkpoint the step in progress first, unless a second signal or "
               "their grace period cut it short; `--resume` continues from the newest complete checkpoint)"
               if received[0] in stopping.preempt else "")
        print(f"{name}: stopped by {signal.Signals(received[0]).name}; the launcher and its ranks have "
              f"exited{why}", file=sys.stderr)
        return 128 + received[0]
    if (notes := getattr(output, "notes", None)) is not None:  # msrun's: crashes after the run was complete
        sys.stderr.writelines(notes(name))
    kills = OomKills.read().since(kills_before) if code != 0 else 0
    if (output.failed() or kills) and code != 2:  # code 2: the ranks said what was wrong in one line each already
        print(closing_line(output, code, kills, memory, name), file=sys.stderr)
    return code


def closing_line(output: OutputFilter, code: int, kills: int, memory: RunMemory | None,
                 name: str = "pulse train") -> str:
    """``pulse train: the launch failed (rank 1: signal 9)``, and what the out-of-memory killer did."""
    line = f"{name}: the launch failed ({output.failure_note() or f'exit code {code}'})"
    if not kills:
        return line
    sigkilled = sorted(r for r, c in output.failed().items() if c == -signal.SIGKILL)
    return f"{line}; {oom_note(kills, sigkilled, memory)}"


def _pump(stream, feed: Callable[[str], list[str]], out) -> threading.Thread:
    """A thread passing ``stream``'s lines through ``feed`` to ``out`` as they come (until it closes).
    Read as bytes up to each newline: a progress bar's carriage returns stay inside its line."""
    def run() -> None:
        for raw in iter(stream.buffer.readline, b""):
            out.writelines(feed(raw.decode(errors="replace")))
            out.flush()
    thread = threading.Thread(target=run, name="launcher stdout", daemon=True)
    thread.start()
    return thread


def _die_with_parent() -> None:
    """In the launcher's child, before exec: SIGTERM it when ``pulse train`` dies, even by SIGKILL."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def _forward_to(process: subprocess.Popen, received: list[int], stopping: Stopping):
    def forward(signum: int, _frame) -> None:
        received.append(signum)
        stopping.forward(process, signum)
    return forward


def _wait(process: subprocess.Popen, received: list[int], stopping: Stopping) -> int:
    """The launcher's exit code; after a forwarded signal, SIGKILL it if it outstays the grace period."""
    while True:
        try:
            return process.wait(timeout=stopping.wait_s() if received else None)
        except subprocess.TimeoutExpired:
            kill_group(process, signal.SIGKILL)
