"""pulse.profiling.mean: two profiles of one job averaged, figure by figure."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pulse.costs import CostTable
from pulse.errors import PulseError
from pulse.hardware import load_cluster
from pulse.links import AllReduceCurve, LinkCost
from pulse.profiling.mean import at_speed, mean_cluster, mean_costs


def table(scale: float, **extra) -> CostTable:
    return CostTable("m", 2, ("a", "b"), fwd=(1.0 * scale, 2.0 * scale), bwd=(3.0 * scale, 4.0 * scale),
                     act_mem=(10, 20), source="measured:torch-cpu, 2 ranks", bwd_input=(1.0 * scale, 2.0 * scale),
                     bwd_weight=(2.0 * scale, 2.0 * scale), optimizer=(0.5 * scale, 0.25 * scale),
                     per_action=(("F", 0.1 * scale), ("B", -0.2 * scale)), cold_start=(("F", 0.3 * scale),),
                     **extra)


def test_mean_costs_averages_every_timed_figure_and_keeps_the_rest() -> None:
    mean = mean_costs([table(1.0), table(1.5)])
    assert mean.fwd == pytest.approx((1.25, 2.5))
    assert mean.bwd == pytest.approx((3.75, 5.0))
    assert mean.bwd_input == pytest.approx((1.25, 2.5))
    assert mean.bwd_weight == pytest.approx((2.5, 2.5))
    assert mean.optimizer == pytest.approx((0.625, 0.3125))
    assert dict(mean.per_action) == pytest.approx({"F": 0.125, "B": -0.25})
    assert dict(mean.cold_start) == pytest.approx({"F": 0.375})
    assert mean.act_mem == (10, 20) and mean.layer_names == ("a", "b")
    assert mean.source.startswith("mean of 2 profiles")


def test_mean_costs_refuses_profiles_of_different_jobs() -> None:
    with pytest.raises(PulseError, match="different jobs"):
        mean_costs([table(1.0), replace(table(1.0), microbatch_size=4)])
    with pytest.raises(PulseError, match="per_action"):
        mean_costs([table(1.0), replace(table(1.0), per_action=(("F", 0.1),))])


def measured(scale: float):
    cluster = load_cluster("cpu-local")
    links = {(0, 1): LinkCost(1e9 * scale, 0.0, 2e-4 * scale, 1e-4 * scale),
             (1, 0): LinkCost(2e9 * scale, 1e-6 * scale, 3e-4 * scale, 2e-4 * scale)}
    return replace(cluster, links=links, allreduce=(AllReduceCurve(2, (1024, 4096), (1e-3 * scale, 2e-3 * scale)),),
                   hardware=replace(cluster.hardware, core_sharing=0.9 * scale))


def test_mean_cluster_averages_links_curves_and_core_sharing() -> None:
    mean = mean_cluster([measured(1.0), measured(0.5)])
    link = mean.links[(0, 1)]
    assert (link.bandwidth, link.latency, link.message_overhead, link.send_overhead) == \
        pytest.approx((7.5e8, 0.0, 1.5e-4, 7.5e-5))
    assert mean.links[(1, 0)].bandwidth == pytest.approx(1.5e9)
    assert mean.allreduce_seconds(1024, 2) == pytest.approx(7.5e-4)
    assert mean.allreduce_seconds(4096, 2) == pytest.approx(1.5e-3)
    assert mean.hardware.core_sharing == pytest.approx(0.675)


def test_mean_cluster_refuses_curves_at_other_sizes() -> None:
    other = replace(measured(1.0), allreduce=(AllReduceCurve(2, (1024, 8192), (1e-3, 2e-3)),))
    with pytest.raises(PulseError, match="different sizes"):
        mean_cluster([measured(1.0), other])


def test_at_speed_scales_every_compute_figure_and_nothing_else() -> None:
    slow = at_speed(table(1.0), 1.25)
    assert slow.fwd == pytest.approx((1.25, 2.5)) and slow.bwd_weight == pytest.approx((2.5, 2.5))
    assert slow.optimizer == pytest.approx((0.625, 0.3125))
    assert dict(slow.per_action) == pytest.approx({"F": 0.125, "B": -0.25})
    assert dict(slow.cold_start) == pytest.approx({"F": 0.375})
    assert slow.act_mem == (10, 20) and slow.microbatch_size == 2
