"""Do a CPU host's ranks fit in its memory together? ``pulse train``'s check before launch.

::

    a rank   = the simulator's peak of its pipeline device + its training data (pulse.data.footprint)
    the host = the sum over the ranks one node runs (world / nnodes of them, rank = replica * pp + stage)
               <= the hardware's memory_bytes (on a CPU cluster: the host's, which its ranks share)

An accelerator's ranks each have a device of their own (``Hardware.shared_cores`` None):
the per-device check covers them, and their data lives in host memory, not the device's.
"""
from __future__ import annotations

from dataclasses import dataclass

from pulse.hardware import Hardware
from pulse.plan import Plan

GiB = 2**30


@dataclass(frozen=True)
class HostNeed:
    ranks: int  # on the busiest node
    state_bytes: int  # the simulator's peaks of those ranks' devices, summed
    data_bytes: int  # each rank's data

    @property
    def total(self) -> int:
        return self.state_bytes + self.ranks * self.data_bytes


def host_need(plan: Plan, data_bytes: int, nnodes: int, node: int | None = None) -> HostNeed | None:
    """What the busiest node's ranks hold together, or node ``node``'s (rank 0's: 0; None: the plan was
    not simulated per device)."""
    peaks = plan.predicted.get("peak_memory_bytes_per_device")
    if not peaks or len(peaks) != plan.pp or plan.world_size % nnodes:
        return None
    per_node = plan.world_size // nnodes
    nodes = [range(n * per_node, (n + 1) * per_node) for n in range(nnodes)]
    states = [sum(int(peaks[rank % plan.pp]) for rank in ranks) for ranks in nodes]
    return HostNeed(per_node, max(states) if node is None else states[node], data_bytes)


def host_refusal(plan: Plan, hardware: Hardware, data_bytes: int, nnodes: int,
                 limit: int | None = None) -> str | None:
    """The one line that refuses a plan whose ranks outgrow their shared host (None: it fits, or the
    ranks have devices of their own). ``limit``: what the job may use of the host (its memory cgroup's
    limit, ``pulse.host_limits``); None: the hardware's figure."""
    if hardware.shared_cores is None:
        return None
    need = host_need(plan, data_bytes, nnodes)
    usable = hardware.memory_bytes if limit is None else min(limit, hardware.memory_bytes)
    if need is None or need.total <= usable:
        return None
    where = (f"the {hardware.name} host has {hardware.memory_bytes / GiB:.1f} GiB" if usable == hardware.memory_bytes
             else f"this process's memory cgroup allows {usable / GiB:.1f} GiB of the {hardware.name} host")
    return (f"the plan's {need.ranks} ranks on one host need {need.total / GiB:.1f} GiB together "
            f"({need.state_bytes / GiB:.1f} GiB of model, activations and optimizer state in simulation + "
            f"{need.data_bytes / GiB:.2f} GiB of training data each) but {where}; raise --nnodes, lower --dp, "
            "--microbatch-size or the model's size, give --recompute, or --force to launch anyway")
