"""The lower bound is tight for 1F1B on uniform stages and never above a simulated makespan."""
from __future__ import annotations

import pytest
from test_schedule_helpers import cluster, interleaved, sequential, unet, uniform_costs, wave

from pulse.schedule.deps import build_dependencies
from pulse.schedule.generators import BASELINES, applicable_baselines
from pulse.sim import simulate
from pulse.costs import CostTable
from pulse.sim.bounds import critical_path, lower_bound


@pytest.mark.parametrize("p,m", [(4, 8), (3, 3), (1, 5)])
def test_bound_is_exact_for_uniform_sequential(p, m):
    spec = unet(max(p, 2)) if p > 1 else unet(1)
    placement = sequential(p)
    graph = build_dependencies(spec, placement, m, uniform_costs(spec), cluster())
    assert lower_bound(graph) == pytest.approx((m + p - 1) * 3.0)
    assert critical_path(graph) == pytest.approx(p * 3.0)


@pytest.mark.parametrize("placement", [sequential(4), interleaved(2, 2), wave(4), wave(2, 2)],
                         ids=["seq", "interleaved", "v", "wave"])
def test_bound_below_every_baseline(placement):
    spec = unet(placement.num_layers, out_bytes=1000)
    net = cluster(bandwidth=2e3, latency=0.05)
    costs = uniform_costs(spec, f=1.0, b=2.5)
    for split in (False, True):
        bound = lower_bound(build_dependencies(spec, placement, 4, costs, net, split_backward=split))
        for name in applicable_baselines(placement, 4):
            schedule = BASELINES[name](placement, 4, costs)
            if (name == "zero_bubble_v") == split:
                assert bound <= simulate(spec, placement, schedule, costs, net).makespan + 1e-9


def test_ramp_counts_the_work_that_cannot_start_early():
    from pulse.sim.bounds import ramp

    assert ramp([(0.0, 1.0), (10.0, 5.0)]) == 15.0  # the late task alone sets it
    assert ramp([(0.0, 8.0), (2.0, 5.0)]) == 13.0  # all work from the first start
    assert ramp([]) == 0.0
    # with what must follow each: the least of them over the tasks counted (one of them ends last)
    assert ramp([(0.0, 1.0), (10.0, 5.0)], [3.0, 1.0]) == 16.0
    assert ramp([(0.0, 8.0), (2.0, 5.0)], [4.0, 1.0]) == 14.0


def test_a_v_whose_last_chunk_starts_late_is_bounded_by_its_ramp():
    """Device 0 of a V holds the first layer (light) and the last: the last cannot start before the first
    microbatch has come down the whole forward, so the device ends no earlier than that forward plus all M
    microbatches of the last layer and of the first one's backward (6.1 + 73.6); from its earliest head (0)
    all its work reads 74.4."""
    spec = unet(8, out_bytes=1000)
    placement, m = wave(4), 8
    f = (0.1,) + (1.0,) * 6 + (3.0,)
    costs = CostTable(spec.name, 1, tuple(l.name for l in spec.layers), f, tuple(2 * x for x in f), (7,) * 8,
                      "test")
    net = cluster()
    bound = lower_bound(build_dependencies(spec, placement, m, costs, net))
    assert bound == pytest.approx(sum(f[:7]) + m * (3 * f[7] + 2 * f[0]))  # the last layer's ramp on device 0
    assert bound > m * 3 * (f[0] + f[7]) + 3  # device 0's work from time 0, the bound before the ramp
    for name in applicable_baselines(placement, m):
        if name != "zero_bubble_v":
            assert bound <= simulate(spec, placement, BASELINES[name](placement, m, costs), costs, net).makespan + 1e-9
