"""The schedule synthesizer: ILP where the problem is small, a tiled wave pattern
where it is not, and always the simulator's verdict against every baseline.

::

    pattern   modulo ILP: one offset per (kind, chunk), period T, no microbatch index
    window    W microbatches, orders tied to repeat with the microbatch shift (ILP)
    tile      per device: prefix | block x R | suffix  ->  prefix | block x (R + M - W) | suffix (+M-W)
    full      all M microbatches when small enough: ILP around the best start
              (baselines, memory-capped list schedules, the tiled pattern)
    choose    simulate every candidate and baseline; over the memory budget is out

Why both: with M = 2P..4P a V pipeline is mostly warm-up and cool-down, which
a strictly periodic pattern handles poorly (the full route wins there); for
large M the steady state dominates and the tiled pattern is the scalable
answer. The window is the pattern's depth (periods a microbatch spends in the
pipeline) + 4 microbatches, so that two clean repeats fit in it; M at or below
it is solved whole. A memory budget becomes an in-flight cap per device:
(budget - static bytes) // bytes one microbatch holds there. Every solve has a
time limit; when nothing beats them, the best baseline is kept (deterministic).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster
from pulse.placement import Placement
from pulse.schedule.deps import TaskGraph, build_dependencies
from pulse.schedule.generators import OnLinks, applicable_baselines, list_schedule, make_schedule
from pulse.schedule.ir import Schedule
from pulse.schedule.timing import Key, asap, device_orders, extended_edges, makespan_of
from pulse.schedule.validate import validate
from pulse.sim.bounds import lower_bound
from pulse.sim.engine import simulate
from pulse.sim.memory import MemoryModel, recompute_of
from pulse.sim.result import SimResult
from pulse.spec import ModelSpec
from pulse.synth.caps import inflight_caps
from pulse.synth.ilp import solve_window
from pulse.synth.modulo import Pattern, min_period, solve_pattern
from pulse.synth.tiling import orders_of, tile, to_schedule

ILP_NAME = "ilp-wave"
MAX_FULL_TASKS = 1600  # the full-M model beyond this builds too slowly to pay off
WINDOW_MARGIN = 4  # microbatches beyond the pattern's depth: room for two clean repeats
_PERIOD_STEPS = (1.0, 1.02, 1.05, 1.1, 1.25, 1.5, 2.0)  # of the period lower bound
_TIE = 1e-9  # relative: a candidate must beat a baseline by more than this to win

Progress = Callable[[str], None]


@dataclass(frozen=True)
class SynthResult:
    schedule: Schedule  # the winner's, named after it
    winner: str
    makespans: dict[str, float]  # seconds, every simulated candidate that fits
    bubble_ratios: dict[str, float]  # the same candidates' idle share
    variants: dict[str, float]  # simulated makespan of each ILP route (ilp-wave is the faster)
    rejected: dict[str, str]  # candidate -> why it is out
    margin: float  # winner over the best baseline: (baseline - winner) / baseline
    lower_bound: float  # seconds, from the task graph alone
    solve_seconds: float
    pattern_found: bool
    explanation: str
    window: int  # microbatches in the pattern's window (0: no pattern)
    seed: str  # the start the full-M ILP improved on ("" if it did not run)
    ilp_gain: float  # the full-M ILP over its seed on the task graph, relative


@dataclass
class _Clock:
    """The solve budget: shares of what is left, never past the deadline."""

    deadline: float

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def share(self, fraction: float) -> float:
        return self.left() * fraction


# -- the two ILP routes -------------------------------------------------------------

def find_pattern(graph: TaskGraph, caps: Mapping[int, int] | None, seconds: float,
                 say: Progress) -> Pattern | None:
    """The fastest period that admits a modulo schedule, from the lower bound up."""
    base = min_period(graph, caps)
    deadline = time.monotonic() + seconds
    for step in _PERIOD_STEPS:
        left = deadline - time.monotonic()
        if left < 0.05:
            break
        pattern = solve_pattern(graph, inflight_cap=caps, period=base * step, time_limit=left)
        say(f"pattern at period {base * step * 1e3:.3f} ms ({step:.2f}x the bound): "
            + ("found" if pattern else "none"))
        if pattern is not None:
            return pattern
    return None


def pattern_depth(pattern: Pattern, graph: TaskGraph) -> int:
    """Periods one microbatch spends in the pipeline: how deep warm-up and cool-down reach."""
    span = max(pattern.offsets[(k, c)] + t.duration for (k, c, m), t in graph.tasks.items() if m == 0)
    return max(1, math.ceil(span / pattern.period))


def pattern_caps(pattern: Pattern, graph: TaskGraph) -> dict[int, int]:
    """Microbatches each device holds under the pattern: the window keeps to it, else the
    ILP would trade the steady state for a GPipe-like window that has nothing to tile."""
    caps: dict[int, int] = {}
    for (k, c, m), t in graph.tasks.items():
        if k != "F" or m != 0:
            continue
        release = ("W", c) if ("W", c) in pattern.offsets else ("B", c)
        end = pattern.offsets[release] + graph.tasks[(*release, 0)].duration
        held = max(1, math.ceil((end - pattern.offsets[("F", c)]) / pattern.period - 1e-9))
        caps[t.device] = max(caps.get(t.device, 1), held)
    return caps


def tiled_route(spec: ModelSpec, placement: Placement, costs: CostTable, cluster: Cluster, num_mb: int,
                caps: Mapping[int, int] | None, seconds: float, window: int | None,
                say: Progress,
                recompute: frozenset[int] = frozenset()) -> tuple[dict[int, list[Key]] | None, int, bool]:
    """(orders for num_mb, window, pattern found): pattern, periodic window ILP, tile."""
    began = time.monotonic()
    one = build_dependencies(spec, placement, 1, costs, cluster, recompute=recompute)
    pattern = find_pattern(one, caps, seconds / 2, say)
    if pattern is None:
        return None, 0, False
    size = min(num_mb, window or pattern_depth(pattern, one) + WINDOW_MARGIN)
    graph = build_dependencies(spec, placement, size, costs, cluster, recompute=recompute)
    start = device_orders(graph, pattern.times(graph))
    held = pattern_caps(pattern, one)
    left = seconds - (time.monotonic() - began)
    sol = solve_window(graph, inflight_cap=held, time_limit=left, periodic=True, hints=[start])
    orders = sol.orders if sol is not None else start
    if sol is not None:
        say(f"window of {size} microbatches: {sol.makespan * 1e3:.3f} ms "
            f"({'optimal' if sol.optimal else 'best found'}, {sol.num_binaries} binaries)")
    tiled = tile(orders, size, num_mb)
    if tiled is None and size == num_mb:
        return {d: list(r) for d, r in orders.items()}, size, False
    return tiled, size, tiled is not None


def full_route(spec: ModelSpec, placement: Placement, costs: CostTable, cluster: Cluster, num_mb: int,
               caps: Mapping[int, int] | None, seeds: Mapping[str, Schedule], seconds: float,
               say: Progress,
               recompute: frozenset[int] = frozenset()) -> tuple[dict[int, list[Key]] | None, str, float]:
    """(orders, seed, gain): the whole problem (B/W split) solved around its best start."""
    if 3 * len(placement.chunks) * num_mb > MAX_FULL_TASKS or seconds < 0.5:
        return None, "", 0.0
    graph = build_dependencies(spec, placement, num_mb, costs, cluster, split_backward=True, recompute=recompute)
    edges = extended_edges(graph, caps, True)
    timed = {name: asap(graph, edges, orders_of(s, split=True)) for name, s in sorted(seeds.items())}
    timed = {name: t for name, t in timed.items() if t is not None}  # None: breaks a cap
    if not timed:
        return None, "", 0.0
    seed = min(timed, key=lambda n: (makespan_of(graph, timed[n]), n))
    before = makespan_of(graph, timed[seed])
    sol = solve_window(graph, inflight_cap=caps, time_limit=seconds, hints=[device_orders(graph, timed[seed])])
    if sol is None:
        return None, "", 0.0
    gain = 1.0 - sol.makespan / before
    say(f"all {num_mb} microbatches from {seed}: {sol.makespan * 1e3:.3f} ms "
        f"({gain:+.2%} on the task graph, {'optimal' if sol.optimal else 'best found'})")
    return {d: list(r) for d, r in sol.orders.items()}, seed, gain


def capped_seeds(placement: Placement, num_mb: int, costs: CostTable,
                 caps: Mapping[int, int] | None) -> dict[str, Schedule]:
    """The list schedulers rerun under the memory-derived cap: starts that fit the budget."""
    if caps is None:
        return {}
    cap = min(min(caps.values()), num_mb)  # more than M in flight is no cap at all
    out = {}
    for split in (False, True):
        name = f"list-{'bw' if split else 'b'}-cap{cap}"
        try:
            out[name] = list_schedule(name, placement, num_mb, costs, cap, split)
        except PlanError:
            pass  # the cap stalls this list scheduler: no start from it
    return out


# -- compare and choose ---------------------------------------------------------------

def synthesize(spec: ModelSpec, placement: Placement, costs: CostTable, cluster: Cluster, num_microbatches: int,
               *, memory_budget: int | None = None, memory: MemoryModel = MemoryModel(),
               time_limit: float = 10.0, window: int | None = None,
               progress: Progress | None = None) -> SynthResult:
    """The fastest schedule found for ``placement``: the ILP's or, failing that, a baseline's.

    ``time_limit`` bounds all ILP solves together (seconds); ``window`` fixes
    the pattern window (default: the pattern's depth + 4 microbatches, at
    most M; M itself is then solved directly). ``memory_budget`` (bytes per
    device) caps the microbatches in flight and rejects candidates whose
    simulated peak exceeds it; ``memory`` says how many static bytes a parameter
    holds and which chunks recompute, for the caps, the ILP's durations and the
    simulator alike.
    """
    began = time.monotonic()
    say = progress or (lambda message: None)
    if num_microbatches < 1:
        raise PlanError(f"need at least one microbatch, got {num_microbatches}")
    placement.validate(spec.num_layers)
    caps = inflight_caps(spec, placement, costs, memory_budget, memory)
    links = OnLinks(spec, cluster)  # the list schedules ordered on the job's links
    baselines = {name: make_schedule(name, placement, num_microbatches, costs, links)
                 for name in applicable_baselines(placement, num_microbatches)}
    clock = _Clock(began + time_limit)
    recompute = recompute_of(memory, placement)  # the ILP times recomputing backwards as they run
    variants, info = _ilp_variants(spec, placement, costs, cluster, num_microbatches, caps, baselines,
                                   clock, window, say, recompute)
    solve_seconds = time.monotonic() - began
    results, rejected = simulate_all(spec, placement, costs, cluster, {**baselines, **variants}, memory_budget,
                                     memory)
    routes = {n: results[n].makespan for n in variants if n in results}
    chosen = fold_variants(results, rejected, variants)
    schedules: dict[str, Schedule] = dict(baselines)
    if chosen is not None:
        schedules[ILP_NAME] = variants[chosen]
    winner, margin = choose(results, list(baselines))
    how = info.how.get(chosen, "")
    graphs = [build_dependencies(spec, placement, num_microbatches, costs, cluster, split_backward=s,
                                 recompute=recompute)
              for s in (False, True)]
    return SynthResult(
        schedule=schedules[winner], winner=winner,
        makespans={n: r.makespan for n, r in results.items()},
        bubble_ratios={n: r.bubble_ratio for n, r in results.items()}, variants=routes,
        rejected=rejected, margin=margin,
        lower_bound=min(lower_bound(g) for g in graphs), solve_seconds=solve_seconds,
        pattern_found=info.pattern_found, explanation=explain(winner, results, rejected, list(baselines), how),
        window=info.window, seed=info.seed, ilp_gain=info.gain,
    )


@dataclass
class _Routes:
    """What the two ILP routes did, for the result and its explanation."""

    pattern_found: bool = False
    window: int = 0
    seed: str = ""
    gain: float = 0.0
    how: dict[str, str] = field(default_factory=dict)  # variant -> how it was made


def _ilp_variants(spec: ModelSpec, placement: Placement, costs: CostTable, cluster: Cluster, num_mb: int,
                  caps: Mapping[int, int] | None, baselines: Mapping[str, Schedule], clock: _Clock,
                  window: int | None, say: Progress,
                  recompute: frozenset[int] = frozenset()) -> tuple[dict[str, Schedule], _Routes]:
    """Candidate schedules from both routes, named ilp-wave/tiled and ilp-wave/full."""
    info = _Routes()
    full_fits = 3 * len(placement.chunks) * num_mb <= MAX_FULL_TASKS
    variants: dict[str, Schedule] = {}
    orders, size, found = tiled_route(spec, placement, costs, cluster, num_mb, caps,
                                      clock.share(0.3 if full_fits else 0.95), window, say, recompute)
    if orders is not None:
        tiled = to_schedule(ILP_NAME, num_mb, orders)
        try:
            validate(tiled, placement, num_mb)  # the tiling's verification; never trusted blindly
            variants[f"{ILP_NAME}/tiled"] = tiled
            info.pattern_found, info.window = found, size
            info.how[f"{ILP_NAME}/tiled"] = (f"pattern of a {size}-microbatch window tiled to {num_mb}"
                                             if size < num_mb else f"periodic ILP over all {_mbs(num_mb)}")
        except PlanError as exc:
            say(f"tiled pattern rejected: {str(exc).splitlines()[0]}")
    seeds = {**baselines, **capped_seeds(placement, num_mb, costs, caps), **variants}
    full, seed, gain = full_route(spec, placement, costs, cluster, num_mb, caps, seeds, clock.left(), say,
                                  recompute)
    if full is not None:
        variants[f"{ILP_NAME}/full"] = to_schedule(ILP_NAME, num_mb, full)
        info.seed, info.gain = seed, gain
        start = "the tiled pattern" if seed.startswith(ILP_NAME) else seed
        info.how[f"{ILP_NAME}/full"] = (
            f"ILP over all {_mbs(num_mb)} improved {start} by {_pct(gain)} on the task graph" if gain > 1e-9
            else f"{start} as is: the ILP over all {_mbs(num_mb)} found nothing better")
    return variants, info


def simulate_all(spec: ModelSpec, placement: Placement, costs: CostTable, cluster: Cluster,
                 schedules: Mapping[str, Schedule], memory_budget: int | None,
                 memory: MemoryModel = MemoryModel()) -> tuple[dict[str, SimResult], dict[str, str]]:
    """Simulated results of the schedules that run and fit; the reason for each that does not."""
    results: dict[str, SimResult] = {}
    rejected: dict[str, str] = {}
    for name, schedule in schedules.items():
        try:
            result = simulate(spec, placement, schedule, costs, cluster, memory_budget=memory_budget,
                              memory=memory)
        except PlanError as exc:
            rejected[name] = str(exc).splitlines()[0]
            continue
        if not result.fits_memory:
            rejected[name] = (f"peak {max(result.peak_memory) / 2**30:.2f} GiB > budget "
                              f"{memory_budget / 2**30:.2f} GiB")
            continue
        results[name] = result
    return results, rejected


def fold_variants(results: dict[str, SimResult], rejected: dict[str, str],
                  variants: Mapping[str, Schedule]) -> str | None:
    """Replace the ILP variants by ilp-wave, the faster one that fits; returns which it was."""
    fitting = [n for n in variants if n in results]
    best = min(fitting, key=lambda n: (results[n].makespan, n)) if fitting else None
    if best is not None:
        results[ILP_NAME] = results[best]
    elif variants:
        rejected[ILP_NAME] = "; ".join(f"{n.split('/')[1]}: {rejected[n]}" for n in variants)
    for n in variants:
        results.pop(n, None)
        rejected.pop(n, None)
    return best


def choose(results: Mapping[str, SimResult], baselines: Sequence[str]) -> tuple[str, float]:
    """(winner, margin over the best baseline). A tie goes to the baseline."""
    fitting = [n for n in baselines if n in results]
    if not fitting and ILP_NAME not in results:
        raise PlanError("no schedule fits: every candidate deadlocks or exceeds the memory budget")
    if not fitting:
        return ILP_NAME, 0.0
    best = min(fitting, key=lambda n: (results[n].makespan, n))
    base = results[best].makespan
    ilp = results.get(ILP_NAME)
    if ilp is not None and ilp.makespan < base * (1 - _TIE):
        return ILP_NAME, (base - ilp.makespan) / base
    return best, 0.0


def explain(winner: str, results: Mapping[str, SimResult], rejected: Mapping[str, str],
            baselines: Sequence[str], how: str) -> str:
    """One line: who won, by how much, and why the other side lost."""
    fitting = [n for n in baselines if n in results]
    if winner == ILP_NAME:
        if not fitting:
            return f"{ILP_NAME} is the only schedule that fits ({how})"
        best = min(fitting, key=lambda n: (results[n].makespan, n))
        gain = 1 - results[ILP_NAME].makespan / results[best].makespan
        return f"{ILP_NAME} beats {best} by {_pct(gain)} ({how})"
    if ILP_NAME in rejected:
        return f"{winner} kept: {ILP_NAME} {rejected[ILP_NAME]}"
    if ILP_NAME not in results:
        return f"{winner} kept: no ILP schedule within the time limit"
    slower = results[ILP_NAME].makespan / results[winner].makespan - 1
    if slower <= _TIE:
        return f"{winner} kept: {ILP_NAME} only matches it ({how})"
    return f"{winner} kept: {ILP_NAME} is {_pct(slower)} slower ({how})"


def _mbs(n: int) -> str:
    return f"{n} microbatch" + ("" if n == 1 else "es")


def _pct(x: float) -> str:
    return f"{x:.2%}" if abs(x) < 0.01 else f"{x:.1%}"
