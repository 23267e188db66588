"""Link-aware partitioning: the V's cuts priced on the link they use, exact against brute force."""
from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from partition_helpers import all_chains, random_costs

from pulse.cli.common import load_model
from pulse.costs import AnalyticProfiler
from pulse.hardware import load_cluster
from pulse.partition import plan_symmetric
from pulse.partition.chain import build_problem, min_max_chain
from pulse.partition.common import boundary_loads, prefix_times
from pulse.partition.cuts import valid_cuts
from pulse.partition.linkaware import MESSAGES_PER_CUT, link_aware_problem
from pulse.placement import from_cuts, wave_devices
from pulse.schedule.generators import OnLinks, greedy_v_1f1b
from pulse.sim.engine import simulate
from pulse.spec import Layer, ModelSpec, SharedInput, SkipEdge
from pulse.traffic import summarize, transfers

DIFFUSERS_UNET = {"_class_name": "UNet2DConditionModel", "block_out_channels": [32, 64, 64], "layers_per_block": 1,
                  "sample_size": 32, "in_channels": 4, "out_channels": 4, "cross_attention_dim": 32,
                  "attention_head_dim": 8, "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                                                "DownBlock2D"],
                  "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]}


def slow_cluster(bandwidth: float, overhead: float = 0.0):
    base = load_cluster("cpu-local")
    hw = replace(base.hardware, intra_node_bandwidth=bandwidth, message_overhead=overhead, shared_cores=None)
    return replace(base, hardware=hw)


def unet_without_made_inputs(rng: random.Random, num_layers: int, num_skips: int) -> ModelSpec:
    middle = num_layers // 2
    sources = sorted(rng.choice(range(middle)) for _ in range(num_skips))
    dests = sorted(rng.sample(range(middle + 1, num_layers), num_skips), reverse=True)
    layers = [Layer(f"l{i}", "x", 1, 1.0, rng.randint(1, 50), 0) for i in range(num_layers)]
    skips = [SkipEdge(f"l{s}", f"l{t}", rng.randint(1, 80)) for s, t in zip(sources, dests)]
    return ModelSpec("rand-u", layers, skips, [SharedInput("ctx", 9)])


def brute_force_cost(spec, costs, chain, pp, cluster, mbs) -> float:
    """Max over devices of max(compute + message calls, bytes out / bandwidth), from traffic itself."""
    order = [a for a, _ in chain] + [b for _, b in reversed(chain[:-1])]
    placement = from_cuts("v", order, wave_devices(pp, 1), pp, "direct", "t")
    link = cluster.link_cost(0, 1)
    out_bytes, cuts = [0] * pp, [0] * pp
    for tr in transfers(spec, placement):
        out_bytes[tr.src_device] += tr.total_bytes  # activations forward
        out_bytes[tr.dst_device] += tr.total_bytes  # their gradients back
    for j, ((a0, b0), (a1, b1)) in enumerate(zip(chain, chain[1:])):
        cuts[j] = (a0 > 0) + (a1 != b1)
    compute = [0.0] * pp
    for c in placement.chunks:
        compute[c.device] += costs.total(c.start, c.end)
    calls = [k * MESSAGES_PER_CUT * (link.send_overhead + link.message_overhead) for k in cuts]
    return max(max(compute[d] + calls[d], out_bytes[d] * mbs / link.bandwidth) for d in range(pp))


@pytest.mark.parametrize("seed", range(12))
def test_link_aware_v_dp_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    spec = unet_without_made_inputs(rng, rng.randint(8, 12), rng.randint(1, 3))
    pp, mbs = rng.choice([2, 3]), rng.choice([1, 4])
    costs = random_costs(rng, spec, mbs)
    cluster = slow_cluster(rng.choice([20.0, 200.0, 2000.0]), overhead=rng.choice([0.0, 0.05]))
    loads = boundary_loads(spec, relay=False)
    problem = build_problem(valid_cuts(spec.num_layers, [(s, t) for s, t, _ in spec.skip_spans()]),
                            prefix_times(costs), [l.main + l.skip for l in loads], [l.shared for l in loads])
    chains = all_chains(spec, pp)
    if not chains:
        pytest.skip("no V of that depth")
    best = min(brute_force_cost(spec, costs, c, pp, cluster, mbs) for c in chains)
    value, _ = min_max_chain(link_aware_problem(problem, cluster, mbs, pp), pp)
    assert value == pytest.approx(best, rel=1e-9)


def test_on_a_slow_link_the_v_cuts_where_tensors_are_small_and_runs_faster(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(DIFFUSERS_UNET))
    spec = load_model(f"diffusers:{tmp_path}")
    base = load_cluster("cpu-local")
    costs = AnalyticProfiler(base.hardware).profile(spec, 2)
    placements = {}
    for bandwidth in (1e9, 2e6):
        cluster = slow_cluster(bandwidth)
        for objective in ("balance", "time"):
            p = plan_symmetric(spec, costs, 4, cluster=cluster, objective=objective).placement
            step = simulate(spec, p, greedy_v_1f1b(p, 8), costs, cluster).makespan
            placements[(bandwidth, objective)] = (p, step, summarize(spec, p).total_bytes)
    fast_b, fast_t = placements[(1e9, "balance")], placements[(1e9, "time")]
    assert fast_t[1] <= fast_b[1] * (1 + 1e-9)  # free links: never slower than balance
    slow_b, slow_t = placements[(2e6, "balance")], placements[(2e6, "time")]
    assert slow_t[2] < slow_b[2], "fewer bytes on the slow link"
    assert slow_t[1] < 0.95 * slow_b[1], "and a faster simulated step"
    assert slow_t[0] != slow_b[0]


@pytest.mark.parametrize("model,pp", [("tiny-unet", 2), ("tiny-unet", 4), ("tiny-uvit", 4), ("tiny-dit", 4)])
@pytest.mark.parametrize("bandwidth", [1e9, 2e7, 2e6])
def test_time_objective_is_never_priced_slower_than_balance_on_the_whole_step(model, pp, bandwidth) -> None:
    """The time objective keeps the chain the simulator prices faster over the *step* the runtime
    runs (its cost-aware greedy schedule, then the optimizer of the slowest rank and the step's
    all-reduces), so it can never be priced slower than the balance objective's. Heavy optimizer
    figures make a pipeline-only comparison pick the wrong chain."""
    from pulse.sim.step import step_time

    spec = load_model(model).with_act_bytes(4)
    cluster = slow_cluster(bandwidth, overhead=1e-4)
    costs = AnalyticProfiler(cluster.hardware).profile(spec, 2)
    costs = replace(costs, optimizer=tuple(3.0 * (f + b) for f, b in zip(costs.fwd, costs.bwd)))

    def priced(objective: str) -> float:
        p = plan_symmetric(spec, costs, pp, cluster=cluster, objective=objective).placement
        schedule = greedy_v_1f1b(p, 2 * pp, costs, links=OnLinks(spec, cluster))  # as the planner orders it
        return step_time(spec, p, costs, cluster, simulate(spec, p, schedule, costs, cluster)).total

    assert priced("time") <= priced("balance") * (1 + 1e-9)
