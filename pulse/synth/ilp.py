"""The exact part of the synthesizer: a mixed-integer model of a window of microbatches.

::

    variables  s[t] >= 0   start of compute task t = (kind, chunk, microbatch)
               C           makespan
               y[a, b]     1 if a runs before b (same device, different (kind, chunk))
    minimise   C
    subject to s[t] >= s[p] + d[p] + delay(p, t)       each dependency; delay = link time
               s[g, m+1] >= s[g, m] + d[g, m]          microbatch order inside (kind, chunk) g
               s[F c, m+cap] >= s[R c, m] + d[R c, m]  in-flight cap (R: B, or W when split)
               s[a] + d[a] <= s[b] + M_ab (1 - y)      no overlap on a device
               s[b] + d[b] <= s[a] + M_ba y
               C >= s[t] + tail[t]                     tail: longest path, and the device's
                                                       work still to come after t

Microbatch order inside a (kind, chunk) is without loss of generality here
(every microbatch of a chunk has the same work and the same dependencies), and
it makes the binaries of two groups a monotone staircase: a_i before b_j
implies a_i before b_{j+1} and a_{i-1} before b_j. Binaries are only created
for pairs whose order neither a dependency path nor the time windows of the
incumbent (the best start: hints, or a serial order) already decide; the
incumbent also warm-starts CBC, so a stopped solve is never worse than it.
Beyond a few hundred binaries CBC's big-M relaxation is too weak to move in
seconds, so larger models are searched in slabs (large-neighbourhood search).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import pulp

from pulse.schedule.timing import (Edge, GraphLike, Key, asap, descendants, device_orders, extended_edges,
                                   heads_and_tails, is_periodic, makespan_of, tighten, topological)

MAX_NODES = 20000  # a deterministic stop besides the wall-clock one
DEFAULT_MAX_BINARIES = 150  # per neighbourhood: CBC settles one of this size in about a second


@dataclass(frozen=True)
class WindowSolution:
    makespan: float
    starts: dict[Key, float]
    orders: dict[int, tuple[Key, ...]]  # per device, by start time
    optimal: bool  # CBC proved it (else: best found within the limits)
    solve_seconds: float
    num_binaries: int
    incumbent_makespan: float  # the start CBC improved on


# -- which pairs need a binary ------------------------------------------------

@dataclass(frozen=True)
class _Bounds:
    dur: dict[Key, float]
    device: dict[Key, int]
    head: dict[Key, float]
    tail: dict[Key, float]
    reach: dict[Key, int]
    pos: dict[Key, int]
    upper: float  # makespan of the incumbent

    @property
    def lower(self) -> float:
        """Critical path, or a device's earliest start + all its work + shortest drain."""
        best = max(self.head[k] + self.tail[k] for k in self.dur)
        rows: dict[int, list[Key]] = {}
        for k, d in self.device.items():
            rows.setdefault(d, []).append(k)
        for keys in rows.values():
            busy = sum(self.dur[k] for k in keys)
            best = max(best, min(self.head[k] for k in keys) + busy
                       + min(self.tail[k] - self.dur[k] for k in keys))
        return best

    def fixed(self, a: Key, b: Key) -> int | None:
        """1 if a must run before b, 0 if after, None if the model must decide."""
        if self.reach[a] >> self.pos[b] & 1:
            return 1
        if self.reach[b] >> self.pos[a] & 1:
            return 0
        slack = 1e-9 * max(self.upper, 1e-12)
        a_first_ok = self.head[a] + self.dur[a] + self.tail[b] <= self.upper + slack
        b_first_ok = self.head[b] + self.dur[b] + self.tail[a] <= self.upper + slack
        if a_first_ok and not b_first_ok:
            return 1
        if b_first_ok and not a_first_ok:
            return 0
        return None

    def big_m(self, a: Key, b: Key) -> float:
        """Largest s[a] + d[a] - s[b] any start within the windows can reach."""
        return max(0.0, self.upper - self.tail[a] + self.dur[a] - self.head[b])


def _staircase(values: list[list[int | None]]) -> list[list[int | None]]:
    """Close a pair-of-chains order matrix under a_i<b_j => a_i<b_j+1 and a_i-1<b_j."""
    n, m = len(values), len(values[0])
    ones = [[False] * m for _ in range(n)]
    zeros = [[False] * m for _ in range(n)]
    for i in reversed(range(n)):
        for j in range(m):
            ones[i][j] = values[i][j] == 1 or (i + 1 < n and ones[i + 1][j]) or (j > 0 and ones[i][j - 1])
    for i in range(n):
        for j in reversed(range(m)):
            zeros[i][j] = values[i][j] == 0 or (i > 0 and zeros[i - 1][j]) or (j + 1 < m and zeros[i][j + 1])
    out = [[1 if ones[i][j] else 0 if zeros[i][j] else None for j in range(m)] for i in range(n)]
    return out


def _groups(graph: GraphLike) -> dict[int, dict[tuple[str, int], list[Key]]]:
    """Per device, its (kind, chunk) groups, each a list of keys by microbatch."""
    out: dict[int, dict[tuple[str, int], list[Key]]] = {}
    for k, t in sorted(graph.tasks.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        out.setdefault(t.device, {}).setdefault((k[0], k[1]), []).append(k)
    return out


@dataclass
class _Pairs:
    free: list[tuple[Key, Key, int]]  # (a, b, binary id): y = 1 iff a runs before b
    forced: list[tuple[Key, Key]]  # (first, second): decided, but no dependency path says so
    links: set[tuple[int, int]]  # staircase: y[p] <= y[q]
    num_binaries: int = 0


def classify_pairs(graph: GraphLike, bounds: _Bounds, ordered: bool, periodic: bool) -> _Pairs:
    """Decide what can be decided before solving, number the binaries of the rest."""
    out = _Pairs([], [], set())
    for groups in _groups(graph).values():
        names = sorted(groups)
        if not ordered:
            keys = [k for g in names for k in groups[g]]
            for i, a in enumerate(keys):
                for b in keys[i + 1:]:
                    value = bounds.fixed(a, b)
                    _note(out, bounds, a, b, value, None if value is not None else out.num_binaries)
                    out.num_binaries += value is None
            continue
        for gi, g in enumerate(names):
            for h in names[gi + 1:]:
                _pair_of_groups(out, bounds, groups[g], groups[h], periodic)
    return out


def _pair_of_groups(out: _Pairs, bounds: _Bounds, ga: list[Key], hb: list[Key], periodic: bool) -> None:
    n, m = len(ga), len(hb)
    matrix = _staircase([[bounds.fixed(a, b) for b in hb] for a in ga])
    if periodic:  # one binary per offset j - i: the order repeats with the microbatch shift
        matrix = _tie_offsets(matrix)
    ids: dict[tuple[int, int], int] = {}
    for i, a in enumerate(ga):
        for j, b in enumerate(hb):
            if matrix[i][j] is None:
                slot = (0, j - i) if periodic else (i, j)
                if slot not in ids:
                    ids[slot] = out.num_binaries
                    out.num_binaries += 1
                _note(out, bounds, a, b, None, ids[slot])
            else:
                _note(out, bounds, a, b, matrix[i][j], None)
    for (i, j), vid in ids.items():
        for nxt in ((i, j + 1), (i - 1, j)):  # later b, or earlier a: a-before-b stays true
            if nxt in ids:
                out.links.add((vid, ids[nxt]))


def _tie_offsets(matrix: list[list[int | None]]) -> list[list[int | None]]:
    n, m = len(matrix), len(matrix[0])
    by_offset: dict[int, int | None] = {}
    for i in range(n):
        for j in range(m):
            if matrix[i][j] is not None:
                by_offset[j - i] = matrix[i][j]
    tied = [[by_offset.get(j - i) for j in range(m)] for i in range(n)]
    return _staircase(tied)


def _note(out: _Pairs, bounds: _Bounds, a: Key, b: Key, value: int | None, vid: int | None) -> None:
    if vid is not None:
        out.free.append((a, b, vid))
        return
    first, second = (a, b) if value == 1 else (b, a)
    if not bounds.reach[first] >> bounds.pos[second] & 1:
        out.forced.append((first, second))


# -- the model ------------------------------------------------------------------

def solve_window(graph: GraphLike, *, inflight_cap: Mapping[int, int] | None, time_limit: float,
                 ordered_microbatches: bool = True, periodic: bool = False,
                 hints: Sequence[Mapping[int, Sequence[Key]]] = (),
                 max_binaries: int = DEFAULT_MAX_BINARIES) -> WindowSolution | None:
    """Minimum-makespan start times for every task of ``graph``.

    ``inflight_cap[d]``: at most that many microbatches between a forward and
    its releasing backward on device d. ``periodic`` (needs ordered
    microbatches) ties the order of a_i, b_j to that of a_i+1, b_j+1: the
    device orders then repeat with the microbatch shift, which is the pattern
    the synthesizer tiles, and the model shrinks to one binary per offset.
    ``hints``: device orders of known schedules of this window; the best
    feasible one warm-starts CBC (with ``periodic``, only hints whose orders
    repeat with the microbatch shift count: others would cut the model off).

    A model with more than ``max_binaries`` undecided pairs is solved by
    large-neighbourhood search: a slab of the pairs that start next in the
    incumbent may swap, every other pair keeps its order; the slab slides
    along the schedule, each improvement becomes the incumbent, and a full
    sweep without one ends the search. Returns the best solution within
    ``time_limit`` seconds (model building included), never worse than the
    best start; None if the limit ran out before CBC could start. The same
    input gives the same answer (one thread, a node limit per solve) unless
    the time limit cuts a solve short.
    """
    deadline = time.monotonic() + time_limit
    if any(c < 1 for c in (inflight_cap or {}).values()):
        raise ValueError(f"in-flight caps must be >= 1, got {dict(inflight_cap or {})}")
    periodic = periodic and ordered_microbatches
    edges = extended_edges(graph, inflight_cap, ordered_microbatches)
    order = topological(list(graph.tasks), edges)
    reach = descendants(edges, order)
    head, tail = tighten(graph, edges, order, reach, *heads_and_tails(graph, edges, order))
    usable = [h for h in hints if not periodic or is_periodic(h)]
    start = incumbent_schedule(graph, edges, order, usable)
    model = _Model(graph, edges, _Bounds(
        {k: t.duration for k, t in graph.tasks.items()}, {k: t.device for k, t in graph.tasks.items()},
        head, tail, reach, {k: i for i, k in enumerate(order)}, makespan_of(graph, start)),
        ordered_microbatches, periodic)
    found = _search(model, start, deadline, max_binaries)
    if found is None:
        return None
    best, optimal, binaries = found
    return WindowSolution(
        makespan=makespan_of(graph, best), starts=best, orders=device_orders(graph, best),
        optimal=optimal, solve_seconds=time_limit - (deadline - time.monotonic()),
        num_binaries=binaries, incumbent_makespan=makespan_of(graph, start),
    )


@dataclass(frozen=True)
class _Model:
    graph: GraphLike
    edges: list[Edge]
    bounds: _Bounds  # for the first incumbent; ``upper`` moves with it
    ordered: bool
    periodic: bool


def _search(model: _Model, start: dict[Key, float], deadline: float,
            max_binaries: int) -> tuple[dict[Key, float], bool, int] | None:
    """(best starts, proved optimal, most binaries in one model), or None if CBC never ran."""
    graph, best = model.graph, start
    optimal, solved_once, binaries = False, False, 0
    full, cursor, idle = None, 0.0, 0
    while True:
        began = time.monotonic()
        if full is None:  # after each improvement: its tighter time windows decide more pairs
            bounds = replace(model.bounds, upper=makespan_of(graph, best))
            full = classify_pairs(graph, bounds, model.ordered, model.periodic)
        if bounds.upper <= bounds.lower * (1 + 1e-9):  # at the lower bound: optimal
            return best, True, binaries
        pairs, cursor = _slab(full, best, cursor, max_binaries)
        whole, total = pairs is full, full.num_binaries
        pairs.forced = reduce_forced(pairs.forced, bounds, best)
        prob, starts, y = _build(graph, model.edges, bounds, pairs)
        _warm_start(prob, starts, y, pairs, best, bounds.upper)
        seconds = deadline - time.monotonic() - (time.monotonic() - began)  # writing costs about as much
        if seconds < 0.1:
            break
        solved, proved = _run_cbc(prob, starts, seconds)
        solved_once, binaries = True, max(binaries, pairs.num_binaries)
        timed = None if solved is None else asap(graph, model.edges, device_orders(graph, solved))
        if timed is not None and makespan_of(graph, timed) < bounds.upper * (1 - 1e-9):
            best, full, idle = timed, None, 0
        else:
            idle += pairs.num_binaries
        if whole:  # the whole model: proved optimal, or out of time
            optimal = proved
            break
        if idle >= 2 * total:  # a whole sweep (slabs overlap by half) gained nothing
            break
    return (best, optimal, binaries) if solved_once else None


def _slab(pairs: _Pairs, incumbent: Mapping[Key, float], cursor: float, size: int) -> tuple[_Pairs, float]:
    """The binaries of the ``size`` pairs that start first at or after time ``cursor`` in the
    incumbent; every other pair keeps the incumbent's order. Returns the next cursor: half a
    slab later, or 0 to wrap around."""
    if pairs.num_binaries <= size:
        return pairs, 0.0
    when: dict[int, float] = {}
    for a, b, vid in pairs.free:
        when[vid] = min(when.get(vid, float("inf")), incumbent[a], incumbent[b])
    ordered = sorted(when, key=lambda v: (when[v], v))
    first = next((i for i, v in enumerate(ordered) if when[v] >= cursor), 0)
    first = min(first, len(ordered) - size)
    keep = {vid: n for n, vid in enumerate(ordered[first:first + size])}
    nxt = when[ordered[first + size // 2]] if first + size < len(ordered) else 0.0
    out = _Pairs([], list(pairs.forced), set(), len(keep))
    for a, b, vid in pairs.free:
        if vid in keep:
            out.free.append((a, b, keep[vid]))
        else:
            out.forced.append((a, b) if incumbent[a] < incumbent[b] else (b, a))
    out.links = {(keep[p], keep[q]) for p, q in pairs.links if p in keep and q in keep}
    return out, nxt


def cbc(seconds: float, warm_start: bool = False) -> pulp.LpSolver:
    """The bundled CBC, one thread, fixed options (pulp 3.3 flags the bundled-CBC class
    as deprecated in favour of a separately installed one; the bundled one is what we have)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=max(0.1, seconds), threads=1,
                                 maxNodes=MAX_NODES, warmStart=warm_start)


def _run_cbc(prob: pulp.LpProblem, starts: dict, seconds: float) -> tuple[dict[Key, float] | None, bool]:
    # One thread and a node limit besides the clock: the same input gives the
    # same answer unless the clock stops the search first.
    try:
        prob.solve(cbc(seconds, warm_start=True))
    except pulp.PulpSolverError:
        return None, False
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None, False
    solved = {k: v.value() for k, v in starts.items()}
    if any(v is None for v in solved.values()):
        return None, False
    return solved, prob.sol_status == pulp.LpSolutionOptimal


def _build(graph: GraphLike, edges: Sequence[Edge], bounds: _Bounds, pairs: _Pairs):
    """The pulp model; rows are built as (terms, rhs) for sum(coef * var) >= rhs (pulp's
    operators cost about three times as much on models of this size)."""
    dur, head, tail, upper = bounds.dur, bounds.head, bounds.tail, bounds.upper
    prob = pulp.LpProblem("window", pulp.LpMinimize)
    keys = sorted(graph.tasks)
    slack = 1e-9 * upper  # the bounds are the same sums in another order
    s = {k: prob.add_variable(f"s{i}", head[k], max(head[k], upper - tail[k]) + slack)
         for i, k in enumerate(keys)}
    makespan = prob.add_variable("C", min(bounds.lower, upper), upper + slack)
    prob += makespan
    y = {vid: prob.add_variable(f"y{vid}", 0, 1, pulp.LpBinary) for vid in range(pairs.num_binaries)}
    rows: list[tuple[list, float]] = [([(makespan, 1), (s[k], -1)], tail[k]) for k in keys]
    rows += [([(s[t], 1), (s[p], -1)], dur[p] + d) for p, t, d in edges]
    rows += [([(s[b], 1), (s[a], -1)], dur[a]) for a, b in pairs.forced]
    for a, b, vid in pairs.free:  # y = 1: a ends before b starts; y = 0: the other way round
        m_ab, m_ba = bounds.big_m(a, b), bounds.big_m(b, a)
        rows.append(([(s[b], 1), (s[a], -1), (y[vid], -m_ab)], dur[a] - m_ab))
        rows.append(([(s[a], 1), (s[b], -1), (y[vid], m_ba)], dur[b]))
    rows += [([(y[q], 1), (y[p], -1)], 0.0) for p, q in sorted(pairs.links)]
    for n, (terms, rhs) in enumerate(rows):
        prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintGE, f"r{n}", rhs))
    return prob, s, y


def reduce_forced(forced: Sequence[tuple[Key, Key]], bounds: _Bounds,
                  incumbent: Mapping[Key, float]) -> list[tuple[Key, Key]]:
    """Drop forced pairs that other forced pairs or dependency paths already imply.

    Per device, in the incumbent's order (which every forced pair and path
    respects), a pair a->b is redundant when b is reachable from another
    successor of a.
    """
    by_device: dict[int, list[tuple[Key, Key]]] = {}
    for a, b in forced:
        by_device.setdefault(bounds.device[a], []).append((a, b))
    out: list[tuple[Key, Key]] = []
    for device, pairs in sorted(by_device.items()):
        row = sorted((k for k, d in bounds.device.items() if d == device),
                     key=lambda k: (incumbent[k], bounds.pos[k]))
        idx = {k: i for i, k in enumerate(row)}
        direct = [0] * len(row)
        for a, b in pairs:
            direct[idx[a]] |= 1 << idx[b]
        succ = [direct[i] | sum(1 << j for j in range(i + 1, len(row)) if bounds.reach[a] >> bounds.pos[row[j]] & 1)
                for i, a in enumerate(row)]
        closure = [0] * len(row)
        for i in reversed(range(len(row))):
            implied = 0
            for j in _bits(succ[i]):
                implied |= closure[j]
            closure[i] = succ[i] | implied
            out += [(row[i], row[j]) for j in _bits(direct[i] & ~implied)]
    return out


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _warm_start(prob, starts, y, pairs: _Pairs, incumbent: Mapping[Key, float], upper: float) -> None:
    for k, v in starts.items():
        v.setInitialValue(min(max(incumbent[k], v.lowBound), v.upBound))
    for a, b, vid in pairs.free:
        y[vid].setInitialValue(1 if incumbent[a] < incumbent[b] else 0)
    prob.variablesDict()["C"].setInitialValue(upper)


# -- the incumbent ----------------------------------------------------------------

def incumbent_schedule(graph: GraphLike, edges: Sequence[Edge], order: Sequence[Key],
                       hints: Sequence[Mapping[int, Sequence[Key]]]) -> dict[Key, float]:
    """The best feasible start among the hints and a serial order (one microbatch after another,
    which is periodic, within any cap and never deadlocks)."""
    pos = {k: i for i, k in enumerate(order)}
    rows: dict[int, list[Key]] = {}
    for k, t in graph.tasks.items():
        rows.setdefault(t.device, []).append(k)
    serial = {d: sorted(r, key=lambda k: (k[2], pos[k])) for d, r in rows.items()}
    timed = [asap(graph, edges, c) for c in (serial, *hints)]
    return min((t for t in timed if t is not None), key=lambda t: makespan_of(graph, t))
