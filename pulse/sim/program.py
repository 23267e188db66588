"""Time the program each rank really runs: its compute, sends and receives, in list order.

The runtime (``pulse.runtime.executor``) walks a lowered action list, one
action after another on one thread; a receive blocks the rank until its
message is there, a send hands the message to the communicator and returns.
This engine runs the same list::

    F / B / W    the rank is busy for the cost table's time, plus its cold start
                 (``CostTable.cold_start``) when a message action comes right before
                 it in the rank's list (or it is the list's first): its layers' code and
                 data left the caches while the communicator ran or the rank slept
    SF / SB      the rank is busy issuing the message: per wire message (one
                 header + one payload carrying all the transfer's tensors; one per
                 tensor with ``Cluster.tensor_messages``, as MindSpore's
                 communicator sends them), the link's send overhead; then the message
                 queues on the sender's outbound link (FIFO), then takes the
                 first free stretch of the receiver's inbound link from when it
                 started sending (``pulse.link_slots``; one of each per rank),
                 holds each for bytes / bandwidth, and arrives ``latency`` later
    RF / RB      the rank waits for the message, then is busy receiving it:
                 per wire message, the link's message overhead (header, then payload)
    FREE / AR    no time on the rank's thread: the moment is recorded (memory is
                 released then; the chunk's gradient bucket is launched then)
    E            a frozen encoder's forward: busy for the cost table's ``encoder_fwd``
    SE / RE      its output to a reader on another device: one wire message, as SF / RF

    rank 0  [F0][SF0]  [F1][SF1]              [RB0][B0]
    out 0          [==m0==]  [==m1==]
    rank 1            ^arr [RF0][F0][B0][SB0]

On a CPU host (``shared_cores``) ranks pinned to one core share it (each busy
rank at ``core_sharing`` / busy ranks), as ``pulse.cores`` pins them; unpinned
they share all of the host's cores. The other data-parallel replicas' ranks share
them too: one replica is simulated, and replica r's rank of device d runs what d
runs when d runs it, so d's every job weighs as many ranks as d has twins on its cores.

Events are processed in time order, so every link is claimed in the order the
messages become ready. A rank whose next receive has nothing coming, while no
other rank can move, is a deadlock: the same one the runtime would hit.
"""
from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field

from pulse.cores import core_groups
from pulse.link_slots import InboundLinks
from pulse.links import LinkCost
from pulse.hardware import Cluster
from pulse.placement import Placement
from pulse.schedule.deps import ComputeKey, TaskGraph
from pulse.schedule.ir import COMPUTE_KINDS, ENCODE_KINDS, MEMORY_KINDS, SYNC_KINDS, Action, Schedule
from pulse.sim.result import MessageEvent
from pulse.spec import ModelSpec
from pulse.encoders import EncoderSet
from pulse.traffic import EncodeTransfer, Transfer, encode_transfers, transfers, wire_messages

MessageKey = tuple[str, int, int]  # direction, transfer index, microbatch
Times = dict[ComputeKey, tuple[float, float]]
MARK_KINDS = MEMORY_KINDS + SYNC_KINDS  # FREE, AR: no time on the rank's thread
MarkKey = tuple[str, int, int]  # FREE or AR, chunk, microbatch


@dataclass(frozen=True)
class Wire:
    """The transfers of one (spec, placement), as the runtime matches them to actions."""

    transfers: tuple[Transfer, ...]
    by_pair: dict[tuple[int, int], tuple[int, ...]]  # (src chunk, dst chunk) -> transfer indices
    tensors: tuple[int, ...]  # tensors each transfer carries
    messages: tuple[int, ...]  # wire messages (one header + one payload each) per transfer
    encodes: tuple[EncodeTransfer, ...] = ()  # encoder outputs' deliveries (one tensor each)
    encode_index: dict[tuple[int, int], int] = field(default_factory=dict)  # (encoder, dst chunk) -> index

    @classmethod
    def of(cls, spec: ModelSpec, placement: Placement, encoders: EncoderSet | None = None,
           tensor_messages: bool = False) -> "Wire":
        """``tensor_messages``: the communicator sends every tensor as a message of its own
        (``Cluster.tensor_messages``), not a transfer's tensors together."""
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
        encodes = tuple(encode_transfers(spec, placement, encoders)) if encoders is not None else ()
        return cls(trs, {k: tuple(v) for k, v in by_pair.items()}, tuple(counts),
                   tuple(n if tensor_messages else wire_messages(n) for n in counts),
                   encodes, {(tr.encoder, tr.dst_chunk): i for i, tr in enumerate(encodes)})

    def message_keys(self, row: tuple[Action, ...]) -> dict[int, MessageKey]:
        """Position of each send/receive in ``row`` -> the message it moves (k-th action of a
        chunk pair and microbatch moves the k-th transfer of that pair, as the runtime does)."""
        seen: dict[tuple, int] = defaultdict(int)
        out = {}
        for pos, a in enumerate(row):
            if not a.is_comm:
                continue
            if a.is_encode_comm:  # SE: encoder -> reader chunk (peer); RE: reader chunk <- encoder
                reader = a.peer if a.kind == "SE" else a.chunk
                out[pos] = ("E", self.encode_index[(a.encoder, reader)], a.microbatch)
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
    marks: dict[MarkKey, float] = field(default_factory=dict)  # when each FREE / AR was reached
    messages: list[MessageEvent] = field(default_factory=list)
    comm_busy: dict[int, float] = field(default_factory=dict)  # rank seconds spent issuing/unpacking
    next_position: dict[int, int] = field(default_factory=dict)
    end: dict[int, float] = field(default_factory=dict)  # when each rank finished its list
    last_arrival: dict[int, float] = field(default_factory=dict)  # per sender: its last message landed


@dataclass
class _CorePool:
    """The processors one group of ranks shares (``cores``; None: a device per rank, no sharing).

    Egalitarian processor sharing: with n busy ranks on c cores each advances at
    min(1, c / n), times the share they keep between them once n > c (``core_sharing``:
    switching between ranks costs the rest, measured by ``pulse profile``). A global
    work clock W runs at that rate; a job of w seconds started at W0 ends when W
    reaches W0 + w, so one heap of end marks orders them. A job counts as ``weight``
    busy ranks: its device's data-parallel twins on the same cores, busy with it.
    """

    cores: int | None
    sharing: float = 1.0  # the share of the cores busy ranks keep once they outnumber them
    work: float = 0.0  # W
    at: float = 0.0  # real time at which W was last advanced
    jobs: list = field(default_factory=list)  # heap of (W at end, seq, device, start, action position, weight)
    seq: int = 0
    busy: int = 0  # ranks busy now: the jobs' weights

    def rate(self) -> float:
        n = self.busy
        return 1.0 if self.cores is None or n <= self.cores else self.sharing * self.cores / n

    def advance(self, t: float) -> None:
        if self.cores is None:  # a rate of 1: the same sum, without the product by 1.0 (exact either way)
            self.work += t - self.at
        else:
            self.work += (t - self.at) * self.rate()
        self.at = t

    def next_done(self) -> float:
        if not self.jobs:
            return math.inf
        if self.cores is None:
            return self.at + max(self.jobs[0][0] - self.work, 0.0)
        return self.at + max(self.jobs[0][0] - self.work, 0.0) / self.rate()

    def add(self, t: float, seconds: float, device: int, position: int, weight: int = 1) -> float:
        """Start a job at ``t``; when the pool's first job now ends (``next_done``)."""
        self.advance(t)
        self.seq += 1
        self.busy += weight
        heapq.heappush(self.jobs, (self.work + seconds, self.seq, device, t, position, weight))
        return self.next_done()

    def pop(self, t: float) -> tuple[int, float, int, float]:
        """The first job, ended at ``t``: its (device, start, action position), and ``next_done``."""
        self.advance(t)
        _, _, device, start, position, weight = heapq.heappop(self.jobs)
        self.busy -= weight
        return device, start, position, self.next_done()


def _core_pools(cluster: Cluster, devices: list[int],
                replicas: int = 1) -> tuple[dict[int, int], dict[int, _CorePool], dict[int, int]]:
    """Each rank's processor pool, and the weight of its jobs there: a node's ranks share its cores as
    the runtime pins them (``pulse.cores``: pinned ranks on one core split that core even while another
    idles), the data-parallel replicas' ranks among them (``pulse.layout``: replica r's rank of device d
    is d + r x P). A twin on another group of cores loads that group, not d's: left out (only where
    the ranks outnumber the cores and P is no multiple of them)."""
    per_node = cluster.hardware.devices_per_node
    pp = len(devices)
    world = [d + r * pp for r in range(replicas) for d in devices]
    pools: dict[int, _CorePool] = {}
    group_of: dict[int, int] = {}  # rank -> its pool, for every rank of the job on a node with one of ours
    for node in sorted({d // per_node for d in devices}):
        local = sorted(g for g in world if g // per_node == node)
        if cluster.shared_cores is None:  # a device per rank: replicas share nothing
            local = sorted(d for d in devices if d // per_node == node)
            groups = [(None, tuple(range(len(local))))]
        else:
            groups = core_groups(len(local), cluster.shared_cores, cluster.pinned_cores)
        for cores, ranks in groups:
            key = len(pools)
            pools[key] = _CorePool(cores, cluster.hardware.core_sharing)
            group_of.update({local[r]: key for r in ranks})
    pool_of = {d: group_of[d] for d in devices}
    weight = {d: sum(group_of.get(d + r * pp) == pool_of[d] for r in range(replicas)) for d in devices}
    return pool_of, pools, weight


@dataclass
class _RowPlan:
    """One rank's list as the event loop reads it, worked out once per run: per position, the
    FREE / AR key of a mark (else None), the task key of a compute or encode (else None), the
    message a receive waits for or a send moves (else None), and what the action costs the
    rank's thread (its compute and cold start, or its message calls). The loop meets an action
    once or more (a receive whose message is late is met again), so none of this is per event."""

    marks: list
    computes: list
    receives: list
    sends: list
    busy: list


@dataclass
class _State:
    rows: dict[int, tuple[Action, ...]]
    keys: dict[int, dict[int, MessageKey]]
    pools: dict[int, _CorePool]  # per group of ranks sharing cores
    pool_of: dict[int, int]  # rank -> its pool
    weight: dict[int, int]  # rank -> the ranks busy in its pool when it is (its data-parallel twins there)
    heap: list = field(default_factory=list)
    arrived: dict[MessageKey, float] = field(default_factory=dict)
    waiting: dict[MessageKey, int] = field(default_factory=dict)
    out_free: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    inbound: InboundLinks = field(default_factory=InboundLinks)
    encode_src: dict[tuple[int, int], int] = field(default_factory=dict)  # (encoder, mb) -> its device
    cold_start: dict[str, float] = field(default_factory=dict)  # compute kind -> seconds (CostTable.cold_start)
    plans: dict[int, _RowPlan] = field(default_factory=dict)  # per rank (``_row_plan``)
    links: dict[tuple[int, int], LinkCost] = field(default_factory=dict)  # (sender, receiver) -> its cost
    due: list[float] = field(default_factory=list)  # per pool key (0, 1, ...): its next_done, set as it changes
    seq: int = 0

    def push(self, when: float, event: tuple) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (when, self.seq, event))

    def add_job(self, now: float, seconds: float, d: int, pos: int) -> None:
        key = self.pool_of[d]
        self.due[key] = self.pools[key].add(now, seconds, d, pos, self.weight[d])

    def link(self, sender: int, receiver: int, cluster: Cluster) -> LinkCost:
        """``cluster.link_cost``, once per pair and run."""
        terms = self.links.get((sender, receiver))
        if terms is None:
            terms = self.links[(sender, receiver)] = cluster.link_cost(sender, receiver)
        return terms


def run_program(program: Schedule, graph: TaskGraph, spec: ModelSpec, placement: Placement,
                cluster: Cluster, microbatch_size: int, encoders: EncoderSet | None = None,
                cold_start: dict[str, float] | None = None, replicas: int = 1) -> ProgramRun:
    """Run every rank's lowered action list; ``graph`` gives the compute (and encode) durations,
    ``cold_start`` what a compute action after a message action takes more (by the graph's F, B, W);
    ``replicas``: the data-parallel replicas running it in lockstep (they share a CPU host's cores)."""
    wire = Wire.of(spec, placement, encoders, cluster.tensor_messages)
    rows = {d: tuple(program.actions.get(d, ())) for d in range(placement.num_devices)}
    pool_of, pools, weight = _core_pools(cluster, list(rows), replicas)
    state = _State(rows, {d: wire.message_keys(row) for d, row in rows.items()}, pools, pool_of, weight)
    state.cold_start = {kind: t for kind, t in (cold_start or {}).items() if t}  # none: no look-back
    state.encode_src = {(a.encoder, a.microbatch): d for d, row in rows.items() for a in row if a.is_encode}
    state.plans = {d: _row_plan(state, wire, graph, cluster, d) for d in rows}
    state.due = [pools[key].next_done() for key in range(len(pools))]
    run = ProgramRun(next_position={d: 0 for d in rows}, comm_busy={d: 0.0 for d in rows})
    for d in rows:
        state.push(0.0, ("run", d))
    heap, due = state.heap, state.due
    while True:
        done_at = min(due)  # the pool whose first job ends first, the lowest key among equal ends
        if heap and heap[0][0] < done_at:
            now, _, event = heapq.heappop(heap)
            if event[0] == "sent":
                _deliver(state, run, wire, cluster, microbatch_size, now, event[1], event[2])
            else:
                _start(state, run, event[1], now)
        elif done_at < math.inf:  # a pool has a job
            pool = due.index(done_at)
            device, start, position, due[pool] = pools[pool].pop(done_at)
            _finish(state, run, device, position, start, done_at)
        else:
            break
    return run


def _row_plan(state: _State, wire: Wire, graph: TaskGraph, cluster: Cluster, d: int) -> _RowPlan:
    row, keys = state.rows[d], state.keys[d]
    n = len(row)
    plan = _RowPlan([None] * n, [None] * n, [None] * n, [None] * n, [0.0] * n)
    message_costs: dict[tuple, float] = {}  # a transfer's cost to issue or unpack: the same every microbatch
    after_compute = False  # the last action but marks was a compute or an encode (``_cold_start``)
    for pos, a in enumerate(row):
        kind = a.kind
        if kind in MARK_KINDS:
            plan.marks[pos] = a.task
            continue
        if kind in COMPUTE_KINDS or kind in ENCODE_KINDS:
            task = plan.computes[pos] = a.task
            duration = graph.tasks[task].duration
            plan.busy[pos] = duration if kind in ENCODE_KINDS else duration + _cold_start(state, kind, after_compute)
            after_compute = True
            continue
        msg = keys[pos]
        receiving = kind in ("RF", "RB", "RE")
        if receiving:
            plan.receives[pos] = msg
        else:
            plan.sends[pos] = msg
        cost = (msg[0], msg[1], receiving)
        if msg[0] == "E" or cost not in message_costs:  # an encode's sender depends on the microbatch
            message_costs[cost] = _message_seconds(state, wire, cluster, msg, receiving)
        plan.busy[pos] = message_costs[cost]
        after_compute = False
    return plan


def _message_seconds(state: _State, wire: Wire, cluster: Cluster, msg: MessageKey, receiving: bool) -> float:
    """What a send (issue) or receive (unpack) of ``msg`` costs its rank's thread."""
    if msg[0] == "E":  # one tensor: one wire message
        etr = wire.encodes[msg[1]]
        terms = state.link(state.encode_src[(etr.encoder, msg[2])], etr.dst_device, cluster)
        return terms.message_overhead if receiving else terms.send_overhead
    tr = wire.transfers[msg[1]]
    sender, receiver = (tr.src_device, tr.dst_device) if msg[0] == "F" else (tr.dst_device, tr.src_device)
    terms = state.link(sender, receiver, cluster)
    return wire.messages[msg[1]] * (terms.message_overhead if receiving else terms.send_overhead)


def _cold_start(state: _State, kind: str, after_compute: bool) -> float:
    """What a compute action takes more for following a message action, or for starting the
    rank's list (marks do not count: they are no work on the rank's thread)."""
    if not state.cold_start or after_compute:
        return 0.0
    return state.cold_start.get(kind, 0.0)


def _start(state: _State, run: ProgramRun, d: int, now: float) -> None:
    """Start rank ``d``'s next action at ``now``, or park it until its message arrives."""
    pos = run.next_position[d]
    plan = state.plans[d]
    marks = plan.marks
    end = len(marks)
    while pos < end and marks[pos] is not None:  # inline: no event of its own, so event order is unchanged
        run.marks[marks[pos]] = now
        pos += 1
    run.next_position[d] = pos
    if pos >= end:
        run.end[d] = now
        return
    msg = plan.receives[pos]
    if msg is not None:
        arrival = state.arrived.get(msg)
        if arrival is None:
            state.waiting[msg] = d  # woken by _deliver
            return
        if arrival > now:
            state.push(arrival, ("run", d))
            return
    state.add_job(now, plan.busy[pos], d, pos)


def _finish(state: _State, run: ProgramRun, d: int, pos: int, start: float, end: float) -> None:
    plan = state.plans[d]
    task = plan.computes[pos]
    if task is not None:
        run.compute[task] = (start, end)
    else:
        run.comm_busy[d] += end - start
        msg = plan.sends[pos]
        if msg is not None:
            state.push(end, ("sent", msg, d))
    run.next_position[d] = pos + 1
    state.push(end, ("run", d))


def _deliver(state: _State, run: ProgramRun, wire: Wire, cluster: Cluster, microbatch_size: int,
             now: float, msg: MessageKey, sender: int) -> None:
    direction, index, mb = msg
    if direction == "E":
        _deliver_encode(state, run, wire, cluster, microbatch_size, now, msg, sender)
        return
    tr = wire.transfers[index]
    receiver = tr.dst_device if direction == "F" else tr.src_device
    terms = state.link(sender, receiver, cluster)
    nbytes = tr.total_bytes * microbatch_size
    start, arrival = _claim_links(state, sender, receiver, now, nbytes, terms)
    state.arrived[msg] = arrival
    run.last_arrival[sender] = max(run.last_arrival.get(sender, 0.0), arrival)
    src_chunk, dst_chunk = (tr.src_chunk, tr.dst_chunk) if direction == "F" else (tr.dst_chunk, tr.src_chunk)
    run.messages.append(MessageEvent(sender, receiver, src_chunk, dst_chunk, mb, direction, nbytes,
                                     tr.skips, now, start, arrival))
    if msg in state.waiting:
        state.push(arrival, ("run", state.waiting.pop(msg)))


def _claim_links(state: _State, sender: int, receiver: int, now: float, nbytes: float,
                 terms: LinkCost) -> tuple[float, float]:
    """(when the message starts on the sender's outbound link, when it has arrived): the outbound
    link in FIFO order, the receiver's inbound link from that start on (``pulse.link_slots``), so a
    sender goes on with its next message while another sender holds this receiver's link."""
    hold = nbytes / terms.bandwidth if nbytes > 0 else 0.0
    start = max(now, state.out_free[sender])
    state.out_free[sender] = start + hold
    landed = state.inbound.book(receiver, start, hold) + hold
    return start, landed + terms.latency


def _deliver_encode(state: _State, run: ProgramRun, wire: Wire, cluster: Cluster, microbatch_size: int,
                    now: float, msg: MessageKey, sender: int) -> None:
    """An encoder's output on the same outbound / inbound links as every other message."""
    _, index, mb = msg
    tr = wire.encodes[index]
    terms = state.link(sender, tr.dst_device, cluster)
    nbytes = tr.nbytes * microbatch_size
    start, arrival = _claim_links(state, sender, tr.dst_device, now, nbytes, terms)
    state.arrived[msg] = arrival
    run.last_arrival[sender] = max(run.last_arrival.get(sender, 0.0), arrival)
    run.messages.append(MessageEvent(sender, tr.dst_device, tr.encoder, tr.dst_chunk, mb, "E", nbytes,
                                     (), now, start, arrival))
    if msg in state.waiting:
        state.push(arrival, ("run", state.waiting.pop(msg)))
