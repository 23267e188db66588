"""What a launcher tells the ranks it starts, and what this host shows of its devices. Framework-free.

::

    pulse train --backend mindspore ─▶ msrun env: PULSE_GLOO_PORT   (a CPU pipeline's gloo rendezvous,
                                                                     pulse_mindspore.transport)
                                                  PULSE_MSRUN_NODES (the nodes the job spans: a CPU worker's
                                                                     share of its node's cores,
                                                                     pulse_mindspore.msrun_env.local_worker)

Both the launcher (``pulse.cli.msrun_launch``) and the workers read these names, so they live in
the core, where a worker can import them without the command line.
"""
from __future__ import annotations

from pathlib import Path

GLOO_PORT_ENV = "PULSE_GLOO_PORT"  # read by pulse_mindspore.transport.gloo_rendezvous
NODES_ENV = "PULSE_MSRUN_NODES"  # the nodes the job spans: a CPU worker's share of its node's cores


def ascend_available() -> bool:
    """Ascend NPUs are visible: the driver's device nodes (/dev/davinci0, ...) exist."""
    return any(Path("/dev").glob("davinci[0-9]*"))
