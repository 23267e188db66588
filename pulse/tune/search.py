"""The tuner's search: every placement once, then candidates priced where they can still win, on every core.

::

    candidates ──by placement──▶ groups (the schedules, caps and encoders modes of one shape)
    1. place every group once (in the workers)
    2. bound every candidate (pulse.tune.bounds), then in rounds of ROUND, lowest bound first:
         skip a candidate whose bound cannot beat the incumbents (pulse.tune.incumbents),
         simulate the others (and their recomputing variants) in the workers,
         merge the round's outcomes in order: the incumbents fall, the next round starts

The rounds are fixed in size and merged in order, so the same candidates are priced
however many workers run, and the result lists every outcome in enumeration order.
"""
from __future__ import annotations

import multiprocessing
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Iterator

from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.placement import Placement
from pulse.schedule.generators import OnLinks
from pulse.sim.memory import static_bytes
from pulse.sim.step import StepTerms
from pulse.spec import ModelSpec
from pulse.tune.bounds import placement_bound
from pulse.tune.evaluate import Evaluation, place, safe_evaluate
from pulse.tune.incumbents import Incumbents
from pulse.tune.space import Candidate

if TYPE_CHECKING:
    from pulse.tune.request import TuneRequest

ROUND = 8  # candidates priced between two merges: small enough that the incumbents fall early
PlacementKey = tuple[str, int, int, int, int]


def placement_key(c: Candidate) -> PlacementKey:
    """Candidates with the same key share one placement's cuts (they differ in schedule, cap, encoders
    mode, and how skips travel: ``with_transport``)."""
    return (c.partitioner, c.pp, c.folds, c.virtual, c.microbatch_size)


def with_transport(placement: Placement | str, c: Candidate) -> Placement | str:
    """The shared placement with the candidate's skip transport (PULSE's direct skips on a baseline's cuts)."""
    if isinstance(placement, str) or placement.skip_transport == c.skip_transport:
        return placement
    return replace(placement, skip_transport=c.skip_transport)


@dataclass(frozen=True)
class Priced:
    """One candidate's outcome: its evaluations (as priced, then recomputing), why it cannot be
    built, or skipped (its bound cannot beat the incumbents)."""

    index: int  # in the enumeration
    candidate: Candidate
    evaluations: tuple[Evaluation, ...] = ()
    reason: str = ""
    skipped: bool = False


@dataclass(frozen=True)
class Job:
    """What a worker needs: the request, the candidate's cost table, and (to price) its placement."""

    request: "TuneRequest"
    costs: CostTable
    index: int
    candidate: Candidate
    placement: Placement | None = None


def search(request: "TuneRequest", tables: dict[int, CostTable], candidates: list[Candidate], *,
           incumbents: Incumbents | None, workers: int = 1,
           progress: Callable[[str], None] | None = None) -> list[Priced]:
    """Every candidate's outcome, in enumeration order; ``incumbents`` None prices them all."""
    _LINKS.clear()  # another request's graphs; forked workers start from this empty cache
    firsts: dict[PlacementKey, int] = {}
    for i, c in enumerate(candidates):
        firsts.setdefault(placement_key(c), i)
    out: list[Priced] = []

    def record(priced: Priced) -> None:
        out.append(priced)
        if incumbents is not None:
            for e in priced.evaluations:
                incumbents.add(e)
        if progress:
            progress(priced.candidate.label + (" (skipped: its bound cannot win)" if priced.skipped else ""))

    with worker_pool(workers) as pool:
        run = pool.imap if pool is not None else map
        placing = [Job(request, tables[key[4]], i, candidates[i]) for key, i in firsts.items()]
        placements = dict(zip(firsts, run(place_job, placing)))
        bounds, jobs = {}, []
        for i, c in enumerate(candidates):
            placement = with_transport(placements[placement_key(c)], c)
            if isinstance(placement, str):
                record(Priced(i, c, reason=placement))
                continue
            jobs.append(Job(request, tables[c.microbatch_size], i, c, placement))
            if incumbents is not None:
                bounds[i] = placement_bound(request.spec, placement, jobs[-1].costs, request.cluster, c,
                                            _terms(request, c))
        jobs.sort(key=lambda j: (bounds.get(j.index, 0.0), j.index))
        for start in range(0, len(jobs), ROUND):
            live = []
            for job in jobs[start:start + ROUND]:
                if incumbents is None or incumbents.matters(bounds[job.index], job.candidate):
                    live.append(job)
                else:
                    record(Priced(job.index, job.candidate, skipped=True))
            for priced in _largest_first(run, live):
                record(priced)
    return sorted(out, key=lambda p: p.index)


def _largest_first(run: Callable, live: list[Job]) -> list[Priced]:
    """The round's outcomes in ``live``'s order, its jobs handed to the workers largest first:
    a round ends with its slowest worker, and a long simulation started last would leave the
    other cores idle. The outcomes, merged in order after the round, do not depend on it."""
    order = sorted(range(len(live)), key=lambda i: (-_size(live[i]), i))
    outcomes = dict(zip(order, run(price_job, [live[i] for i in order])))
    return [outcomes[i] for i in range(len(live))]


def _size(job: Job) -> int:
    """A job's tasks (chunks x microbatches): its schedule's and simulation's work grow with them."""
    return len(job.placement.chunks) * job.candidate.num_microbatches


@contextmanager
def worker_pool(workers: int) -> Iterator:
    """Worker processes (forked where the platform can: they inherit the loaded modules), or None."""
    if workers <= 1:
        yield None
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    with context.Pool(workers) as pool:
        yield pool


def place_job(job: Job) -> Placement | str:
    """The placement every candidate of the job's group shares, or why it cannot be built (a worker)."""
    return place_or_reason(job.request.spec, job.costs, job.request.cluster, job.candidate)


_LINKS: dict[tuple[str, str], OnLinks] = {}  # per process and search: the list schedules' task graphs


def price_job(job: Job) -> Priced:
    """Simulate one candidate on its placement, and its recomputing variants when it is over the
    budget (a worker). The candidates of one shape share their list schedules' task graphs."""
    request, c = job.request, job.candidate
    spec, cluster = request.spec, request.cluster
    links = _LINKS.setdefault((spec.name, cluster.name), OnLinks(spec, cluster))
    outcome = safe_evaluate(spec, job.costs, cluster, c, request.memory_budget, request.memory,
                            placement=job.placement, encoders=request.encoders, links=links)
    if isinstance(outcome, str):
        return Priced(job.index, c, reason=outcome)
    tried = [outcome]
    if request.recompute and not outcome.fits:  # the recompute dimension: only where it can help
        tried += recompute_variants(spec, job.costs, cluster, outcome, request)
    return Priced(job.index, c, tuple(tried))


def _terms(request: "TuneRequest", c: Candidate) -> StepTerms:
    return StepTerms(dp=c.dp, grad_bytes=request.memory.grad_bytes)  # as pulse.tune.evaluate prices it


def recompute_variants(spec: ModelSpec, costs: CostTable, cluster: Cluster, over: Evaluation,
                       request: "TuneRequest") -> list[Evaluation]:
    """``over`` (a shape over the budget) priced again with recomputation, the cheapest first:
    the chunks of its over-budget devices, then (if that does not fit) every chunk.

    Stops at the first that fits: recomputing more chunks only adds forwards. Nothing is
    tried when static memory alone (parameters, gradients, optimizer) exceeds the budget.
    """
    placement, budget = over.placement, request.memory_budget
    buckets = request.memory.bucket_bytes if over.candidate.dp > 1 else 0  # as evaluate prices the candidate
    static = static_bytes(spec, placement, request.memory.per_param - request.memory.bucket_bytes + buckets)
    if max(static) > budget:
        return []
    over_devices = {d for d, peak in enumerate(over.device_peaks) if peak > budget}
    tries = [tuple(c for c, ch in enumerate(placement.chunks) if ch.device in over_devices),
             tuple(range(len(placement.chunks)))]
    schedule = over.schedule.without_encodes() if over.schedule.has_encodes else over.schedule  # placed again
    out: list[Evaluation] = []
    for chunks in dict.fromkeys(tries):  # in order, once each
        again = safe_evaluate(spec, costs, cluster, replace(over.candidate, recompute=chunks), budget,
                              request.memory, schedule=schedule, placement=placement, encoders=request.encoders)
        if isinstance(again, str):
            break
        out.append(again)
        if again.fits:
            break
    return out


def place_or_reason(spec: ModelSpec, costs: CostTable, cluster: Cluster, cand: Candidate) -> Placement | str:
    try:
        return place(spec, costs, cluster, cand)
    except PlanError as exc:
        return str(exc)
