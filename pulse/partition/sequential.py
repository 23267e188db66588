"""Sequential balanced partition: the baseline every mainstream pipeline uses.

::

    layers  0 ........................................ L-1
    stages  [ dev 0 ][ dev 1 ][ dev 2 ][ dev 3 ]   contiguous, one per device
    skips   relayed across every stage boundary they span

The split minimises the bottleneck stage time (forward + backward) exactly,
with a dynamic program over (stage, end layer), O(P * L^2); torchgpipe's
``blockpartition`` solves the same problem. Many splits often share the
optimal bottleneck (40 identical DiT blocks leave the non-bottleneck stages
free), so a second pass picks, among them, the most even split (least sum of
squared stage times), the way a balancer that never looks at bytes would; it
does not favour cheap boundaries, so the baseline is not tuned to look bad or
good on communication.
"""
from __future__ import annotations

import math
from typing import Callable

from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.partition.common import check_chunks, check_request, prefix_times
from pulse.placement import Placement, from_cuts
from pulse.spec import ModelSpec

StageCost = Callable[[int, int, int], float]  # (stage index, first layer, end layer) -> seconds
REL_TOL = 1e-9  # splits within this relative distance of the optimum count as optimal


def min_max_split(num_items: int, parts: int, cost: StageCost) -> float:
    """The least achievable max stage cost over contiguous splits into ``parts``."""
    inf = math.inf
    best = [inf] * (num_items + 1)
    for end in range(1, num_items + 1):
        best[end] = cost(0, 0, end)
    for p in range(1, parts):
        nxt = [inf] * (num_items + 1)
        for end in range(p + 1, num_items + 1):
            nxt[end] = min(max(best[s], cost(p, s, end)) for s in range(p, end))
        best = nxt
    return best[num_items]


def even_split_under(num_items: int, parts: int, cost: StageCost, cap: float) -> list[int]:
    """Cuts [0, c1, ..., n] with every stage <= cap and least sum of squared stage costs."""
    inf = math.inf
    score = [inf] * (num_items + 1)
    back: list[list[int]] = [[0] * (num_items + 1) for _ in range(parts)]
    for end in range(1, num_items + 1):
        c = cost(0, 0, end)
        score[end] = c * c if c <= cap else inf
    for p in range(1, parts):
        nxt = [inf] * (num_items + 1)
        for end in range(p + 1, num_items + 1):
            for s in range(p, end):
                c = cost(p, s, end)
                if c <= cap and score[s] + c * c < nxt[end]:
                    nxt[end], back[p][end] = score[s] + c * c, s
        score = nxt
    if score[num_items] == inf:
        raise PlanError(f"no split into {parts} stages fits under {cap:.3g} s (internal error)")
    cuts = [num_items]
    for p in range(parts - 1, 0, -1):
        cuts.append(back[p][cuts[-1]])
    return [0, *reversed(cuts)]


def balanced_cuts(num_items: int, parts: int, cost: StageCost) -> tuple[float, list[int]]:
    """(optimal bottleneck, cuts): exact min-max split, ties broken towards evenness."""
    optimum = min_max_split(num_items, parts, cost)
    cuts = even_split_under(num_items, parts, cost, optimum * (1 + REL_TOL))
    return optimum, cuts


def sequential_placement(spec: ModelSpec, costs: CostTable, num_devices: int, *, folds: int = 1,
               cluster: Cluster | None = None) -> Placement:
    """Contiguous stages balanced by forward+backward time; skips relayed."""
    if folds != 1:
        raise PlanError("the sequential partitioner has no folds: use folds=1 (or the pulse partitioner)")
    check_request(spec, costs, num_devices, folds)
    check_chunks(spec, num_devices, 1, "sequential stages")
    prefix = prefix_times(costs)
    _, cuts = balanced_cuts(spec.num_layers, num_devices, lambda p, s, e: prefix[e] - prefix[s])
    return from_cuts("sequential", cuts, list(range(num_devices)), num_devices, "relay", "sequential")
