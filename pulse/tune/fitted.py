"""The tuner's bests priced again with finer layers only where their cuts fall.

A search on finer layers (``split_resnets`` / ``split_transformers``) finds cuts inside a few blocks;
every other block it left whole still pays a second launch in every pass. Each strategy's best is
priced again on the model with only the blocks its cuts enter split (``pulse.partition.fitted_splits``):
the same candidate, chunks, devices and caps, its schedule made again on the fitted layers, kept where
the step is faster. The baselines get the same, so the comparison stays like for like.

A measured cost table prices the layers it was measured on and no others: with one, nothing is
fitted (``pulse profile`` the fitted model to price it).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from pulse.costs import CostTable, Profiler, with_encoder_costs
from pulse.errors import PulseError
from pulse.partition.fitted_splits import fit_splits
from pulse.spec import ModelSpec
from pulse.tune.evaluate import Evaluation, safe_evaluate
from pulse.tune.request import TuneRequest

SpecBuilder = Callable[[dict], ModelSpec]  # split options -> the model built with them (and the run's others)


def cost_table(profiler: Profiler, spec: ModelSpec, microbatch_size: int, request: TuneRequest) -> CostTable:
    """The table the tuner prices ``spec`` with: the profiler's, with the encoders' measured times."""
    table = profiler.profile(spec, microbatch_size)
    if request.encoders is not None:
        table = with_encoder_costs(table, request.encoders, request.cluster.hardware)
    return table


def refit(e: Evaluation, request: TuneRequest, profiler: Profiler, build: SpecBuilder) -> Evaluation:
    """``e`` on the model with only the blocks its cuts enter split, where that prices faster and
    still fits; else ``e``."""
    if e.placement is None or request.memory.adapters is not None:  # LoRA's counts are per finer layer
        return e
    fitted = fit_splits(request.spec, e.placement, build)
    if fitted.spec.num_layers == request.spec.num_layers:
        return e  # every split block is cut (or none was split)
    try:
        costs = cost_table(profiler, fitted.spec, e.candidate.microbatch_size, request)
    except PulseError:  # a measured table knows the finer layers only
        return e
    again = safe_evaluate(fitted.spec, costs, request.cluster, e.candidate, request.memory_budget, request.memory,
                          placement=fitted.placement, encoders=request.encoders)
    if isinstance(again, str) or not again.fits or again.iteration_time >= e.iteration_time:
        return e
    return replace(again, fitted=fitted)


def refit_bests(fitting: list[Evaluation], request: TuneRequest, profiler: Profiler,
                build: SpecBuilder) -> list[Evaluation]:
    """``fitting`` with each strategy's (and encoders mode's) fastest refitted (``refit``)."""
    firsts: dict[tuple[str, str], Evaluation] = {}
    for e in sorted(fitting, key=lambda e: e.iteration_time):
        firsts.setdefault((e.candidate.strategy, e.candidate.encoders), e)
    again = {id(e): refit(e, request, profiler, build) for e in firsts.values()}
    return [again.get(id(e), e) for e in fitting]
