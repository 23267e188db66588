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
    choose       the fastest; the others are the runners-up `pulse plan` / `train` print

Pricing is pure and deterministic: the same inputs give the same choice on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
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
