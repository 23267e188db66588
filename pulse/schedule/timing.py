"""Times and orders on a task graph: earliest starts for given device orders, heads and
tails, reachability. Plain functions over ``TaskGraph``-shaped data, shared by the
window ILP, the modulo pattern and the synthesizer.

A device order is a list of (kind, chunk, microbatch) keys per device; ``asap``
runs them as early as the dependencies allow (the simulator without links).
"""
from __future__ import annotations

from typing import Mapping, Protocol, Sequence

Key = tuple[str, int, int]  # (kind, chunk, microbatch); ("E", encoder, microbatch) for an encode
Edge = tuple[Key, Key, float]  # (pred, succ, delay after pred ends)

RELEASE_KINDS = ("W", "B")  # the task whose end frees a microbatch's activations


class TaskLike(Protocol):
    device: int
    duration: float


class GraphLike(Protocol):
    """Shape of ``pulse.schedule.deps.TaskGraph`` that the model reads."""

    tasks: Mapping[Key, TaskLike]
    preds: Mapping[Key, Sequence[tuple[Key, float]]]


def extended_edges(graph: GraphLike, inflight_cap: Mapping[int, int] | None,
                   ordered: bool) -> list[Edge]:
    """The graph's dependencies plus microbatch-order and in-flight-cap edges."""
    edges: list[Edge] = [(p, t, delay) for t, ps in graph.preds.items() for p, delay in ps]
    tasks = graph.tasks
    if ordered:  # by microbatch within a (kind, chunk) on one device: an encoder's E may run on
        # several devices, each with some of its microbatches (and M + m: the next step's, last)
        groups: dict[tuple[str, int, int], list[int]] = {}
        for (k, c, m), task in tasks.items():
            groups.setdefault((k, c, task.device), []).append(m)
        for (k, c, _), ms in groups.items():
            ms.sort()
            edges += [((k, c, a), (k, c, b), 0.0) for a, b in zip(ms, ms[1:])]
    for (k, c, m), task in tasks.items():
        cap = (inflight_cap or {}).get(task.device)
        if k != "F" or cap is None or m - cap < 0:
            continue
        release = next((r, c, m - cap) for r in RELEASE_KINDS if (r, c, m - cap) in tasks)
        edges.append((release, (k, c, m), 0.0))
    return edges


def topological(keys: Sequence[Key], edges: Sequence[Edge]) -> list[Key]:
    succ: dict[Key, list[Key]] = {k: [] for k in keys}
    indeg = {k: 0 for k in keys}
    for p, t, _ in edges:
        succ[p].append(t)
        indeg[t] += 1
    ready = sorted(k for k in keys if indeg[k] == 0)
    out: list[Key] = []
    while ready:
        k = ready.pop()
        out.append(k)
        for t in succ[k]:
            indeg[t] -= 1
            if indeg[t] == 0:
                ready.append(t)
    if len(out) != len(keys):
        raise ValueError("task graph has a cycle")
    return out


def heads_and_tails(graph: GraphLike, edges: Sequence[Edge],
                    order: Sequence[Key]) -> tuple[dict[Key, float], dict[Key, float]]:
    """Earliest start of each task, and the longest path from its start to the end."""
    dur = {k: t.duration for k, t in graph.tasks.items()}
    preds: dict[Key, list[tuple[Key, float]]] = {k: [] for k in order}
    succs: dict[Key, list[tuple[Key, float]]] = {k: [] for k in order}
    for p, t, d in edges:
        preds[t].append((p, d))
        succs[p].append((t, d))
    head: dict[Key, float] = {}
    for k in order:
        head[k] = max((head[p] + dur[p] + d for p, d in preds[k]), default=0.0)
    tail: dict[Key, float] = {}
    for k in reversed(order):
        tail[k] = dur[k] + max((d + tail[s] for s, d in succs[k]), default=0.0)
    return head, tail


def descendants(edges: Sequence[Edge], order: Sequence[Key]) -> dict[Key, int]:
    """Bitmask (over positions in ``order``) of every task reachable from each task."""
    pos = {k: i for i, k in enumerate(order)}
    succs: dict[Key, list[Key]] = {k: [] for k in order}
    for p, t, _ in edges:
        succs[p].append(t)
    reach: dict[Key, int] = {}
    for k in reversed(order):
        mask = 0
        for s in succs[k]:
            mask |= reach[s] | (1 << pos[s])
        reach[k] = mask
    return reach


def tighten(graph: GraphLike, edges: Sequence[Edge], order: Sequence[Key], reach: Mapping[Key, int],
            head: dict[Key, float], tail: dict[Key, float]) -> tuple[dict[Key, float], dict[Key, float]]:
    """Heads and tails that also count the device: before t starts its device must run every
    same-device task that precedes t; after t starts, t and every same-device task after it."""
    dur = {k: t.duration for k, t in graph.tasks.items()}
    pos = {k: i for i, k in enumerate(order)}
    rows: dict[int, list[Key]] = {}
    for k in order:
        rows.setdefault(graph.tasks[k].device, []).append(k)
    preds: dict[Key, list[tuple[Key, float]]] = {k: [] for k in order}
    succs: dict[Key, list[tuple[Key, float]]] = {k: [] for k in order}
    for p, t, d in edges:
        preds[t].append((p, d))
        succs[p].append((t, d))
    new_head: dict[Key, float] = {}
    for k in order:
        before = [u for u in rows[graph.tasks[k].device] if reach[u] >> pos[k] & 1]
        chained = max((new_head[p] + dur[p] + d for p, d in preds[k]), default=0.0)
        packed = min((new_head[u] for u in before), default=0.0) + sum(dur[u] for u in before)
        new_head[k] = max(head[k], chained, packed)
    new_tail: dict[Key, float] = {}
    for k in reversed(order):
        after = [u for u in rows[graph.tasks[k].device] if reach[k] >> pos[u] & 1]
        chained = dur[k] + max((d + new_tail[s] for s, d in succs[k]), default=0.0)
        drain = min([new_tail[u] - dur[u] for u in after] + [chained - dur[k]])
        packed = dur[k] + sum(dur[u] for u in after) + drain
        new_tail[k] = max(tail[k], chained, packed)
    return new_head, new_tail


def makespan_of(graph: GraphLike, starts: Mapping[Key, float]) -> float:
    return max(starts[k] + t.duration for k, t in graph.tasks.items())


def device_orders(graph: GraphLike, starts: Mapping[Key, float]) -> dict[int, tuple[Key, ...]]:
    rows: dict[int, list[Key]] = {}
    for k, t in graph.tasks.items():
        rows.setdefault(t.device, []).append(k)
    return {d: tuple(sorted(row, key=lambda k: (round(starts[k], 12), k[2], k[0] != "F", k[1])))
            for d, row in sorted(rows.items())}


def asap(graph: GraphLike, edges: Sequence[Edge], orders: Mapping[int, Sequence[Key]]) -> dict[Key, float] | None:
    """Earliest starts that keep ``orders`` on each device; None if they deadlock."""
    chained = list(edges) + [(row[i - 1], row[i], 0.0) for row in orders.values() for i in range(1, len(row))]
    try:
        order = topological(list(graph.tasks), chained)
    except ValueError:
        return None
    head, _ = heads_and_tails(graph, chained, order)
    return head


def is_periodic(orders: Mapping[int, Sequence[Key]]) -> bool:
    """Does a_i precede b_j exactly when a_i+1 precedes b_j+1, for all groups a, b of a device?"""
    for row in orders.values():
        pos = {k: n for n, k in enumerate(row)}
        for a in row:
            for b in row:
                a2, b2 = (a[0], a[1], a[2] + 1), (b[0], b[1], b[2] + 1)
                if (a[0], a[1]) != (b[0], b[1]) and a2 in pos and b2 in pos \
                        and (pos[a] < pos[b]) != (pos[a2] < pos[b2]):
                    return False
    return True
