"""One whole training step as the launcher runs it, on top of the pipeline's simulated program.

After its action list, every rank of ``pulse_torch.train`` / the step loop does::

    actions ──▶ data-parallel buckets ──▶ wait sends ──▶ clip: norm all-reduce ──▶ optimizer ──▶ report
    (program)   (pulse.grad_buckets: each    (its last      over the pipeline         step of its    all-reduce
                 launched when its layers'    message        ranks: every rank         layers         over the world
                 gradients are final, one     arrived)       waits for the slowest)
                 after another per rank)

so the step ends when the slowest rank has finished all of it::

    step = max_d(end_d) + norm all-reduce + max_d(optimizer_d) + report all-reduce
    end_d = max(rank d's list done, its last bucket reduced, its last send arrived)

A chunk's buckets become final during its last backward action (B, or W when split), the
one its AR follows in the lowered program (``pulse.schedule.lower``): that action walks the
chunk's layers from the last to the first, and a bucket is final once the walk has passed
its first layer, at that share of the action's per-layer seconds. A backend whose backward
yields no gradient before it ends (``cluster.buckets_at_chunk_end``: MindSpore's vjp) launches
them all at the AR. The runtime launches them as ``pulse.runtime.grad_sync`` says: what the
runtime does is what is priced.
"""
from __future__ import annotations

from dataclasses import dataclass

from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.grad_buckets import BUCKET_CAP_BYTES, bucket_layers
from pulse.hardware import Cluster
from pulse.ownership import trained_params
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
    bucket_cap: int = BUCKET_CAP_BYTES  # bytes of gradients one bucket holds (pulse.grad_buckets)

    def trained(self, spec: ModelSpec, start: int, end: int) -> int:
        """Parameters layers ``start``..``end - 1`` train: their gradients make a chunk's buckets."""
        return trained_params(spec, self.adapters, start, end)

    def buckets(self, spec: ModelSpec, start: int, end: int) -> list[tuple[int, int, int]]:
        """The chunk of layers ``start``..``end - 1``'s buckets in launch order: (first layer,
        end layer, bytes), spec indices."""
        sizes = [self.trained(spec, layer, layer + 1) * self.grad_bytes for layer in range(start, end)]
        return [(start + s, start + e, sum(sizes[s:e])) for s, e in bucket_layers(sizes, self.bucket_cap)]


@dataclass(frozen=True)
class BucketSpan:
    device: int
    chunk: int
    nbytes: int
    start: float
    end: float
    ready: float = 0.0  # its gradients final: the bucket may start (it waits for the rank's earlier ones)


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
    """Chunk -> its AR in the program, right after its last B (or last W when split), where its
    parameter gradients are all final: its buckets are launched by then."""
    out = {mark.chunk: mark.time for mark in result.marks if mark.kind == "AR"}
    missing = sorted(set(range(len(placement.chunks))) - out.keys())
    if missing:
        raise PlanError(f"simulated program of '{result.schedule_name}' has no all-reduce (AR) for chunks "
                        f"{missing}: it was not lowered by pulse.schedule.lower")
    return out


def bucket_spans(spec: ModelSpec, placement: Placement, result: SimResult, cluster: Cluster,
                 terms: StepTerms, costs: CostTable | None = None) -> list[BucketSpan]:
    """Each chunk's buckets, launched when final (``bucket_ready``), one after another per rank;
    with ``cluster.deferred_buckets`` (a communicator without an asynchronous all-reduce), in the
    same order but only once the rank's list is done and its sends have arrived, as its all-reduce waits."""
    if terms.dp <= 1:
        return []
    pp = placement.num_devices
    final = gradient_final_times(result, placement)
    walks = _final_backwards(result)
    spans = []
    for device in range(pp):
        group = replica_devices(device, pp, terms.dp)
        clock = _list_done(result, device) if cluster.deferred_buckets else 0.0
        ready = [(t, chunk, nbytes) for chunk in placement.chunks_of(device)
                 for t, nbytes in bucket_ready(spec, placement, chunk, final[chunk], walks.get(chunk), costs,
                                               cluster, terms)]
        for t, chunk, nbytes in sorted(ready, key=lambda r: (r[0], final[r[1]], r[1])):
            start = max(clock, t)
            clock = start + allreduce_seconds(nbytes, group, cluster)
            spans.append(BucketSpan(device, chunk, nbytes, start, clock, t))
    return spans


def bucket_ready(spec: ModelSpec, placement: Placement, chunk: int, final: float,
                 walk: tuple[str, float, float] | None, costs: CostTable | None, cluster: Cluster,
                 terms: StepTerms) -> list[tuple[float, int]]:
    """(when final, bytes) of ``chunk``'s buckets in launch order: during its last backward action
    ``walk`` (kind, start, end), at the share of the action's per-layer seconds (``costs``; equal
    shares without) the walk from the chunk's last layer has done once past the bucket's first
    layer; all at ``final``, the chunk's AR, where the backend yields nothing sooner."""
    ch = placement.chunks[chunk]
    buckets = terms.buckets(spec, ch.start, ch.end)
    if walk is None or cluster.buckets_at_chunk_end or len(buckets) == 1:
        return [(final, nbytes) for _, _, nbytes in buckets]
    kind, begin, end = walk
    seconds = [_layer_backward(costs, kind, layer) for layer in range(ch.start, ch.end)]
    total = sum(seconds)
    out = []
    for first, _, nbytes in buckets:
        done = sum(seconds[first - ch.start:]) / total if total > 0 else 1.0
        out.append((min(begin + done * (end - begin), final), nbytes))
    return out


def _layer_backward(costs: CostTable | None, kind: str, layer: int) -> float:
    if costs is None:
        return 1.0
    return costs.weight_backward(layer, layer + 1) if kind == "W" else costs.span(layer, layer + 1)[1]


def _final_backwards(result: SimResult) -> dict[int, tuple[str, float, float]]:
    """Chunk -> (kind, start, end) of its last B or W: the action whose walk makes its gradients final."""
    out: dict[int, tuple[str, float, float]] = {}
    for span in result.compute:
        if span.kind in ("B", "W") and (span.chunk not in out or span.end >= out[span.chunk][2]):
            out[span.chunk] = (span.kind, span.start, span.end)
    return out


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
    buckets = bucket_spans(spec, placement, result, cluster, terms, costs)
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
