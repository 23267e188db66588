"""`pulse train --partitioner auto`: the fastest placement at the job's shape, a sequential one included.

Two toys over two devices. Heavy first and last layers: every V puts both on device 0 (chunk 0 and
its mirror, the last chunk, share it), a sequential split does not, so on a fast link a sequential
placement is faster. Heavy skips on a slow link: a sequential placement sends them, the V keeps
them, so the V is faster. Each plan is checked against the planner's own plan with the other
partitioner named, priced the same way.
"""
from __future__ import annotations

import pytest

from pulse.cli.main import main as pulse_main
from pulse.costs import CostTable
from pulse.errors import PulseError
from pulse.hardware import load_cluster
from pulse.planner import PlanRequest, make_plan
from pulse.spec import Layer, ModelSpec, SkipEdge

from test_partition_crossing import heavy_ends_spec

MICROBATCHES = 4


def skip_heavy_spec() -> ModelSpec:
    layers = [Layer(f"l{i}", "x", 1000, 1e9, 1 << 10, 1 << 16) for i in range(8)]
    skips = [SkipEdge(f"l{i}", f"l{7 - i}", 8 << 20) for i in range(3)]
    return ModelSpec("skip-heavy", layers, skips, [])


def table(spec: ModelSpec, heavy: set[int]) -> CostTable:
    fwd = [0.010 if i in heavy else 0.001 for i in range(spec.num_layers)]
    return CostTable(spec.name, 1, tuple(l.name for l in spec.layers), fwd, [2 * f for f in fwd],
                     [1 << 16] * spec.num_layers, "test")


def planned(spec, costs, cluster, partitioner: str, lines: list[str] | None = None):
    request = PlanRequest(model=spec.name, cluster=cluster.name, pp=2, num_microbatches=MICROBATCHES,
                          partitioner=partitioner, time_limit=1.0)
    return make_plan(spec, costs, cluster, request, placed=None if lines is None else lines.append)


def test_heavy_ends_on_a_fast_link_train_a_sequential_placement():
    spec, cluster = heavy_ends_spec(), load_cluster("cpu-local")
    costs = table(spec, {0, 7})
    lines: list[str] = []
    auto = planned(spec, costs, cluster, "auto", lines)
    v = planned(spec, costs, cluster, "pulse")
    assert auto.placement.kind in ("sequential", "interleaved") and auto.partitioner != "pulse"
    assert auto.predicted["step_seconds"] < v.predicted["step_seconds"]
    (line,) = lines
    assert line.startswith("placement auto: ") and "the best V placement" in line


def test_heavy_skips_on_a_slow_link_train_the_v():
    spec = skip_heavy_spec()
    cluster = load_cluster("cpu-local").with_link_bandwidth(5e6)  # 5 MB/s: an 8 MiB skip takes 1.7 s
    costs = table(spec, {3, 4})
    lines: list[str] = []
    auto = planned(spec, costs, cluster, "auto", lines)
    sequential = planned(spec, costs, cluster, "sequential")
    assert auto.placement.kind == "v" and auto.partitioner == "pulse"
    assert auto.predicted["step_seconds"] < sequential.predicted["step_seconds"]
    (line,) = lines
    assert line.startswith("placement auto: pulse V") and "the best sequential placement" in line


def test_auto_refuses_recompute_in_one_line():
    spec, cluster = heavy_ends_spec(), load_cluster("cpu-local")
    request = PlanRequest(model=spec.name, cluster=cluster.name, pp=2, partitioner="auto", recompute="all")
    with pytest.raises(PulseError, match="--partitioner auto prices placements without recomputation"):
        make_plan(spec, table(spec, {0, 7}), cluster, request)


def test_pulse_train_plan_only_says_which_placement_it_chose(tmp_path, capsys):
    code = pulse_main(["train", "--model", "tiny-unet", "--pp", "2", "--partitioner", "auto", "--schedule", "1f1b",
                       "--steps", "1", "--plan-only", "--out-dir", str(tmp_path / "run")])
    assert code == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("placement auto: "))
    assert "1f1b" in line and (tmp_path / "run" / "plan.yaml").exists()
