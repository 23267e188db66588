"""pulse.sim.floor: the compute floor is the ideal schedule's step less its bubble on a balanced toy,
and never above a simulated step."""
import random
from dataclasses import replace

import pytest
from test_schedule_helpers import cluster, sequential, unet, uniform_costs

from pulse.costs import CostTable
from pulse.hardware import load_cluster
from pulse.partition import partition, plan_symmetric
from pulse.schedule.generators import applicable_baselines, make_schedule
from pulse.sim.engine import simulate
from pulse.sim.floor import compute_floor, floor_distance
from pulse.sim.step import StepTerms, step_time


def balanced(spec, **kw) -> CostTable:
    """F = 1, B = 2 per layer, B's input half 1 but none on the first layer: the model's input needs no
    gradient, so a split backward saves nothing a whole one pays (the floor counts that saving)."""
    costs = uniform_costs(spec)
    n = spec.num_layers
    return replace(costs, bwd_input=(0.0,) + (1.0,) * (n - 1), bwd_weight=(2.0,) + (1.0,) * (n - 1), **kw)


def simulated_step(spec, placement, costs, net, schedule: str, m: int, dp: int = 1) -> float:
    s = make_schedule(schedule, placement, m, costs)
    return step_time(spec, placement, costs, net, simulate(spec, placement, s, costs, net), StepTerms(dp=dp)).total


@pytest.mark.parametrize("p, m", [(2, 2), (4, 4), (4, 8), (4, 16)])
def test_on_a_balanced_toy_the_floor_is_1f1b_without_its_bubble(p, m):
    """P equal one-layer stages, F = 1, B = 2, optimizer 0.5 per layer, free links: 1F1B takes
    (M + P - 1)(F + B) + 0.5 (the bubble formula); each device's equal share is M(F + B) + 0.5."""
    spec = unet(p)
    costs = balanced(spec, optimizer=(0.5,) * p)
    step = simulated_step(spec, sequential(p), costs, cluster(p), "1f1b", m)
    assert step == pytest.approx((m + p - 1) * 3.0 + 0.5, rel=1e-12)
    distance = floor_distance(costs, p, m, step)
    assert distance.floor == pytest.approx(m * 3.0 + 0.5, rel=1e-12)
    assert distance.above == pytest.approx((p - 1) * 3.0, rel=1e-12)  # the bubble, nothing else
    assert distance.ratio == pytest.approx(1 + (p - 1) * 3.0 / (m * 3.0 + 0.5), rel=1e-12)


def test_the_floor_splits_the_replica_not_the_layers():
    """Equal work per device whatever the partition: the floor depends on the total alone."""
    spec = unet(8)
    costs = balanced(spec)
    uneven = replace(costs, fwd=(4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 4.0))
    assert compute_floor(costs, 4, 4) == pytest.approx(4 * 8 * 3.0 / 4)
    assert compute_floor(uneven, 4, 4) == pytest.approx(4 * (14.0 + 16.0) / 4)
    assert compute_floor(costs, 2, 4) == pytest.approx(2 * compute_floor(costs, 4, 4))


def random_table(rng: random.Random, spec) -> CostTable:
    n = spec.num_layers
    fwd = [rng.uniform(0.2, 3.0) for _ in range(n)]
    bwd = [f * rng.uniform(1.5, 2.5) for f in fwd]
    bwd_input = [b * rng.uniform(0.3, 0.7) for b in bwd]
    per_action = (("F", rng.uniform(0, 0.1)), ("B", rng.uniform(0, 0.1)), ("Bi", rng.uniform(0, 0.05)),
                  ("W", rng.uniform(-0.05, 0.05)), ("O", rng.uniform(0, 0.02)))
    return CostTable(spec.name, 1, tuple(l.name for l in spec.layers), fwd, bwd, [7] * n, "test",
                     bwd_input=bwd_input, bwd_weight=[b - i for b, i in zip(bwd, bwd_input)],
                     optimizer=[rng.uniform(0, 0.3) for _ in range(n)], per_action=per_action,
                     cold_start=(("F", rng.uniform(0, 0.05)), ("B", rng.uniform(0, 0.05))),
                     whole_backward_in_b=rng.random() < 0.3)


def test_the_floor_is_never_above_a_simulated_step_on_random_toys():
    rng = random.Random(43)
    hosts = [cluster(8), cluster(8, bandwidth=1e3, latency=0.01), load_cluster("cpu-local")]
    checked = 0
    for trial in range(12):
        spec = unet(rng.choice([8, 10, 12]))
        costs = random_table(rng, spec)
        net = hosts[trial % len(hosts)]
        p = rng.choice([2, 4])
        m = rng.choice([1, 2, 4, 8])
        placements = [partition("sequential", spec, costs, p),
                      plan_symmetric(spec, costs, p, strict=False).placement]
        for placement in placements:
            for schedule in applicable_baselines(placement, m):
                step = simulated_step(spec, placement, costs, net, schedule, m, dp=rng.choice([1, 2]))
                assert compute_floor(costs, placement.num_devices, m) <= step * (1 + 1e-12), (trial, schedule)
                checked += 1
    assert checked > 30


def test_pulse_simulate_reports_each_steps_distance_from_the_floor(capsys):
    import json

    from pulse.cli.main import main as pulse_main
    from pulse.costs import AnalyticProfiler
    from pulse.zoo import get_spec

    args = ["simulate", "--model", "tiny-unet", "--cluster", "cpu-local", "--pp", "2", "--schedule", "1f1b",
            "--partitioner", "sequential", "--num-microbatches", "4"]
    assert pulse_main([*args, "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    spec = get_spec("tiny-unet").with_act_bytes(2)
    floor = compute_floor(AnalyticProfiler(load_cluster("cpu-local").hardware).profile(spec, 1), 2, 4)
    assert report["compute_floor_seconds"] == pytest.approx(floor, rel=1e-12)
    (row,) = [r for r in report["schedules"] if r["schedule"] == "1f1b"]
    assert row["step_over_floor"] == pytest.approx(row["step_seconds"] / floor, rel=1e-12)
    assert row["step_over_floor"] > 1.0  # 1F1B over two stages has a bubble
    assert pulse_main(args) == 0
    text = capsys.readouterr().out
    assert f"compute floor {floor * 1e3:.2f} ms: step {row['step_over_floor']:.3f}x" in text
