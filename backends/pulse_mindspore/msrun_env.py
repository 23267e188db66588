"""What a worker can check before joining an msrun job: who it is, how many were started, what the device allows.

msrun exports to every process it starts (scheduler and workers)::

    MS_ROLE        MS_SCHED (the scheduler: runs the same script, serves the cluster in init())
                   or MS_WORKER
    MS_WORKER_NUM  --worker_num: the world size
    DEVICE_ID      the worker's local rank on its node (0 .. --local_worker_num - 1)
    RANK_ID        the worker's rank, when msrun numbers them itself (one node, or --node_rank)

Ascend's older rank-table start-up (one process per NPU started by hand with
RANK_TABLE_FILE, RANK_SIZE, RANK_ID and DEVICE_ID exported) has no
scheduler: its processes count as workers and RANK_SIZE as the world size.

These checks run on every process before ``init()``, so a bad plan or launch
ends the whole job at once with one line (from worker 0) and exit code 2,
instead of a cluster that waits for workers that never come. Framework-free.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, MutableMapping

from pulse.launch_env import NODES_ENV, finished_mark
from pulse.errors import PlanError

SCHEDULER, WORKER = "MS_SCHED", "MS_WORKER"
# HCCL's documented ranges (seconds): link set-up, and one operation (rounded down to 68 s steps).
HCCL_CONNECT_RANGE = (120, 7200)
HCCL_EXEC_RANGE = (68, 17340)


@dataclass(frozen=True)
class MsrunEnv:
    role: str | None  # SCHEDULER, WORKER, or None when not started by msrun
    world_size: int | None
    rank: int | None  # None until init() when msrun did not number the workers

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> "MsrunEnv":
        role = environ.get("MS_ROLE") or (WORKER if environ.get("RANK_TABLE_FILE") else None)
        world = environ.get("MS_WORKER_NUM") or environ.get("RANK_SIZE")
        rank = environ.get("RANK_ID") if role == WORKER else None
        return cls(role, int(world) if world else None, int(rank) if rank else None)

    @property
    def speaks(self) -> bool:
        """Whether this process reports an error every process hits: worker 0 (or every worker
        when ranks are not known yet); never the scheduler, whose output goes to its own log."""
        return self.role != SCHEDULER and self.rank in (0, None)


def local_worker(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(this worker's local rank, workers on its node): msrun exports the first as DEVICE_ID;
    pulse starts the same number on every node, so the second is the world over the nodes."""
    nodes = max(int(environ.get(NODES_ENV, "1")), 1)
    return int(environ.get("DEVICE_ID", "0")), max(int(environ.get("MS_WORKER_NUM", "1")) // nodes, 1)


def check_world(pp: int, dp: int, env: MsrunEnv) -> None:
    """The plan's pp x dp must be the number of workers msrun started."""
    if env.role is None:
        raise PlanError("pulse_mindspore.train runs under msrun: launch it with `pulse train --backend mindspore "
                        f"...`, or `msrun --worker_num {pp * dp} --local_worker_num {pp * dp} --master_port PORT "
                        "--join True python -m pulse_mindspore.train --plan PLAN` (or, on Ascend, with "
                        "RANK_TABLE_FILE, RANK_SIZE, RANK_ID and DEVICE_ID exported; see docs/ASCEND.md)")
    if env.world_size != pp * dp:
        raise PlanError(f"the plan needs pp x dp = {pp} x {dp} = {pp * dp} workers but msrun started "
                        f"{env.world_size}; launch with msrun --worker_num {pp * dp} --local_worker_num "
                        f"{pp * dp} (or re-plan for {env.world_size})")


def check_device(pp: int, device_target: str, p2p_devices: tuple[str, ...], why: str) -> None:
    """A pipeline (pp > 1) sends activations point to point: refuse it where no carrier exists
    (``p2p_devices``: Ascend's HCCL, CPU when torch brings gloo; ``pulse_mindspore.comm.p2p_devices``)."""
    if pp > 1 and device_target not in p2p_devices:
        raise PlanError(f"this plan pipelines over pp {pp} workers, but {why}")


def set_hccl_timeouts(timeout: float | None, environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Default HCCL's link and operation timeouts to ``timeout`` (clamped to HCCL's ranges).

    Values the user exported win. Returns what was set. HCCL reads them when
    ``init()`` builds the communicators, so call this first.
    """
    if timeout is None:
        return {}
    chosen = {}
    for name, (lo, hi) in (("HCCL_CONNECT_TIMEOUT", HCCL_CONNECT_RANGE), ("HCCL_EXEC_TIMEOUT", HCCL_EXEC_RANGE)):
        if name not in environ:
            environ[name] = chosen[name] = str(int(min(max(timeout, lo), hi)))
    return chosen


def mark_finished(log_dir: Path) -> None:
    """Everything this worker writes is written: say so where the launcher (`pulse train`, `pulse
    profile`) looks (``pulse.launch_env.finished_mark``), before the interpreter's teardown, in which
    MindSpore sometimes crashes (signal 11)."""
    if log_dir.is_dir():  # a worker started by hand, with another --log_dir, leaves no mark
        finished_mark(log_dir, os.getpid()).touch()
