"""The steady-state pattern of a pipeline as a small ILP: a modulo schedule.

Every microbatch m runs each (kind, chunk) group g at o_g + m T::

    device 3   |F3 F4 .. B4 B3|F3 F4 .. B4 B3|F3 ...     one period T per microbatch
                <----- T ----->

No microbatch index appears in the model, so it stays small for any number of
microbatches (one integer per pair of groups sharing a device); the window
model in ``ilp.py`` starts from it and ``synthesize.py`` tiles what comes out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import pulp

from pulse.synth.ilp import cbc
from pulse.schedule.timing import RELEASE_KINDS, GraphLike, Key, TaskLike, heads_and_tails, topological

Group = tuple[str, int]  # (kind, chunk)


@dataclass(frozen=True)
class Pattern:
    """Microbatch m runs group g at ``offsets[g] + m * period``."""

    period: float
    offsets: dict[Group, float]

    def times(self, graph: GraphLike) -> dict[Key, float]:
        return {(k, c, m): self.offsets[(k, c)] + m * self.period for (k, c, m) in graph.tasks}


def solve_pattern(graph: GraphLike, *, inflight_cap: Mapping[int, int] | None, period: float,
                  time_limit: float) -> Pattern | None:
    """Shortest-latency modulo schedule with the given period (None: none found in time).

    Two groups g, h of a device never overlap in any microbatch iff
    (o_h - o_g) mod T lies in [d_g, T - d_h]: one integer q per pair,
    d_g <= o_h - o_g - q T <= T - d_h. Far smaller than a window: no
    microbatch index appears.
    """
    dur, dev, intra = _group_view(graph)
    groups = sorted(dur)
    horizon = sum(dur.values()) + sum(d for _, _, d in intra) + period * len(groups)
    prob = pulp.LpProblem("pattern", pulp.LpMinimize)
    o = {g: prob.add_variable(f"o{i}", 0, horizon) for i, g in enumerate(groups)}
    span = prob.add_variable("span", 0, horizon + period)
    prob += span
    for g in groups:
        prob += span >= o[g] + dur[g]
    for p, g, d in intra:
        prob += o[g] >= o[p] + dur[p] + d
    wraps = int(horizon / period) + 2
    for n, (g, h) in enumerate((g, h) for i, g in enumerate(groups) for h in groups[i + 1:] if dev[g] == dev[h]):
        q = prob.add_variable(f"q{n}", -wraps, wraps, pulp.LpInteger)
        prob += o[h] - o[g] - period * q >= dur[g]
        prob += o[h] - o[g] - period * q <= period - dur[h]
    for release, fwd, cap in _cap_pairs(dur, dev, inflight_cap):
        prob += o[fwd] + cap * period >= o[release] + dur[release]
    try:
        prob.solve(cbc(time_limit))
    except pulp.PulpSolverError:
        return None
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    return Pattern(period, {g: o[g].value() for g in groups})


def min_period(graph: GraphLike, inflight_cap: Mapping[int, int] | None) -> float:
    """No pattern is faster than the busiest device, nor than a capped chunk's latency / cap."""
    dur, dev, intra = _group_view(graph)
    load: dict[int, float] = {}
    for g, d in dur.items():
        load[dev[g]] = load.get(dev[g], 0.0) + d
    one = {k: t for k, t in graph.tasks.items() if k[2] == 0}
    edges = [((*p, 0), (*g, 0), d) for p, g, d in intra]
    head, _ = heads_and_tails(_Sub(one), edges, topological(list(one), edges))
    bound = max(load.values())
    for release, fwd, cap in _cap_pairs(dur, dev, inflight_cap):
        bound = max(bound, (head[(*release, 0)] + dur[release] - head[(*fwd, 0)]) / cap)
    return bound


@dataclass(frozen=True)
class _Sub:
    tasks: Mapping[Key, TaskLike]


def _group_view(graph: GraphLike):
    """Per (kind, chunk): duration, device, and the dependencies inside one microbatch."""
    dur: dict[Group, float] = {}
    dev: dict[Group, int] = {}
    for (k, c, m), t in graph.tasks.items():
        dur[(k, c)] = max(dur.get((k, c), 0.0), t.duration)
        dev[(k, c)] = t.device
    intra = [((p[0], p[1]), (k, c), d) for (k, c, m), ps in graph.preds.items() if m == 0
             for p, d in ps if p[2] == 0]
    return dur, dev, intra


def _cap_pairs(dur, dev, inflight_cap) -> list[tuple[Group, Group, int]]:
    out = []
    for (k, c), d in sorted(dev.items()):
        cap = (inflight_cap or {}).get(d)
        release = next(((r, c) for r in RELEASE_KINDS if (r, c) in dur), None)
        if k == "F" and cap is not None and release is not None:
            out.append((release, (k, c), cap))
    return out
