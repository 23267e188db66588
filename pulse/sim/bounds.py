"""A makespan lower bound from the task graph alone (no schedule needed).

For each device: it cannot start before the earliest of its tasks can (the
longest path from the graph's sources, "fill"), it must then run all its work
("busy"), and after its last task something still has to finish ("drain", at
least the shortest tail after any of its tasks). The fill is taken as a ramp
(``ramp``): no task starts before its own head, so every task whose head is at
least h runs after h, whatever the schedule::

    bound(d) = max over h of (h + sum duration(t) over d's tasks with head(t) >= h) + min tail(t)
    lower_bound = max(max over devices bound(d), critical path)

The ramp matters where a device's chunks start far apart: a V's outer device holds the
model's first and last layers, and its decoder chunk cannot start before the first
microbatch has come back down the whole forward (SD v2 at pp 16 on 910A 2x8: 9-13 ms of
a 58 ms floor, which the earliest head alone reads as 0).
"""
from __future__ import annotations

from pulse.schedule.deps import ComputeKey, TaskGraph


def heads(graph: TaskGraph, order: list[ComputeKey]) -> dict[ComputeKey, float]:
    """Earliest start of each task with unlimited devices."""
    out: dict[ComputeKey, float] = {}
    for key in order:
        out[key] = max((out[p] + graph.tasks[p].duration + delay for p, delay in graph.preds.get(key, ())),
                       default=0.0)
    return out


def tails(graph: TaskGraph, order: list[ComputeKey]) -> dict[ComputeKey, float]:
    """Longest time from a task's end to the end of the iteration."""
    succs = graph.succs()
    out: dict[ComputeKey, float] = {}
    for key in reversed(order):
        out[key] = max((delay + graph.tasks[s].duration + out[s] for s, delay in succs[key]), default=0.0)
    return out


def ramp(starts: list[tuple[float, float]], afters: list[float] | None = None) -> float:
    """The least time a device finishes ``(earliest start, seconds)`` tasks by, in any order on one
    device: max over h of h + the seconds of every task that cannot start before h. With ``afters``
    (what must still follow each task's end), plus the least of them over those tasks: one of them
    ends last."""
    best, later, least_after = 0.0, 0.0, float("inf")
    order = sorted(range(len(starts)), key=lambda i: starts[i][0], reverse=True)
    for i in order:
        start, seconds = starts[i]
        later += seconds
        least_after = min(least_after, afters[i]) if afters is not None else 0.0
        best = max(best, start + later + least_after)
    return best


def critical_path(graph: TaskGraph) -> float:
    order = graph.topological_order()
    head = heads(graph, order)
    return max((head[k] + graph.tasks[k].duration for k in order), default=0.0)


def lower_bound(graph: TaskGraph) -> float:
    """Busy time plus unavoidable fill and drain of the tightest device (seconds)."""
    order = graph.topological_order()
    head, tail = heads(graph, order), tails(graph, order)
    per_device: dict[int, list[ComputeKey]] = {}
    for key, task in graph.tasks.items():
        per_device.setdefault(task.device, []).append(key)
    best = max((head[k] + graph.tasks[k].duration + tail[k] for k in order), default=0.0)
    for keys in per_device.values():
        filled = ramp([(head[k], graph.tasks[k].duration) for k in keys])
        best = max(best, filled + min(tail[k] for k in keys))
    return best
