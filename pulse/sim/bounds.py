"""A makespan lower bound from the task graph alone (no schedule needed).

For each device: it cannot start before the earliest of its tasks can (the
longest path from the graph's sources, "fill"), it must then run all its work
("busy"), and after its last task something still has to finish ("drain", at
least the shortest tail after any of its tasks)::

    bound(d) = min head(t) + sum duration(t) + min tail(t)     over d's tasks t
    lower_bound = max(max over devices bound(d), critical path)
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
        busy = sum(graph.tasks[k].duration for k in keys)
        best = max(best, min(head[k] for k in keys) + busy + min(tail[k] for k in keys))
    return best
