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


@pytest.mark.parametrize("seed", range(4))
def test_k_best_under_heavy_ties_is_the_brute_force_ranking(seed):
    """Pair times from four values, so that many chains tie on the max and some on both keys, and rows
    long enough that only the contenders are sorted (``chain._k_smallest``'s partition)."""
    from pulse.partition.chain import ChainProblem

    rng = np.random.default_rng(seed)
    spans = {(0, 30)} | {(int(a), int(a)) for a in rng.integers(12, 18, 5)}
    while len(spans) < 40:
        a, b = sorted(rng.integers(1, 30, 2))
        spans.add((int(a), int(b)))
    spans = sorted(spans, key=lambda s: (s[0] - s[1], s))  # cut 0 first
    a, b = np.array([s[0] for s in spans]), np.array([s[1] for s in spans])
    nested = (a[None, :] > a[:, None]) & (b[None, :] < b[:, None])
    problem = ChainProblem(a, b, np.where(nested, rng.choice([0.5, 1.0, 1.5, 2.0], (40, 40)), np.inf),
                           np.zeros(40), a == b, np.zeros(40))

    def key(chain):
        times = [problem.pair_time[x, y] for x, y in zip(chain, chain[1:])]
        return max(times), sum(t * t for t in times)
    for pairs in (2, 3, 4):
        ranked = sorted(every_chain(problem, pairs), key=key)
        best = k_best_chains(problem, pairs, 6)
        assert len(best) == min(6, len(ranked)) and len({tuple(c) for _, c in best}) == len(best)
        assert [key(c) for _, c in best] == [key(c) for c in ranked[:6]]
        assert [v for v, _ in best] == [key(c)[0] for c in ranked[:6]]


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


def _every_two_device_v(spec, costs, cluster, num_microbatches):
    """Every two-device V (first layers | encoder chunk | turn | decoder chunk | last layers on device 0),
    each priced here: (step, boundaries), fastest first."""
    n = spec.num_layers
    steps = []
    for a in range(1, n - 2):
        for t in range(a + 1, n - 1):
            for c in range(t + 1, n):
                placement = cuts_placement(((0, n), (a, c), (t, t)), 2, 1)
                steps.append((independent_step(spec, costs, cluster, placement, num_microbatches), (a, t, c)))
    return sorted(steps)


@pytest.mark.parametrize("model", ["tiny-unet", "tiny-uvit"])
def test_two_devices_take_the_fastest_v_of_every_cut(model):
    """Over two devices a V is a pair of cuts and its turn, few enough to price them all here: on analytic
    costs (no scan, no refinement) the proxies' pick comes within 1% of the fastest and is never
    slower than any chain they proposed."""
    spec = load_model(model, {})
    cluster = load_cluster("cpu-local")
    costs = AnalyticProfiler(cluster.hardware).profile(spec, 2)
    plan = plan_symmetric(spec, costs, 2, cluster=cluster, candidates=8, strict=False, num_microbatches=4)
    chosen = independent_step(spec, costs, cluster, plan.placement, 4)
    fastest, _ = _every_two_device_v(spec, costs, cluster, 4)[0]
    assert chosen <= fastest * 1.01
    assert chosen <= min(p.step_seconds for p in plan.priced) * (1 + 1e-12)


def test_refinement_only_keeps_faster_chains_and_stops_at_a_local_best():
    """From a lopsided V over four devices each kept chain is faster than the one before, and no single
    move of one boundary by a layer or two from the last makes the step faster still."""
    from pulse.partition.crossing import all_cuts
    from pulse.partition.priced import PricedCuts, _moves, price_chain, refine_v, v_boundaries, v_chain

    spec = load_model("tiny-unet", {})
    cluster = load_cluster("cpu-local")
    costs = AnalyticProfiler(cluster.hardware).profile(spec, 2)
    cutset = all_cuts(spec)
    index = {cut: i for i, cut in enumerate(cutset.cuts)}
    n = spec.num_layers
    start_bounds = [0, 1, 2, 3, 4, 5, 6, 7, n]  # device 0's encoder chunk one layer, the decoder's the rest
    chain = v_chain(cutset, start_bounds, index)
    placement_of = lambda c: cuts_placement([cutset.cuts[i] for i in c], 4, 1)  # noqa: E731
    step, schedule = price_chain(spec, costs, cluster, placement_of(chain), 8, None)
    start = PricedCuts("start", tuple(chain), (), step, schedule)
    kept = refine_v(spec, costs, cluster, cutset, start, placement_of, 8, budget=10_000)
    steps = [step] + [k.step_seconds for k in kept]
    assert len(kept) >= 2 and all(b < a for a, b in zip(steps, steps[1:]))
    assert kept[-1].step_seconds == pytest.approx(independent_step(spec, costs, cluster, placement_of(kept[-1].chain), 8))
    last = v_boundaries(cutset, kept[-1].chain)
    for move in _moves(len(last)):
        trial = [b + move.get(i, 0) for i, b in enumerate(last)]
        if all(x < y for x, y in zip(trial, trial[1:])):
            assert independent_step(spec, costs, cluster, cuts_placement(
                [cutset.cuts[i] for i in v_chain(cutset, trial, index)], 4, 1), 8) >= kept[-1].step_seconds


def test_sd2_on_two_cpu_ranks_takes_a_v_the_proxies_miss():
    """The real SD v2 UNet on the committed two-rank profile (``benchmarks/results/sd2_profile``): the
    proxies' chains balance F + B within a percent of each other, while the step differs by more
    than 5%; the plan is within 1% of every V priced here (each cut pair, its turn one layer in)."""
    from pathlib import Path

    from pulse.costs import CostTable

    root = Path(__file__).resolve().parents[1] / "benchmarks"
    spec = load_model(f"diffusers:{root / 'sd2_unet_config.json'}", {"resolution": 256}).with_act_bytes(4)
    costs = CostTable.load(root / "results" / "sd2_profile" / "costs.yaml")
    cluster = load_cluster(str(root / "results" / "sd2_profile" / "cluster.yaml"))
    plan = plan_symmetric(spec, costs, 2, cluster=cluster, candidates=8, strict=False, num_microbatches=2)
    chosen = independent_step(spec, costs, cluster, plan.placement, 2)
    proposed = [p for p in plan.priced if not p.source.startswith(("every cut", "refined"))]
    assert chosen < 0.95 * min(p.step_seconds for p in proposed)
    n, best = spec.num_layers, float("inf")
    for a in range(1, n - 2):
        for c in range(a + 2, n):
            placement = cuts_placement(((0, n), (a, c), (a + 1, a + 1)), 2, 1)
            best = min(best, independent_step(spec, costs, cluster, placement, 2))
    assert chosen <= best * 1.01


def test_sd2_in_finer_layers_plans_at_least_as_well_as_in_blocks():
    """SD v2 with every ResNet and transformer block in halves (85 layers), on its committed profile
    (``benchmarks/results/sd2_profile_fine``): each cut between blocks is a cut here too, so the plan is
    within 1% of the blocks' plan (23|40, turn at 31) moved onto the same layers. The two-device scan
    prices the finer pairs (about 3,000) as it does the blocks' 1,035."""
    from pathlib import Path

    from pulse.costs import CostTable

    root = Path(__file__).resolve().parents[1] / "benchmarks"
    model = f"diffusers:{root / 'sd2_unet_config.json'}"
    blocks = load_model(model, {"resolution": 256})
    spec = load_model(model, {"resolution": 256, "split_resnets": True, "split_transformers": True}).with_act_bytes(4)
    costs = CostTable.load(root / "results" / "sd2_profile_fine" / "costs.yaml")
    cluster = load_cluster(str(root / "results" / "sd2_profile_fine" / "cluster.yaml"))
    names = [layer.name for layer in spec.layers]

    def finer(i):  # a block's first layer in the finer spec
        name = blocks.layers[i].name
        return next(names.index(n) for n in (name, f"{name}_in", f"{name}_self0") if n in names)
    n = spec.num_layers
    blocks_v = cuts_placement(((0, n), (finer(23), finer(40)), (finer(31), finer(31))), 2, 1)
    plan = plan_symmetric(spec, costs, 2, cluster=cluster, candidates=8, strict=False, num_microbatches=2)
    chosen = independent_step(spec, costs, cluster, plan.placement, 2)
    assert chosen <= independent_step(spec, costs, cluster, blocks_v, 2) * 1.01
    assert any(p.source.startswith("every cut") for p in plan.priced)
