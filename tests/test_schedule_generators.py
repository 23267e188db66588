"""Closed forms of the baseline generators on uniform stages and an ideal network."""
from __future__ import annotations

import random

import pytest
from test_schedule_helpers import cluster, interleaved, sequential, unet, uniform_costs, wave

from pulse.errors import PlanError
from pulse.schedule.generators import (BASELINES, _Ready, applicable_baselines, gpipe, greedy_v_1f1b,
                                       interleaved_1f1b, make_schedule, one_f_one_b, zero_bubble_v)
from pulse.schedule.validate import validate
from pulse.sim import simulate


def run(schedule, placement, f=1.0, b=2.0):
    spec = unet(placement.num_layers)
    validate(schedule, placement, schedule.num_microbatches)
    return simulate(spec, placement, schedule, uniform_costs(spec, f, b), cluster())


@pytest.mark.parametrize("gen", [gpipe, one_f_one_b])
@pytest.mark.parametrize("p,m,f,b", [(4, 8, 1.0, 2.0), (3, 5, 1.5, 1.0), (5, 2, 1.0, 3.0), (1, 4, 1.0, 2.0)])
def test_gpipe_and_1f1b_makespan(gen, p, m, f, b):
    result = run(gen(sequential(p), m), sequential(p), f, b)
    assert result.makespan == pytest.approx((m + p - 1) * (f + b))


@pytest.mark.parametrize("p,m", [(4, 8), (6, 6), (3, 10)])
def test_1f1b_in_flight_is_p_minus_d(p, m):
    result = run(one_f_one_b(sequential(p), m), sequential(p))
    assert result.peak_inflight == tuple(p - d for d in range(p))
    assert run(gpipe(sequential(p), m), sequential(p)).peak_inflight == (m,) * p


@pytest.mark.parametrize("p,v,m", [(4, 2, 4), (4, 2, 8), (4, 3, 12), (2, 4, 6), (3, 2, 9)])
def test_interleaved_bubble_matches_megatron(p, v, m):
    f, b = 1.0, 2.0  # per chunk; a device's ideal time is v*m*(f+b)
    result = run(interleaved_1f1b(interleaved(p, v), m), interleaved(p, v), f, b)
    ideal = v * m * (f + b)
    assert (result.makespan - ideal) / ideal == pytest.approx((p - 1) / (v * m))


def test_interleaved_needs_divisible_microbatches():
    with pytest.raises(PlanError) as err:
        interleaved_1f1b(interleaved(4, 2), 6)
    assert "divisible by 4" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(PlanError, match="round-robin"):
        interleaved_1f1b(wave(4), 8)


@pytest.mark.parametrize("folds", [1, 2])
@pytest.mark.parametrize("gen", [greedy_v_1f1b, zero_bubble_v])
def test_greedy_v_validates_and_runs_on_v_and_wave(gen, folds):
    placement = wave(4, folds)
    spec = unet(placement.num_layers)
    schedule = gen(placement, 8, uniform_costs(spec))
    result = run(schedule, placement)
    ideal = 8 * len(placement.chunks_of(0)) * 3.0
    assert ideal <= result.makespan < gpipe_makespan(placement, 8)
    assert max(result.peak_inflight) <= len(placement.chunks)


def gpipe_makespan(placement, m):
    return run(gpipe(placement, m), placement).makespan


def test_zero_bubble_v_splits_backward_and_beats_greedy():
    placement = wave(4)
    zb, greedy = zero_bubble_v(placement, 12), greedy_v_1f1b(placement, 12)
    assert {a.kind for a in zb.all_actions()} == {"F", "B", "W"}
    assert run(zb, placement).makespan < run(greedy, placement).makespan


def test_greedy_cap_bounds_in_flight():
    placement = wave(4)
    result = run(greedy_v_1f1b(placement, 8, inflight_cap=2), placement)
    assert max(result.peak_inflight) <= 2


@pytest.mark.parametrize("call", [
    lambda: greedy_v_1f1b(wave(4), 8, inflight_cap=0),
    lambda: one_f_one_b(sequential(4), 0),
    lambda: gpipe(sequential(4), -1),
    lambda: one_f_one_b(wave(4), 4),
    lambda: make_schedule("nope", sequential(2), 2),
])
def test_bad_input_is_one_clear_line(call):
    with pytest.raises(PlanError) as err:
        call()
    assert "\n" not in str(err.value)


def test_applicable_baselines():
    assert applicable_baselines(sequential(4)) == ["gpipe", "1f1b", "greedy_v_1f1b", "zero_bubble_v"]
    assert "interleaved_1f1b" in applicable_baselines(interleaved(4, 2), 8)
    assert "interleaved_1f1b" not in applicable_baselines(interleaved(4, 2), 6)
    assert applicable_baselines(wave(4)) == ["gpipe", "greedy_v_1f1b", "zero_bubble_v"]
    for placement in (sequential(4), interleaved(4, 2), wave(4), wave(2, 2)):
        for name in applicable_baselines(placement, 8):
            schedule = BASELINES[name](placement, 8, None)
            assert all(a.is_compute for a in schedule.all_actions())
            validate(schedule, placement, 8)


def _oldest_by_rule(ready, inflight, cap):
    """The list schedulers' choice by brute force: the backward of the oldest microbatch (least
    (microbatch, -chunk)), else the oldest forward the cap admits, else the oldest weight grad."""
    def oldest(kind, ok=lambda k: True):
        keys = [k for k in ready if k[0] == kind and ok(k)]
        return min(keys, key=lambda k: (k[2], -k[1])) if keys else None

    return oldest("B") or oldest("F", lambda k: k[2] in inflight or cap is None or len(inflight) < cap) \
        or oldest("W")


def test_ready_tasks_are_picked_by_the_rule():
    """The sorted ready lists pick, one after another, what scanning every ready task picks."""
    rng = random.Random(7)
    for _ in range(400):
        keys = {(rng.choice("FBW"), rng.randrange(6), rng.randrange(12)) for _ in range(rng.randrange(16))}
        inflight, cap = set(rng.sample(range(12), rng.randrange(5))), rng.choice([None, 1, 2, 3, 4])
        ready, left = _Ready(), list(keys)
        for key in keys:
            ready.add(key)
        while True:
            expect = _oldest_by_rule(left, inflight, cap)
            assert ready.pick(inflight, cap) == expect
            if expect is None:
                break
            left.remove(expect)
