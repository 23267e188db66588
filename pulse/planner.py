"""The planner as a library: a model's spec, cost table and cluster plus a ``PlanRequest`` in, a ``Plan`` out.

::

    PlanRequest (pp, dp, microbatching, partitioner, schedule, recompute, encoders, BackendTraits)
        │ make_plan(spec, costs, cluster, request)
        ▼
    traits.runs ─▶ costs and cluster as the backend runs them (pulse.backend_traits)
    choose_placement ─▶ Placement            (pulse.partition: the V / wave, or a baseline partitioner)
    traits.recompute ─▶ the recomputing chunks (what was asked, or every chunk where the backend must)
    choose_schedule ─▶ Schedule              (pulse.synth: the ILP's pick, or a named baseline)
      + the frozen encoders' tasks placed    (pulse.synth.encodes)
    predict ─▶ Plan.predicted                (pulse.sim: the whole step on the links the job gets)

`pulse train` turns its flags into a ``PlanRequest`` and calls ``make_plan``; `pulse train --plan
FILE` prices a given plan with ``price_plan``. Nothing here reads argparse or prints: progress and
notes go to the callables the caller hands in.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from pulse.backend_traits import BackendTraits
from pulse.costs import CostTable, with_encoder_costs
from pulse.encoders import EncoderSet
from pulse.errors import PlanError, PulseError
from pulse.grad_buckets import BUCKET_CAP_BYTES
from pulse.hardware import Cluster
from pulse.partition import partition, plan_symmetric
from pulse.partition.priced import DEFAULT_CANDIDATES, PricedCuts
from pulse.placement import Placement
from pulse.plan import Plan
from pulse.schedule.generators import OnLinks, make_schedule
from pulse.schedule.ir import Schedule
from pulse.schedule.validate import validate
from pulse.sim.engine import simulate
from pulse.sim.figures import sim_figures
from pulse.sim.memory import MemoryModel
from pulse.sim.step import StepTerms, step_time
from pulse.spec import ModelSpec

if TYPE_CHECKING:
    from pulse.synth.synthesize import SynthResult

Say = Callable[[str], None]


@dataclass(frozen=True)
class PlanRequest:
    """What to plan; the fields are `pulse train`'s flags of the same names.

    ``model``, ``cluster`` and ``model_options`` are what the plan records (a zoo name, spec path or
    ``diffusers:DIR``; a cluster name or YAML). ``num_microbatches`` None: 2 x pp. ``schedule``: 'auto'
    (the ILP's pick among it and every baseline, by simulation) or a baseline's name. ``recompute``:
    'all', 'none', chunk indices like '0,3', or None (none). ``encoders``: None (cached offline) or the
    set that runs in the pipeline. ``emulate_bandwidth``: every link at that rate (bytes/s). ``adapters``
    (``--lora-rank``): the LoRA parameters each spec layer trains beside its frozen own
    (``pulse.zoo.lora.adapter_params``), priced as ``MemoryModel.adapters``; None: a full fine-tune.
    """

    model: str
    cluster: str
    pp: int
    dp: int = 1
    microbatch_size: int = 1
    num_microbatches: int | None = None
    partitioner: str = "pulse"
    folds: int = 1
    strict: bool = False
    objective: str = "time"
    schedule: str = "auto"
    time_limit: float = 20.0
    recompute: str | None = None
    encoders: EncoderSet | None = None
    emulate_bandwidth: float | None = None
    cut_candidates: int = DEFAULT_CANDIDATES  # V / wave cut sets the simulator prices (0: the proxy's pick)
    traits: BackendTraits = BackendTraits()
    model_options: Mapping = field(default_factory=dict, hash=False)
    adapters: tuple[int, ...] | None = None
    bucket_cap: int = BUCKET_CAP_BYTES  # --bucket-cap-mb: the data-parallel buckets' bytes (pulse.grad_buckets)
    # what the run's ranks hold per parameter (``pulse.sim.memory.run_memory``); the default: the
    # planners' mixed-precision accounting
    memory: MemoryModel = MemoryModel()

    def __post_init__(self) -> None:
        counts = {"pp": self.pp, "dp": self.dp, "microbatch_size": self.microbatch_size, "folds": self.folds,
                  "num_microbatches": self.microbatches}
        for name, value in counts.items():  # worded as the flags are (`pulse train` checks them the same way)
            if value < 1:
                raise PulseError(f"--{name.replace('_', '-')} must be >= 1, got {value}")

    @property
    def microbatches(self) -> int:
        """Microbatches per step and replica."""
        return self.num_microbatches or 2 * self.pp

    def link_cluster(self, cluster: Cluster) -> Cluster:
        """The cluster the job will see: with ``emulate_bandwidth``, every link at that rate."""
        return cluster.with_link_bandwidth(self.emulate_bandwidth) if self.emulate_bandwidth else cluster


def recompute_chunks(choice: str | None, num_chunks: int, default: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The chunks ``choice`` (``--recompute``: all, none, indices like 0,3) names on a placement of
    ``num_chunks`` (None: ``default``)."""
    if choice is None:
        return default
    if choice in ("all", "none"):
        return tuple(range(num_chunks)) if choice == "all" else ()
    chunks = tuple(sorted({int(c) for c in choice.split(",")}))
    if chunks[-1] >= num_chunks:
        raise PulseError(f"--recompute names chunk {chunks[-1]}, but the placement has chunks 0..{num_chunks - 1}")
    return chunks


def memory_of(recompute: tuple[int, ...], adapters: tuple[int, ...] | None = None,
              base: MemoryModel | None = None) -> MemoryModel:
    """The simulator's memory model with these chunks recomputing: ``base``'s bytes per parameter (None: the
    defaults); with ``adapters``, a LoRA run's: the base frozen, the adapters trained."""
    return replace(base or MemoryModel(), recompute=frozenset(recompute), adapters=adapters)


def choose_placement(spec: ModelSpec, costs: CostTable, cluster: Cluster, request: PlanRequest,
                     cuts: Say | None = None) -> Placement:
    """The request's partitioner over ``pp`` devices. Pulse's V / wave: the cut set the simulator prices
    fastest on the job's links among ``cut_candidates`` proposals (``pulse.partition.priced``); ``cuts``
    hears the chosen one and its runners-up."""
    if request.partitioner == "pulse":
        plan = plan_symmetric(spec, costs, request.pp, folds=request.folds, strict=request.strict,
                              cluster=request.link_cluster(cluster), objective=request.objective,
                              num_microbatches=request.microbatches, candidates=request.cut_candidates,
                              memory_budget=cluster.hardware.memory_bytes)
        if cuts is not None:
            for line in describe_priced(plan.priced):
                cuts(line)
        return plan.placement
    return partition(request.partitioner, spec, costs, request.pp, folds=request.folds, cluster=cluster)


AUTO = "auto"  # the partitioner that picks the fastest placement at the job's shape (pulse.tune.placement_choice)


def auto_placement(spec: ModelSpec, costs: CostTable, cluster: Cluster, request: PlanRequest, cuts: Say | None,
                   placed: Say | None) -> tuple[Placement, PlanRequest]:
    """``--partitioner auto``: the planner's V against the sequential and interleaved shapes at the request's
    pp, dp and microbatching, each with its fastest schedule (the request's, when it names one), by simulated
    step on the job's links; returns the winner's placement and the request with its partitioner."""
    from pulse.tune.placement_choice import Shape, choose_placement_auto

    if request.recompute not in (None, "none") or (request.encoders is not None and request.encoders.active):
        raise PulseError("--partitioner auto prices placements without recomputation and with the encoders cached: "
                         "name the partitioner (pulse, sequential) to plan with --recompute or --encoders")
    v_request = replace(request, partitioner="pulse")
    try:
        v_placement = choose_placement(spec, costs, cluster, v_request, cuts)
    except PlanError:  # e.g. too few cut points for a V at this pp: the sequential shapes alone
        v_placement = None
    shape = Shape(request.pp, request.dp, request.microbatch_size, request.microbatches, request.folds)
    schedule = None if request.schedule == "auto" else request.schedule
    choice = choose_placement_auto(spec, costs, request.link_cluster(cluster), shape, v_placement,
                                   memory_of((), request.adapters, request.memory), cluster.hardware.memory_bytes,
                                   schedule)
    if placed is not None:
        placed(choice.line())
    winner = choice.winner
    return winner.placement, replace(request, partitioner=winner.candidate.partitioner)


def describe_priced(priced: Sequence[PricedCuts], runners_up: int = 3) -> list[str]:
    """The chosen cut set and its first runners-up, one line each (none when nothing was priced)."""
    if not priced:
        return []
    lines = [f"chosen       {priced[0].describe()}"]
    lines += [f"runner-up {i}  {p.describe()}" for i, p in enumerate(priced[1:runners_up + 1], 1)]
    if len(priced) > runners_up + 1:
        lines.append(f"({len(priced) - runners_up - 1} more cut sets priced)")
    return lines


def auto_schedule(spec: ModelSpec, placement: Placement, costs: CostTable, cluster: Cluster, num_microbatches: int,
                  memory: MemoryModel, time_limit: float, budget: int | None = None,
                  progress: Say | None = None) -> SynthResult:
    """``--schedule auto``: ``synthesize``'s pick (the ILP's schedule vs every baseline, by simulation),
    within ``time_limit`` seconds of ILP and, when given, ``budget`` bytes per device."""
    from pulse.synth import synthesize  # the ILP solver loads only when a schedule is synthesized

    return synthesize(spec, placement, costs, cluster, num_microbatches, memory_budget=budget, memory=memory,
                      time_limit=time_limit, progress=progress)


def choose_schedule(spec: ModelSpec, placement: Placement, costs: CostTable, cluster: Cluster,
                    request: PlanRequest, recompute: tuple[int, ...] = (), progress: Say | None = None) -> Schedule:
    """The request's schedule for ``placement``: synthesized ('auto', on the job's links) or a baseline."""
    if request.schedule == "auto":
        memory = memory_of(recompute, request.adapters, request.memory)
        return auto_schedule(spec, placement, costs, request.link_cluster(cluster), request.microbatches,
                             memory, request.time_limit, progress=progress).schedule
    schedule = make_schedule(request.schedule, placement, request.microbatches, costs,
                             OnLinks(spec, request.link_cluster(cluster)))
    validate(schedule, placement, request.microbatches)
    return schedule


def plan_of(request: PlanRequest, placement: Placement, schedule: Schedule | None = None,
            recompute: tuple[int, ...] = (), predicted: dict | None = None) -> Plan:
    """The ``Plan`` record of ``request`` with this placement, schedule and recomputing chunks."""
    return Plan(model=request.model, cluster=request.cluster, pp=request.pp, dp=request.dp,
                microbatch_size=request.microbatch_size, num_microbatches=request.microbatches,
                partitioner=request.partitioner, placement=placement, schedule=schedule,
                model_options=dict(request.model_options), predicted=dict(predicted or {}), recompute=recompute,
                encoders=request.encoders)


def make_plan(spec: ModelSpec, costs: CostTable, cluster: Cluster, request: PlanRequest, *,
              progress: Say | None = None, note: Say | None = None, cuts: Say | None = None,
              placed: Say | None = None) -> Plan:
    """Plan ``spec`` as ``request`` asks, priced as its backend runs it.

    ``costs`` and ``cluster`` are the measured (or analytic) table and the cluster, before the
    backend's traits; ``progress`` hears the ILP's progress lines, ``note`` what the backend changed
    of the request (MindSpore: recompute on every chunk), ``cuts`` the priced cut sets (chosen first),
    ``placed`` (partitioner 'auto') which placement won and by how much.
    Returns the plan with ``predicted`` set.
    """
    costs, cluster = request.traits.runs(costs, cluster)
    if request.partitioner == AUTO:
        placement, request = auto_placement(spec, costs, cluster, request, cuts, placed)
    else:
        placement = choose_placement(spec, costs, cluster, request, cuts)
    num_chunks = len(placement.chunks)
    recompute, said = request.traits.recompute(recompute_chunks(request.recompute, num_chunks), num_chunks)
    if said and note:
        note(said)
    schedule = choose_schedule(spec, placement, costs, cluster, request, recompute, progress)
    encoders = request.encoders
    if encoders is not None:  # the encodes go into the chosen schedule (before it, or in its bubbles)
        from pulse.synth.encodes import ENCODE_ILP_SECONDS, place_encodes_with_ilp

        costs = with_encoder_costs(costs, encoders, cluster.hardware)
        memory = memory_of(recompute, request.adapters, request.memory)
        schedule = place_encodes_with_ilp(spec, placement, schedule, costs, request.link_cluster(cluster), encoders,
                                          cluster.hardware.memory_bytes, memory,
                                          ilp_seconds=min(ENCODE_ILP_SECONDS, request.time_limit))
    plan = plan_of(request, placement, schedule, recompute)
    return replace(plan, predicted=predict(spec, costs, request.link_cluster(cluster), plan, request.adapters,
                                           request.memory, request.bucket_cap))


def price_plan(spec: ModelSpec, costs: CostTable, cluster: Cluster, plan: Plan,
               traits: BackendTraits = BackendTraits(), emulate_bandwidth: float | None = None,
               note: Say | None = None, adapters: tuple[int, ...] | None = None,
               memory: MemoryModel | None = None, bucket_cap: int = BUCKET_CAP_BYTES) -> Plan:
    """A given plan as ``traits``' backend runs it (its recomputing chunks), predicted on this table and
    cluster (every link at ``emulate_bandwidth`` when given); ``note`` as ``make_plan``'s; ``adapters``
    as ``PlanRequest``'s (LoRA)."""
    costs, cluster = traits.runs(costs, cluster)
    recompute, said = traits.recompute(plan.recompute, len(plan.placement.chunks))
    if said and note:
        note(said)
    plan = replace(plan, recompute=recompute)
    if plan.encoders is not None and plan.encoders.active:
        costs = with_encoder_costs(costs, plan.encoders, cluster.hardware)
    link = cluster.with_link_bandwidth(emulate_bandwidth) if emulate_bandwidth else cluster
    return replace(plan, predicted=predict(spec, costs, link, plan, adapters, memory, bucket_cap))


def predict(spec: ModelSpec, costs: CostTable, cluster: Cluster, plan: Plan,
            adapters: tuple[int, ...] | None = None, memory: MemoryModel | None = None,
            bucket_cap: int = BUCKET_CAP_BYTES) -> dict:
    """What the simulator says of ``plan`` on ``cluster`` (the links the job gets; ``pulse.sim.step``: the
    whole step), under ``pulse.sim.figures``' names; a plan it cannot simulate gets a ``note`` instead.
    With LoRA ``adapters`` (per layer), priced with the base frozen, and ``trainable_params`` their sum;
    ``memory``: what the run's ranks hold per parameter (None: the planners' defaults); ``bucket_cap``:
    the bytes of its data-parallel buckets."""
    if plan.schedule is None:
        raise PlanError("the plan has no schedule to simulate")
    predicted: dict = {"cost_source": costs.source}
    timed = sum(costs.measured_span("F", c.start, c.end) is not None for c in plan.placement.chunks)
    if timed:  # `pulse profile --time-chunks`: said wherever the prediction's source is
        predicted["cost_source"] += f", {timed} of its {len(plan.placement.chunks)} chunks timed whole"
    if adapters is not None:
        predicted["trainable_params"] = sum(adapters)
    encoders = plan.encoders if plan.encoders is not None and plan.encoders.active else None
    try:
        sim = simulate(spec, plan.placement, plan.schedule, costs, cluster,
                       memory=memory_of(plan.recompute, adapters, memory), encoders=encoders, replicas=plan.dp)
        step = step_time(spec, plan.placement, costs, cluster, sim,
                         StepTerms(dp=plan.dp, grad_bytes=4, adapters=adapters, bucket_cap=bucket_cap))
        predicted.update(sim_figures(sim, step, plan.dp), cluster=cluster.name)  # the names simulate/tune use
    except PlanError as exc:  # e.g. more pipeline devices than the cluster file has: run unpredicted
        predicted["note"] = f"not simulated: {exc}".splitlines()[0]
    return predicted
