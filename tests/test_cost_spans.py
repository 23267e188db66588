"""A cost table's measured chunks (``CostTable.spans``, `pulse profile --plan P --time-chunks`): a chunk
with exactly those layers is priced as measured, every other as its layers' sum less the per-action
fit; the figures survive the file, averaging and scaling, and a bad entry is one line."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pulse.costs import CostTable
from pulse.errors import PulseError
from pulse.hardware import load_cluster
from pulse.placement import from_cuts
from pulse.profiling.mean import at_speed, mean_costs
from pulse.schedule.generators import one_f_one_b
from pulse.sim.engine import simulate
from pulse.sim.step import StepTerms, step_time
from pulse.zoo import get_spec

SPEC = get_spec("tiny-unet")
N = SPEC.num_layers


def table(**changes) -> CostTable:
    n = N
    base = CostTable(SPEC.name, 1, tuple(l.name for l in SPEC.layers), tuple([1e-3] * n), tuple([2e-3] * n),
                     tuple([0] * n), "measured:test", bwd_input=tuple([1e-3] * n), bwd_weight=tuple([1e-3] * n),
                     optimizer=tuple([1e-4] * n), per_action=(("F", 1e-4), ("B", 2e-4), ("Bi", 1e-4), ("W", 0.0),
                                                              ("O", 5e-5)))
    return replace(base, **changes)


WHOLE = ((0, N, "F", 0.004), (0, N, "B", 0.009), (0, N, "Bi", 0.0001), (0, N, "W", 0.008), (0, N, "O", 0.0007))


def one_chunk_step(costs: CostTable, microbatches: int = 4) -> float:
    placement = from_cuts("sequential", [0, N], [0], 1, "direct", "test")
    cluster = load_cluster("cpu-local")
    result = simulate(SPEC, placement, one_f_one_b(placement, microbatches), costs, cluster)
    return step_time(SPEC, placement, costs, cluster, result, StepTerms(dp=1)).total


def test_a_chunk_of_exactly_the_measured_layers_is_priced_as_measured():
    layers, measured = table(), table(spans=WHOLE)
    assert measured.span(0, N) == (0.004, 0.009)
    assert measured.optimizer_seconds(0, N) == 0.0007
    assert measured.split_backward(0, N, input_grads=False) == (0.0001, 0.008)  # timed where it runs: as is
    for a, b in [(0, N - 1), (1, N), (3, 7)]:  # any other chunk: its layers, as without the spans
        assert measured.span(a, b) == layers.span(a, b)
        assert measured.split_backward(a, b) == layers.split_backward(a, b)
        assert measured.optimizer_seconds(a, b) == layers.optimizer_seconds(a, b)
    # the layers' figure for comparison: n x 1 ms less (n - 1) x 0.1 ms
    assert layers.span(0, N)[0] == pytest.approx(N * 1e-3 - (N - 1) * 1e-4)


def test_the_simulated_step_of_the_measured_chunk_moves_by_its_difference_per_microbatch():
    """M = 4 forwards and backwards of the one chunk, then its optimizer step: the step with the
    chunk measured differs from the layers' by M x (F + B difference) + the optimizer's."""
    layers, measured = table(), table(spans=WHOLE)
    f, b = layers.span(0, N)
    want = 4 * ((0.004 - f) + (0.009 - b)) + (0.0007 - layers.optimizer_seconds(0, N))
    assert one_chunk_step(measured) - one_chunk_step(layers) == pytest.approx(want, rel=1e-6)


def test_spans_survive_the_file_averaging_and_scaling(tmp_path: Path):
    measured = table(spans=WHOLE + ((0, 4, "F", 0.002),))
    for name in ("costs.yaml", "costs.json"):
        measured.save(tmp_path / name)
        assert CostTable.load(tmp_path / name) == measured
    other = table(spans=tuple((a, b, k, 3 * t) for a, b, k, t in measured.spans))
    assert mean_costs([measured, other]).spans == tuple((a, b, k, 2 * t) for a, b, k, t in measured.spans)
    assert at_speed(measured, 1.5).spans == tuple((a, b, k, 1.5 * t) for a, b, k, t in measured.spans)
    with pytest.raises(PulseError, match="spans"):
        mean_costs([measured, table()])  # one profile timed chunks the other did not


@pytest.mark.parametrize("entry, words", [
    ({"layers": [0, N + 1], "F": 0.1}, "not a chunk of the table"),
    ({"layers": [3, 3], "F": 0.1}, "not a chunk of the table"),
    ({"layers": [0, 4], "X": 0.1}, "unknown key 'X'"),
    ({"layers": [0, 4], "F": -1}, "must not be negative"),
    ({"layers": [0], "F": 0.1}, "'layers' must be [first, one past the last]"),
    ({"layers": ["a", 4], "F": 0.1}, "must be a number"),
    ({"F": 0.1}, "missing key 'layers'"),
    ("0,4", "must be a mapping"),
])
def test_a_bad_span_is_one_line_naming_the_file(tmp_path: Path, entry, words):
    data = table().to_dict()
    data["spans"] = [entry]
    path = tmp_path / "costs.yaml"
    from pulse.yamlio import dump_yaml
    path.write_text(dump_yaml(data))
    with pytest.raises(PulseError) as caught:
        CostTable.load(path)
    message = str(caught.value)
    assert words in message and str(path) in message and len(message.splitlines()) == 1


def test_a_span_given_twice_is_refused():
    with pytest.raises(PulseError, match="given twice"):
        table(spans=((0, 4, "F", 0.1), (0, 4, "F", 0.2)))


def test_a_plans_prediction_says_how_many_of_its_chunks_were_timed_whole():
    from pulse.plan import Plan
    from pulse.planner import predict

    placement = from_cuts("sequential", [0, 5, N], [0, 1], 2, "direct", "test")
    plan = Plan(SPEC.name, "cpu-local", 2, 1, 1, 4, "test", placement, one_f_one_b(placement, 4))
    cluster = load_cluster("cpu-local")
    assert predict(SPEC, table(), cluster, plan)["cost_source"] == "measured:test"
    half = table(spans=((0, 5, "F", 0.004), (0, 5, "B", 0.005), (0, N, "F", 0.01)))  # the second chunk: not timed
    assert predict(SPEC, half, cluster, plan)["cost_source"] == "measured:test, 1 of its 2 chunks timed whole"
