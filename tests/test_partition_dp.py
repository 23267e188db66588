"""The partition DPs against brute force on small random models."""
import random
from dataclasses import replace

import pytest

from partition_helpers import (all_chains, all_splits, chain_loads, nested_unet, pair_local_splits, random_costs,
                               random_skips, skip_local_v_splits)
from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster, Hardware
from pulse.partition import partition, plan_symmetric
from pulse.partition import fold2, symmetric
from pulse.partition.chain import build_problem
from pulse.partition.common import boundary_loads
from pulse.partition.cuts import spanning_cuts, valid_cuts
from pulse.partition.wave import chain_bytes
from pulse.partition.diffusionpipe import send_times
from pulse.partition.interleaved import interleaved_placement
from pulse.partition.report import report
from pulse.placement import from_cuts, wave_devices
from pulse.spec import Layer, ModelSpec, SharedInput, SkipEdge
from pulse.traffic import skips_leaving_device, summarize

SEEDS = range(8)
HW = Hardware("slow-link", 1e12, 0.5, 2**34, 1e12, 40.0, 0.5, 10.0, 1.0, 2)
CLUSTER = Cluster("two-nodes", HW, nodes=2)


def _case(seed: int, num_layers: int = 12, num_skips: int = 4):
    rng = random.Random(seed)
    spec = nested_unet(rng, num_layers, num_skips)
    return spec, random_costs(rng, spec)


def _any_case(seed: int, num_layers: int = 12, num_skips: int = 4):
    """Skips anywhere (short, long, crossing): the widened rule's space."""
    rng = random.Random(1000 + seed)
    spec = random_skips(rng, num_layers, num_skips)
    return spec, random_costs(rng, spec)


def _v_loads(costs, split: list[int], num_devices: int) -> list[float]:
    chunks = 2 * num_devices
    return [costs.total(split[d], split[d + 1]) + costs.total(split[chunks - 1 - d], split[chunks - d])
            for d in range(num_devices)]


CASES = {"u": _case, "any": _any_case}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("num_devices", [1, 2, 3])
@pytest.mark.parametrize("model", ["u", "any"])
def test_v_dp_bottleneck_equals_brute_force(seed, num_devices, model):
    """Brute force over every V split whose skips stay on their device (traffic's verdict)."""
    spec, costs = CASES[model](seed)
    splits = list(skip_local_v_splits(spec, num_devices))
    if not splits:
        with pytest.raises(PlanError):
            plan_symmetric(spec, costs, num_devices, slack=0.0)
        return
    brute = min(max(_v_loads(costs, s, num_devices)) for s in splits)
    plan = plan_symmetric(spec, costs, num_devices, slack=0.0)
    assert plan.balanced_bottleneck == pytest.approx(brute, rel=1e-9)
    assert plan.bottleneck == pytest.approx(brute, rel=1e-9)
    assert report(spec, costs, plan.placement).bottleneck == pytest.approx(brute, rel=1e-9)
    assert skips_leaving_device(spec, plan.placement) == []


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model", ["u", "any"])
def test_pair_local_chains_are_exactly_the_skip_local_vs(seed, model):
    """For a V (one pair per device) the chains the DPs walk are every skip-local placement."""
    spec, _ = CASES[model](seed, num_layers=11)
    for num_devices in (2, 3):
        assert list(pair_local_splits(spec, num_devices)) == list(skip_local_v_splits(spec, num_devices))


def test_a_skip_inside_one_chunk_is_local():
    """8 layers, one skip 3 -> 7. The old rule (s < a) == (t >= b) only allowed device 1 inside
    [4, 7), best bottleneck 32; keeping layers 3..7 on device 0 gives loads 15 / 20."""
    load = [1, 7, 8, 1, 1, 1, 1, 15]  # fwd + bwd per layer
    layers = [Layer(f"l{i}", "x", 1, 1.0, 4, 0) for i in range(8)]
    spec = ModelSpec("short-skip", layers, [SkipEdge("l3", "l7", 1)])
    costs = CostTable(spec.name, 1, tuple(l.name for l in layers), [0.25 * x for x in load],
                      [0.75 * x for x in load], [0] * 8, "test")
    plan = plan_symmetric(spec, costs, 2, slack=0.0)
    assert plan.bottleneck == 20.0
    assert sorted(report(spec, costs, plan.placement).device_load) == [15.0, 20.0]
    assert skips_leaving_device(spec, plan.placement) == []
    old_rule = [split for split in skip_local_v_splits(spec, 2) if split[1] > 3]  # skip spanning the fold
    assert min(max(_v_loads(costs, s, 2)) for s in old_rule) == 32.0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("slack", [0.0, 0.05, 0.3])
@pytest.mark.parametrize("model", ["u", "any"])
def test_v_communication_pass_is_the_least_bytes_under_the_cap(seed, slack, model):
    spec, costs = CASES[model](seed, num_layers=13, num_skips=3)
    num_devices = 2
    splits = list(skip_local_v_splits(spec, num_devices))
    if not splits:
        pytest.skip("no skip-local V at P=2 for this random model")
    plan = plan_symmetric(spec, costs, num_devices, slack=slack)
    cap = plan.balanced_bottleneck * (1 + slack) * (1 + 1e-9)
    feasible = [summarize(spec, from_cuts("v", split, wave_devices(2, 1), 2, "direct", "brute")).forward_bytes
                for split in splits if max(_v_loads(costs, split, num_devices)) <= cap]
    assert plan.forward_bytes == min(feasible)
    assert plan.forward_bytes == summarize(spec, plan.placement).forward_bytes
    assert plan.forward_bytes <= plan.balanced_bytes
    assert plan.bottleneck <= cap


@pytest.mark.parametrize("seed", SEEDS)
def test_pulse_placements_are_valid_and_skip_local(seed):
    spec, costs = _case(seed, num_layers=16, num_skips=5)
    for num_devices, folds in [(1, 1), (2, 1), (3, 1), (2, 2), (1, 3)]:
        placement = partition("pulse", spec, costs, num_devices, folds=folds)
        placement.validate(spec.num_layers)
        assert placement.kind == ("v" if folds == 1 else "wave")
        assert placement.skip_transport == "direct"
        assert skips_leaving_device(spec, placement) == []
        chunks = placement.chunks
        for j in range(len(chunks)):  # chunk j and its mirror share a device
            assert chunks[j].device == chunks[len(chunks) - 1 - j].device


def _wave_brute(spec, costs, num_devices, folds, cap=None):
    """(least max device load, least bytes under cap) over every chain."""
    devices = wave_devices(num_devices, folds)[: num_devices * folds]
    rows = []
    for chain in all_chains(spec, len(devices)):
        order = [a for a, _ in chain] + [b for _, b in reversed(chain[:-1])]
        placement = from_cuts("wave", order, wave_devices(num_devices, folds), num_devices, "direct", "b")
        rows.append((max(chain_loads(costs, chain, devices, num_devices)),
                     summarize(spec, placement).forward_bytes))
    best = min(load for load, _ in rows)
    if cap is None:
        return best, None
    return best, min(nbytes for load, nbytes in rows if load <= cap)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("slack", [0.0, 0.1])
@pytest.mark.parametrize("model", ["u", "any"])
def test_two_fold_dp_equals_brute_force(seed, slack, model):
    """Brute force over every pair-local two-fold wave (a wave could also keep a skip between
    two pairs of one device local; the DP does not search those)."""
    spec, costs = CASES[model](seed, num_layers=16, num_skips=5)
    if not all_chains(spec, 4):
        pytest.skip("no pair-local two-fold wave at P=2 for this random model")
    plan = plan_symmetric(spec, costs, 2, folds=2, slack=slack)
    best, least_bytes = _wave_brute(spec, costs, 2, 2, cap=None)
    assert plan.balanced_bottleneck == pytest.approx(best, rel=1e-9)
    _, least_bytes = _wave_brute(spec, costs, 2, 2, cap=plan.balanced_bottleneck * (1 + slack) * (1 + 1e-9))
    assert plan.forward_bytes == least_bytes
    assert report(spec, costs, plan.placement).bottleneck == pytest.approx(plan.bottleneck, rel=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
def test_three_fold_local_search_is_near_the_optimum(seed):
    spec, costs = _case(seed, num_layers=18, num_skips=6)
    try:
        plan = plan_symmetric(spec, costs, 2, folds=3, slack=0.0)
    except PlanError:
        pytest.skip("this random model has fewer than 6 nested pairs")
    best, _ = _wave_brute(spec, costs, 2, 3)
    assert best * (1 - 1e-9) <= plan.bottleneck <= best * 1.05  # local, not proven optimal


@pytest.mark.parametrize("seed", range(2))
def test_two_folds_beyond_the_exact_limit_use_the_local_search(seed, monkeypatch):
    # no skips: every (a, b) is a valid cut, 136 of them, more than fold2.MAX_CUTS
    rng = random.Random(seed)
    spec = nested_unet(rng, 17, 0, name="flat")
    costs = random_costs(rng, spec)
    local = plan_symmetric(spec, costs, 3, folds=2, slack=0.0)
    assert local.num_valid_cuts + 1 > fold2.MAX_CUTS
    local.placement.validate(spec.num_layers)
    monkeypatch.setattr(symmetric, "MAX_CUTS", 10**6)
    exact = plan_symmetric(spec, costs, 3, folds=2, slack=0.0)
    assert exact.bottleneck * (1 - 1e-9) <= local.bottleneck <= exact.bottleneck * 1.05


@pytest.mark.parametrize("seed", SEEDS)
def test_two_folds_beyond_the_exact_limit_are_no_worse_than_the_narrow_rule(seed, monkeypatch):
    """With more widened cuts than the exact DP takes, the wave is still at least as good as the
    best chain of the older spanning-only cuts, in balance and then in bytes under the cap."""
    spec, costs = _case(seed, num_layers=16, num_skips=4)
    spans = [(s, t) for s, t, _ in spec.skip_spans()]
    cutset = valid_cuts(16, spans)
    narrow = spanning_cuts(cutset, spans)
    if len(narrow) == len(cutset.cuts):
        pytest.skip("the widened rule adds no cut to this model")
    monkeypatch.setattr(symmetric, "MAX_CUTS", len(narrow))  # too few for the widened set only
    plan = plan_symmetric(spec, costs, 2, folds=2, slack=0.05)
    narrow_set = {cutset.cuts[i] for i in narrow}
    devices = wave_devices(2, 2)[:4]
    rows = []
    for chain in all_chains(spec, 4):
        if set(chain[1:]) <= narrow_set:
            order = [a for a, _ in chain] + [b for _, b in reversed(chain[:-1])]
            placement = from_cuts("wave", order, wave_devices(2, 2), 2, "direct", "b")
            rows.append((max(chain_loads(costs, chain, devices, 2)), summarize(spec, placement).forward_bytes))
    assert plan.balanced_bottleneck <= min(load for load, _ in rows) * (1 + 1e-9)
    cap = plan.balanced_bottleneck * 1.05 * (1 + 1e-9)
    assert plan.bottleneck <= cap
    assert plan.forward_bytes <= min((nbytes for load, nbytes in rows if load <= cap), default=float("inf"))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("num_devices", [1, 2, 3, 4])
def test_sequential_dp_equals_brute_force(seed, num_devices):
    spec, costs = _case(seed, num_layers=10)
    brute = min(max(costs.total(s[i], s[i + 1]) for i in range(num_devices))
                for s in all_splits(spec.num_layers, num_devices))
    placement = partition("sequential", spec, costs, num_devices)
    placement.validate(spec.num_layers)
    assert placement.skip_transport == "relay"
    assert report(spec, costs, placement).bottleneck == pytest.approx(brute, rel=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("num_devices", [2, 3, 4])
def test_diffusionpipe_dp_equals_brute_force(seed, num_devices):
    spec, costs = _case(seed, num_layers=10)
    fwd, bwd = send_times(spec, costs, CLUSTER, num_devices)

    def worst(cuts):
        return max(costs.total(cuts[p], cuts[p + 1]) + fwd[p][cuts[p + 1]] + bwd[p][cuts[p]]
                   for p in range(num_devices))

    brute = min(worst(s) for s in all_splits(spec.num_layers, num_devices))
    placement = partition("diffusionpipe", spec, costs, num_devices, cluster=CLUSTER)
    cuts = [c.start for c in placement.chunks] + [spec.num_layers]
    assert worst(cuts) == pytest.approx(brute, rel=1e-9)
    assert skips_leaving_device(spec, placement) == sorted(
        e.key for s, t, e in spec.skip_spans() if any(s < x <= t for x in cuts[1:-1]))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("num_devices", [2, 3])
@pytest.mark.parametrize("base", ["sequential", "diffusionpipe"])
def test_interleaved_dp_equals_brute_force(seed, num_devices, base):
    """Two chunks per device, chunk c on device c % P: least max chunk time (plus, for
    diffusionpipe, its sends to the neighbouring chunks' devices) over every split."""
    spec, costs = _case(seed, num_layers=10)
    devices = [c % num_devices for c in range(2 * num_devices)]
    payload = [load.total * costs.microbatch_size for load in boundary_loads(spec, relay=True)]
    priced = base == "diffusionpipe"

    def worst(cuts):
        out = []
        for c, dev in enumerate(devices):
            s, e = cuts[c], cuts[c + 1]
            sends = (CLUSTER.transfer_time(dev, devices[c + 1], payload[e]) if c + 1 < len(devices) else 0.0) + \
                (CLUSTER.transfer_time(dev, devices[c - 1], payload[s]) if c > 0 else 0.0)
            out.append(costs.total(s, e) + (sends if priced else 0.0))
        return max(out)

    brute = min(worst(split) for split in all_splits(spec.num_layers, len(devices)))
    placement = interleaved_placement(spec, costs, num_devices, base=base, cluster=CLUSTER)
    placement.validate(spec.num_layers)
    assert (placement.kind, placement.skip_transport, placement.partitioner) == ("interleaved", "relay", base)
    assert [c.device for c in placement.chunks] == devices
    assert worst([c.start for c in placement.chunks] + [spec.num_layers]) == pytest.approx(brute, rel=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
def test_diffusionpipe_beats_sequential_once_sends_are_priced(seed):
    spec, costs = _case(seed, num_layers=12)
    fwd, bwd = send_times(spec, costs, CLUSTER, 3)

    def worst(placement):
        cuts = [c.start for c in placement.chunks] + [spec.num_layers]
        return max(costs.total(cuts[p], cuts[p + 1]) + fwd[p][cuts[p + 1]] + bwd[p][cuts[p]] for p in range(3))

    seq = partition("sequential", spec, costs, 3)
    dp = partition("diffusionpipe", spec, costs, 3, cluster=CLUSTER)
    assert worst(dp) <= worst(seq) * (1 + 1e-9)


@pytest.mark.parametrize("seed", SEEDS)
def test_boundary_table_agrees_with_traffic(seed):
    spec, costs = _case(seed, num_layers=12)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, 12), 3))
    for relay, placement in [(True, from_cuts("sequential", [0, *cuts, 12], [0, 1, 2, 3], 4, "relay", "t")),
                             (False, partition("pulse", spec, costs, 2))]:
        loads = boundary_loads(spec, relay)
        crossing = [c.start for i, c in enumerate(placement.chunks[1:])
                    if c.device != placement.chunks[i].device]
        traffic = summarize(spec, placement)
        assert sum(loads[x].main + loads[x].skip for x in crossing) == traffic.main_bytes + traffic.skip_bytes
        # relay: at every crossing; direct: temb (made by layer 0) once into each device but device 0
        shared = (sum(loads[x].shared for x in crossing) if relay
                  else (placement.num_devices - 1) * loads[spec.num_layers - 1].shared)
        assert shared == traffic.shared_bytes > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_chain_bytes_price_shared_inputs_made_anywhere_exactly(seed):
    """Direct transport sends a produced shared input once into each device that has not
    held it (traffic.transfers); the DPs' per-cut prices add up to that for every V and
    wave chain, wherever the maker sits (encoder side, mid-wave, outermost decoder)."""
    rng = random.Random(seed)
    base = nested_unet(rng, 14, 3)
    makers = [rng.randrange(14), rng.randrange(14)]
    spec = replace(base, shared_inputs=(SharedInput("a", 3, f"l{makers[0]}"),
                                        SharedInput("b", 7, f"l{makers[1]}"), SharedInput("d", 5)))
    cutset = valid_cuts(14, [(s, t) for s, t, _ in spec.skip_spans()])
    loads = boundary_loads(spec, relay=False)
    problem = build_problem(cutset, [0.0] * 15, [l.main + l.skip for l in loads], [l.shared for l in loads])
    index = {c: i for i, c in enumerate(cutset.cuts)}
    for num_devices, folds in [(2, 1), (3, 1), (2, 2), (3, 2), (2, 3)]:
        devices = wave_devices(num_devices, folds)
        for chain in all_chains(spec, num_devices * folds)[:100]:
            order = [a for a, _ in chain] + [b for _, b in reversed(chain[:-1])]
            placement = from_cuts("wave", order, devices, num_devices, "direct", "brute")
            assert chain_bytes(problem, [index[c] for c in chain], devices[: num_devices * folds]) == \
                summarize(spec, placement).forward_bytes, (makers, num_devices, folds, chain)


@pytest.mark.parametrize("model,devices", [("sd2-unet", 4), ("sd2-unet", 8), ("uvit", 4)])
def test_a_ceiling_on_the_two_fold_dp_changes_nothing_it_allows(model, devices):
    """The two-fold DP drops states that cannot end under a ceiling (``fold2._fits``): with the ceiling at
    the least max load or above, the same chain; below it, none. (The bytes pass's ceiling is its cap:
    ``test_two_fold_dp_equals_brute_force`` holds that pass against brute force.)"""
    from pulse.costs import AnalyticProfiler
    from pulse.hardware import load_cluster
    from pulse.partition.wave import device_loads
    from pulse.zoo import get_spec

    spec = get_spec(model)
    costs = AnalyticProfiler(load_cluster("ascend-910a-1x8").hardware).profile(spec, 1)
    _, problem, _, _ = symmetric._plannable_problem(spec, costs, devices, 2, False)
    free = fold2.two_fold_chain(problem, devices)
    wave = wave_devices(devices, 2)[: 2 * devices]
    least = float(device_loads(problem, free, wave, devices).max())
    for upper in (least, least * 1.3):
        assert fold2.two_fold_chain(problem, devices, upper=upper) == free
    assert fold2.two_fold_chain(problem, devices, upper=least * 0.99) == []
