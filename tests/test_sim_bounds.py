"""The lower bound is tight for 1F1B on uniform stages and never above a simulated makespan."""
from __future__ import annotations

import pytest
from test_schedule_helpers import cluster, interleaved, sequential, unet, uniform_costs, wave

from pulse.schedule.deps import build_dependencies
from pulse.schedule.generators import BASELINES, applicable_baselines
from pulse.sim import simulate
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
