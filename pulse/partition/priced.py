"""Cuts chosen by the simulated step, not by the partitioner's proxy.

The chain DPs rank cuts by a proxy: the largest device load (balance), or that load
with the cuts' link time (``linkaware``). Neither is the step the job runs: bubbles,
the schedule's order, the optimizer on the slowest rank and the all-reduces are left
out, and on profiled costs the proxy's first choice can lose to another V by 10% or more.
So the planner proposes several cut sets and lets the simulator decide::

    candidates   the k best chains under the proxy (``chain.k_best_chains``, V only),
                 the bytes pass's chain, the link-aware chain, the chain the analytic
                 costs give (the default a user gets without a profile)
    price        each with every V schedule (``PULSE_SCHEDULES``) on the cluster:
                 the whole step (``pulse.sim.step``), over-budget schedules left out
    scan         (V on two devices, measured costs) every pair of cuts (SD v2: 1,035; in finer layers ~3,000),
                 in order of a bound on the step, until the bound passes the best found:
                 the step's best cut is often not the proxy's
    refine       (V, measured costs) the fastest moved a layer or two at a time, one boundary at a
                 time, while the simulator says the step gets faster (``refine_v``):
                 the proxy ranks by balance alone and its k best chains can all sit
                 in one basin, 6% above a cut nearby (SD v2, pp 2, profiled)
    choose       the fastest; the others are the runners-up `pulse plan` / `train` print

Pricing is pure and deterministic: the same inputs give the same choice on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.partition.chain import INF
from pulse.partition.cuts import CutSet
from pulse.placement import Placement
from pulse.spec import ModelSpec

PRICED_SCHEDULES = ("greedy_v_1f1b", "zero_bubble_v")  # the V schedules the tuner searches too
DEFAULT_CANDIDATES = 8  # proxy chains priced by `pulse plan` / `train` (each a few simulations)
REFINE_PRICINGS = 256  # chains ``refine_v`` prices at most, over the devices (each pricing grows with them:
# SD v2 at P = 8, M = 16, 75 ms): 128 at P = 2, 32 at P = 8, about 2.5 s more `pulse plan` there
REFINE_STEPS = (1, 2)  # layers a boundary moves by (2: past a zero-time layer the step cannot tell)
SCAN_PRICINGS = 10000  # a two-device V's every pair of cuts priced where there are at most this many
BOUND_SLACK = 0.02  # the scan's bound, lowered by what a fitted per-action correction can take off a step


@dataclass(frozen=True)
class PricedCuts:
    """One candidate cut set and what the simulator says of it."""

    source: str  # where the chain came from: "proxy #1", "bytes pass", "link-aware", "analytic costs"
    chain: tuple[int, ...]  # cut indices into the cut set, outermost first
    cuts: tuple[tuple[int, int], ...]  # (encoder-side layer, decoder-side layer) of each cut
    step_seconds: float  # the simulated step with its best schedule (inf: no schedule priced)
    schedule: str  # that schedule

    def describe(self) -> str:
        cuts = " ".join(f"{a}|{b}" for a, b in self.cuts[1:])
        step = f"{self.step_seconds * 1e3:.2f} ms" if self.step_seconds < INF else "not priced"
        return f"{step} ({self.schedule}) cuts {cuts or '-'}  [{self.source}]"


def price_chain(spec: ModelSpec, costs: CostTable, cluster: Cluster, placement: Placement,
                num_microbatches: int, memory_budget: int | None) -> tuple[float, str]:
    """(simulated step seconds, schedule) of ``placement`` with its fastest V schedule that fits."""
    from pulse.schedule.generators import OnLinks, make_schedule
    from pulse.sim.engine import simulate
    from pulse.sim.step import step_time

    best = (INF, PRICED_SCHEDULES[0])
    for name in PRICED_SCHEDULES:
        try:
            schedule = make_schedule(name, placement, num_microbatches, costs, OnLinks(spec, cluster))
            result = simulate(spec, placement, schedule, costs, cluster)
        except PlanError:  # e.g. a cluster smaller than the plan, or too few microbatches
            continue
        if memory_budget is not None and max(result.peak_memory) > memory_budget:
            continue
        total = step_time(spec, placement, costs, cluster, result).total
        best = min(best, (total, name))
    return best


def choose_priced(spec: ModelSpec, costs: CostTable, cluster: Cluster, cutset: CutSet,
                  proposals: Sequence[tuple[str, list[int]]], placement_of, num_microbatches: int,
                  memory_budget: int | None = None) -> list[PricedCuts]:
    """Every distinct proposal priced, fastest first (ties: the earlier proposal).

    ``placement_of(chain)`` builds the placement a chain stands for. A proposal seen
    before under another source keeps its first source.
    """
    seen: dict[tuple[int, ...], str] = {}
    for source, chain in proposals:
        seen.setdefault(tuple(chain), source)
    priced = []
    for order, (chain, source) in enumerate(seen.items()):
        step, schedule = price_chain(spec, costs, cluster, placement_of(list(chain)), num_microbatches,
                                     memory_budget)
        cuts = tuple((int(cutset.cuts[c][0]), int(cutset.cuts[c][1])) for c in chain)
        priced.append((step, order, PricedCuts(source, chain, cuts, step, schedule)))
    return [p for _, _, p in sorted(priced, key=lambda x: (x[0], x[1]))]


def v_boundaries(cutset: CutSet, chain: Sequence[int]) -> list[int]:
    """A V chain's chunk boundaries, first layer to last: 0, a_1 .. a_P (the tip), b_(P-1) .. b_1, L."""
    cuts = [cutset.cuts[c] for c in chain]
    return [a for a, _ in cuts] + [b for _, b in reversed(cuts[:-1])]


def v_chain(cutset: CutSet, bounds: Sequence[int], index: dict[tuple[int, int], int]) -> list[int] | None:
    """The chain (indices into ``cutset``, ``index`` its cut -> position) with chunk boundaries
    ``bounds``; None where a cut is not in the set (a skip would cross in a skip-local set)."""
    pairs = len(bounds) // 2
    cuts = [(bounds[j], bounds[-1 - j]) for j in range(pairs)] + [(bounds[pairs], bounds[pairs])]
    chain = [index.get(cut) for cut in cuts]
    return None if any(c is None for c in chain) else chain  # type: ignore[return-value]


def _moves(size: int) -> list[dict[int, int]]:
    """Boundary moves over a V's ``size`` boundaries (the ends fixed): each one alone by
    ``REFINE_STEPS`` layers either way, then each boundary with its mirror (an encoder cut and the
    decoder cut of the same pair), both at once: one device gives a layer on one side and takes
    one on the other, a move no single boundary makes without unbalancing first."""
    single = [{p: m * sign} for p in range(1, size - 1) for m in REFINE_STEPS for sign in (1, -1)]
    steps = [m * sign for m in REFINE_STEPS for sign in (1, -1)]
    paired = [{p: dp, size - 1 - p: dq} for p in range(1, (size - 1) // 2)
              for dp in steps for dq in steps]
    return single + paired


def refine_v(spec: ModelSpec, costs: CostTable, cluster: Cluster, cutset: CutSet, start: PricedCuts,
             placement_of, num_microbatches: int, memory_budget: int | None = None,
             budget: int | None = None) -> list[PricedCuts]:
    """``start``'s V moved a few layers at a time (``_moves``), each move kept where the simulated
    step (``price_chain``) gets faster, until no move does or ``budget`` chains were priced: the
    chains it kept, in order (empty: none was faster). Deterministic, so every rank plans alike."""
    index = {cut: i for i, cut in enumerate(cutset.cuts)}
    if budget is None:
        budget = REFINE_PRICINGS // (len(start.chain) - 1)
    bounds, best, kept, priced = v_boundaries(cutset, start.chain), start.step_seconds, [], 0
    moves, seen = _moves(len(v_boundaries(cutset, start.chain))), {tuple(v_boundaries(cutset, start.chain))}
    improved = True
    while improved and priced < budget:
        improved = False
        for move in moves:
            trial = [b + move.get(i, 0) for i, b in enumerate(bounds)]
            if tuple(trial) in seen or not all(x < y for x, y in zip(trial, trial[1:])):
                continue
            seen.add(tuple(trial))
            chain = v_chain(cutset, trial, index)
            if chain is None:
                continue
            if priced >= budget:
                break
            priced += 1
            step, schedule = price_chain(spec, costs, cluster, placement_of(chain), num_microbatches, memory_budget)
            if step < best:
                cuts = tuple((int(cutset.cuts[c][0]), int(cutset.cuts[c][1])) for c in chain)
                kept.append(PricedCuts(f"refined from {start.source}", tuple(chain), cuts, step, schedule))
                bounds, best, improved = trial, step, True
                break
    return kept


def scan_two_device_v(spec: ModelSpec, costs: CostTable, cluster: Cluster, cutset: CutSet, placement_of,
                      num_microbatches: int, memory_budget: int | None = None,
                      limit: int = SCAN_PRICINGS) -> PricedCuts | None:
    """The fastest two-device V over every (encoder cut, decoder cut) of ``cutset``, its turn at the
    first valid layer past the middle of the device's span (``refine_v`` moves it after); None where
    there are more than ``limit`` pairs. On two devices the proxy's best chains balance F + B within a
    percent of each other while the step, with its bubbles and each rank's optimizer, differs by 7%.

    Pairs are priced in order of a bound no step goes below (each device's M (F + B) and optimizer,
    back to back, and the pipeline's fill) and the scan stops at the first bound above the fastest
    step found."""
    index = {cut: i for i, cut in enumerate(cutset.cuts)}
    tips = sorted(a for a, b in cutset.cuts if a == b)
    outer = [(a, b) for a, b in cutset.cuts[1:] if a < b]
    if not outer or len(outer) > limit:
        return None
    work = [0.0, *accumulate(num_microbatches * (f + b) + o for f, b, o in
                             zip(costs.fwd, costs.bwd, costs.optimizer or [0.0] * len(costs.fwd)))]
    fwd = [0.0, *accumulate(costs.fwd)]

    def bound(cut: tuple[int, int]) -> float:
        """Device 1 waits for the first microbatch's forward on device 0; device 0 waits for that
        microbatch's way through device 1 less the forwards it can run meanwhile."""
        a, b = cut
        inner, first = work[b] - work[a], fwd[a]
        fill = max(0.0, fwd[b] - num_microbatches * first)  # F0 + F1 + F2 of one microbatch, less M x F0
        return max(first + inner, work[-1] - inner + fill) * (1 - BOUND_SLACK)

    best: PricedCuts | None = None
    for a, b in sorted(outer, key=bound):
        if best is not None and bound((a, b)) >= best.step_seconds:
            break
        tip = next((t for t in tips if t > a and t >= (a + b) // 2 and t < b), None)
        if tip is None:
            continue
        chain = [0, index[(a, b)], index[(tip, tip)]]
        step, schedule = price_chain(spec, costs, cluster, placement_of(chain), num_microbatches, memory_budget)
        if best is None or step < best.step_seconds:
            best = PricedCuts("every cut", tuple(chain), ((0, cutset.num_layers), (a, b), (tip, tip)), step, schedule)
    return best
