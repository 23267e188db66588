"""The partition registry, its one-line errors, crossing skips and the report."""
import random

import pytest

from partition_helpers import nested_unet, random_costs, random_skips, skip_local_v_splits
from pulse.errors import PlanError
from pulse.hardware import Cluster, Hardware
from pulse.partition import PARTITIONERS, partition, plan_symmetric
from pulse.partition.cuts import heaviest_nested_subset, valid_cuts
from pulse.partition.report import compare, format_rows, report
from pulse.placement import from_cuts
from pulse.spec import Layer, ModelSpec, SkipEdge
from pulse.traffic import skips_leaving_device, summarize

CLUSTER = Cluster("one-node", Hardware("hw", 1e12, 0.5, 2**34, 1e12, 1e9, 1e-5, 1e8, 1e-5, 8))


def _u(num_layers=12, num_skips=4, seed=0):
    rng = random.Random(seed)
    spec = nested_unet(rng, num_layers, num_skips)
    return spec, random_costs(rng, spec, microbatch_size=3)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and text
    return text


def test_registry_names_and_unknown_name():
    assert set(PARTITIONERS) == {"sequential", "diffusionpipe", "pulse"}
    spec, costs = _u()
    with pytest.raises(PlanError) as exc:
        partition("gpipe", spec, costs, 2)
    assert "known: sequential, diffusionpipe, pulse" in _one_line(exc)


@pytest.mark.parametrize("name", ["sequential", "diffusionpipe", "pulse"])
def test_too_many_devices_is_one_clear_line(name):
    spec, costs = _u(num_layers=12)
    devices = 13 if name != "pulse" else 7  # a V needs 2 chunks per device
    with pytest.raises(PlanError) as exc:
        partition(name, spec, costs, devices, cluster=CLUSTER)
    assert "--pp <=" in _one_line(exc)


def test_too_few_nested_cuts_names_the_limit():
    # l0 feeds l9..l11 and l1..l3 all feed l8: no cut may fall inside either group,
    # so 12 layers admit only 4 nested pairs (a V over 4 devices), not 6
    layers = [Layer(f"l{i}", "x", 1, 1.0, 4, 0) for i in range(12)]
    skips = [SkipEdge("l0", f"l{t}", 1) for t in (9, 10, 11)] + [SkipEdge(f"l{s}", "l8", 1) for s in (1, 2, 3)]
    spec = ModelSpec("grouped", layers, skips)
    costs = random_costs(random.Random(1), spec)
    assert plan_symmetric(spec, costs, 4).max_pairs == 4
    with pytest.raises(PlanError) as exc:
        partition("pulse", spec, costs, 5)
    text = _one_line(exc)
    assert "at most 4 devices with V placement" in text and "--pp <= 4" in text
    assert "sequential partitioner" in text
    with pytest.raises(PlanError, match="at most 1 devices with wave placement .3 folds.*use --pp <= 1"):
        partition("pulse", spec, costs, 2, folds=3)
    with pytest.raises(PlanError, match="use fewer folds"):
        partition("pulse", spec, costs, 1, folds=5)


def test_two_us_side_by_side_fold_around_one_of_them():
    """No boundary lies under both skips, yet skips inside one pair are local: device 1 takes
    layers the skips do not touch. The deepest V matches brute force over skip-local splits."""
    layers = [Layer(f"l{i}", "x", 1, 1.0, 4, 0) for i in range(8)]
    spec = ModelSpec("two-us", layers, [SkipEdge("l0", "l3", 1), SkipEdge("l4", "l7", 1)])
    costs = random_costs(random.Random(0), spec)
    deepest = max(p for p in range(1, 5) if any(True for _ in skip_local_v_splits(spec, p)))
    plan = plan_symmetric(spec, costs, deepest)
    assert skips_leaving_device(spec, plan.placement) == []
    with pytest.raises(PlanError, match=f"at most {deepest} devices with V placement"):
        partition("pulse", spec, costs, deepest + 1)


def _crossing_spec():
    layers = [Layer(f"l{i}", "x", 1, 1.0, 4, 0) for i in range(10)]
    skips = [SkipEdge("l0", "l9", 8), SkipEdge("l1", "l6", 5), SkipEdge("l3", "l8", 2)]  # 1-6 x 3-8
    return ModelSpec("crossed", layers, skips)


def test_crossing_skips_stay_local_when_they_share_a_pair():
    """Crossing skips are local when both sit in one pair: up to P = 3 a V keeps all three
    skips on their devices; P = 4 has no such V (brute force) and is refused when strict."""
    spec = _crossing_spec()
    costs = random_costs(random.Random(0), spec)
    deepest = max(p for p in range(1, 6) if any(True for _ in skip_local_v_splits(spec, p)))
    assert deepest == 3
    for num_devices in range(1, deepest + 1):
        plan = plan_symmetric(spec, costs, num_devices)
        assert plan.dropped_skips == () and skips_leaving_device(spec, plan.placement) == []
    with pytest.raises(PlanError) as exc:
        partition("pulse", spec, costs, deepest + 1)
    assert "crosses" in _one_line(exc) and "strict=False" in str(exc.value)


def test_crossing_skips_are_sent_directly_when_not_strict():
    spec = _crossing_spec()
    costs = random_costs(random.Random(0), spec)
    plan = plan_symmetric(spec, costs, 4, strict=False)
    assert plan.dropped_skips == ("l3->l8",)  # the lighter of the crossing pair
    plan.placement.validate(spec.num_layers)
    assert set(skips_leaving_device(spec, plan.placement)) <= {"l3->l8"}
    # sequential still works on crossing skips (it relays everything)
    partition("sequential", spec, costs, 3).validate(spec.num_layers)


def test_heaviest_nested_subset():
    spans = [(0, 9), (1, 6), (3, 8), (2, 4)]
    assert heaviest_nested_subset(spans, [8, 5, 2, 1]) == [0, 1, 3]
    assert heaviest_nested_subset(spans, [8, 1, 5, 1]) == [0, 2]  # (2, 4) crosses (3, 8)
    assert heaviest_nested_subset([], []) == []


@pytest.mark.parametrize("seed", range(4))
def test_valid_cuts_are_the_ones_keeping_skips_on_their_device(seed):
    """Cut (a, b) is valid iff the two-device V with device 1 holding [a, b) keeps every skip
    on its device (traffic's verdict); a terminal cut (a == a) is always valid."""
    spec = random_skips(random.Random(seed), 14, 5) if seed % 2 else _u(num_layers=14, num_skips=5, seed=seed)[0]
    spans = [(s, t) for s, t, _ in spec.skip_spans()]
    cuts = set(valid_cuts(spec.num_layers, spans).cuts)
    for a in range(1, 14):
        assert (a, a) in cuts
        for b in range(a + 1, 14):
            v = from_cuts("v", [0, a, a + 1, b, 14], [0, 1, 1, 0], 2, "direct", "t")
            assert ((a, b) in cuts) == (skips_leaving_device(spec, v) == []), (a, b)


def test_report_scales_traffic_by_the_microbatch_size():
    spec, costs = _u()
    for name in ("sequential", "pulse"):
        placement = partition(name, spec, costs, 2, cluster=CLUSTER)
        rep = report(spec, costs, placement)
        traffic = summarize(spec, placement)
        assert rep.forward.total == traffic.forward_bytes * 3
        assert rep.bytes_per_microbatch == traffic.total_bytes * 3
        assert rep.forward.skip == traffic.skip_bytes * 3
        assert sum(rep.device_load) == pytest.approx(costs.total(0, spec.num_layers))
        assert rep.imbalance >= 1.0
    assert report(spec, costs, partition("pulse", spec, costs, 2)).forward.skip == 0


def test_compare_rows():
    spec, costs = _u(num_layers=14, num_skips=5)
    rows = compare(spec, costs, 2, cluster=CLUSTER)
    assert [r.name for r in rows] == ["sequential", "diffusionpipe", "pulse"]
    assert rows[0].reduction_vs_sequential == 0.0
    pulse_row = rows[2]
    assert pulse_row.kind == "v" and pulse_row.reduction_vs_sequential > 0
    assert [r.name for r in compare(spec, costs, 2)] == ["sequential", "pulse"]  # no cluster, no diffusionpipe
    assert "pulse" in format_rows(rows)


def test_partitioners_are_pure_and_deterministic():
    spec, costs = _u(num_layers=16, num_skips=5, seed=2)
    for name in PARTITIONERS:
        for folds in (1, 2) if name == "pulse" else (1,):
            first = partition(name, spec, costs, 2, folds=folds, cluster=CLUSTER)
            assert partition(name, spec, costs, 2, folds=folds, cluster=CLUSTER) == first


def test_folds_are_refused_by_sequential_partitioners():
    spec, costs = _u()
    with pytest.raises(PlanError, match="no folds"):
        partition("sequential", spec, costs, 2, folds=2)
    with pytest.raises(PlanError, match="cluster"):
        partition("diffusionpipe", spec, costs, 2)


def test_mismatched_cost_table_is_refused():
    spec, costs = _u()
    other, _ = _u(num_layers=10)
    with pytest.raises(Exception, match="re-profile"):
        partition("pulse", other, costs, 2)
