"""The hybrid-parallelism tuner: search, price, reject what does not fit, rank.

Pure over its inputs (spec, cluster, cost tables): the CLI adds the progress
bar and the tables. ``refine`` may improve the finalists' schedules (the ILP
synthesizer); everything else uses the baseline generators, which are fast.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from pulse.costs import AnalyticProfiler, CostTable, Profiler
from pulse.encoders import check_feeds
from pulse.errors import PlanError, PulseError
from pulse.hardware import Cluster
from pulse.sim.breakdown import step_breakdown
from pulse.spec import ModelSpec
from pulse.tune.caps_fit import fit_caps
from pulse.tune.evaluate import Evaluation
from pulse.tune.fitted import SpecBuilder, cost_table, refit_bests
from pulse.tune.incumbents import GroupOf, Incumbents
from pulse.tune.request import TuneRequest
from pulse.tune.search import recompute_variants, search, worker_pool
from pulse.tune.space import STRATEGIES, Candidate, enumerate_candidates, with_encoder_modes

Refiner = Callable[[ModelSpec, CostTable, Cluster, Evaluation, int], Evaluation]


@dataclass(frozen=True)
class TuneResult:
    ranked: tuple[Evaluation, ...]  # fitting candidates, fastest first
    rejected: tuple[Evaluation, ...]  # priced but over the memory budget, fastest first
    unbuildable: tuple[tuple[Candidate, str], ...]  # e.g. more chunks than the model has cut points
    best_by_strategy: dict[str, Evaluation] = field(hash=False)
    seconds: float = 0.0
    best_by_encoders: dict[str, Evaluation] = field(default_factory=dict, hash=False)  # per encoders mode
    skipped: int = 0  # candidates not simulated: their lower bound cannot change the answer (pulse.tune.incumbents)

    @property
    def winner(self) -> Evaluation:
        return self.ranked[0]

    @property
    def strongest_baseline(self) -> Evaluation | None:
        """The fastest fitting configuration of any strategy but pulse, whatever its schedule."""
        rivals = [e for name, e in self.best_by_strategy.items() if name != "pulse"]
        return max(rivals, key=lambda e: e.samples_per_s, default=None)

    def speedup_over_strongest(self) -> float | None:
        best, pulse = self.strongest_baseline, self.best_by_strategy.get("pulse")
        return None if best is None or pulse is None else pulse.samples_per_s / best.samples_per_s

    def speedup_over(self, strategy: str) -> float | None:
        best = self.best_by_strategy.get(strategy)
        pulse = self.best_by_strategy.get("pulse")
        if best is None or pulse is None:
            return None
        return pulse.samples_per_s / best.samples_per_s


def default_budget(cluster: Cluster, margin_bytes: int = 2 * 2**30) -> int:
    """Device memory minus a margin for the framework, workspace and fragmentation."""
    return cluster.hardware.memory_bytes - margin_bytes


def tune(request: TuneRequest, profiler: Profiler | None = None,
         progress: Callable[[str], None] | None = None, refine: Refiner | None = None,
         finalists: int = 3, *, top: int = 10, exhaustive: bool = False, workers: int | None = None,
         keep_best_of: GroupOf | None = None, fit_caps_of_bests: bool = True,
         fit_layers: SpecBuilder | None = None) -> TuneResult:
    """Rank the request's candidates by simulated step.

    Skips (without simulating) every candidate whose lower bound shows it cannot reach the
    ranking's first ``top``, its strategy's best or its encoders mode's best (nor the best of
    the group ``keep_best_of`` names): those are exactly the exhaustive search's
    (``exhaustive=True`` prices everything). ``workers``: processes (default: every core).
    ``fit_caps_of_bests``: each strategy's best on a list schedule gets per-device in-flight caps
    fitted to the memory budget (``pulse.tune.caps_fit``), the baselines' as PULSE's. ``fit_layers`` (how
    the model is built with other split options): each strategy's best is priced again with finer layers
    only where its cuts fall (``pulse.tune.fitted``); such an evaluation's ``fitted`` holds that model."""
    started = time.monotonic()
    spec, cluster = request.spec, request.cluster
    candidates = _candidates(request)
    profiler = profiler or AnalyticProfiler(cluster.hardware)
    if request.encoders is not None:  # measured encoder times kept, the others estimated like layers
        check_feeds(spec, request.encoders)
    tables = {mbs: cost_table(profiler, spec, mbs, request) for mbs in sorted({c.microbatch_size for c in candidates})}
    incumbents = None if exhaustive else Incumbents(top, finalists if refine is not None else 1, keep_best_of)
    workers = (os.cpu_count() or 1) if workers is None else workers
    priced = search(request, tables, candidates, incumbents=incumbents, workers=workers, progress=progress)
    fitting, rejected = [], []
    for p in priced:
        for e in p.evaluations:
            (fitting if e.fits else rejected).append(e)
    unbuildable = [(p.candidate, p.reason) for p in priced if p.reason]
    if refine is not None:
        fitting = _refined(fitting, refine, spec, tables, cluster, request.memory_budget, finalists)
    if not fitting:
        raise _nothing_fits(request, rejected, unbuildable)
    if fit_caps_of_bests:
        fitting = _caps_fitted(fitting, request, tables, workers)
    if fit_layers is not None:
        fitting = refit_bests(fitting, request, profiler, fit_layers)
    fitting.sort(key=lambda e: -e.samples_per_s)
    rejected.sort(key=lambda e: -e.samples_per_s)
    best = {}
    for evaluation in fitting:
        best.setdefault(evaluation.candidate.strategy, evaluation)
    explained = {id(e): explain(e, request, tables[e.candidate.microbatch_size], profiler) for e in best.values()}
    fitting = [explained.get(id(e), e) for e in fitting]
    best = {strategy: explained[id(e)] for strategy, e in best.items()}
    by_mode: dict[str, Evaluation] = {}
    for evaluation in fitting:
        by_mode.setdefault(evaluation.candidate.encoders, evaluation)
    return TuneResult(tuple(fitting), tuple(rejected), tuple(unbuildable), best, time.monotonic() - started,
                      by_mode, skipped=sum(p.skipped for p in priced))


def explain(e: Evaluation, request: TuneRequest, costs: CostTable, profiler: Profiler | None = None) -> Evaluation:
    """``e`` with its step broken down (``pulse.sim.breakdown``: one more simulation, messages free);
    on its fitted model where it has one (``profiler`` prices that model's layers)."""
    if e.fitted is not None:
        request = replace(request, spec=e.fitted.spec)
        costs = cost_table(profiler or AnalyticProfiler(request.cluster.hardware), e.fitted.spec,
                           e.candidate.microbatch_size, request)
    memory = replace(request.memory, recompute=frozenset(e.candidate.recompute))
    parts = step_breakdown(request.spec, e.placement, e.schedule, costs, request.cluster, e.step, memory,
                           e.encoders, e.candidate.dp)
    return replace(e, breakdown=parts)


def _candidates(request: TuneRequest) -> list[Candidate]:
    if request.global_batch < 1:
        raise PulseError(f"--global-batch must be >= 1, got {request.global_batch}")
    max_pp = min(request.max_pp or request.cluster.num_devices, request.spec.num_layers)
    candidates = enumerate_candidates(request.cluster.num_devices, request.global_batch,
                                      request.sizes, request.folds, max_pp)
    if request.encoders is not None and request.encoder_modes != ("cached",):
        candidates = with_encoder_modes(candidates, request.encoder_modes)
    if not candidates:
        devices = request.cluster.num_devices
        min_dp = devices // max(d for d in range(1, max_pp + 1) if devices % d == 0)
        unit = min_dp * min(request.sizes)
        raise PulseError(
            f"global batch {request.global_batch} cannot be split as DP x microbatch size x M on {devices} "
            f"devices (pipelines of at most {max_pp}, microbatch sizes "
            f"{', '.join(map(str, request.sizes))}): use a multiple of {unit}")
    return candidates


def _refined(fitting: list[Evaluation], refine: Refiner, spec: ModelSpec, tables: dict[int, CostTable],
             cluster: Cluster, budget: int, finalists: int) -> list[Evaluation]:
    pulse = sorted((e for e in fitting if e.candidate.strategy == "pulse"), key=lambda e: -e.samples_per_s)
    improved = {id(e): refine(spec, tables[e.candidate.microbatch_size], cluster, e, budget)
                for e in pulse[:finalists]}
    return [improved.get(id(e), e) for e in fitting]


def _caps_fitted(fitting: list[Evaluation], request: TuneRequest, tables: dict[int, CostTable],
                 workers: int) -> list[Evaluation]:
    """``fitting`` with each strategy's (and encoders mode's) fastest given fitted caps."""
    firsts: dict[tuple[str, str], Evaluation] = {}
    for e in sorted(fitting, key=lambda e: e.iteration_time):
        firsts.setdefault((e.candidate.strategy, e.candidate.encoders), e)
    bests = list(firsts.values())
    jobs = [(request, tables[e.candidate.microbatch_size], e) for e in bests]
    with worker_pool(workers) as pool:
        fitted = dict(zip(map(id, bests), (pool.map if pool is not None else map)(_fit_job, jobs)))
    return [fitted.get(id(e), e) for e in fitting]


def _fit_job(job: tuple[TuneRequest, CostTable, Evaluation]) -> Evaluation:
    request, costs, e = job
    return fit_caps(request.spec, costs, request.cluster, e, request.memory_budget, request.memory)


def _nothing_fits(request: TuneRequest, rejected: list[Evaluation],
                  unbuildable: list[tuple[Candidate, str]]) -> PulseError:
    if not rejected:
        reason = unbuildable[0][1] if unbuildable else "no candidate"
        return PlanError(f"no configuration can be built: {reason}")
    smallest = min(rejected, key=lambda e: e.peak_memory)
    return PlanError(
        f"nothing fits the memory budget of {request.memory_budget / 2**30:.2f} GiB per device; the "
        f"smallest need is {smallest.peak_memory / 2**30:.2f} GiB ({smallest.candidate.label}): raise "
        f"--memory-budget to at least {smallest.peak_memory / 2**30:.2f} GiB or add devices")


__all__ = ["STRATEGIES", "TuneRequest", "TuneResult", "default_budget", "recompute_variants", "tune"]
