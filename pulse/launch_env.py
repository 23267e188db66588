"""What a launcher tells the ranks it starts, and what this host shows of its devices. Framework-free.

::

    pulse train --backend mindspore ─▶ msrun env: PULSE_GLOO_PORT   (a CPU pipeline's gloo rendezvous,
                                                                     pulse_mindspore.transport)
                                                  PULSE_MSRUN_NODES (the nodes the job spans: a CPU worker's
                                                                     share of its node's cores,
                                                                     pulse_mindspore.msrun_env.local_worker)
                                 ◀─ each worker: msrun_logs/finished-<pid> once its work and outputs are done
                                    (a MindSpore crash in the teardown after it lost nothing)

Both the launcher (``pulse.cli.msrun_launch``) and the workers read these names, so they live in
the core, where a worker can import them without the command line.
"""
from __future__ import annotations

from pathlib import Path

MSRUN_LOGS = "msrun_logs"  # beside the run's run.yaml: msrun's --log_dir, and where its workers mark their end
GLOO_PORT_ENV = "PULSE_GLOO_PORT"  # read by pulse_mindspore.transport.gloo_rendezvous
NODES_ENV = "PULSE_MSRUN_NODES"  # the nodes the job spans: a CPU worker's share of its node's cores


def ascend_available() -> bool:
    """Ascend NPUs are visible: the driver's device nodes (/dev/davinci0, ...) exist."""
    return any(Path("/dev").glob("davinci[0-9]*"))


def msrun_log_dir(config_path: str | Path) -> Path:
    """msrun's ``--log_dir`` for the job whose main file is ``config_path``: a run's run.yaml, a
    profile's costs.yaml (``pulse.cli.profile_cmd``)."""
    return Path(config_path).parent / MSRUN_LOGS


FINISHED = "finished-"  # + the worker's pid


def finished_mark(log_dir: str | Path, pid: int) -> Path:
    """The file an msrun worker writes once its work and every output of the run are done (before the
    interpreter's teardown): a crash after it lost nothing (``pulse.cli.msrun_launch.MsrunOutput``)."""
    return Path(log_dir) / f"{FINISHED}{pid}"


def finished_marks(log_dir: str | Path) -> dict[int, Path]:
    """The marks in ``log_dir``, by the pid of the worker that wrote each."""
    return {int(m.name[len(FINISHED):]): m for m in Path(log_dir).glob(f"{FINISHED}*")
            if m.name[len(FINISHED):].isdigit()}
