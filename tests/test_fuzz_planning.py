"""Property tests: random models and cost tables through every partitioner, schedule and the simulator.

Models are drawn with properly nested skips (a bracket sequence over 4-40
layers, some layers without a skip), random positive sizes and costs, and
random shared inputs made by a layer or read from the data. The properties:

* every partitioner returns a placement that passes ``Placement.validate``, or
  raises PlanError with a one-line message, never another exception;
* the PULSE placement never sends a skip between devices;
* every applicable baseline schedule validates (compute only, and with the
  sends and receives of ``add_send_recv``) and simulates without deadlock, in
  no less time than ``sim.bounds.lower_bound`` of its task graph, and a plan
  holding it round-trips through ``plan_from_dict``;
* the sequential placement moves at least the skip bytes of the V (none);
* a model whose skips cross is planned with every skip local when a chain puts
  each crossing pair in one encoder/decoder pair (brute force ``most_pairs``);
  otherwise the strict PULSE partitioner refuses it and, without ``strict``, it
  is planned with crossing skips sent directly.

Bounded and deterministic (``derandomize``); ``FUZZ_CASES`` counts the examples
run (pytest --hypothesis-show-statistics prints hypothesis' own numbers).
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.hardware import Cluster, Hardware
from pulse.partition import PARTITIONERS, partition, plan_symmetric
from pulse.placement import Placement
from pulse.plan import Plan, check_layer_names, plan_from_dict
from pulse.schedule.deps import build_dependencies
from pulse.schedule.generators import applicable_baselines, make_schedule
from pulse.schedule.passes import add_send_recv
from pulse.schedule.validate import is_split, validate
from pulse.sim.bounds import lower_bound
from pulse.sim.engine import simulate
from pulse.spec import Layer, ModelSpec, SharedInput, SkipEdge
from pulse.traffic import skips_leaving_device, summarize

FUZZ_CASES: Counter = Counter()  # examples run per property

FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fuzz(max_examples: int) -> settings:
    return settings(FUZZ, max_examples=max_examples)


# -- strategies --------------------------------------------------------------------------------------
@st.composite
def nested_pairs(draw, n: int) -> list[tuple[int, int]]:
    """Properly nested (src, dst) layer pairs with distinct endpoints.

    Half the time a U (every skip spans one middle boundary, so a V exists),
    otherwise any bracket sequence (siblings too, which a V may not fold)."""
    if draw(st.booleans()):
        mid = draw(st.integers(1, n - 1))  # skips span the boundary before layer ``mid``
        left = sorted(draw(st.sets(st.integers(0, mid - 1), max_size=mid)))
        right = sorted(draw(st.sets(st.integers(mid, n - 1), max_size=n - mid)))
        k = min(len(left), len(right))
        return [(left[len(left) - 1 - i], right[i]) for i in range(k)]
    stack: list[int] = []
    pairs = []
    for i, token in enumerate(draw(st.lists(st.sampled_from("().."), min_size=n, max_size=n))):
        if token == "(":
            stack.append(i)
        elif token == ")" and stack:
            pairs.append((stack.pop(), i))
    return pairs


def build_spec(draw, n: int, pairs: list[tuple[int, int]]) -> ModelSpec:
    size = st.integers(0, 10**6)
    layers = [Layer(f"l{i}", draw(st.sampled_from(["res", "attn", "mlp"])), draw(size),
                    draw(st.floats(1e3, 1e12)), draw(size), draw(size)) for i in range(n)]
    skips = [SkipEdge(f"l{s}", f"l{t}", draw(size)) for s, t in pairs]
    shared = [SharedInput(f"in{j}", draw(size), draw(st.none() | st.sampled_from([l.name for l in layers])))
              for j in range(draw(st.integers(0, 3)))]
    return ModelSpec("fuzz", layers, skips, shared)


@st.composite
def nested_specs(draw) -> ModelSpec:
    n = draw(st.integers(4, 40))
    return build_spec(draw, n, draw(nested_pairs(n)))


@st.composite
def crossing_specs(draw) -> ModelSpec:
    """A U with nested skips around a middle boundary plus two skips that cross
    (both also spanning it, so some V still exists once one is sent directly)."""
    n = draw(st.integers(4, 40))
    mid = draw(st.integers(2, n - 2))
    a, b = sorted(draw(st.sets(st.integers(0, mid - 1), min_size=2, max_size=2)))
    c, d = sorted(draw(st.sets(st.integers(mid, n - 1), min_size=2, max_size=2)))
    left = sorted(draw(st.sets(st.integers(0, mid - 1), max_size=mid)))
    right = sorted(draw(st.sets(st.integers(mid, n - 1), max_size=n - mid)))
    k = min(len(left), len(right))
    pairs = {(left[len(left) - 1 - i], right[i]) for i in range(k)} | {(a, c), (b, d)}
    return build_spec(draw, n, sorted(pairs))


@st.composite
def cost_tables(draw, spec: ModelSpec) -> CostTable:
    n = spec.num_layers
    fwd = draw(st.lists(st.floats(1e-5, 1e-1), min_size=n, max_size=n))
    ratio = draw(st.lists(st.floats(1.0, 3.0), min_size=n, max_size=n))
    mem = draw(st.lists(st.integers(0, 10**8), min_size=n, max_size=n))
    return CostTable(spec.name, draw(st.integers(1, 4)), tuple(l.name for l in spec.layers), tuple(fwd),
                     tuple(f * r for f, r in zip(fwd, ratio)), tuple(mem), "fuzz")


@st.composite
def clusters(draw, devices: int) -> Cluster:
    per_node = draw(st.integers(1, 4))
    bandwidth = draw(st.floats(1e6, 1e11))
    hw = Hardware("fuzz", 1e12, 0.5, 2**34, 1e12, bandwidth, draw(st.floats(0.0, 1e-3)),
                  bandwidth / draw(st.floats(1.0, 10.0)), draw(st.floats(0.0, 1e-2)), per_node)
    return Cluster("fuzz", hw, math.ceil(devices / per_node))


@st.composite
def setups(draw, specs=nested_specs()):
    spec = draw(specs)
    devices = draw(st.integers(1, min(6, spec.num_layers)))
    return spec, draw(cost_tables(spec)), devices, draw(clusters(devices))


# -- helpers -----------------------------------------------------------------------------------------
def try_partition(name: str, spec, costs, devices, cluster, folds=1) -> Placement | None:
    """The placement, or None after a PlanError that must be one line; any other exception fails."""
    try:
        placement = partition(name, spec, costs, devices, folds=folds, cluster=cluster)
    except PlanError as exc:
        assert "\n" not in str(exc) and str(exc), f"{name}: not one line: {exc}"
        return None
    placement.validate(spec.num_layers)
    assert placement.num_devices == devices
    return placement


def most_pairs(spec: ModelSpec) -> int:
    """Brute force: the most encoder/decoder pairs a V chain can have (0: none).

    A cut (a, b) keeps [a, b) inside and [0, a) + [b, L) outside; it is valid when
    no skip has one end on each side (a skip wholly inside or wholly outside is
    local: both ends land in one encoder/decoder pair). A chain (0, L) > (a1, b1) > ... ends at a
    fold point a == b, each cut strictly inside the one before; it has a pair per
    step. D[a][b] is the longest chain from a valid (a, b), M its running maximum
    over cuts inside (a' >= a, b' <= b)."""
    n, spans = spec.num_layers, [(s, t) for s, t, _ in spec.skip_spans()]
    none = -1
    D = [[none] * (n + 1) for _ in range(n + 1)]
    M = [[none] * (n + 1) for _ in range(n + 2)]
    for a in range(n - 1, 0, -1):
        for b in range(a, n):
            if all((a <= s < b) == (a <= t < b) for s, t in spans):
                D[a][b] = 0 if a == b else (1 + M[a + 1][b - 1] if M[a + 1][b - 1] >= 0 else none)
            M[a][b] = max(D[a][b], M[a + 1][b], M[a][b - 1] if b > a else none)
    return 1 + M[1][n - 1] if n > 1 and M[1][n - 1] >= 0 else 0


def check_schedules(spec, placement, costs, cluster, num_mb: int) -> int:
    """Every applicable baseline validates and simulates at or above the lower bound."""
    names = applicable_baselines(placement, num_mb)
    assert {"gpipe", "greedy_v_1f1b", "zero_bubble_v"} <= set(names)
    for name in names:
        schedule = make_schedule(name, placement, num_mb, costs)
        validate(schedule, placement, num_mb)
        validate(add_send_recv(schedule, spec, placement), placement, num_mb, with_comm=True)
        result = simulate(spec, placement, schedule, costs, cluster)
        graph = build_dependencies(spec, placement, num_mb, costs, cluster, split_backward=is_split(schedule))
        bound = lower_bound(graph)
        assert result.makespan >= bound * (1 - 1e-9) - 1e-12, (name, result.makespan, bound)
        assert len(result.compute) == len(schedule.all_actions())
        # what a plan file stores of it loads back, checked against the placement and the model
        plan = Plan(spec.name, "fuzz", placement.num_devices, 1, costs.microbatch_size, num_mb,
                    placement.partitioner, placement, schedule)
        data = plan.to_dict(spec)
        assert plan_from_dict(data) == plan
        check_layer_names(data, spec, "fuzz plan")
    return len(names)


# -- properties --------------------------------------------------------------------------------------
@fuzz(100)
@given(setups())
def test_partitioners_return_valid_placements_or_plan_errors(setup):
    spec, costs, devices, cluster = setup
    FUZZ_CASES["partitioners"] += 1
    for name in PARTITIONERS:
        for folds in ((1, 2) if name == "pulse" else (1,)):
            placement = try_partition(name, spec, costs, devices, cluster, folds)
            event(f"{name} folds={folds}: {'placement' if placement else 'PlanError'}")
            if name != "pulse" and devices <= spec.num_layers:
                assert placement is not None, f"{name} refused {devices} devices for {spec.num_layers} layers"
            if name == "pulse":
                feasible = most_pairs(spec) >= folds * devices
                assert (placement is not None) == feasible, (folds, devices, most_pairs(spec))
            if placement is not None and name == "pulse":
                assert placement.kind == ("v" if folds == 1 else "wave") and placement.folds == folds
                assert skips_leaving_device(spec, placement) == []
                assert summarize(spec, placement).skip_bytes == 0


@fuzz(35)  # each case lowers and simulates every baseline on up to three placements
@given(setups(), st.integers(1, 6))
def test_baseline_schedules_validate_and_simulate(setup, num_mb):
    spec, costs, devices, cluster = setup
    FUZZ_CASES["schedules"] += 1
    sequential = try_partition("sequential", spec, costs, devices, cluster)
    assert sequential is not None
    placements = [sequential]
    for folds in (1, 2):
        v = try_partition("pulse", spec, costs, devices, cluster, folds)
        if v is not None:
            placements.append(v)
            seq_traffic, v_traffic = summarize(spec, sequential), summarize(spec, v)
            assert v_traffic.skip_bytes == 0 <= seq_traffic.skip_bytes
            assert seq_traffic.forward_bytes >= v_traffic.skip_bytes
    event(f"placements simulated: {len(placements)}")
    for placement in placements:
        FUZZ_CASES["schedules run"] += check_schedules(spec, placement, costs, cluster, num_mb)


@fuzz(120)
@given(setups(crossing_specs()))
def test_crossing_skips_need_non_strict_planning_only_without_a_shared_pair(setup):
    """Crossing skips stay local when a chain puts both in one pair (brute force says whether
    one with enough pairs exists); only otherwise does strict planning refuse them."""
    spec, costs, devices, cluster = setup
    FUZZ_CASES["crossing"] += 1
    assert spec.crossing_pairs()
    for p in sorted({1, devices}):
        local = most_pairs(spec) >= p  # every skip, crossing ones too, in one pair
        try:
            strict = plan_symmetric(spec, costs, p, strict=True)
        except PlanError as exc:
            assert not local and "crosses" in str(exc) and "\n" not in str(exc)
            event("crossing, strict: refused")
        else:
            assert local and skips_leaving_device(spec, strict.placement) == []
            event("crossing, strict: all skips local")
        try:
            plan = plan_symmetric(spec, costs, p, strict=False)
        except PlanError as exc:
            assert not local and p > 1 and "\n" not in str(exc)
            event("crossing, non-strict: PlanError")
            continue
        plan.placement.validate(spec.num_layers)
        assert bool(plan.dropped_skips) == (not local)
        assert set(skips_leaving_device(spec, plan.placement)) <= set(plan.dropped_skips)
        if p == devices:
            FUZZ_CASES["crossing schedules run"] += check_schedules(spec, plan.placement, costs, cluster, 2)

