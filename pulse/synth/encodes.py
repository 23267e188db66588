"""The ILP's turn at the frozen encoders: encode tasks sequenced together with the pipeline's work.

The bubbles pass (``pulse.schedule.encode``) places E actions one at a time into
the gaps of a fixed compute order. Here the same tasks go into the disjunctive
model of ``pulse.synth.ilp``, each on the device the pass chose (that device had
room for the encoder's weights), with what makes them encodes::

    E (e, m)      forward only: one task of the encoder's measured seconds, no B, no W,
                  nothing saved for a backward (no in-flight cap counts it)
    E -> F (c, m) its output reaches each reader chunk c after the link's transfer time
    E (e, M + m)  a prefetch for the next step: no successor in this step, only a device slot

so the solver may move compute around the encodes as well as the encodes
between the compute (the pass can only do the latter). CBC starts from the
pass's order, so the answer is never worse on the task graph; it is kept only
when the simulator prices it faster (``place_encodes_with_ilp``).
"""
from __future__ import annotations

from typing import Mapping

from pulse.costs import CostTable
from pulse.encoders import EncoderSet
from pulse.hardware import Cluster
from pulse.placement import Placement
from pulse.schedule.deps import add_encode_tasks, build_dependencies
from pulse.schedule.ir import Action, Schedule
from pulse.schedule.validate import is_split
from pulse.sim.encodes import place_encodes
from pulse.sim.engine import simulate
from pulse.sim.memory import MemoryModel
from pulse.spec import ModelSpec
from pulse.synth.caps import inflight_caps
from pulse.synth.ilp import WindowSolution, solve_window

ENCODE_ILP_SECONDS = 5.0  # per schedule: a pipeline's encodes with its compute solve in well under this


def place_encodes_with_ilp(spec: ModelSpec, placement: Placement, schedule: Schedule, costs: CostTable,
                           cluster: Cluster, encoders: EncoderSet, budget: int | None,
                           memory: MemoryModel = MemoryModel(), ilp_seconds: float = ENCODE_ILP_SECONDS) -> Schedule:
    """The bubbles pass's encodes (``pulse.sim.encodes.place_encodes``), then for ``bubbles`` the ILP's
    re-sequencing of encodes and compute, kept when the simulator prices it faster within the budget."""
    greedy = place_encodes(spec, placement, schedule, costs, cluster, encoders, budget, memory)
    if encoders.mode != "bubbles" or ilp_seconds <= 0 or not greedy.has_encodes:
        return greedy
    caps = inflight_caps(spec, placement, costs, budget, memory)
    found = sequence_encodes(spec, placement, greedy, costs, cluster, encoders, time_limit=ilp_seconds, caps=caps)
    if found is None:
        return greedy
    ilp, kept = (simulate(spec, placement, s, costs, cluster, memory_budget=budget, memory=memory, encoders=encoders)
                 for s in (found[0], greedy))
    if ilp.fits_memory and ilp.makespan < kept.makespan * (1 - 1e-9):
        return found[0]
    return greedy


def sequence_encodes(spec: ModelSpec, placement: Placement, schedule: Schedule, costs: CostTable,
                     cluster: Cluster, encoders: EncoderSet, *, time_limit: float,
                     caps: Mapping[int, int] | None = None) -> tuple[Schedule, WindowSolution] | None:
    """``schedule`` (with its E actions) re-sequenced by the ILP; None if the solver had no time."""
    compute = schedule.compute_only()
    num_mb = compute.num_microbatches
    graph = build_dependencies(spec, placement, num_mb, costs, cluster, split_backward=is_split(compute))
    devices = {(a.encoder, a.microbatch): a.device for a in compute.all_actions() if a.is_encode}
    graph = add_encode_tasks(graph, spec, placement, costs, cluster, encoders, devices)
    start = {d: _encodes_in_microbatch_order([a.task for a in row])
             for d, row in compute.actions.items()}
    solution = solve_window(graph, inflight_cap=caps, time_limit=time_limit, hints=[start])
    if solution is None:
        return None
    rows = {d: tuple(Action.of_task(d, key) for key in solution.orders.get(d, ()))
            for d in range(placement.num_devices)}
    return Schedule(schedule.name, num_mb, rows), solution


def _encodes_in_microbatch_order(row: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The model orders one encoder's E on a device by microbatch (equal tasks, the earlier one
    read first: no loss); the start must too. Sorting them within the slots they hold keeps every
    E before the forwards that read it: a slot held by a later microbatch's E opened earlier."""
    out = list(row)
    for e in sorted({c for kind, c, _ in row if kind == "E"}):
        slots = [i for i, (kind, c, _) in enumerate(row) if kind == "E" and c == e]
        for i, key in zip(slots, sorted(row[i] for i in slots)):
            out[i] = key
    return out
