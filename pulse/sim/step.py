"""One whole training step as the launcher runs it, on top of the pipeline's simulated program.

After its action list, every rank of ``pulse_torch.train`` / the step loop does::

    actions ──▶ data-parallel buckets ──▶ wait sends ──▶ clip: norm all-reduce ──▶ optimizer ──▶ report
    (program)   (one per chunk, launched     (its last      over the pipeline         step of its    all-reduce
                 when the chunk's gradients   message        ranks: every rank         layers         over the world
                 are final, one after         arrived)       waits for the slowest)
                 another per rank)

so the step ends when the slowest rank has finished all of it::

    step = max_d(end_d) + norm all-reduce + max_d(optimizer_d) + report all-reduce
    end_d = max(rank d's list done, its last bucket reduced, its last send arrived)

The buckets are the lowered program's AR actions (``pulse.schedule.lower``), which the
runtime dispatches to ``pulse.runtime.grad_sync``: what the runtime does is what is priced.
"""
from __future__ import annotations

from dataclasses import dataclass

from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.placement import Placement
from pulse.sim.collectives import allreduce_seconds, replica_devices
from pulse.sim.result import SimResult
from pulse.spec import ModelSpec

REPORT_BYTES = 32  # loss sum, loss count, pipeline bytes, all-reduce bytes: four float64
NORM_BYTES = 8  # the squared gradient norm of one rank


@dataclass(frozen=True)
class StepTerms:
    """What the launcher does around the pipeline, per step."""

    dp: int = 1
    grad_bytes: int = 4  # bytes per parameter all-reduced (the runtime keeps fp32 gradients)
    clip: bool = True  # global-norm clipping: a small all-reduce over the pipeline ranks
    report: bool = True  # the loss / bytes all-reduce over every rank
    # LoRA: the trained parameters per spec layer (``MemoryModel.adapters``); None: the layers' own
    adapters: tuple[int, ...] | None = None

    def trained(self, spec: ModelSpec, start: int, end: int) -> int:
        """Parameters layers ``start``..``end - 1`` train: their gradients make a chunk's bucket."""
        if self.adapters is None:
            return sum(l.params for l in spec.layers[start:end])
        return sum(self.adapters[start:end])


@dataclass(frozen=True)
class BucketSpan:
    device: int
    chunk: int
    nbytes: int
    start: float
    end: float


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step and where they go."""

    pipeline: float  # the slowest rank's action list
    devices_done: float  # the slowest rank's list, buckets and sends
    sync: float  # the norm and report all-reduces
    optimizer: float  # the slowest rank's optimizer step
    total: float
    buckets: tuple[BucketSpan, ...] = ()
    lists_done: float = 0.0  # the slowest rank's list and sends, buckets left out (pulse.sim.breakdown)

    @property
    def exposed_allreduce(self) -> float:
        return self.devices_done - self.pipeline

    def allreduce_bytes(self, dp: int) -> int:
        """Bytes the buckets put on the wire in one step: a ring all-reduce over D ranks sends
        2(D-1)/D of a bucket from each of them, so 2(D-1) bucket sizes per pipeline position."""
        return sum(2 * (dp - 1) * b.nbytes for b in self.buckets)


def gradient_final_times(result: SimResult, placement: Placement) -> dict[int, float]:
    """Chunk -> when its bucket is launched: its AR in the program, right after its last B
    (or last W when split), where its parameter gradients become final."""
    out = {mark.chunk: mark.time for mark in result.marks if mark.kind == "AR"}
    missing = sorted(set(range(len(placement.chunks))) - out.keys())
    if missing:
        raise PlanError(f"simulated program of '{result.schedule_name}' has no all-reduce (AR) for chunks "
                        f"{missing}: it was not lowered by pulse.schedule.lower")
    return out


def bucket_spans(spec: ModelSpec, placement: Placement, result: SimResult, cluster: Cluster,
                 terms: StepTerms) -> list[BucketSpan]:
    """Each chunk's gradient all-reduce, launched when final, one after another per rank; with
    ``cluster.deferred_buckets`` (a communicator without an asynchronous all-reduce), in the same
    order but only once the rank's list is done and its sends have arrived, as its all-reduce waits."""
    if terms.dp <= 1:
        return []
    pp = placement.num_devices
    final = gradient_final_times(result, placement)
    spans = []
    for device in range(pp):
        group = replica_devices(device, pp, terms.dp)
        clock = _list_done(result, device) if cluster.deferred_buckets else 0.0
        for chunk in sorted(placement.chunks_of(device), key=lambda c: (final[c], c)):
            ch = placement.chunks[chunk]
            nbytes = terms.trained(spec, ch.start, ch.end) * terms.grad_bytes
            start = max(clock, final[chunk])
            clock = start + allreduce_seconds(nbytes, group, cluster)
            spans.append(BucketSpan(device, chunk, nbytes, start, clock))
    return spans


def _list_done(result: SimResult, device: int) -> float:
    """When rank ``device``'s list is done and its last send has arrived."""
    end = result.rank_end[device] if result.rank_end else result.makespan
    return max(end, result.sends_done[device] if result.sends_done else 0.0)


def optimizer_seconds(costs: CostTable, placement: Placement, device: int) -> float:
    chunks = placement.chunks
    return sum(costs.optimizer_seconds(chunks[c].start, chunks[c].end) for c in placement.chunks_of(device))


def step_time(spec: ModelSpec, placement: Placement, costs: CostTable, cluster: Cluster, result: SimResult,
              terms: StepTerms = StepTerms()) -> StepTime:
    """The whole step: the simulated program plus what the launcher does after it."""
    pp = placement.num_devices
    buckets = bucket_spans(spec, placement, result, cluster, terms)
    ends = [_list_done(result, d) for d in range(pp)]
    for b in buckets:
        ends[b.device] = max(ends[b.device], b.end)
    sync = sync_seconds(pp, terms, cluster)
    optimizer = max((optimizer_seconds(costs, placement, d) for d in range(pp)), default=0.0)
    done = max(ends, default=0.0)
    lists_done = max((_list_done(result, d) for d in range(pp)), default=0.0)
    return StepTime(pipeline=result.makespan, devices_done=done, sync=sync, optimizer=optimizer,
                    total=done + sync + optimizer, buckets=tuple(buckets), lists_done=lists_done)


def sync_seconds(pp: int, terms: StepTerms, cluster: Cluster) -> float:
    """The step's small all-reduces after the buckets: the clipping norm over the pipeline
    ranks, the report over every rank (they depend on the shape only, not on the schedule)."""
    pipeline_ranks = list(range(pp))
    world = list(range(pp * max(terms.dp, 1)))
    return (allreduce_seconds(NORM_BYTES, pipeline_ranks, cluster) if terms.clip else 0.0) + \
           (allreduce_seconds(REPORT_BYTES, world, cluster) if terms.report else 0.0)
