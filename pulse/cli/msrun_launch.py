"""`pulse train --backend mindspore`: the msrun command line, its environment, and what to show of its output.

::

    msrun --worker_num N --local_worker_num N --master_port <free> --log_dir RUN/msrun_logs --join True \\
          python -m pulse_mindspore.train --plan RUN/plan.yaml --config RUN/run.yaml
      msrun starts a scheduler and N workers (each runs the entry; their output goes to
      RUN/msrun_logs/worker_<r>.log, which msrun tails to this terminal)

msrun starts the task with the ``python`` found on PATH, so the launch puts
this interpreter's directory first. A pipeline plan (pp > 1) needs Ascend
(HCCL send/recv) or, on CPU, torch: its gloo carries the point-to-point
messages (``pulse_mindspore.transport``), meeting at a TCPStore on the free
port exported as ``PULSE_GLOO_PORT`` (``pulse.launch_env``). Framework-free, like all of ``pulse``:
whether MindSpore is installed is asked of importlib, not by importing it. What MindSpore refuses
(settings, models) it declares itself: ``pulse_mindspore.traits``.
"""
from __future__ import annotations

import importlib.util
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

from pulse import launch_env
from pulse.errors import PulseError
from pulse.launch_env import GLOO_PORT_ENV, NODES_ENV
from pulse.plan import Plan

ENTRY = "pulse_mindspore.train"


def gloo_available() -> bool:
    """torch is importable: the MindSpore workers can carry send/recv over its gloo on CPU."""
    return importlib.util.find_spec("torch") is not None


def free_port() -> int:
    """A TCP port nobody listens on now (msrun's scheduler takes it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_msrun() -> Path:
    if importlib.util.find_spec("mindspore") is None or importlib.util.find_spec("pulse_mindspore") is None:
        raise PulseError("--backend mindspore needs MindSpore and pulse_mindspore: pip install -e '.[mindspore]'")
    msrun = Path(sys.executable).parent / "msrun"
    if not msrun.exists():
        raise PulseError(f"--backend mindspore launches with msrun, which is not next to {sys.executable}; "
                         "install MindSpore (it brings msrun) into this environment")
    return msrun


def msrun_command(plan: Plan, plan_path: Path, config_path: Path, where: Any = None) -> list[str]:
    """One worker per rank of this node. One node: every worker here, a free scheduler port. Several
    (``where``: nnodes, node_rank, master_addr, master_port; the same command on each node): msrun's
    multi-node form, ``--node_rank`` numbering the workers node by node as ``pulse.layout`` expects,
    the scheduler on the node whose address is ``--master_addr``."""
    msrun = find_msrun()
    if plan.pp > 1:
        check_p2p(f"--pp {plan.pp}", "use --pp 1 (data parallel) here")
    return msrun_prefix(msrun, plan.world_size, launch_env.msrun_log_dir(config_path), where) + \
        ["python", "-m", ENTRY, "--plan", str(plan_path), "--config", str(config_path)]


def check_p2p(what: str, instead: str) -> None:
    """Point-to-point messages between MindSpore workers: Ascend (HCCL), or torch's gloo on a CPU."""
    if not launch_env.ascend_available() and not gloo_available():
        raise PulseError(f"{what} with --backend mindspore needs Ascend NPUs (none found: no "
                         "/dev/davinci*) or torch (its gloo carries send/recv on CPU, where MindSpore's mccl "
                         f"has none): pip install torch, {instead}, or --backend torch")


def msrun_prefix(msrun: Path, n: int, log_dir: Path, where: Any = None) -> list[str]:
    """msrun for ``n`` workers, up to ``python``: all here with a free scheduler port, or this node's share.
    An earlier job's finished marks in ``log_dir`` are removed: they would vouch for this job's workers."""
    for stale in launch_env.finished_marks(log_dir).values():
        stale.unlink()
    nodes = getattr(where, "nnodes", 1)
    if nodes == 1:
        place = ["--worker_num", str(n), "--local_worker_num", str(n), "--master_port", str(free_port())]
    else:
        place = ["--worker_num", str(n), "--local_worker_num", str(n // nodes), "--master_addr", where.master_addr,
                 "--master_port", str(where.master_port), "--node_rank", str(where.node_rank)]
    return [str(msrun), *place, "--log_dir", str(log_dir), "--join", "True"]


def msrun_env(environ: dict[str, str] | None = None, nodes: int = 1) -> dict[str, str]:
    """The launch environment: this interpreter first on PATH (msrun runs ``python``), quiet C++ logs,
    and on one node a free port for the gloo group of a CPU pipeline (unused otherwise; several nodes
    agree on the scheduler's port + 1 instead, ``pulse_mindspore.transport.gloo_rendezvous``)."""
    env = dict(os.environ if environ is None else environ)
    if nodes == 1:
        env.setdefault(GLOO_PORT_ENV, str(free_port()))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env[NODES_ENV] = str(nodes)  # read by pulse_mindspore.msrun_env.local_worker
    env.setdefault("OMP_NUM_THREADS", "1")  # N workers share the host's cores
    # MindSpore's C++ warnings (cluster building retries, ...) would flood the tailed worker logs.
    env.setdefault("GLOG_v", "3")
    return env


class MsrunOutput:
    """Filters msrun's stderr: its report of a failed worker and its own traceback are summarised.

    When a worker fails, msrun logs "Worker process <pid> exit with exception.
    Error code: N", kills the others, and raises RuntimeError (exit 1). A
    worker that failed on bad input printed its one line already (msrun tails
    every worker log to stdout): this drops msrun's lines, keeping the code.
    """

    _WORKER = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
    _NOISE = re.compile(r"^\[(INFO|WARNING)\] |Scheduler process \d+ exit with exception|"
                        r"There's worker exits with exception")
    _LOGS = re.compile(r"Please check logs in directory: (.*?)\.?$")
    # MindSpore's glog lines: [INFO] DISTRIBUTED(pid,thread,python):time [file:line] ...
    _MINDSPORE_LOG = re.compile(r"^\[(DEBUG|INFO|WARNING)\] [A-Z_]+\(\d+,")

    def __init__(self) -> None:
        self.exit_codes: dict[int, int] = {}  # worker pid -> exit code
        self.finished_crashes: dict[int, int] = {}  # worker pid -> signal, died after its finished mark
        self.log_dir: str | None = None
        self._held: list[str] = []  # msrun's traceback, until its last line says whose it is

    def feed(self, line: str) -> list[str]:
        """The lines to show now."""
        if match := self._WORKER.search(line):
            self.exit_codes[int(match.group(1))] = int(match.group(2))
            return []
        if self._held or line.startswith("Traceback (most recent call last):"):
            self._held.append(line)
            if line[:1] in (" ", "\t") or line.startswith("Traceback"):
                return []
            held, self._held = self._held, []
            if (match := self._LOGS.search(line.strip())) and self.failed():
                self.log_dir = match.group(1)  # a worker failed: its own output said why
                return []
            return held
        return [] if self._NOISE.search(line) else [line]

    def flush(self) -> list[str]:
        held, self._held = self._held, []
        return held

    def feed_stdout(self, line: str) -> list[str]:
        """msrun's stdout (the workers' logs, tailed): MindSpore's own log lines dropped. Its
        communicators log ``[INFO] DISTRIBUTED(...) ... Event base dispatch success!`` as a worker exits,
        after PULSE's closing line, whatever ``GLOG_v`` / ``MS_SUBMODULE_LOG_v`` say (MindSpore 2.10)."""
        return [] if self._MINDSPORE_LOG.match(line) else [line]

    def _failed_by_themselves(self) -> dict[int, int]:
        """Workers msrun reported failing on their own (it SIGKILLs the rest: -9)."""
        return {p: c for p, c in self.exit_codes.items() if c not in (0, -9)}

    def failed(self) -> dict[int, int]:
        """Workers that failed by themselves, but not after they finished."""
        return {p: c for p, c in self._failed_by_themselves().items() if p not in self.finished_crashes}

    def exit_code(self, launcher_code: int) -> int:
        """The failed workers' code when they agree on a positive one (2: bad input), else msrun's; 0 when
        the only failures are crashes after the run was complete (``crashed_after_finishing``)."""
        if launcher_code != 0 and self.crashed_after_finishing():
            return 0
        codes = set(self.failed().values())
        return codes.pop() if len(codes) == 1 and min(codes) > 0 and launcher_code != 0 else launcher_code

    def crashed_after_finishing(self) -> bool:
        """Every worker of this node (a ``worker_<rank>.log`` of msrun's) wrote its finished mark
        (``launch_env.finished_mark``), and those that failed by themselves died of a signal: MindSpore's
        native objects crashing the garbage collection of a finished process (signal 11,
        mindspore-ai/hyper-parallel#510). The run's outputs were all written and closed before the marks,
        so the run is complete; they are no failure then (``notes`` says so). msrun reports only the first
        worker to fail and SIGKILLs the rest unreported: hence every worker's mark, not the reported ones'."""
        own = self._failed_by_themselves()
        if self.log_dir is None or not own or any(c >= 0 for c in own.values()):
            return False
        logs = Path(self.log_dir)
        workers = len(list(logs.glob("worker_*.log")))
        marks = set(launch_env.finished_marks(logs))
        if workers == 0 or len(marks) != workers or not set(own) <= marks:
            return False
        self.finished_crashes = own
        return True

    def notes(self, name: str = "pulse train") -> list[str]:
        """What the launch says beside its outcome: the crashes it did not count as failures."""
        return [f"{name}: note: worker pid {p} died of signal {-c} after the run was complete (its "
                "work and every output written): a crash in MindSpore's teardown, not in the run\n"
                for p, c in sorted(self.finished_crashes.items())]

    def failure_note(self) -> str:
        codes = ", ".join(f"worker pid {p}: {'exit code ' + str(c) if c >= 0 else 'signal ' + str(-c)}"
                          for p, c in sorted(self.failed().items())) or "msrun failed"
        return codes + (f"; worker logs in {self.log_dir}" if self.log_dir else "")
