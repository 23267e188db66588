"""In-flight caps fitted to memory, device by device: the tuner's finalists' last step.

A list schedule's cap bounds the microbatches a device holds. One cap for every
device is set by the device with the least room, while a V's devices hold
different activations (the tip holds the fewest pairs' worth of layers at once,
the first device the embeddings and the output). On a slow link a device that may
hold one more microbatch can run a forward while its next backward's gradient is
still on the wire. So, for a finalist on a list schedule::

    caps = its cap on every device
    repeat: for each device, most memory to spare first:
                caps[d] + 1 (else + 2) -> schedule, simulate; keep it if every device fits and the step
            is faster by MIN_GAIN
            until a round keeps nothing (or MAX_ROUNDS)

Coordinate ascent, not an optimum; each try is one schedule and one simulation,
priced as every candidate is (``pulse.tune.evaluate``).
"""
from __future__ import annotations

from dataclasses import replace

from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.placement import Placement
from pulse.schedule.generators import LIST_SCHEDULES, OnLinks
from pulse.schedule.ir import Schedule
from pulse.sim.memory import MemoryModel
from pulse.spec import ModelSpec
from pulse.tune.evaluate import Evaluation, candidate_schedule, safe_evaluate
from pulse.tune.space import Candidate

MAX_ROUNDS = 6  # rounds over the devices: enough for the caps one margin allows
STEPS = (1, 2)  # microbatches more a device is tried with, in order
MIN_GAIN = 1e-3  # relative: a raise must buy this much of the step, else the round stops paying


def fit_caps(spec: ModelSpec, costs: CostTable, cluster: Cluster, e: Evaluation, budget: int,
             memory: MemoryModel = MemoryModel()) -> Evaluation:
    """``e`` with per-device caps raised while the step gets faster and every device fits (or ``e``)."""
    c = e.candidate
    if c.schedule not in LIST_SCHEDULES or not e.fits or e.encoders is not None or e.placement is None \
            or e.placement.num_devices == 1:  # one device: nothing to wait for
        return e
    devices = e.placement.num_devices
    start = c.inflight_cap if c.inflight_cap is not None else len(e.placement.chunks)
    caps = list(c.device_caps or [start] * devices)
    best, links = e, OnLinks(spec, cluster)  # every try orders on the same task graph: built once
    tried_schedules = {_rows(e.schedule)}
    for _ in range(MAX_ROUNDS):
        kept = False
        for d in sorted(range(devices), key=lambda d: best.device_peaks[d]):
            for more in STEPS:  # one more alone may change nothing until the next arrives
                trial = caps[:d] + [caps[d] + more] + caps[d + 1:]
                tried = _try(spec, costs, cluster, replace(c, inflight_cap=None, device_caps=tuple(trial)),
                             budget, memory, e.placement, links, tried_schedules)
                if tried is None or isinstance(tried, str) or not tried.fits or \
                        tried.iteration_time >= best.iteration_time * (1 - MIN_GAIN):
                    continue
                caps, best, kept = trial, tried, True
                break
        if not kept:
            break
    return best


def _try(spec: ModelSpec, costs: CostTable, cluster: Cluster, cand: Candidate, budget: int, memory: MemoryModel,
         placement: Placement, links: OnLinks, tried_schedules: set) -> Evaluation | str | None:
    """``cand`` evaluated, or None when its caps give a schedule already tried (``e``'s or a try's).

    Such a schedule simulates to the same step, which did not beat the best then (or is the best
    since), and the best only gets faster: it cannot be kept, so it is not simulated again."""
    try:
        schedule = candidate_schedule(cand, placement, costs, links)
    except PlanError as exc:
        return str(exc)
    rows = _rows(schedule)
    if rows in tried_schedules:
        return None
    tried_schedules.add(rows)
    return safe_evaluate(spec, costs, cluster, cand, budget, memory, schedule=schedule, placement=placement,
                         links=links)


def _rows(schedule: Schedule) -> tuple:
    """The schedule's actions, hashable: two tries with equal rows are the same schedule."""
    return tuple(schedule.actions.items())
