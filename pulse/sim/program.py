"""Time the program each rank really runs: its compute, sends and receives, in list order.

The runtime (``pulse.runtime.executor``) walks a lowered action list, one
action after another on one thread; a receive blocks the rank until its
message is there, a send hands the message to the communicator and returns.
This engine runs the same list::

    F / B / W    the rank is busy for the cost table's time
    SF / SB      the rank is busy issuing the message: per tensor, the link's
                 send overhead (header + payload sends); then the message
                 queues on the sender's outbound link and the receiver's
                 inbound link (one of each per rank, FIFO), holds both for
                 bytes / bandwidth, and arrives ``latency`` later
    RF / RB      the rank waits for the message, then is busy receiving it:
                 per tensor, the link's message overhead (header, then payload)

    rank 0  [F0][SF0]  [F1][SF1]              [RB0][B0]
    out 0          [==m0==]  [==m1==]
    rank 1            ^arr [RF0][F0][B0][SB0]

Events are processed in time order, so every link is claimed in the order the
messages become ready. A rank whose next receive has nothing coming, while no
other rank can move, is a deadlock: the same one the runtime would hit.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

from pulse.hardware import Cluster
from pulse.placement import Placement
from pulse.schedule.deps import ComputeKey, TaskGraph
from pulse.schedule.ir import Action, Schedule
from pulse.sim.result import MessageEvent
from pulse.spec import ModelSpec
from pulse.traffic import Transfer, transfers

MessageKey = tuple[str, int, int]  # direction, transfer index, microbatch
Times = dict[ComputeKey, tuple[float, float]]


@dataclass(frozen=True)
class LinkTerms:
    """What one message costs on the link from ``a`` to ``b`` (``Cluster.link_cost`` when the
    cluster was measured, else its hardware figures)."""

    bandwidth: float
    latency: float
    message_overhead: float  # the receiver's time per tensor (header, then payload, each a wake-up)
    send_overhead: float  # the sender's time per tensor (two asynchronous sends issued)


def link_terms(cluster: Cluster, a: int, b: int) -> LinkTerms:
    measured = getattr(cluster, "link_cost", None)
    if measured is not None:
        cost = measured(a, b)
        overhead = getattr(cost, "message_overhead", 0.0)
        return LinkTerms(cost.bandwidth, cost.latency, overhead, getattr(cost, "send_overhead", overhead))
    bandwidth, latency = cluster.link(a, b)
    overhead = getattr(cluster.hardware, "message_overhead", 0.0)
    return LinkTerms(bandwidth, latency, overhead, overhead)


@dataclass(frozen=True)
class Wire:
    """The transfers of one (spec, placement), as the runtime matches them to actions."""

    transfers: tuple[Transfer, ...]
    by_pair: dict[tuple[int, int], tuple[int, ...]]  # (src chunk, dst chunk) -> transfer indices
    tensors: tuple[int, ...]  # tensors each transfer sends (each is one header + one payload)

    @classmethod
    def of(cls, spec: ModelSpec, placement: Placement) -> "Wire":
        trs = tuple(transfers(spec, placement))
        by_pair: dict[tuple[int, int], list[int]] = defaultdict(list)
        main_of: set[int] = set()
        counts = []
        for i, tr in enumerate(trs):
            by_pair[(tr.src_chunk, tr.dst_chunk)].append(i)
            # the first message into the next chunk is the main path; it carries the shared inputs
            main = tr.dst_chunk == tr.src_chunk + 1 and tr.src_chunk not in main_of
            if main:
                main_of.add(tr.src_chunk)
            counts.append((1 + len(tr.shared) if main else 0) + len(tr.skips))
        return cls(trs, {k: tuple(v) for k, v in by_pair.items()}, tuple(counts))

    def message_keys(self, row: tuple[Action, ...]) -> dict[int, MessageKey]:
        """Position of each send/receive in ``row`` -> the message it moves (k-th action of a
        chunk pair and microbatch moves the k-th transfer of that pair, as the runtime does)."""
        seen: dict[tuple, int] = defaultdict(int)
        out = {}
        for pos, a in enumerate(row):
            if a.is_compute:
                continue
            pair = (a.chunk, a.peer) if a.kind in ("SF", "RB") else (a.peer, a.chunk)
            direction = "F" if a.kind in ("SF", "RF") else "B"
            slot = (a.kind, pair, a.microbatch)
            out[pos] = (direction, self.by_pair[pair][seen[slot]], a.microbatch)
            seen[slot] += 1
        return out


@dataclass
class ProgramRun:
    """Times of one run of the program (plain data; ``engine`` turns it into a SimResult)."""

    compute: Times = field(default_factory=dict)
    messages: list[MessageEvent] = field(default_factory=list)
    comm_busy: dict[int, float] = field(default_factory=dict)  # rank seconds spent issuing/unpacking
    next_position: dict[int, int] = field(default_factory=dict)
    end: dict[int, float] = field(default_factory=dict)  # when each rank finished its list
    last_arrival: dict[int, float] = field(default_factory=dict)  # per sender: its last message landed


@dataclass
class _State:
    rows: dict[int, tuple[Action, ...]]
    keys: dict[int, dict[int, MessageKey]]
    heap: list = field(default_factory=list)
    free: dict[int, float] = field(default_factory=dict)
    arrived: dict[MessageKey, float] = field(default_factory=dict)
    waiting: dict[MessageKey, int] = field(default_factory=dict)
    out_free: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    in_free: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    seq: int = 0

    def push(self, when: float, event: tuple) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (when, self.seq, event))


def run_program(program: Schedule, graph: TaskGraph, spec: ModelSpec, placement: Placement,
                cluster: Cluster, microbatch_size: int) -> ProgramRun:
    """Run every rank's lowered action list; ``graph`` gives the compute durations."""
    wire = Wire.of(spec, placement)
    rows = {d: tuple(program.actions.get(d, ())) for d in range(placement.num_devices)}
    state = _State(rows, {d: wire.message_keys(row) for d, row in rows.items()})
    run = ProgramRun(next_position={d: 0 for d in rows}, comm_busy={d: 0.0 for d in rows})
    for d in rows:
        state.free[d] = 0.0
        state.push(0.0, ("run", d))
    while state.heap:
        now, _, event = heapq.heappop(state.heap)
        if event[0] == "sent":
            _deliver(state, run, wire, cluster, microbatch_size, now, event[1], event[2])
        else:
            _step(state, run, wire, graph, cluster, event[1], now)
    return run


def _step(state: _State, run: ProgramRun, wire: Wire, graph: TaskGraph, cluster: Cluster,
          d: int, now: float) -> None:
    """Run rank ``d``'s next action at ``now`` (or park it until its message arrives)."""
    pos = run.next_position[d]
    row = state.rows[d]
    if pos >= len(row):
        run.end[d] = now
        return
    a = row[pos]
    start = max(now, state.free[d])
    if a.is_compute:
        key = (a.kind, a.chunk, a.microbatch)
        end = start + graph.tasks[key].duration
        run.compute[key] = (start, end)
    else:
        msg = state.keys[d][pos]
        tr = wire.transfers[msg[1]]
        sender, receiver = (tr.src_device, tr.dst_device) if msg[0] == "F" else (tr.dst_device, tr.src_device)
        terms = link_terms(cluster, sender, receiver)
        receiving = a.kind in ("RF", "RB")
        busy = wire.tensors[msg[1]] * (terms.message_overhead if receiving else terms.send_overhead)
        if receiving:
            if msg not in state.arrived:
                state.waiting[msg] = d  # woken by _deliver
                return
            start = max(start, state.arrived[msg])
        end = start + busy
        run.comm_busy[d] += busy
        if a.kind in ("SF", "SB"):
            state.push(end, ("sent", msg, d))
    state.free[d] = end
    run.next_position[d] = pos + 1
    state.push(end, ("run", d))


def _deliver(state: _State, run: ProgramRun, wire: Wire, cluster: Cluster, microbatch_size: int,
             now: float, msg: MessageKey, sender: int) -> None:
    direction, index, mb = msg
    tr = wire.transfers[index]
    receiver = tr.dst_device if direction == "F" else tr.src_device
    terms = link_terms(cluster, sender, receiver)
    nbytes = tr.total_bytes * microbatch_size
    start = max(now, state.out_free[sender], state.in_free[receiver])
    hold = nbytes / terms.bandwidth if nbytes > 0 else 0.0
    state.out_free[sender] = state.in_free[receiver] = start + hold
    arrival = start + hold + terms.latency
    state.arrived[msg] = arrival
    run.last_arrival[sender] = max(run.last_arrival.get(sender, 0.0), arrival)
    src_chunk, dst_chunk = (tr.src_chunk, tr.dst_chunk) if direction == "F" else (tr.dst_chunk, tr.src_chunk)
    run.messages.append(MessageEvent(sender, receiver, src_chunk, dst_chunk, mb, direction, nbytes,
                                     tr.skips, now, start, arrival))
    if msg in state.waiting:
        state.push(arrival, ("run", state.waiting.pop(msg)))
