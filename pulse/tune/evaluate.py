"""Price one candidate: partition, schedule, simulate, add the data-parallel all-reduce."""
from __future__ import annotations

from dataclasses import dataclass, replace

from pulse.costs import CostTable
from pulse.encoders import EncoderSet
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.partition import partition
from pulse.partition.fitted_splits import FittedSplits
from pulse.partition.interleaved import interleaved_placement
from pulse.partition.symmetric import plan_symmetric
from pulse.placement import Placement
from pulse.schedule.generators import BASELINES, OnLinks, make_schedule
from pulse.schedule.ir import Schedule
from pulse.sim.encodes import place_encodes
from pulse.sim.engine import simulate
from pulse.sim.memory import MemoryModel
from pulse.sim.breakdown import StepBreakdown
from pulse.sim.step import StepTerms, StepTime, step_time
from pulse.spec import ModelSpec
from pulse.tune.space import Candidate


@dataclass(frozen=True)
class Evaluation:
    candidate: Candidate
    iteration_time: float  # seconds of the whole step (pulse.sim.step): pipeline, exposed all-reduce,
    # clipping sync, optimizer
    samples_per_s: float
    pipeline_time: float  # makespan of the schedule alone
    allreduce_time: float  # seconds of all-reduce on the busiest device (mostly overlapped)
    peak_memory: int  # bytes, worst device
    bytes_per_iteration: int  # pipeline traffic of all replicas + all-reduce traffic
    p2p_bytes_per_iteration: int  # pipeline point-to-point traffic of all replicas alone
    bubble_ratio: float
    fits: bool
    reason: str  # why it does not fit, or ""
    placement: Placement | None = None
    schedule: Schedule | None = None
    device_peaks: tuple[int, ...] = ()  # bytes per pipeline device (the tuner's recompute search reads it)
    encoders: EncoderSet | None = None  # the plan's encoders when they run in the pipeline
    step: StepTime | None = None  # the simulated step's terms (pulse.sim.step)
    breakdown: StepBreakdown | None = None  # where the step goes (pulse.sim.breakdown), for the tuner's bests
    fitted: FittedSplits | None = None  # priced on this model, finer only where its cuts fall (pulse.tune.fitted)


CROSSING_CHAINS = 1  # V chains over every cut (skips may cross) timed beside the skip-local ones, per V shape: the
# min-max one (2: also the least bytes within the slack of it, about 1.4x the search time on SD v2 2x8, not 1.15x)


def place(spec: ModelSpec, costs: CostTable, cluster: Cluster, cand: Candidate) -> Placement:
    """The candidate's placement. PULSE's V: the fastest by simulated step of its skip-local chains and
    ``CROSSING_CHAINS`` chains over every cut, which may let a skip leave its device (``partition.crossing``;
    timed only where they balance better): the V `pulse plan` / `train` pick on a fast link."""
    if cand.partitioner == "pulse":
        return plan_symmetric(spec, costs, cand.pp, folds=cand.folds, strict=False, cluster=cluster,
                              num_microbatches=cand.num_microbatches, crossing=CROSSING_CHAINS).placement
    if cand.virtual > 1:
        placement = interleaved_placement(spec, costs, cand.pp, virtual=cand.virtual, base=cand.partitioner,
                                          cluster=cluster)
        placement.validate(spec.num_layers)
    else:
        placement = partition(cand.partitioner, spec, costs, cand.pp, cluster=cluster)
    return replace(placement, skip_transport=cand.skip_transport)  # PULSE's shapes send skips direct


def evaluate(spec: ModelSpec, costs: CostTable, cluster: Cluster, cand: Candidate, budget: int,
             memory: MemoryModel = MemoryModel(), schedule: Schedule | None = None,
             placement: Placement | None = None, encoders: EncoderSet | None = None,
             links: OnLinks | None = None) -> Evaluation:
    """Simulate one replica's pipeline; replicas run the same schedule in lockstep.
    ``cand.recompute`` says which chunks recompute (it replaces ``memory.recompute``); ``links``
    (the cluster's, by default) orders the list schedules and keeps their task graphs. With
    ``encoders`` (and a candidate whose mode is not cached) the encodes are placed and priced."""
    placement = placement or place(spec, costs, cluster, cand)
    if schedule is None:
        links = links or OnLinks(spec, cluster)
        schedule = candidate_schedule(cand, placement, costs, links)
    # a replica alone keeps no data-parallel buckets
    memory = replace(memory, recompute=frozenset(cand.recompute),
                     bucket_bytes=memory.bucket_bytes if cand.dp > 1 else 0)
    plan_encoders = None
    if encoders is not None and cand.encoders != "cached":
        plan_encoders = encoders.with_mode(cand.encoders)
        schedule = place_encodes(spec, placement, schedule, costs, cluster, plan_encoders, budget, memory)
    result = simulate(spec, placement, schedule, costs, cluster, memory_budget=budget, memory=memory,
                      encoders=plan_encoders, links=links, replicas=cand.dp)  # the shape's task graph, built once
    step = step_time(spec, placement, costs, cluster, result, StepTerms(dp=cand.dp, grad_bytes=memory.grad_bytes))
    iteration = step.total
    ar_bytes = step.allreduce_bytes(cand.dp)
    per_device: dict[int, float] = {}
    for b in step.buckets:
        per_device[b.device] = per_device.get(b.device, 0.0) + b.end - b.start
    ar_longest = max(per_device.values(), default=0.0)
    batch = cand.dp * cand.microbatch_size * cand.num_microbatches
    peak = max(result.peak_memory)
    worst = result.peak_memory.index(peak)
    at_peak = result.memory[worst]
    made = f", gradients {at_peak.gradients / 2**30:.2f}" if at_peak.gradients else ""
    reason = "" if peak <= budget else (
        f"device {worst} needs {peak / 2**30:.2f} GiB (static {at_peak.static / 2**30:.2f}{made}, "
        f"activations {at_peak.activations / 2**30:.2f}, skips {at_peak.skip_cache / 2**30:.2f}) "
        f"> budget {budget / 2**30:.2f} GiB")
    return Evaluation(cand, iteration, batch / iteration, result.makespan, ar_longest, peak,
                      result.total_link_bytes * cand.dp + ar_bytes, result.total_link_bytes * cand.dp,
                      result.bubble_ratio, peak <= budget,
                      reason, placement, schedule, tuple(result.peak_memory), plan_encoders, step)


def candidate_schedule(cand: Candidate, placement: Placement, costs: CostTable, links: OnLinks) -> Schedule:
    """The candidate's schedule; the list schedules ordered on the cluster's links."""
    if cand.inflight_cap is None and not cand.device_caps:
        return make_schedule(cand.schedule, placement, cand.num_microbatches, costs, links)
    caps = dict(enumerate(cand.device_caps)) if cand.device_caps else cand.inflight_cap
    return BASELINES[cand.schedule](placement, cand.num_microbatches, costs, inflight_cap=caps, links=links)


def safe_evaluate(*args, **kwargs) -> Evaluation | str:
    """An evaluation, or the reason the candidate cannot be built (too many chunks, ...)."""
    try:
        return evaluate(*args, **kwargs)
    except PlanError as exc:
        return str(exc)
