"""Lower bounds on a candidate's simulated step, so the tuner simulates only what can still win.

The bound is provably <= the step ``pulse.tune.evaluate`` simulates for the candidate
(and for its recomputing variants, which only add work), on every schedule::

    placement_bound   compute over devices, bytes over links: per device, its work as a ramp
                      (``sim.bounds.ramp``): all M microbatches of the tasks that cannot
                      start before h, after h, for every h a task's earliest start takes
                      (forwards through the chunks before it, each message's latency +
                      bytes / bandwidth); then
                      the least that must still follow its last task (the backward through the
                      chunks before it, or that chunk's last gradient bucket's all-reduce); its
                      buckets, one after another on its link, each chunk's from its last
                      backward's start (after all its work and the last microbatch's way to it),
                      as a ramp again; the slowest device, or one microbatch's critical
                      path; or a device's outbound link: its first task, then every message it
                      sends (M microbatches' activations and gradients, one link a rank)

    step >= pipeline bound + norm and report syncs + the slowest optimizer step

The simulator only adds to these: per-message calls, cold starts, link contention,
receives that wait, a shared core's slowdown (``pulse.sim.program``). The syncs and the
optimizer step are the step's own figures (``pulse.sim.step``), which depend on the
shape and the placement only.
"""
from __future__ import annotations

import math

from pulse.costs import CostTable
from pulse.hardware import Cluster
from pulse.placement import Placement
from pulse.schedule.deps import build_dependencies
from pulse.sim.bounds import heads, ramp, tails
from pulse.sim.collectives import allreduce_seconds, replica_devices
from pulse.sim.step import StepTerms, optimizer_seconds, sync_seconds
from pulse.spec import ModelSpec
from pulse.traffic import transfers
from pulse.tune.space import Candidate

# what the generators (pulse.schedule.generators) do with a backward: split it into B and W, or not;
# a schedule in neither is bounded both ways and gets the lesser
SPLIT_SCHEDULES = ("zero_bubble_v",)
WHOLE_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "greedy_v_1f1b")


def placement_bound(spec: ModelSpec, placement: Placement, costs: CostTable, cluster: Cluster,
                    cand: Candidate, terms: StepTerms) -> float:
    """Seconds ``cand``'s step on ``placement`` cannot beat (module docstring)."""
    splits = [split for split, names in ((False, WHOLE_SCHEDULES), (True, SPLIT_SCHEDULES))
              if cand.schedule in names] or [False, True]
    pipeline = min(_pipeline_bound(spec, placement, costs, cluster, cand, terms, split) for split in splits)
    optimizer = max(optimizer_seconds(costs, placement, d) for d in range(placement.num_devices))
    return pipeline * _slowdown(cluster) + optimizer + sync_seconds(placement.num_devices, terms, cluster)


def _pipeline_bound(spec: ModelSpec, placement: Placement, costs: CostTable, cluster: Cluster, cand: Candidate,
                    terms: StepTerms, split: bool) -> float:
    """The slowest device's head + work + what must follow, or one microbatch's critical path."""
    graph = build_dependencies(spec, placement, 1, costs, cluster, split_backward=split)
    order = graph.topological_order()
    head, tail = heads(graph, order), tails(graph, order)
    reduce = _bucket_seconds(spec, placement, cluster, terms)
    # a device's last task has no successor on it: each F has its B after it there (a split B its W), and
    # every B its chunk's B of every chunk before it: unsplit, the last is a B of the device's first chunk
    last_kind = "W" if split else "B"
    # encodes in the schedule (frozen encoders run in the pipeline) may come last: then nothing is known after
    encodes = cand.encoders != "cached"
    per_device: dict[int, list] = {}
    for key, task in graph.tasks.items():
        per_device.setdefault(task.device, []).append(key)
    pipeline = max(head[k] + graph.tasks[k].duration + tail[k] for k in order)
    sending = _send_ramps(spec, placement, cluster, cand, graph, head, tail)
    for device, keys in per_device.items():
        # every microbatch's copy of a task starts no earlier than the first microbatch's (``sim.bounds.ramp``)
        filled = ramp([(head[k], cand.num_microbatches * graph.tasks[k].duration) for k in keys])
        after = 0.0 if encodes else min(
            max(tail[k], sum(reduce[c][1] for c in placement.chunks_of(device)) if cluster.deferred_buckets
                else max(reduce[k[1]][0], reduce[k[1]][1] - graph.tasks[k].duration))
            for k in keys if k[0] == last_kind and (split or k[1] == min(placement.chunks_of(device))))
        first_output = min(head[k] + graph.tasks[k].duration for k in keys)
        # its sends, none before its first output (so at least that + all of them), as a ramp
        pipeline = max(pipeline, filled + after, ramp(*_unzip(sending.get(device, []), first_output)))
        if not encodes and not cluster.deferred_buckets:
            # a device's buckets share its one link: each chunk's from when they can start, one after another
            pipeline = max(pipeline, ramp([(_buckets_ready(graph, order, head, keys, c, last_kind, cand,
                                                           cluster.buckets_at_chunk_end), reduce[c][1])
                                           for c in placement.chunks_of(device) if reduce[c][1] > 0]))
    return pipeline


def _buckets_ready(graph, order: list, head: dict, keys: list, chunk: int, last_kind: str, cand: Candidate,
                   at_chunk_end: bool) -> float:
    """The earliest chunk ``chunk``'s buckets can start all-reducing: its gradients are final in its last
    backward, which follows all M microbatches' work of the chunk and the last microbatch's way to it
    (``_last_copy_start``); the buckets start no earlier than that backward's start, or at its end where
    they launch together at the chunk's AR."""
    mine = [k for k in keys if k[1] == chunk]
    last = max((graph.tasks[k].duration for k in mine if k[0] == last_kind), default=0.0)
    work = cand.num_microbatches * sum(graph.tasks[k].duration for k in mine)
    target = next((k for k in mine if k[0] == last_kind), None)
    way = _last_copy_start(graph, order, head, target, cand.num_microbatches) if target else 0.0
    return max(min(head[k] for k in mine) + work - last, way) + (last if at_chunk_end else 0.0)


def _last_copy_start(graph, order: list, head: dict, target, num_microbatches: int) -> float:
    """The least start of ``target``'s last microbatch: every task before it runs its M copies one after
    another from no earlier than its own head, and the copy that ends last still has its longest way to
    ``target`` ahead (a wave's first chunk holds every microbatch's first forward: the last of them reaches
    the chunks' last backwards only at the end of the pipeline, so their buckets cannot start earlier)."""
    way = {target: 0.0}  # longest time from a task's start to ``target``'s start
    for key in reversed(order):
        if key not in way:
            continue
        for pred, delay in graph.preds.get(key, ()):
            through = graph.tasks[pred].duration + delay + way[key]
            if through > way.get(pred, -1.0):
                way[pred] = through
    return max(head[k] + (num_microbatches - 1) * graph.tasks[k].duration + w for k, w in way.items())


def _send_ramps(spec: ModelSpec, placement: Placement, cluster: Cluster, cand: Candidate, graph, head: dict,
                tail: dict) -> dict[int, list[tuple[tuple[float, float], float]]]:
    """Per device, what its outbound link (one a rank, ``pulse.sim.program``) sends a step: for each
    transfer, ((the earliest the first microbatch's message is made, the seconds of all M microbatches'),
    what must follow the last one's arrival: its receiving task and that task's tail). Each transfer's
    bytes go forward from its sender, its gradient back from its receiver (a message's fixed costs left
    out, so it stays a bound)."""
    out: dict[int, list] = {}
    for tr in transfers(spec, placement):
        if tr.src_device == tr.dst_device:  # a V's fold: no wire
            continue
        nbytes = tr.total_bytes * cand.microbatch_size * cand.num_microbatches
        for sender, receiver, made, used in ((tr.src_device, tr.dst_device, ("F", tr.src_chunk, 0),
                                              ("F", tr.dst_chunk, 0)),
                                             (tr.dst_device, tr.src_device, ("B", tr.dst_chunk, 0),
                                              ("B", tr.src_chunk, 0))):
            bandwidth = cluster.link_cost(sender, receiver).bandwidth
            if not (math.isfinite(bandwidth) and bandwidth > 0):
                continue
            ready = head[made] + graph.tasks[made].duration if made in graph.tasks else 0.0
            after = graph.tasks[used].duration + tail[used] if used in graph.tasks else 0.0
            out.setdefault(sender, []).append(((ready, nbytes / bandwidth), after))
    return out


def _unzip(sends: list, floor: float) -> tuple[list[tuple[float, float]], list[float]]:
    """``sim.bounds.ramp``'s arguments for a device's sends, none made before its first output."""
    return [(max(ready, floor), seconds) for (ready, seconds), _ in sends], [after for _, after in sends]


def _bucket_seconds(spec: ModelSpec, placement: Placement, cluster: Cluster,
                    terms: StepTerms) -> list[tuple[float, float]]:
    """Per chunk, (what must follow its last backward, all of its buckets' all-reduces), seconds
    (``pulse.sim.step.bucket_spans``): its last bucket's, final only when that backward ends; all of
    them where they launch together at its AR (``buckets_at_chunk_end``) or after the rank's list
    (``deferred_buckets``, summed over the device's chunks by the caller); (0, 0) without DP. The
    buckets run one after the other, the first final no earlier than that backward's start."""
    out = []
    for chunk in placement.chunks:
        if terms.dp <= 1:
            out.append((0.0, 0.0))
            continue
        group = replica_devices(chunk.device, placement.num_devices, terms.dp)
        seconds = [allreduce_seconds(nbytes, group, cluster) for _, _, nbytes in terms.buckets(spec, chunk.start,
                                                                                                chunk.end)]
        whole = cluster.deferred_buckets or cluster.buckets_at_chunk_end
        out.append((sum(seconds) if whole else seconds[-1], sum(seconds)))
    return out


def _slowdown(cluster: Cluster) -> float:
    """At most how much faster than its table a rank computes: never, unless a shared-core host's
    ranks keep more than a whole core between them (``core_sharing`` > 1), which scales it."""
    sharing = cluster.hardware.core_sharing if cluster.shared_cores is not None else 1.0
    return 1.0 / max(sharing, 1.0)
