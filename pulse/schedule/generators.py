"""Baseline schedule generators: pure functions from a placement to compute actions.

Each returns a ``Schedule`` of F/B(/W) actions only; ``pulse.schedule.lower``
adds the messages, frees and all-reduces. Chunk ``c`` of the placement is pipeline stage ``c``::

    gpipe             all forwards, then all backwards        any placement
    1f1b              warm-up, one F one B, cool-down         one chunk per device
    interleaved_1f1b  Megatron's virtual stages               chunk c on device c % P
    greedy_v_1f1b     list scheduler, backward first          any (meant for V / wave)
    zero_bubble_v     the same with B/W split, W fills gaps   any (meant for V / wave)

The list schedulers take an in-flight cap (one for every device, or one per device)
and, with ``links`` (``OnLinks``: the model and the cluster), order on the messages'
link time too: a task is ready once its inputs have arrived.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field
from typing import Callable, Mapping

from pulse.costs import BACKWARD_INPUT_FRACTION, CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.placement import Placement, interleaved_devices
from pulse.schedule.deps import ComputeKey, TaskGraph, build_dependencies, chain_edges
from pulse.spec import ModelSpec
from pulse.schedule.ir import Action, Schedule

Generator = Callable[[Placement, int, "CostTable | None"], Schedule]


def _need_microbatches(name: str, num_microbatches: int) -> None:
    if num_microbatches < 1:
        raise PlanError(f"{name}: need at least 1 microbatch, got {num_microbatches}")


def _schedule(name: str, num_mb: int, keys: dict[int, list[ComputeKey]]) -> Schedule:
    return Schedule(name, num_mb, {d: tuple(Action.of_task(d, key) for key in row)
                                   for d, row in keys.items()})


def gpipe(placement: Placement, num_microbatches: int) -> Schedule:
    """Every forward in (chunk, microbatch) order, then every backward in reverse chunk order."""
    _need_microbatches("gpipe", num_microbatches)
    rows: dict[int, list[ComputeKey]] = {d: [] for d in range(placement.num_devices)}
    order = list(enumerate(placement.chunks))
    for kind, chunks in (("F", order), ("B", order[::-1])):
        for c, chunk in chunks:
            rows[chunk.device] += [(kind, c, m) for m in range(num_microbatches)]
    return _schedule("gpipe", num_microbatches, rows)


def _one_f_one_b_row(fwd: list[ComputeKey], bwd: list[ComputeKey], warmup: int) -> list[ComputeKey]:
    """warm-up forwards, then alternate F and B, then the remaining backwards."""
    warmup = min(warmup, len(fwd))
    row = fwd[:warmup]
    for i in range(len(fwd) - warmup):
        row += [fwd[warmup + i], bwd[i]]
    return row + bwd[len(fwd) - warmup:]


def one_f_one_b(placement: Placement, num_microbatches: int) -> Schedule:
    """PipeDream-Flush: stage s runs S-s-1 warm-up forwards, then one F one B."""
    _need_microbatches("1f1b", num_microbatches)
    if len(placement.chunks) != placement.num_devices:
        raise PlanError(f"1f1b needs one chunk per device; this {placement.kind} placement has "
                        f"{len(placement.chunks)} chunks on {placement.num_devices} devices")
    stages = len(placement.chunks)
    rows = {}
    for s, chunk in enumerate(placement.chunks):
        fwd = [("F", s, m) for m in range(num_microbatches)]
        bwd = [("B", s, m) for m in range(num_microbatches)]
        rows[chunk.device] = _one_f_one_b_row(fwd, bwd, stages - s - 1)
    return _schedule("1f1b", num_microbatches, rows)


def interleaved_1f1b(placement: Placement, num_microbatches: int) -> Schedule:
    """Megatron-LM interleaved 1F1B over v virtual stages per device.

    Microbatches go in groups of P: device d runs F of local chunk 0 for P
    microbatches, then local chunk 1, ...; backwards mirror it from the last
    local chunk. Warm-up is 2(P-d-1) + (v-1)P forwards. Bubble (P-1)/(v*M).
    """
    num_dev, v = placement.num_devices, placement.chunks_per_device
    devices = [c.device for c in placement.chunks]
    if devices != interleaved_devices(num_dev, v):
        raise PlanError("interleaved_1f1b needs chunk c on device c % P (round-robin); "
                        f"this placement has devices {devices}")
    if num_microbatches < 1 or num_microbatches % num_dev:
        raise PlanError(f"interleaved_1f1b needs a microbatch count divisible by {num_dev} devices, "
                        f"got {num_microbatches}")
    group = num_dev * v

    def task(kind: str, d: int, k: int) -> ComputeKey:
        g, r = divmod(k, group)
        local = r // num_dev if kind == "F" else v - 1 - r // num_dev
        return (kind, local * num_dev + d, g * num_dev + r % num_dev)

    total = num_microbatches * v
    rows = {}
    for d in range(num_dev):
        fwd = [task("F", d, k) for k in range(total)]
        bwd = [task("B", d, k) for k in range(total)]
        rows[d] = _one_f_one_b_row(fwd, bwd, 2 * (num_dev - d - 1) + (v - 1) * num_dev)
    return _schedule("interleaved_1f1b", num_microbatches, rows)


def _durations(placement: Placement, costs: CostTable | None, split: bool) -> dict[tuple[str, int], float]:
    """Per-chunk seconds; without a cost table, F=1 and B=2 (the usual FLOP ratio)."""
    out = {}
    for c, chunk in enumerate(placement.chunks):
        f, b = costs.span(chunk.start, chunk.end) if costs is not None else (1.0, 2.0)
        out[("F", c)] = f
        if split and costs is not None:
            out[("B", c)], out[("W", c)] = costs.split_backward(chunk.start, chunk.end, input_grads=c > 0)
        else:
            out[("B", c)] = b * BACKWARD_INPUT_FRACTION if split else b
            out[("W", c)] = b - out[("B", c)]
    return out


class _Ready:
    """One device's ready tasks, each kind kept oldest first: by (microbatch, -chunk), which differs
    between any two tasks of a kind, so "the oldest" is never a tie.

    ``pick``: the backward of the oldest microbatch; else the oldest forward the cap admits (any
    while fewer than ``cap`` microbatches are in flight, else one of those in flight); else the
    oldest weight grad. Kept sorted, a pick reads the head of a list (a capped forward scans
    only up to the newest microbatch in flight) instead of every ready task: a long pipeline's
    first device holds all M first forwards from the start."""

    def __init__(self) -> None:
        self.kinds: dict[str, list[tuple[int, int, ComputeKey]]] = {"B": [], "F": [], "W": []}

    def add(self, key: ComputeKey) -> None:
        bisect.insort(self.kinds[key[0]], (key[2], -key[1], key))

    def pick(self, inflight: set[int], cap: int | None) -> ComputeKey | None:
        """The task ``pick`` takes (removed), or None."""
        backward, forward, weight = self.kinds["B"], self.kinds["F"], self.kinds["W"]
        if backward:
            return backward.pop(0)[2]
        if forward:
            if cap is None or len(inflight) < cap:
                return forward.pop(0)[2]
            newest = max(inflight)
            for i, (m, _, key) in enumerate(forward):
                if m > newest:
                    break
                if m in inflight:
                    del forward[i]
                    return key
        return weight.pop(0)[2] if weight else None


def list_schedule(name: str, placement: Placement, num_microbatches: int, costs: CostTable | None,
                  inflight_cap: int | Mapping[int, int] | None, split: bool,
                  graph: TaskGraph | None = None) -> Schedule:
    """Greedy list scheduling: whenever a device is idle it takes the best ready task by
    ``_Ready.pick``. On compute times alone (messages free), or with ``graph`` (``deps.build_dependencies``
    on the cluster) on its durations and message delays: a task is ready once its inputs have
    arrived, so a device waiting for a slow message takes other work instead."""
    _need_microbatches(name, num_microbatches)
    caps = dict(inflight_cap) if isinstance(inflight_cap, Mapping) else \
        {d: inflight_cap for d in range(placement.num_devices)}
    if any(c is not None and c < 1 for c in caps.values()):
        raise PlanError(f"{name}: the in-flight cap must be at least 1, got {inflight_cap}")
    device = [c.device for c in placement.chunks]
    waiting: dict[ComputeKey, int] = {}
    succs: dict[ComputeKey, list[tuple[ComputeKey, float]]] = {}
    if graph is None:
        dur = _durations(placement, costs, split)
        edges = [(pred, succ, 0.0) for pred, succ in chain_edges(len(device), num_microbatches, split)]
    else:
        dur = {(k, c): t.duration for (k, c, m), t in graph.tasks.items() if m == 0}
        edges = [(pred, succ, delay) for succ, preds in graph.preds.items() for pred, delay in preds]
    for pred, succ, delay in edges:
        waiting[succ] = waiting.get(succ, 0) + 1
        succs.setdefault(pred, []).append((succ, delay))
    arrives: dict[ComputeKey, float] = {}
    arrivals: list[tuple[float, ComputeKey]] = []
    ready = {d: _Ready() for d in range(placement.num_devices)}
    for m in range(num_microbatches):
        ready[device[0]].add(("F", 0, m))
    last_kind = "W" if split else "B"  # a microbatch leaves a device after its last one of these
    left = {(d, m): len(placement.chunks_of(d)) for d in ready for m in range(num_microbatches)}
    inflight: dict[int, set[int]] = {d: set() for d in ready}
    rows: dict[int, list[ComputeKey]] = {d: [] for d in ready}
    idle, now = set(ready), 0.0
    events: list[tuple[float, ComputeKey]] = []
    while True:
        for d in sorted(idle):
            key = ready[d].pick(inflight[d], caps.get(d))
            if key is None:
                continue
            idle.discard(d)
            rows[d].append(key)
            inflight[d].add(key[2])
            heapq.heappush(events, (now + dur[(key[0], key[1])], key))
        if not events and not arrivals:
            break
        now = min(events[0][0], arrivals[0][0]) if events and arrivals else (events or arrivals)[0][0]
        while arrivals and arrivals[0][0] == now:
            succ = heapq.heappop(arrivals)[1]
            ready[device[succ[1]]].add(succ)
        while events and events[0][0] == now:
            _, (kind, c, m) = heapq.heappop(events)
            d = device[c]
            idle.add(d)
            if kind == last_kind:
                left[(d, m)] -= 1
                if left[(d, m)] == 0:
                    inflight[d].discard(m)
            for succ, delay in succs.get((kind, c, m), ()):
                waiting[succ] -= 1
                arrives[succ] = max(arrives.get(succ, now), now + delay)
                if waiting[succ] == 0:
                    if arrives[succ] > now:
                        heapq.heappush(arrivals, (arrives[succ], succ))
                    else:
                        ready[device[succ[1]]].add(succ)
    if sum(map(len, rows.values())) != len(device) * num_microbatches * (3 if split else 2):
        raise PlanError(f"{name}: in-flight cap {inflight_cap} stalls this {placement.kind} placement; "
                        "raise the cap")
    return _schedule(name, num_microbatches, rows)


def greedy_v_1f1b(placement: Placement, num_microbatches: int, costs: CostTable | None = None,
                  inflight_cap: int | Mapping[int, int] | None = None, links: OnLinks | None = None) -> Schedule:
    """V-shape 1F1B (ZB-V's shape without the B/W split) by greedy list scheduling.

    ``inflight_cap`` bounds the microbatches a device holds activations for;
    the default, the number of chunks in the chain (2P for a V), lets the
    first microbatch come back before device 0 stalls (measured on SD2 UNet:
    a cap of P costs 15-70% makespan on V and wave placements).
    """
    cap = len(placement.chunks) if inflight_cap is None else inflight_cap
    return list_schedule("greedy_v_1f1b", placement, num_microbatches, costs, cap, split=False,
                         graph=_graph(links, placement, num_microbatches, costs, split=False))


def zero_bubble_v(placement: Placement, num_microbatches: int, costs: CostTable | None = None,
                  inflight_cap: int | Mapping[int, int] | None = None, links: OnLinks | None = None) -> Schedule:
    """B/W split: input gradients first, weight gradients fill the idle gaps.

    Same default cap as ``greedy_v_1f1b``. A cap of P is ZB-V's memory
    promise (a V device then holds at most 2P half-stage activations, what
    1F1B's first device holds) at a few percent more makespan; the cap is the
    memory knob for a tuner.
    """
    cap = len(placement.chunks) if inflight_cap is None else inflight_cap
    return list_schedule("zero_bubble_v", placement, num_microbatches, costs, cap, split=True,
                         graph=_graph(links, placement, num_microbatches, costs, split=True))


@dataclass(frozen=True)
class OnLinks:
    """The model and cluster a list schedule is ordered on: with them its messages take their
    link time (``deps.build_dependencies``), without them they are free. One ``OnLinks`` builds
    each task graph once (``graphs``: by placement, microbatches, split and cost table)."""

    spec: ModelSpec
    cluster: Cluster
    graphs: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def graph(self, placement: Placement, num_microbatches: int, costs: CostTable, split: bool) -> TaskGraph:
        key = (placement, num_microbatches, split, costs)
        if key not in self.graphs:
            self.graphs[key] = build_dependencies(self.spec, placement, num_microbatches, costs, self.cluster,
                                                  split_backward=split)
        return self.graphs[key]


def _graph(links: OnLinks | None, placement: Placement, num_microbatches: int, costs: CostTable | None,
           split: bool) -> TaskGraph | None:
    if links is None or costs is None:
        return None
    return links.graph(placement, num_microbatches, costs, split)


BASELINES: dict[str, Generator] = {
    "gpipe": lambda placement, m, costs=None: gpipe(placement, m),
    "1f1b": lambda placement, m, costs=None: one_f_one_b(placement, m),
    "interleaved_1f1b": lambda placement, m, costs=None: interleaved_1f1b(placement, m),
    "greedy_v_1f1b": greedy_v_1f1b,
    "zero_bubble_v": zero_bubble_v,
}


def applicable_baselines(placement: Placement, num_microbatches: int | None = None) -> list[str]:
    """Names in BASELINES that accept this placement (and microbatch count, if given)."""
    names = ["gpipe"]
    if len(placement.chunks) == placement.num_devices:
        names.append("1f1b")
    v = placement.chunks_per_device
    round_robin = [c.device for c in placement.chunks] == interleaved_devices(placement.num_devices, v)
    if v >= 2 and round_robin and (num_microbatches is None or num_microbatches % placement.num_devices == 0):
        names.append("interleaved_1f1b")
    return names + ["greedy_v_1f1b", "zero_bubble_v"]


LIST_SCHEDULES = ("greedy_v_1f1b", "zero_bubble_v")  # ordered by list scheduling: they can see the links


def make_schedule(name: str, placement: Placement, num_microbatches: int,
                  costs: CostTable | None = None, links: OnLinks | None = None) -> Schedule:
    """A named schedule; ``links`` orders the list schedules with their messages' link time."""
    if name not in BASELINES:
        raise PlanError(f"unknown schedule '{name}' (known: {', '.join(BASELINES)})")
    if name in LIST_SCHEDULES:
        return BASELINES[name](placement, num_microbatches, costs, links=links)
    return BASELINES[name](placement, num_microbatches, costs)
