"""The task graph of one training iteration: compute tasks, their devices,
durations and the precedence edges between them (with message delays).

One graph feeds the simulator, the lower bound and the ILP synthesizer::

    F(c-1,m) ──main msg──▶ F(c,m) ──▶ ... ──▶ F(last,m)
                                                  │
    B(c-1,m) ◀──grad msg── B(c,m) ◀── ... ◀── B(last,m)
                             ▲
                           F(c,m)          (a chunk's backward needs its forward)

A direct-sent skip adds F(src chunk) → F(dst chunk) and, for its gradient,
B(dst chunk) → B(src chunk), each delayed by that message.  With
``split_backward`` the backward is split Zero-Bubble style into B (input
gradient, on the critical path) and W (weight gradient, free to move later).

Encodes (``add_encode_tasks``) are tasks ("E", encoder, microbatch) on the device
the schedule runs them on, with an edge to the forward of every chunk reading
their output, delayed by the message when that chunk lives elsewhere::

    E(e,m) ──output msg──▶ F(first reader chunk of each device, m)
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache

from pulse.costs import CostTable
from pulse.encoders import EncoderSet, reader_chunks
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.placement import Placement
from pulse.spec import ModelSpec
from pulse.traffic import Transfer, transfers

ComputeKey = tuple[str, int, int]  # (kind, chunk, microbatch); ("E", encoder, microbatch) for an encode



@dataclass(frozen=True)
class Task:
    device: int
    duration: float  # seconds


@dataclass(frozen=True)
class TaskGraph:
    """Tasks and predecessor edges ``pred -> [(predecessor, min delay after its end)]``."""

    tasks: dict[ComputeKey, Task]
    preds: dict[ComputeKey, list[tuple[ComputeKey, float]]]
    num_microbatches: int = 0
    split_backward: bool = False

    def succs(self) -> dict[ComputeKey, list[tuple[ComputeKey, float]]]:
        out: dict[ComputeKey, list[tuple[ComputeKey, float]]] = {k: [] for k in self.tasks}
        for key, edges in self.preds.items():
            for pred, delay in edges:
                out[pred].append((key, delay))
        return out

    def devices(self) -> list[int]:
        return sorted({t.device for t in self.tasks.values()})

    def topological_order(self) -> list[ComputeKey]:
        """Kahn's order; raises PlanError on a cycle (a malformed graph)."""
        indegree = {k: len(self.preds.get(k, ())) for k in self.tasks}
        succs = self.succs()
        ready = sorted(k for k, n in indegree.items() if n == 0)
        order: list[ComputeKey] = []
        while ready:
            key = ready.pop()
            order.append(key)
            for succ, _ in succs[key]:
                indegree[succ] -= 1
                if indegree[succ] == 0:
                    ready.append(succ)
        if len(order) != len(self.tasks):
            raise PlanError("task graph has a cycle")
        return order


@lru_cache(maxsize=32)
def chain_edges(num_chunks: int, num_microbatches: int,
                split_backward: bool = False) -> tuple[tuple[ComputeKey, ComputeKey], ...]:
    """The placement-independent (pred, succ) edges: the chain order of chunks.

    Direct skip edges are implied transitively by these (a skip always points
    forward in the chain), so checking order needs nothing else. Kept per shape (a
    tuple: every task graph, list schedule and validation of a tuner's shape reads it).
    """
    last = num_chunks - 1
    edges: list[tuple[ComputeKey, ComputeKey]] = []
    for m in range(num_microbatches):
        for c in range(num_chunks):
            if c > 0:
                edges.append((("F", c - 1, m), ("F", c, m)))
            edges.append((("F", c, m), ("B", c, m)))
            if c < last:
                edges.append((("B", c + 1, m), ("B", c, m)))
            if split_backward:
                edges.append((("B", c, m), ("W", c, m)))
    return tuple(edges)


def pair_transfers(spec: ModelSpec, placement: Placement) -> dict[tuple[int, int], tuple[Transfer, ...]]:
    """Messages per (src chunk, dst chunk), in traffic order (the runtime matches them in that order)."""
    out: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
    for tr in transfers(spec, placement):
        out[(tr.src_chunk, tr.dst_chunk)].append(tr)
    return {k: tuple(v) for k, v in out.items()}


def message_delay(cluster: Cluster, src: int, dst: int, msgs: tuple[Transfer, ...],
                  microbatch_size: int) -> float:
    """Time for all messages of one chunk pair sent together on a free link."""
    nbytes = sum(tr.total_bytes for tr in msgs) * microbatch_size
    return cluster.transfer_time(src, dst, nbytes)


def task_durations(placement: Placement, costs: CostTable, split_backward: bool,
                   recompute: frozenset[int] = frozenset()) -> dict[tuple[str, int], float]:
    """Duration of each (kind, chunk) for one microbatch.

    A chunk in ``recompute`` keeps only its inputs from F to B, so its B first re-runs
    the forward with autograd on (the backends' recomputation): B costs the chunk's
    forward on top. W walks the graph that B rebuilt and costs what it always does.

    The first chunk of every device but layer 0's makes that device's copy of each
    microbatch's batch in its forward (``CostTable.batch_seconds``), as the executor does.
    """
    out: dict[tuple[str, int], float] = {}
    for c, chunk in enumerate(placement.chunks):
        f, b = costs.span(chunk.start, chunk.end)
        out[("F", c)] = f
        if split_backward:  # as the runtime splits it (CostTable.split_backward); chunk 0 has no input grads
            out[("B", c)], out[("W", c)] = costs.split_backward(chunk.start, chunk.end, input_grads=c > 0)
        else:
            out[("B", c)] = b
        if c in recompute:
            out[("B", c)] += f
    for d in range(placement.num_devices):
        first = min(placement.chunks_of(d), default=0)
        if first > 0:
            out[("F", first)] += costs.batch_seconds()
    return out


def build_dependencies(spec: ModelSpec, placement: Placement, num_microbatches: int,
                       costs: CostTable, cluster: Cluster, *, split_backward: bool = False,
                       recompute: frozenset[int] = frozenset()) -> TaskGraph:
    """``recompute``: chunks whose backward re-runs their forward first (``task_durations``)."""
    if num_microbatches < 1:
        raise PlanError(f"need at least one microbatch, got {num_microbatches}")
    placement.validate(spec.num_layers)
    costs.check_matches(spec)
    chunks = placement.chunks
    mbs = costs.microbatch_size
    durations = task_durations(placement, costs, split_backward, recompute)
    pairs = pair_transfers(spec, placement)

    def fwd_delay(a: int, b: int) -> float:
        return message_delay(cluster, chunks[a].device, chunks[b].device, pairs.get((a, b), ()), mbs)

    def bwd_delay(a: int, b: int) -> float:  # gradient of the a -> b message, going b -> a
        return message_delay(cluster, chunks[b].device, chunks[a].device, pairs.get((a, b), ()), mbs)

    tasks: dict[ComputeKey, Task] = {}
    preds: dict[ComputeKey, list[tuple[ComputeKey, float]]] = {}
    kinds = ("F", "B", "W") if split_backward else ("F", "B")
    for m in range(num_microbatches):
        for c, chunk in enumerate(chunks):
            for kind in kinds:
                tasks[(kind, c, m)] = Task(chunk.device, durations[(kind, c)])
                preds[(kind, c, m)] = []
    for pred, succ in chain_edges(len(chunks), num_microbatches, split_backward):
        kind, c, m = succ
        if kind == "F":
            delay = fwd_delay(pred[1], c)
        elif kind == "B" and pred[0] == "B":
            delay = bwd_delay(c, pred[1])
        else:
            delay = 0.0
        preds[succ].append((pred, delay))
    # Direct skips between non-adjacent chunks: their own edge and delay.
    for (a, b) in pairs:
        if b == a + 1:
            continue
        for m in range(num_microbatches):
            preds[("F", b, m)].append((("F", a, m), fwd_delay(a, b)))
            preds[("B", a, m)].append((("B", b, m), bwd_delay(a, b)))
    return TaskGraph(tasks, preds, num_microbatches, split_backward)


def add_encode_tasks(graph: TaskGraph, spec: ModelSpec, placement: Placement, costs: CostTable,
                     cluster: Cluster, encoders: EncoderSet,
                     encode_devices: dict[tuple[int, int], int]) -> TaskGraph:
    """``graph`` with an E task per (encoder, microbatch) on its device (``encode_devices``), timed
    by the cost table's ``encoder_fwd``, and its edges to the reader chunks' forwards."""
    tasks = dict(graph.tasks)
    preds = {k: list(v) for k, v in graph.preds.items()}
    readers = [reader_chunks(spec, placement, enc) for enc in encoders.encoders]
    for (e, m), device in sorted(encode_devices.items()):
        enc = encoders.encoders[e]
        key = ("E", e, m)
        tasks[key] = Task(device, costs.encoder_seconds(enc.name))
        preds[key] = []
        if m >= graph.num_microbatches:
            continue  # a prefetch: the next step's forward reads it
        for c in readers[e]:
            delay = cluster.transfer_time(device, placement.chunks[c].device, enc.out_bytes * costs.microbatch_size)
            preds[("F", c, m)].append((key, delay))
    return TaskGraph(tasks, preds, graph.num_microbatches, graph.split_backward)
