"""The window ILP and the modulo pattern, on hand-made task graphs small enough to check by brute force."""
import functools
import itertools
from dataclasses import dataclass

import pytest
from untimed_ilp import untimed_ilp
from virtual_clock import VirtualClock

from pulse.synth.ilp import solve_window
from pulse.schedule.timing import (asap, descendants, device_orders, extended_edges, is_periodic, makespan_of,
                                   topological)
from pulse.synth.modulo import min_period, solve_pattern


@dataclass(frozen=True)
class Task:
    device: int
    duration: float


@dataclass(frozen=True)
class Graph:
    """Shape-compatible with pulse.schedule.deps.TaskGraph."""

    tasks: dict
    preds: dict


def v_graph(num_mb: int, fwd=(1.0, 0.7, 1.3, 0.4), bwd=(2.1, 1.2, 2.4, 1.0), delay=0.15,
            devices=(0, 1, 1, 0)) -> Graph:
    """A 2-device V: chunks 0..3 on devices 0 1 1 0, uneven work, a link delay between devices.

    dev0: F0 .............. F3 B3 .............. B0
    dev1:    F1 F2 ...... B2 B1
    """
    tasks, preds = {}, {}
    n = len(devices)
    hop = lambda a, b: 0.0 if devices[a] == devices[b] else delay
    for m in range(num_mb):
        for c in range(n):
            tasks[("F", c, m)] = Task(devices[c], fwd[c])
            tasks[("B", c, m)] = Task(devices[c], bwd[c])
            preds[("F", c, m)] = [] if c == 0 else [(("F", c - 1, m), hop(c - 1, c))]
            preds[("B", c, m)] = [(("F", c, m), 0.0)] + ([(("B", c + 1, m), hop(c + 1, c))] if c + 1 < n else [])
    return Graph(tasks, preds)


def linear_extensions(keys: list, before: set) -> list[tuple]:
    """Every order of ``keys`` that keeps each (a, b) in ``before`` with a first."""
    if not keys:
        return [()]
    out = []
    for k in keys:
        if not any((p, k) in before for p in keys if p != k):  # nothing left must precede k
            rest = [x for x in keys if x != k]
            out += [(k,) + tail for tail in linear_extensions(rest, before)]
    return out


@functools.lru_cache(maxsize=None)
def brute_force_makespan(num_mb: int) -> float:
    """Try every per-device order that respects the dependencies; keep the shortest."""
    graph = v_graph(num_mb)
    edges = extended_edges(graph, None, ordered=False)
    order = topological(list(graph.tasks), edges)
    reach, pos = descendants(edges, order), {k: i for i, k in enumerate(order)}
    rows = {}
    for key, task in graph.tasks.items():
        rows.setdefault(task.device, []).append(key)
    local = {}  # per device: the orders its own dependency paths allow
    for device, keys in sorted(rows.items()):
        before = {(a, b) for a in keys for b in keys if reach[a] >> pos[b] & 1}
        local[device] = linear_extensions(sorted(keys), before)
    best = float("inf")
    for combo in itertools.product(*local.values()):
        starts = asap(graph, edges, dict(zip(local, combo)))
        if starts is not None:
            best = min(best, makespan_of(graph, starts))
    return best


@pytest.fixture
def untimed(monkeypatch):
    """Solves that end at a proof or the node limit, never at the clock: what a test compares
    cannot depend on the time limit (``untimed_ilp``)."""
    untimed_ilp(monkeypatch)


@pytest.mark.parametrize("ordered", [False, True])
def test_ilp_matches_brute_force_on_two_devices_two_microbatches(untimed, ordered):
    graph = v_graph(2)
    expected = brute_force_makespan(2)
    sol = solve_window(graph, inflight_cap=None, time_limit=10, ordered_microbatches=ordered)
    assert sol is not None and sol.optimal
    assert sol.makespan == pytest.approx(expected, rel=1e-7)
    assert asap(graph, extended_edges(graph, None, ordered), sol.orders) is not None  # the orders run


def test_an_untimed_solve_is_the_same_whatever_its_time_limit(untimed):
    """What the comparisons below rely on: the limit decides nothing once the clock cannot stop CBC."""
    graph = v_graph(4)
    short, long = (solve_window(graph, inflight_cap=None, time_limit=t) for t in (0.15, 60))
    assert short.optimal and long.optimal
    assert short.orders == long.orders and short.makespan == long.makespan


def test_in_flight_cap_holds_in_the_solution(untimed):
    graph = v_graph(4)
    sol = solve_window(graph, inflight_cap={0: 1, 1: 1}, time_limit=10)
    s = sol.starts
    for c in range(4):
        for m in range(1, 4):  # cap 1: a chunk's next forward waits for the previous backward
            assert s[("F", c, m)] >= s[("B", c, m - 1)] + graph.tasks[("B", c, m - 1)].duration - 1e-9
    uncapped = solve_window(graph, inflight_cap=None, time_limit=10)
    assert uncapped.optimal  # proved: the comparison holds for any capped schedule
    assert uncapped.makespan <= sol.makespan + 1e-9


def test_periodic_model_returns_orders_that_repeat_with_the_microbatch_shift(untimed):
    graph = v_graph(5)
    sol = solve_window(graph, inflight_cap={0: 2, 1: 2}, time_limit=10, periodic=True)
    assert is_periodic(sol.orders)
    free = solve_window(graph, inflight_cap={0: 2, 1: 2}, time_limit=10)
    assert free.optimal  # proved: the comparison holds for any periodic schedule
    assert free.makespan <= sol.makespan + 1e-9  # tying can only cost


def test_solution_is_never_worse_than_a_hint():
    graph = v_graph(4)
    gpipe = {0: [("F", 0, m) for m in range(4)] + [("F", 3, m) for m in range(4)]
             + [("B", 3, m) for m in range(4)] + [("B", 0, m) for m in range(4)],
             1: [("F", 1, m) for m in range(4)] + [("F", 2, m) for m in range(4)]
             + [("B", 2, m) for m in range(4)] + [("B", 1, m) for m in range(4)]}
    hinted = asap(graph, extended_edges(graph, None, True), gpipe)
    sol = solve_window(graph, inflight_cap=None, time_limit=10, hints=[gpipe])
    assert sol.makespan <= makespan_of(graph, hinted) + 1e-9
    assert sol.incumbent_makespan <= makespan_of(graph, hinted) + 1e-9


def test_time_limit_is_respected_on_a_large_window(monkeypatch):
    """On a virtual clock where every CBC solve uses all it is granted: the grants add up to the limit."""
    graph = v_graph(40, devices=(0, 1, 2, 3, 3, 2, 1, 0), fwd=(1, .7, 1.3, .4, .9, 1.1, .6, .8),
                    bwd=(2, 1.5, 2.5, 1, 1.9, 2.2, 1.1, 1.7))
    granted = VirtualClock().drive_ilp(monkeypatch)
    sol = solve_window(graph, inflight_cap=None, time_limit=1.0)
    assert granted and sum(granted) <= 1.0 + 1e-9  # no solve starts with less than 0.1 s left
    if sol is not None:  # None only if building the model used the whole second
        assert asap(graph, extended_edges(graph, None, True), sol.orders) is not None


def test_pattern_never_overlaps_on_a_device_and_keeps_its_period():
    graph = v_graph(1)
    period = min_period(graph, None)
    assert period == pytest.approx(0.7 + 1.3 + 1.2 + 2.4)  # the busier device's work per microbatch
    pattern = solve_pattern(graph, inflight_cap=None, period=period, time_limit=10)
    assert pattern is not None
    many = v_graph(6)
    times = pattern.times(many)
    for device in (0, 1):
        spans = sorted((times[k], times[k] + t.duration) for k, t in many.tasks.items() if t.device == device)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))
    orders = device_orders(many, times)
    assert is_periodic(orders)
    assert asap(many, extended_edges(many, None, True), orders) is not None


def test_pattern_respects_a_cap_by_a_longer_period():
    graph = v_graph(1)
    capped = min_period(graph, {0: 1, 1: 1})
    assert capped > min_period(graph, None)  # one microbatch at a time: the period is a round trip
    pattern = solve_pattern(graph, inflight_cap={0: 1, 1: 1}, period=capped, time_limit=10)
    assert pattern is not None
    o = pattern.offsets
    assert o[("F", 0)] + capped >= o[("B", 0)] + 2.1 - 1e-9
