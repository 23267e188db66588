"""pulse.sim.breakdown: the step's parts sum to it, and each is what it claims on hand-built cases."""
from dataclasses import replace

import pytest
from test_schedule_helpers import cluster, sequential, unet, uniform_costs, wave

from pulse.costs import AnalyticProfiler
from pulse.hardware import load_cluster
from pulse.schedule.generators import make_schedule
from pulse.sim.breakdown import PARTS, step_breakdown
from pulse.sim.engine import simulate
from pulse.sim.step import StepTerms, step_time
from pulse.tune.evaluate import place
from pulse.tune.space import Candidate
from pulse.zoo import get_spec


def _priced(spec, placement, costs, net, schedule="1f1b", m=4, dp=1):
    s = make_schedule(schedule, placement, m, costs)
    step = step_time(spec, placement, costs, net, simulate(spec, placement, s, costs, net), StepTerms(dp=dp))
    return step, step_breakdown(spec, placement, s, costs, net, step)


def test_parts_sum_to_the_simulated_step_on_zoo_plans():
    spec, net = get_spec("uvit"), load_cluster("ascend-910a-2x8")
    shapes = [Candidate("pulse", 4, 4, 2, 8, 1, "pulse", "greedy_v_1f1b"),
              Candidate("pulse", 4, 2, 1, 16, 2, "pulse", "zero_bubble_v"),
              Candidate("sequential", 4, 4, 2, 8, 0, "sequential", "1f1b"),
              Candidate("diffusionpipe", 2, 8, 2, 8, 0, "diffusionpipe", "gpipe", None, 2)]
    for c in shapes:
        costs = AnalyticProfiler(net.hardware).profile(spec, c.microbatch_size)
        placement = place(spec, costs, net, c)
        step, parts = _priced(spec, placement, costs, net, c.schedule, c.num_microbatches, c.dp)
        assert sum(parts.parts().values()) == pytest.approx(step.total, rel=1e-12, abs=0)
        assert parts.total == step.total
        assert min(parts.parts().values()) >= -1e-12, c.label
        assert parts.exposed_allreduce > 0  # dp > 1: the last buckets outlast the backward


def test_bubble_of_1f1b_is_its_fill_and_drain():
    """P = 4 one-layer stages, F = 1 s, B = 2 s, ideal links: 1F1B takes (M + P - 1)(F + B),
    every device computes M(F + B); the rest is schedule bubble, nothing else."""
    spec = unet(4)
    step, parts = _priced(spec, sequential(4), uniform_costs(spec), cluster(4), m=4)
    assert step.total == pytest.approx(21.0)
    assert parts.compute == pytest.approx(12.0)
    assert parts.bubble == pytest.approx(9.0)
    assert parts.imbalance == pytest.approx(0.0, abs=1e-12)
    assert parts.exposed_p2p == pytest.approx(0.0, abs=1e-9)
    assert parts.exposed_allreduce == pytest.approx(0.0, abs=1e-9)


def test_a_device_with_doubled_compute_shows_as_imbalance():
    spec = unet(4)
    costs = uniform_costs(spec)
    heavy = replace(costs, fwd=(1.0, 1.0, 2.0, 1.0), bwd=(2.0, 2.0, 4.0, 2.0))  # device 2 does twice the work
    _, even = _priced(spec, sequential(4), costs, cluster(4), m=4)
    _, skewed = _priced(spec, sequential(4), heavy, cluster(4), m=4)
    assert even.imbalance == pytest.approx(0.0, abs=1e-12)
    per_device = [12.0, 12.0, 24.0, 12.0]  # M (F + B) each
    assert skewed.imbalance == pytest.approx(max(per_device) - sum(per_device) / 4)
    assert skewed.compute == pytest.approx(sum(per_device) / 4)


def test_a_slow_link_shows_as_exposed_point_to_point():
    """Exposed p2p is what the messages add: the step on slow links less the step on ideal ones."""
    spec = unet(8)
    costs = uniform_costs(spec)
    fast_step, fast = _priced(spec, wave(4), costs, cluster(4), "greedy_v_1f1b", 8)
    slow_step, slow = _priced(spec, wave(4), costs, cluster(4, bandwidth=20.0, latency=0.5), "greedy_v_1f1b", 8)
    assert fast.exposed_p2p == pytest.approx(0.0, abs=1e-9)
    assert slow.exposed_p2p > 1.0
    assert slow.exposed_p2p == pytest.approx(slow_step.lists_done - fast_step.lists_done)
    assert (slow.compute, slow.bubble, slow.imbalance) == pytest.approx((fast.compute, fast.bubble, fast.imbalance))


def test_parts_are_named_as_the_json_carries_them():
    assert PARTS == ("compute", "bubble", "imbalance", "exposed_p2p", "exposed_allreduce")
