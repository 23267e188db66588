"""The simulator: one engine for every schedule, timing what the runtime runs.

A schedule is lowered by the same step the runtime's launchers take
(``pulse.schedule.lower``: messages, frees, all-reduces); ``pulse.sim.program``
runs every rank's list in order (compute for the cost table's time, sends and
receives with per-message costs on one outbound and one inbound link per
rank, a receive blocking until its message arrives)::

    dev0  [F0 ][SF0][F1 ][SF1]                compute and message calls
    out0            [==m0==]  [==m1==]        the sender's link, serialized
    dev1              ^arrival [RF0][F0 ]

Memory (held until the program's FREE), busy and idle time and bytes per link
follow from those times; the data-parallel buckets start at the program's AR
(``pulse.sim.step``). A compute-only schedule and its lowered form time the
same: lowering is rerun.

With a plan's frozen encoders (``encoders``, ``pulse.encoders``) the program's
encodes are priced too: an E takes the cost table's ``encoder_fwd``, its output
travels as an SE/RE message, the encoder's fp16 weights stay resident on every
device that runs one of its encodes and its output is held until read.
"""
from __future__ import annotations

from pulse.costs import CostTable
from pulse.encoders import EncoderSet, reader_chunks
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.placement import Placement
from pulse.schedule.deps import TaskGraph, add_encode_tasks, build_dependencies
from pulse.schedule.generators import OnLinks
from pulse.schedule.lower import lower
from pulse.schedule.ir import Schedule
from pulse.schedule.validate import fail, is_split
from pulse.sim.memory import EncodeHold, MemoryModel, profile_memory, recompute_of
from pulse.sim.program import ProgramRun, run_program
from pulse.sim.result import ComputeSpan, MarkEvent, SimResult
from pulse.spec import ModelSpec


def simulate(spec: ModelSpec, placement: Placement, schedule: Schedule, costs: CostTable,
             cluster: Cluster, *, memory_budget: int | None = None,
             memory: MemoryModel = MemoryModel(), encoders: EncoderSet | None = None,
             links: OnLinks | None = None, replicas: int = 1) -> SimResult:
    """Time one iteration of ``schedule`` as the runtime runs it; raise PlanError if it deadlocks.

    The schedule is lowered as the runtime's launchers lower it (``pulse.schedule.lower``)
    and every rank's list is run by ``pulse.sim.program`` (per-message costs, one link each
    way per rank, blocking receives). The data-parallel all-reduce (from the ARs), the
    optimizer step and the step's synchronisations are priced on top by ``pulse.sim.step``.
    ``memory`` gives the static bytes per parameter and the chunks that recompute their
    activations (their B re-runs the forward; they hold only their inputs from F to B).
    ``links`` (an ``OnLinks`` of this spec and cluster) lends the task graph it keeps for the
    placement (the one its list schedules were ordered on), built once for all the schedules of a shape.
    ``replicas``: the data-parallel replicas that run this pipeline in lockstep; on a CPU host their
    ranks share its cores with it (``pulse.sim.program``).
    """
    if placement.num_devices > cluster.num_devices:
        raise PlanError(f"placement uses {placement.num_devices} devices but cluster '{cluster.name}' "
                        f"has {cluster.num_devices}")
    num_mb = schedule.num_microbatches
    program = _lowered(schedule, spec, placement, encoders)
    compute = program.compute_only()
    graph = _task_graph(spec, placement, num_mb, costs, cluster, is_split(compute), recompute_of(memory, placement),
                        links)
    encode_devices = {(a.encoder, a.microbatch): a.device for a in compute.all_actions() if a.is_encode}
    if encode_devices:  # lower() refused encodes without encoders
        graph = add_encode_tasks(graph, spec, placement, costs, cluster, encoders, encode_devices)
    backward = "Bi" if graph.split_backward else "B"  # a split backward's B is its input half
    cold_start = {"F": costs.cold_start_seconds("F"), "B": costs.cold_start_seconds(backward),
                  "W": costs.cold_start_seconds("W")}
    run = run_program(program, graph, spec, placement, cluster, costs.microbatch_size, encoders, cold_start,
                      replicas)
    stuck = {(d, p): "" for d, p in run.next_position.items() if p < len(program.actions.get(d, ()))}
    if stuck:
        raise fail(program, "schedule deadlocks: a rank waits for a message that is sent only after "
                   "work scheduled behind that wait", stuck)
    return _result(spec, placement, compute, costs, graph, run, memory, memory_budget,
                   _encode_memory(spec, placement, costs, encoders, encode_devices))


_LOWERED: list[tuple[Schedule, ModelSpec, Placement, EncoderSet | None, Schedule]] = []  # the latest, newest first
KEEP_LOWERED = 2


def _lowered(schedule: Schedule, spec: ModelSpec, placement: Placement, encoders: EncoderSet | None) -> Schedule:
    """``lower``'s program, kept for the latest schedules: the tuner simulates a schedule over the
    budget again with recomputing chunks (a breakdown simulates one again on free links), and
    lowering depends on neither. Kept by the schedule object itself (held here; schedules are
    never changed in place), its spec, placement and encoders: a pure function's memo."""
    for seen, seen_spec, seen_placement, seen_encoders, program in _LOWERED:
        if seen is schedule and seen_spec is spec and seen_placement == placement and seen_encoders == encoders:
            return program
    program = lower(schedule, spec, placement, encoders)
    _LOWERED.insert(0, (schedule, spec, placement, encoders, program))
    del _LOWERED[KEEP_LOWERED:]
    return program


def _task_graph(spec: ModelSpec, placement: Placement, num_mb: int, costs: CostTable, cluster: Cluster,
                split: bool, recompute: frozenset[int], links: OnLinks | None) -> TaskGraph:
    """The program's task graph: ``links``' (kept) when it is of this spec and cluster, else built.
    A recomputing variant's is built and not kept: its backwards are longer."""
    if links is not None and not recompute and links.spec == spec and links.cluster == cluster:
        return links.graph(placement, num_mb, costs, split)
    return build_dependencies(spec, placement, num_mb, costs, cluster, split_backward=split, recompute=recompute)


def _encode_memory(spec: ModelSpec, placement: Placement, costs: CostTable, encoders: EncoderSet | None,
                   encode_devices: dict[tuple[int, int], int]) -> tuple[list[int] | None, list[EncodeHold], tuple]:
    """Per device the weights of the encoders it runs, each encode's output hold, the encoder names."""
    if not encode_devices:
        return None, [], ()
    weights = [0] * placement.num_devices
    for e, d in sorted({(e, d) for (e, _), d in encode_devices.items()}):
        weights[d] += encoders.encoders[e].weight_bytes
    readers = [reader_chunks(spec, placement, enc) for enc in encoders.encoders]
    holds = [EncodeHold(e, m, d, encoders.encoders[e].out_bytes_at(spec.act_bytes) * costs.microbatch_size,
                        tuple(c for c in readers[e] if placement.chunks[c].device == d))
             for (e, m), d in sorted(encode_devices.items())]
    return weights, holds, tuple(enc.name for enc in encoders.encoders)


def _result(spec: ModelSpec, placement: Placement, schedule: Schedule, costs: CostTable, graph: TaskGraph,
            run: ProgramRun, memory: MemoryModel, memory_budget: int | None,
            encode: tuple[list[int] | None, list[EncodeHold], tuple] = (None, [], ())) -> SimResult:
    num_dev = placement.num_devices
    times, messages = run.compute, run.messages
    busy = [0.0] * num_dev
    for key, task in graph.tasks.items():
        busy[task.device] += task.duration
    rank_end = tuple(run.end.get(d, 0.0) for d in range(num_dev))
    makespan = max(rank_end, default=0.0)
    bubble = 1.0 - sum(busy) / (num_dev * makespan) if makespan > 0 else 0.0
    frees = {(c, m): t for (kind, c, m), t in run.marks.items() if kind == "FREE"}
    mem = profile_memory(spec, placement, costs, times, frees, messages, schedule.num_microbatches, memory,
                         encode[0], encode[1])
    marks = tuple(MarkEvent(placement.chunks[c].device, kind, c, m, t)
                  for (kind, c, m), t in sorted(run.marks.items(), key=lambda kv: (kv[1], kv[0])))
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
        rank_end=rank_end, sends_done=tuple(run.last_arrival.get(d, 0.0) for d in range(num_dev)),
        comm_busy=tuple(run.comm_busy.get(d, 0.0) for d in range(num_dev)), marks=marks,
        encoder_names=encode[2],
    )
