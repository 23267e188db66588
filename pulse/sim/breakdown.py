"""Where a simulated step goes: compute, bubble, imbalance, exposed point-to-point, exposed all-reduce.

Each part is what the step would lose if that cost alone went away, taken one
after another on the same placement and lowered schedule, so the parts sum to
the simulated step exactly (a telescoping sum)::

    step                 = done + sync + optimizer                  (pulse.sim.step)
    step without AR      = lists_done + optimizer                   buckets, norm and report free
    step without AR, p2p = makespan_free + optimizer                every message free as well
                                                                    (the same program re-run on links of
                                                                    infinite bandwidth, no latency, no
                                                                    per-message cost)
    makespan_free        = C_max + (makespan_free - C_max)          C_d: device d's compute in that run

    compute            = mean_d C_d + optimizer     the work itself: the pipeline devices' mean compute
                                                    (forwards, backwards, weight gradients, encodes, with
                                                    their cold starts) and the slowest optimizer step
    imbalance          = C_max - mean_d C_d         the most loaded device's compute above the mean: what
                                                    a perfect partition of the same work would save
    bubble             = makespan_free - C_max      the most loaded device idle in the run with free
                                                    messages: fill, drain and dependency waits of the
                                                    schedule itself
    exposed_p2p        = lists_done - makespan_free what the point-to-point messages add (their link time,
                                                    latency, per-message calls, contention) that compute
                                                    does not hide
    exposed_allreduce  = done - lists_done + sync   the data-parallel buckets that outlast the slowest
                                                    rank's list, plus the clipping norm and report all-reduces

``exposed_p2p`` is >= 0 whenever a rank's compute runs at a fixed speed (a fixed
action order only waits longer when messages take longer); on a CPU host whose
ranks share cores it can dip below 0, since a different overlap changes the share.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pulse.costs import CostTable
from pulse.encoders import EncoderSet
from pulse.hardware import Cluster
from pulse.links import LinkCost
from pulse.placement import Placement
from pulse.schedule.ir import Schedule
from pulse.sim.engine import simulate
from pulse.sim.memory import MemoryModel
from pulse.sim.result import SimResult
from pulse.sim.step import StepTime
from pulse.spec import ModelSpec

PARTS = ("compute", "bubble", "imbalance", "exposed_p2p", "exposed_allreduce")


@dataclass(frozen=True)
class StepBreakdown:
    """Seconds of one simulated step by cause (module docstring); they sum to ``total``."""

    compute: float
    bubble: float
    imbalance: float
    exposed_p2p: float
    exposed_allreduce: float
    total: float  # the simulated step (StepTime.total)

    def parts(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in PARTS}

    def text(self) -> str:
        """``step 12.30 ms = compute 9.00 + bubble 2.00 + ...`` for the CLIs."""
        body = " + ".join(f"{name.replace('_', ' ')} {seconds * 1e3:.2f}" for name, seconds in self.parts().items())
        return f"step {self.total * 1e3:.2f} ms = {body}"


def free_links(cluster: Cluster, num_devices: int) -> Cluster:
    """``cluster`` with every link between its first ``num_devices`` ranks free: infinite
    bandwidth, no latency, no per-message cost (compute and all-reduce figures unchanged)."""
    free = LinkCost(math.inf, 0.0, 0.0, 0.0)
    links = {(a, b): free for a in range(num_devices) for b in range(num_devices) if a != b}
    return replace(cluster, name=f"{cluster.name}+free-links", links=links)


def breakdown_of(step: StepTime, free_run: SimResult) -> StepBreakdown:
    """The parts of ``step`` given ``free_run``, the same program simulated on ``free_links``."""
    compute = free_compute(free_run)
    mean, most = sum(compute) / len(compute), max(compute)
    return StepBreakdown(
        compute=mean + step.optimizer,
        bubble=free_run.makespan - most,
        imbalance=most - mean,
        exposed_p2p=step.lists_done - free_run.makespan,
        exposed_allreduce=step.devices_done - step.lists_done + step.sync,
        total=step.total,
    )


def free_compute(run: SimResult) -> list[float]:
    """Per pipeline device, the seconds its compute spans took in ``run`` (cold starts and a
    shared core's slowdown included, as the rank's thread spends them)."""
    out = [0.0] * run.num_devices
    for span in run.compute:
        out[span.device] += span.end - span.start
    return out


def step_breakdown(spec: ModelSpec, placement: Placement, schedule: Schedule, costs: CostTable,
                   cluster: Cluster, step: StepTime, memory: MemoryModel = MemoryModel(),
                   encoders: EncoderSet | None = None, replicas: int = 1) -> StepBreakdown:
    """Decompose ``step`` (the schedule's simulated step on ``cluster``, ``replicas`` running it): one more
    simulation, of the same schedule with every message free."""
    free_run = simulate(spec, placement, schedule, costs, free_links(cluster, placement.num_devices),
                        memory=memory, encoders=encoders, replicas=replicas)
    return breakdown_of(step, free_run)
