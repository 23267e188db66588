"""Cuts chosen by the simulated step: the k-best chain DP, and a case where the proxy's first choice loses."""
import numpy as np
import pytest

from pulse.costs import AnalyticProfiler
from pulse.hardware import load_cluster
from pulse.partition import plan_symmetric
from pulse.partition.chain import build_problem, k_best_chains, min_max_chain
from pulse.partition.common import boundary_loads, prefix_times
from pulse.partition.cuts import valid_cuts
from pulse.partition.symmetric import cuts_placement
from pulse.zoo.loading import load_model

from partition_helpers import independent_step


def tiny_problem():
    spec = load_model("tiny-unet", {})
    costs = AnalyticProfiler(load_cluster("cpu-local").hardware).profile(spec, 1)
    cutset = valid_cuts(spec.num_layers, [(s, t) for s, t, _ in spec.skip_spans()])
    loads = boundary_loads(spec, relay=False)
    return build_problem(cutset, prefix_times(costs), [x.main + x.skip for x in loads], [x.shared for x in loads])


def every_chain(problem, pairs):
    """All chains of ``pairs`` nested pairs from cut 0, by brute force."""
    out = []

    def extend(chain):
        if len(chain) == pairs + 1:
            if problem.terminal[chain[-1]]:
                out.append(chain)
            return
        for nxt in np.flatnonzero(np.isfinite(problem.pair_time[chain[-1]])):
            extend(chain + [int(nxt)])
    extend([0])
    return out


@pytest.mark.parametrize("pairs", [2, 3])
def test_the_k_best_chains_are_the_brute_force_ranking(pairs):
    problem = tiny_problem()

    def key(chain):
        times = [problem.pair_time[a, b] for a, b in zip(chain, chain[1:])]
        return max(times), sum(t * t for t in times)
    ranked = sorted(every_chain(problem, pairs), key=key)
    best = k_best_chains(problem, pairs, 7)
    assert len({tuple(c) for _, c in best}) == 7  # distinct
    assert [key(c) for _, c in best] == [key(c) for c in ranked[:7]]
    assert [v for v, _ in best] == [key(c)[0] for c in ranked[:7]]
    assert best[0][0] == min_max_chain(problem, pairs)[0]


def test_k_best_returns_fewer_when_fewer_chains_exist():
    problem = tiny_problem()
    count = len(every_chain(problem, 2))
    assert len(k_best_chains(problem, 2, count + 5)) == count


@pytest.mark.parametrize("objective", ["balance", "time"])
def test_the_plan_takes_the_simulated_best_not_the_proxys_first_choice(objective):
    """tiny-unet over four CPU ranks: the proxy's chain (the bytes pass under the least bottleneck)
    simulates about 10% slower than one of its runners-up, which the priced plan takes."""
    spec = load_model("tiny-unet", {})
    cluster = load_cluster("cpu-local")
    costs = AnalyticProfiler(cluster.hardware).profile(spec, 2)
    proxy = plan_symmetric(spec, costs, 4, cluster=cluster, objective=objective)
    priced = plan_symmetric(spec, costs, 4, cluster=cluster, objective=objective, candidates=8)
    assert priced.placement != proxy.placement
    first, chosen = independent_step(spec, costs, cluster, proxy.placement, 8), \
        independent_step(spec, costs, cluster, priced.placement, 8)
    assert chosen < 0.95 * first
    assert priced.priced[0].step_seconds == pytest.approx(chosen, rel=1e-12)
    steps = [p.step_seconds for p in priced.priced]
    assert steps == sorted(steps) and len(priced.priced) > 2
    for runner_up in priced.priced[1:3]:  # each price is the placement's own step
        placement = cuts_placement(runner_up.cuts, 4, 1)
        assert runner_up.step_seconds == pytest.approx(independent_step(spec, costs, cluster, placement, 8))


def test_without_candidates_nothing_is_priced_and_the_plan_is_unchanged():
    spec = load_model("tiny-unet", {})
    cluster = load_cluster("cpu-local")
    costs = AnalyticProfiler(cluster.hardware).profile(spec, 2)
    plan = plan_symmetric(spec, costs, 2, cluster=cluster)
    assert plan.priced == ()
    assert plan_symmetric(spec, costs, 2, cluster=cluster, candidates=8).placement == plan.placement


def test_pulse_plan_prints_and_writes_the_runners_up(capsys):
    from pulse.cli.main import main

    assert main(["plan", "--model", "tiny-unet", "--pp", "4", "--cluster", "cpu-local", "--format", "json"]) == 0
    import json
    rows = json.loads(capsys.readouterr().out)["cut_candidates"]
    steps = [r["step_seconds"] for r in rows]
    assert len(rows) > 2 and steps == sorted(steps) and all(len(r["cuts"]) == 4 for r in rows)
    assert main(["plan", "--model", "tiny-unet", "--pp", "4", "--cluster", "cpu-local"]) == 0
    text = capsys.readouterr().out
    assert "cut sets priced by the simulator" in text and "runner-up 1" in text and "chosen" in text
