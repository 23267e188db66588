"""The synthesizer: pattern tiling, the memory cap, the comparison with the baselines, the time limit."""

import pytest
from virtual_clock import VirtualClock

from pulse.costs import AnalyticProfiler
from pulse.errors import PlanError
from pulse.hardware import load_cluster
from pulse.partition import partition
from pulse.schedule.deps import build_dependencies
from pulse.schedule.generators import applicable_baselines
from pulse.schedule.timing import device_orders
from pulse.schedule.validate import validate
from pulse.sim import simulate
from pulse.sim.memory import MemoryModel, static_bytes
from pulse.synth import ILP_NAME, synthesize
from pulse.synth.caps import inflight_caps, microbatch_bytes
from pulse.synth.modulo import min_period, solve_pattern
from pulse.synth.synthesize import tiled_route
from pulse.synth.tiling import tile, to_schedule
from pulse.zoo import get_spec

CLUSTER = load_cluster("ascend-910a")


def setup(model: str, pp: int):
    spec = get_spec(model)
    costs = AnalyticProfiler(CLUSTER.hardware).profile(spec, 1)
    return spec, costs, partition("pulse", spec, costs, pp, cluster=CLUSTER)


def quiet(message: str) -> None:
    pass


def test_tiling_a_pattern_window_reproduces_the_pattern_at_any_length():
    spec, costs, placement = setup("tiny-unet", 4)
    one = build_dependencies(spec, placement, 1, costs, CLUSTER)
    pattern = solve_pattern(one, inflight_cap=None, period=min_period(one, None), time_limit=5)
    window = 12
    orders = device_orders(build_dependencies(spec, placement, window, costs, CLUSTER),
                           pattern.times(build_dependencies(spec, placement, window, costs, CLUSTER)))
    for total in (window, 16, 23):
        graph = build_dependencies(spec, placement, total, costs, CLUSTER)
        expected = {d: list(row) for d, row in device_orders(graph, pattern.times(graph)).items()}
        assert tile(orders, window, total) == expected


@pytest.mark.parametrize("model,pp", [("tiny-unet", 4), ("tiny-dit", 2)])
def test_tiled_schedule_validates_for_2p_and_an_odd_count(model, pp):
    spec, costs, placement = setup(model, pp)
    for num_mb in (2 * pp, 4 * pp + 3):  # the window itself, and a longer run tiled from its pattern
        # half for the pattern, the rest for the window's ILP, whose best found so far (or, if none, the
        # pattern's own orders) is tiled: each must validate. tiny-unet's 10-microbatch window runs CBC to
        # any limit (not optimal after 5 s), so a longer one only costs time
        orders, window, found = tiled_route(spec, placement, costs, CLUSTER, num_mb, None, 4.0, None, quiet)
        assert orders is not None
        assert found or window == num_mb  # a longer run than the window must come from a found pattern
        schedule = to_schedule(ILP_NAME, num_mb, orders)
        validate(schedule, placement, num_mb)
        assert simulate(spec, placement, schedule, costs, CLUSTER).makespan > 0


@pytest.mark.parametrize("model,pp,num_mb", [("tiny-unet", 2, 4), ("tiny-uvit", 4, 8), ("tiny-dit", 4, 11)])
def test_synthesize_is_never_worse_than_the_best_baseline(model, pp, num_mb):
    spec, costs, placement = setup(model, pp)
    result = synthesize(spec, placement, costs, CLUSTER, num_mb, time_limit=1.5)
    baselines = [result.makespans[n] for n in applicable_baselines(placement, num_mb) if n in result.makespans]
    assert result.makespans[result.winner] <= min(baselines) * (1 + 1e-12)
    assert result.schedule.name == result.winner
    validate(result.schedule, placement, num_mb)
    assert result.lower_bound <= result.makespans[result.winner] * (1 + 1e-9)
    assert result.margin >= 0 and "\n" not in result.explanation and result.winner in result.explanation


def test_memory_budget_below_one_microbatch_is_refused_naming_the_minimum():
    spec, costs, placement = setup("tiny-unet", 2)
    static = static_bytes(spec, placement, MemoryModel().per_param)
    per_mb = microbatch_bytes(spec, placement, costs)
    need = max(s + m for s, m in zip(static, per_mb))
    with pytest.raises(PlanError) as err:
        synthesize(spec, placement, costs, CLUSTER, 4, memory_budget=need - 1)
    message = str(err.value)
    assert "\n" not in message and f"{need / 2**30:.2f} GiB" in message and "minimum budget" in message
    assert min(inflight_caps(spec, placement, costs, need, MemoryModel()).values()) >= 1


def test_the_memory_model_given_is_the_one_the_caps_and_the_simulator_use():
    spec, costs, placement = setup("tiny-unet", 2)
    lean = MemoryModel(param_bytes=2, grad_bytes=2, optimizer_bytes=0)  # e.g. plain SGD in fp16
    per_mb = microbatch_bytes(spec, placement, costs)
    need = max(s + m for s, m in zip(static_bytes(spec, placement, lean.per_param), per_mb))
    with pytest.raises(PlanError, match="minimum budget"):  # Adam's 16 bytes per parameter do not fit
        synthesize(spec, placement, costs, CLUSTER, 4, memory_budget=need, time_limit=0.5)
    result = synthesize(spec, placement, costs, CLUSTER, 4, memory_budget=need, memory=lean, time_limit=0.5)
    peak = max(simulate(spec, placement, result.schedule, costs, CLUSTER, memory=lean).peak_memory)
    assert peak <= need


def test_memory_budget_caps_the_winner_and_rejects_what_does_not_fit():
    spec, costs, placement = setup("tiny-unet", 2)
    static = static_bytes(spec, placement, MemoryModel().per_param)
    per_mb = microbatch_bytes(spec, placement, costs)
    budget = max(s + 2 * m for s, m in zip(static, per_mb))  # room for two microbatches per device
    result = synthesize(spec, placement, costs, CLUSTER, 8, memory_budget=budget, time_limit=1.5)
    assert "gpipe" in result.rejected  # eight microbatches in flight cannot fit
    peak = max(simulate(spec, placement, result.schedule, costs, CLUSTER).peak_memory)
    assert peak <= budget


def test_time_limit_is_kept_and_the_fallback_still_gives_a_valid_schedule(monkeypatch):
    """On a virtual clock where every CBC solve uses all it is granted: all solves together get the
    limit (a pattern solve may round its last sliver up to CBC's 0.1 s floor)."""
    spec, costs, placement = setup("tiny-dit", 4)
    granted = VirtualClock().drive_ilp(monkeypatch)
    result = synthesize(spec, placement, costs, CLUSTER, 16, time_limit=1.0)
    assert granted and sum(granted) <= 1.0 + 0.1 + 1e-9
    assert result.solve_seconds == pytest.approx(sum(granted))  # nothing else moved the clock
    validate(result.schedule, placement, 16)
