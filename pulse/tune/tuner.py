"""The hybrid-parallelism tuner: search, price, reject what does not fit, rank.

Pure over its inputs (spec, cluster, cost tables): the CLI adds the progress
bar and the tables. ``refine`` may improve the finalists' schedules (the ILP
synthesizer); everything else uses the baseline generators, which are fast.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

from pulse.costs import AnalyticProfiler, CostTable, Profiler, with_encoder_costs
from pulse.encoders import EncoderSet, check_feeds
from pulse.errors import PlanError, PulseError
from pulse.hardware import Cluster
from pulse.spec import ModelSpec
from pulse.placement import Placement
from pulse.sim.memory import MemoryModel, static_bytes
from pulse.tune.evaluate import Evaluation, place, safe_evaluate
from pulse.tune.space import STRATEGIES, Candidate, enumerate_candidates, with_encoder_modes

Refiner = Callable[[ModelSpec, CostTable, Cluster, Evaluation, int], Evaluation]


@dataclass(frozen=True)
class TuneRequest:
    spec: ModelSpec
    cluster: Cluster
    global_batch: int
    memory_budget: int  # bytes per device
    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    folds: tuple[int, ...] = (1, 2)
    max_pp: int | None = None
    memory: MemoryModel = MemoryModel()
    recompute: bool = True  # may a shape over the budget recompute activations to fit
    encoders: EncoderSet | None = None  # the model's frozen encoders (pulse.zoo.encoders), if any
    encoder_modes: tuple[str, ...] = ("cached",)  # where they may run; each shape is priced per mode


@dataclass(frozen=True)
class TuneResult:
    ranked: tuple[Evaluation, ...]  # fitting candidates, fastest first
    rejected: tuple[Evaluation, ...]  # priced but over the memory budget, fastest first
    unbuildable: tuple[tuple[Candidate, str], ...]  # e.g. more chunks than the model has cut points
    best_by_strategy: dict[str, Evaluation] = field(hash=False)
    seconds: float = 0.0
    best_by_encoders: dict[str, Evaluation] = field(default_factory=dict, hash=False)  # per encoders mode

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
         finalists: int = 3) -> TuneResult:
    started = time.monotonic()
    spec, cluster = request.spec, request.cluster
    candidates = _candidates(request)
    profiler = profiler or AnalyticProfiler(cluster.hardware)
    tables = {mbs: profiler.profile(spec, mbs) for mbs in sorted({c.microbatch_size for c in candidates})}
    if request.encoders is not None:  # measured encoder times kept, the others estimated like layers
        check_feeds(spec, request.encoders)
        tables = {mbs: with_encoder_costs(t, request.encoders, cluster.hardware) for mbs, t in tables.items()}
    fitting, rejected, unbuildable = [], [], []
    placements: dict[tuple, Placement | str] = {}  # candidates differing only in schedule share one
    for cand in candidates:
        costs = tables[cand.microbatch_size]
        key = (cand.partitioner, cand.pp, cand.folds, cand.virtual, cand.microbatch_size)
        if key not in placements:
            placements[key] = _place_or_reason(spec, costs, cluster, cand)
        placement = placements[key]
        outcome = placement if isinstance(placement, str) else safe_evaluate(
            spec, costs, cluster, cand, request.memory_budget, request.memory, placement=placement,
            encoders=request.encoders)
        if isinstance(outcome, str):
            unbuildable.append((cand, outcome))
        else:
            tried = [outcome]
            if request.recompute and not outcome.fits:  # the recompute dimension: only where it can help
                tried += recompute_variants(spec, costs, cluster, outcome, request)
            for e in tried:
                (fitting if e.fits else rejected).append(e)
        if progress:
            progress(cand.label)
    if refine is not None:
        fitting = _refined(fitting, refine, spec, tables, cluster, request.memory_budget, finalists)
    if not fitting:
        raise _nothing_fits(request, rejected, unbuildable)
    fitting.sort(key=lambda e: -e.samples_per_s)
    rejected.sort(key=lambda e: -e.samples_per_s)
    best = {}
    for evaluation in fitting:
        best.setdefault(evaluation.candidate.strategy, evaluation)
    by_mode: dict[str, Evaluation] = {}
    for evaluation in fitting:
        by_mode.setdefault(evaluation.candidate.encoders, evaluation)
    return TuneResult(tuple(fitting), tuple(rejected), tuple(unbuildable), best, time.monotonic() - started,
                      by_mode)


def recompute_variants(spec: ModelSpec, costs: CostTable, cluster: Cluster, over: Evaluation,
                       request: TuneRequest) -> list[Evaluation]:
    """``over`` (a shape over the budget) priced again with recomputation, the cheapest first:
    the chunks of its over-budget devices, then (if that does not fit) every chunk.

    Stops at the first that fits: recomputing more chunks only adds forwards. Nothing is
    tried when static memory alone (parameters, gradients, optimizer) exceeds the budget.
    """
    placement, budget = over.placement, request.memory_budget
    static = static_bytes(spec, placement, request.memory.per_param)
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


def _place_or_reason(spec: ModelSpec, costs: CostTable, cluster: Cluster, cand: Candidate) -> Placement | str:
    try:
        return place(spec, costs, cluster, cand)
    except PlanError as exc:
        return str(exc)


def _candidates(request: TuneRequest) -> list[Candidate]:
    if request.global_batch < 1:
        raise PulseError(f"--global-batch must be >= 1, got {request.global_batch}")
    max_pp = min(request.max_pp or request.cluster.num_devices, request.spec.num_layers)
    candidates = enumerate_candidates(request.cluster.num_devices, request.global_batch,
                                      request.microbatch_sizes, request.folds, max_pp)
    if request.encoders is not None and request.encoder_modes != ("cached",):
        candidates = with_encoder_modes(candidates, request.encoder_modes)
    if not candidates:
        devices = request.cluster.num_devices
        min_dp = devices // max(d for d in range(1, max_pp + 1) if devices % d == 0)
        unit = min_dp * min(request.microbatch_sizes)
        raise PulseError(
            f"global batch {request.global_batch} cannot be split as DP x microbatch size x M on {devices} "
            f"devices (pipelines of at most {max_pp}, microbatch sizes "
            f"{', '.join(map(str, request.microbatch_sizes))}): use a multiple of {unit}")
    return candidates


def _refined(fitting: list[Evaluation], refine: Refiner, spec: ModelSpec, tables: dict[int, CostTable],
             cluster: Cluster, budget: int, finalists: int) -> list[Evaluation]:
    pulse = sorted((e for e in fitting if e.candidate.strategy == "pulse"), key=lambda e: -e.samples_per_s)
    improved = {id(e): refine(spec, tables[e.candidate.microbatch_size], cluster, e, budget)
                for e in pulse[:finalists]}
    return [improved.get(id(e), e) for e in fitting]


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


__all__ = ["STRATEGIES", "TuneRequest", "TuneResult", "default_budget", "tune"]
