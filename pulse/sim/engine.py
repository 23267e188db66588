"""The discrete-event simulator: one engine for every schedule.

Each device runs its compute actions in list order. An action starts when its
device is free and every predecessor in the task graph (``deps.py``) is done,
plus the arrival of the messages between them. Messages come from
``traffic.transfers()`` (activations forward, their gradients backward) and
are asynchronous: a send never blocks compute. A link (ordered device pair)
carries one message at a time, FIFO; a message holds the link for
``bytes / bandwidth`` and arrives ``latency`` later::

    dev0  [F0 ][F1 ][F2 ]            compute
    0->1       [m0]  [m1]  [m2]      link, serialized
    dev1        ^arrival [F0 ][F1 ]

Send/receive actions in the schedule are ignored: the messages they stand for
are derived from the placement, so a compute-only and a full schedule time
the same.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.placement import Placement
from pulse.schedule.deps import ComputeKey, TaskGraph, build_dependencies, pair_transfers
from pulse.schedule.ir import Schedule
from pulse.schedule.validate import check_coverage, fail, is_split, key_of
from pulse.sim.memory import profile_memory
from pulse.sim.result import ComputeSpan, MessageEvent, SimResult
from pulse.spec import ModelSpec
from pulse.traffic import Transfer

Edge = tuple[ComputeKey, ComputeKey]
Pairs = dict[tuple[int, int], tuple[Transfer, ...]]  # (src chunk, dst chunk) -> messages
Times = dict[ComputeKey, tuple[float, float]]  # start, end


@dataclass
class _Links:
    """Mutable link state of one run: FIFO per ordered device pair."""

    cluster: Cluster
    microbatch_size: int
    free_at: dict[tuple[int, int], float] = field(default_factory=dict)
    events: list[MessageEvent] = field(default_factory=list)

    def send(self, src: int, dst: int, chunks: tuple[int, int], m: int, direction: str,
             msgs: tuple[Transfer, ...], ready: float) -> float:
        """Queue the messages of one edge; return when the last one arrives."""
        bandwidth, latency = self.cluster.link(src, dst)
        arrival = ready
        for tr in msgs:
            nbytes = tr.total_bytes * self.microbatch_size
            start = max(ready, self.free_at.get((src, dst), 0.0))
            hold = nbytes / bandwidth if nbytes > 0 else 0.0
            self.free_at[(src, dst)] = start + hold
            end = start + hold + (latency if nbytes > 0 else 0.0)
            arrival = max(arrival, end)
            self.events.append(MessageEvent(src, dst, chunks[0], chunks[1], m, direction, nbytes,
                                            tr.skips, ready, start, end))
        return arrival


def _edge_messages(pred: ComputeKey, succ: ComputeKey, pairs: Pairs) -> tuple[str, tuple[Transfer, ...]]:
    """Direction and traffic messages a cross-device edge stands for."""
    if pred[0] == "F":
        return "F", pairs.get((pred[1], succ[1]), ())
    return "B", pairs.get((succ[1], pred[1]), ())  # gradient of the succ -> pred message


def run_events(graph: TaskGraph, rows: dict[int, list[ComputeKey]], links: _Links,
               pairs: Pairs) -> tuple[Times, dict[int, int]]:
    """Times of every action that ran, and each device's next unrun position."""
    tasks, succs = graph.tasks, graph.succs()
    times: Times = {}  # committed start and end
    done: set[ComputeKey] = set()
    arrival: dict[Edge, float] = {}
    pos = {d: 0 for d in rows}
    free = {d: 0.0 for d in rows}
    running = {d: False for d in rows}
    heap: list[tuple[float, int, ComputeKey]] = []

    def try_start(d: int) -> None:
        if running.get(d, True) or pos[d] >= len(rows[d]):
            return
        key = rows[d][pos[d]]
        start = free[d]
        for pred, _ in graph.preds[key]:
            if pred not in done:
                return
            same = tasks[pred].device == d
            start = max(start, times[pred][1] if same else arrival[(pred, key)])
        running[d] = True
        times[key] = (start, start + tasks[key].duration)
        heapq.heappush(heap, (times[key][1], len(times), key))

    for d in rows:
        try_start(d)
    while heap:
        t, _, key = heapq.heappop(heap)
        d = tasks[key].device
        done.add(key)
        running[d], free[d] = False, t
        pos[d] += 1
        for succ, _ in succs[key]:
            dst = tasks[succ].device
            if dst != d:
                direction, msgs = _edge_messages(key, succ, pairs)
                arrival[(key, succ)] = links.send(d, dst, (key[1], succ[1]), key[2], direction, msgs, t)
        try_start(d)
        for dst in sorted({tasks[s].device for s, _ in succs[key]} - {d}):
            try_start(dst)
    return times, pos


def simulate(spec: ModelSpec, placement: Placement, schedule: Schedule, costs: CostTable,
             cluster: Cluster, *, memory_budget: int | None = None, optimizer_bytes_per_param: int = 12,
             param_bytes: int = 2, grad_bytes: int = 2) -> SimResult:
    """Time one iteration of ``schedule``; raise PlanError if it deadlocks or is incomplete."""
    if placement.num_devices > cluster.num_devices:
        raise PlanError(f"placement uses {placement.num_devices} devices but cluster '{cluster.name}' "
                        f"has {cluster.num_devices}")
    num_mb = schedule.num_microbatches
    compute = schedule.compute_only()
    check_coverage(compute, placement, num_mb)
    compute = Schedule(compute.name, num_mb,  # a device without actions still gets a (empty) row
                       {d: compute.actions.get(d, ()) for d in range(placement.num_devices)})
    graph = build_dependencies(spec, placement, num_mb, costs, cluster, split_backward=is_split(compute))
    rows = {d: [key_of(a) for a in row] for d, row in compute.actions.items()}
    pairs = pair_transfers(spec, placement)
    links = _Links(cluster, costs.microbatch_size)
    times, pos = run_events(graph, rows, links, pairs)
    stuck = {(d, p): "" for d, p in pos.items() if p < len(rows[d])}
    if stuck:
        raise fail(compute, "schedule deadlocks: no device can start its next action "
                   "(it waits for work scheduled after it)", stuck)
    per_param = param_bytes + grad_bytes + optimizer_bytes_per_param
    return _result(spec, placement, compute, costs, graph, times, links.events, per_param, memory_budget)


def _result(spec: ModelSpec, placement: Placement, schedule: Schedule, costs: CostTable, graph: TaskGraph,
            times: Times, messages: list[MessageEvent],
            per_param: int, memory_budget: int | None) -> SimResult:
    num_dev = placement.num_devices
    busy = [0.0] * num_dev
    for key, task in graph.tasks.items():
        busy[task.device] += task.duration
    makespan = max((end for _, end in times.values()), default=0.0)
    bubble = 1.0 - sum(busy) / (num_dev * makespan) if makespan > 0 else 0.0
    mem = profile_memory(spec, placement, costs, times, messages, schedule.num_microbatches, per_param)
    link_bytes: dict[tuple[int, int], int] = {}
    for msg in messages:
        link = (msg.src_device, msg.dst_device)
        link_bytes[link] = link_bytes.get(link, 0) + msg.nbytes
    spans = tuple(ComputeSpan(graph.tasks[k].device, k[0], k[1], k[2], s, e)
                  for k, (s, e) in sorted(times.items(), key=lambda kv: (kv[1][0], kv[0])))
    return SimResult(
        schedule_name=schedule.name, num_devices=num_dev, makespan=makespan,
        busy=tuple(busy), idle=tuple(makespan - b for b in busy), bubble_ratio=bubble,
        peak_memory=mem.peak, memory=mem.breakdown, peak_inflight=mem.peak_inflight,
        peak_skip_cache=mem.peak_skip_cache, skip_cache_curve=mem.skip_cache_curve,
        link_bytes=link_bytes, compute=spans, messages=tuple(messages), memory_budget=memory_budget,
    )
