"""A V may let a skip leave its device when the simulated step says so (``pulse.partition.crossing``).

The model: eight layers, two nested skips, three heavy layers (the outer encoder layer l1 and
the two outer decoder layers l6, l7) tied together by the skip l1 -> l6, as the attentions of
the diffusers UNet in the peer benchmark are. Every skip-local V over two devices puts two of
them on one device; the V that sends l1 -> l6 directly does not.
"""
from __future__ import annotations

import pytest

from pulse.costs import CostTable
from pulse.hardware import load_cluster
from pulse.partition import plan_symmetric
from pulse.partition.crossing import affordable_count, all_cuts, reindex
from pulse.partition.cuts import valid_cuts
from pulse.placement import from_cuts, wave_devices
from pulse.spec import Layer, ModelSpec, SkipEdge
from pulse.traffic import skips_leaving_device

from partition_helpers import all_splits, independent_step, skip_local_v_splits

HEAVY = {1, 6, 7}
SKIP_BYTES = 4 << 20  # per sample: a slow link makes a crossing skip dear


def heavy_ends_spec() -> ModelSpec:
    layers = [Layer(f"l{i}", "x", 1000, 1e9, 1 << 16, 1 << 16) for i in range(8)]
    skips = [SkipEdge("l1", "l6", SKIP_BYTES), SkipEdge("l2", "l5", SKIP_BYTES)]
    return ModelSpec("heavy-ends", layers, skips, [])


def costs_of(spec: ModelSpec) -> CostTable:
    fwd = [0.010 if i in HEAVY else 0.001 for i in range(spec.num_layers)]
    return CostTable(spec.name, 1, tuple(l.name for l in spec.layers), fwd, [2 * f for f in fwd],
                     [1 << 16] * spec.num_layers, "test")


def step_of(spec, costs, cluster, split, microbatches=4) -> float:
    """The whole step of the V on ``split`` with its faster priced schedule, without pulse.partition."""
    placement = from_cuts("v", list(split), wave_devices(2, 1), 2, "direct", "test")
    return independent_step(spec, costs, cluster, placement, microbatches)


def v_splits(spec):
    """Every V over two devices: four non-empty chunks, devices 0 1 1 0."""
    return list(all_splits(spec.num_layers, 4))


def test_on_a_fast_link_the_v_sends_a_skip_and_beats_every_skip_local_v():
    spec, cluster = heavy_ends_spec(), load_cluster("cpu-local")
    costs = costs_of(spec)
    plan = plan_symmetric(spec, costs, 2, cluster=cluster, candidates=4, strict=False)
    assert skips_leaving_device(spec, plan.placement)  # the chosen V sends a skip
    assert set(plan.dropped_skips) == set(skips_leaving_device(spec, plan.placement))
    assert plan.priced[0].source.startswith("skips may cross")
    local_best = min(step_of(spec, costs, cluster, s) for s in skip_local_v_splits(spec, 2))
    chosen = plan.priced[0].step_seconds
    assert chosen < 0.95 * local_best
    # and it is the fastest V of all, skips crossing or not (brute force over every split)
    assert chosen == pytest.approx(min(step_of(spec, costs, cluster, s) for s in v_splits(spec)), rel=1e-9)


def test_strict_keeps_every_skip_local():
    spec, cluster = heavy_ends_spec(), load_cluster("cpu-local")
    plan = plan_symmetric(spec, costs_of(spec), 2, cluster=cluster, candidates=4, strict=True)
    assert skips_leaving_device(spec, plan.placement) == [] and plan.dropped_skips == ()
    assert not any(p.source.startswith("skips may cross") for p in plan.priced)


def test_on_a_slow_link_the_skips_stay_local():
    spec = heavy_ends_spec()
    cluster = load_cluster("cpu-local").with_link_bandwidth(50e6)  # 4 MiB skip: ~84 ms, more than the imbalance
    costs = costs_of(spec)
    plan = plan_symmetric(spec, costs, 2, cluster=cluster, candidates=4, strict=False)
    assert skips_leaving_device(spec, plan.placement) == []
    crossing = [p for p in plan.priced if p.source.startswith("skips may cross")]
    assert crossing and all(p.step_seconds > plan.priced[0].step_seconds for p in crossing)


def test_the_wider_cut_set_holds_every_valid_cut_under_the_same_index_map():
    spec = heavy_ends_spec()
    valid = valid_cuts(spec.num_layers, [(s, t) for s, t, _ in spec.skip_spans()])
    wide = all_cuts(spec)
    assert len(wide.cuts) > len(valid.cuts)
    chain = list(range(len(valid.cuts)))
    assert [wide.cuts[c] for c in reindex(chain, valid, wide)] == list(valid.cuts)


def test_the_k_best_proposals_shrink_with_the_cut_count():
    assert affordable_count(100, 4) == 4
    assert affordable_count(5000, 4) == 1  # 25 M cells per proposal: only the exact min-max chain
    assert 1 < affordable_count(1500, 8) < 8
