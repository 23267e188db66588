"""End to end on a real zoo model: partition, every applicable baseline, simulate (skipped if absent)."""
from __future__ import annotations

import pytest

from pulse.costs import AnalyticProfiler
from pulse.hardware import load_cluster
from pulse.schedule.deps import build_dependencies
from pulse.schedule.generators import BASELINES, applicable_baselines
from pulse.schedule.passes import add_send_recv
from pulse.schedule.validate import validate
from pulse.sim import simulate
from pulse.sim.bounds import lower_bound
from pulse.traffic import summarize

zoo = pytest.importorskip("pulse.zoo")
partition = pytest.importorskip("pulse.partition")


@pytest.mark.parametrize("name", ["sd2-unet", "tiny-uvit"])
def test_v_beats_sequential_on_traffic(name):
    spec, net, m = zoo.get_spec(name), load_cluster("ascend-910a-1x8"), 8
    costs = AnalyticProfiler(net.hardware).profile(spec, 2)
    results = {}
    for kind in ("sequential", "pulse"):
        placement = partition.partition(kind, spec, costs, 4, cluster=net)
        for sched in applicable_baselines(placement, m):
            schedule = BASELINES[sched](placement, m, costs)
            split = sched == "zero_bubble_v"
            bound = lower_bound(build_dependencies(spec, placement, m, costs, net, split_backward=split))
            validate(add_send_recv(schedule, spec, placement), placement, m, with_comm=True)
            result = simulate(spec, placement, schedule, costs, net)
            assert result.makespan >= bound * (1 - 1e-9)
            assert result.total_link_bytes == summarize(spec, placement).total_bytes * m * 2
            results[(kind, sched)] = result
    assert results[("pulse", "gpipe")].total_link_bytes < results[("sequential", "gpipe")].total_link_bytes
    assert all(not msg.skips for msg in results[("pulse", "greedy_v_1f1b")].messages)
