"""Where the frozen encoders run: a pass that adds E actions to any compute schedule.

Generators and the ILP synthesizer place F/B/W; this pass then places one E per
(encoder, microbatch) by the plan's mode (``pulse.encoders.MODES``)::

    cached    nothing to add: the data set was encoded offline
    before    every E on chunk 0's device ahead of its pipeline work (DiffusionPipe's
              sequential baseline: the frozen part runs, then the pipeline)
    bubbles   microbatch by microbatch, each E into the idle gap that hurts least

Bubbles, on the schedule's timing without link contention (``timing.asap`` on
``deps``' task graph, the encodes placed so far included)::

    dev0  [E][F0][F1][F2][F3]....        mb 0's encodes cannot hide: nothing runs before F(0,0)
    dev1  [E1 ]  [F0][F1]...             fill bubble: mb 1's encode, sent to chunk 0
    dev2  [E2      ]  [F0]...
    dev3  [E3          ][F0]...

A gap is a candidate when it opens no later than the microbatch's first forward
starts (so nothing before it can depend on that microbatch: the order cannot
deadlock) on a device with room for the encoder's weights. So is any gap of the
step for a prefetch: E of M + m encodes the next step's microbatch m, which no
action of this step waits for (its RE ends the reader's row; the first step of a
run, with nothing prefetched, encodes where its chunks read). A microbatch whose
first forward opens the step (mb 0: nothing can run before it) hides only that
way, in the drain or the middle of the step before. Among candidates the E goes
where it fits (this step's first, then the earliest arrival at its readers); if
none fits, where it delays the least: the larger of its overrun of the gap and
its lateness for the first forward (a prefetch: for the step's end). After each
placement the times are recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from pulse.costs import CostTable
from pulse.encoders import EncoderSet, reader_chunks
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.placement import Placement
from pulse.schedule.deps import Task, TaskGraph, build_dependencies
from pulse.schedule.ir import Action, Schedule
from pulse.schedule.timing import Key, asap
from pulse.spec import ModelSpec


@dataclass(frozen=True)
class EncodeContext:
    """What placing encodes needs: the model, its placement, times and links, the encoders, and
    per device the bytes free for encoder weights (None: no memory limit)."""

    spec: ModelSpec
    placement: Placement
    costs: CostTable
    cluster: Cluster
    encoders: EncoderSet
    room: Mapping[int, int] | None = None


def add_encodes(schedule: Schedule, ctx: EncodeContext, mode: str | None = None) -> Schedule:
    """``schedule`` with E actions placed by ``mode`` (default: the encoders' own); encodes already in
    it are replaced. ``cached`` removes them."""
    mode = mode or ctx.encoders.mode
    base = schedule.without_encodes().compute_only()
    if mode == "cached" or not ctx.encoders.encoders:
        return base
    if mode == "before":
        return encodes_before(base, ctx)
    if mode == "bubbles":
        return encodes_in_bubbles(base, ctx)
    raise PlanError(f"unknown encoders mode '{mode}' (cached, before, bubbles)")


def encodes_before(schedule: Schedule, ctx: EncodeContext) -> Schedule:
    """All encodes on chunk 0's device, microbatch by microbatch, before its first compute."""
    first = ctx.placement.chunks[0].device
    _check_room(ctx, first, range(len(ctx.encoders.encoders)))
    head = tuple(Action(first, None, m, "E", encoder=e) for m in range(schedule.num_microbatches)
                 for e in range(len(ctx.encoders.encoders)))
    rows = dict(schedule.actions)
    rows[first] = head + tuple(rows.get(first, ()))
    return Schedule(schedule.name, schedule.num_microbatches, rows)


def _check_room(ctx: EncodeContext, device: int, encoders) -> None:
    if ctx.room is None:
        return
    need = sum(ctx.encoders.encoders[e].weight_bytes for e in encoders)
    if need > ctx.room.get(device, 0):
        raise PlanError(f"device {device} has {ctx.room.get(device, 0) / 2**30:.2f} GiB free, the encoders' "
                        f"weights need {need / 2**30:.2f} GiB")


def encodes_in_bubbles(schedule: Schedule, ctx: EncodeContext) -> Schedule:
    """Greedy, microbatch by microbatch, encoder by encoder (see the module docstring)."""
    spec, placement, costs, cluster = ctx.spec, ctx.placement, ctx.costs, ctx.cluster
    num_mb = schedule.num_microbatches
    split = any(a.kind == "W" for a in schedule.all_actions())
    graph = build_dependencies(spec, placement, num_mb, costs, cluster, split_backward=split)
    tasks: dict[Key, Task] = dict(graph.tasks)
    preds = {k: list(v) for k, v in graph.preds.items()}
    orders: dict[int, list[Key]] = {d: [a.task for a in schedule.actions.get(d, ())]
                                    for d in range(placement.num_devices)}
    readers = [reader_chunks(spec, placement, enc) for enc in ctx.encoders.encoders]
    resident: dict[int, set[int]] = {d: set() for d in orders}
    for m in range(num_mb):
        for e, enc in enumerate(ctx.encoders.encoders):
            seconds = costs.encoder_seconds(enc.name)
            starts = asap(TaskGraph(tasks, preds), _edges(preds), orders)
            if starts is None:  # cannot happen: every position offered opens before the first forward
                raise PlanError(f"placing encode {e}E{m} made the schedule cyclic")
            device, position, ahead = _best_gap(ctx, e, m, seconds, readers[e], tasks, starts, orders, resident)
            key = ("E", e, m + ahead * num_mb)
            orders[device].insert(position, key)
            resident[device].add(e)
            tasks[key] = Task(device, seconds)
            preds[key] = []
            for c in readers[e] if not ahead else ():  # a prefetch is read by the next step
                delay = cluster.transfer_time(device, placement.chunks[c].device, enc.out_bytes * costs.microbatch_size)
                preds[("F", c, m)].append((key, delay))
    rows = {d: tuple(Action.of_task(d, key) for key in row) for d, row in orders.items()}
    return Schedule(schedule.name, num_mb, rows)


def _edges(preds: dict[Key, list[tuple[Key, float]]]) -> list[tuple[Key, Key, float]]:
    return [(p, t, delay) for t, ps in preds.items() for p, delay in ps]


def _best_gap(ctx: EncodeContext, e: int, m: int, seconds: float, readers: tuple[int, ...],
              tasks: dict[Key, Task], starts: dict[Key, float], orders: dict[int, list[Key]],
              resident: dict[int, set[int]]) -> tuple[int, int, int]:
    """(device, position in its order, steps ahead) of the best gap for encode (e, m): in this step
    before the microbatch's first forward, or (ahead 1) anywhere in it for the next step's."""
    enc = ctx.encoders.encoders[e]
    first_forward = starts[("F", 0, m)]
    step_end = max(starts[k] + tasks[k].duration for k in starts)
    best: tuple | None = None
    for d, row in orders.items():
        weights = sum(ctx.encoders.encoders[i].weight_bytes for i in resident[d] | {e})
        if ctx.room is not None and weights > ctx.room.get(d, 0):
            continue  # no memory for this encoder's weights here
        opened = 0.0
        for position in range(len(row) + 1):
            closes = starts[row[position]] if position < len(row) else step_end
            end = opened + seconds
            arrivals = {c: end + ctx.cluster.transfer_time(d, ctx.placement.chunks[c].device,
                                                           enc.out_bytes * ctx.costs.microbatch_size)
                        for c in readers}
            tie_break = (max(arrivals.values()), d != ctx.placement.chunks[0].device, d)
            # this step's: before anything that may wait for the microbatch; late for its forwards
            if position == 0 or opened < first_forward:
                late = max([end - first_forward] + [t - starts[("F", c, m)] for c, t in arrivals.items()])
                candidate = ((max(end - closes, late, 0.0), 0, *tie_break), d, position, 0)
                best = candidate if best is None else min(best, candidate)
            # the next step's: nothing here waits for it; late only past the step's end
            late = max(arrivals.values()) - step_end
            best = min(best, ((max(end - closes, late, 0.0), 1, *tie_break), d, position, 1))
            if position < len(row):
                opened = starts[row[position]] + tasks[row[position]].duration
    if best is None:
        raise PlanError(f"no device has room for encoder '{enc.name}'s weights "
                        f"({enc.weight_bytes / 2**30:.2f} GiB)")
    return best[1], best[2], best[3]
