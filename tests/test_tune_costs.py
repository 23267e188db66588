"""`pulse tune --costs`: the tuner searches with a measured cost table, at the size it was measured at."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pulse.cli.main import main as pulse_main
from pulse.costs import AnalyticProfiler
from pulse.hardware import load_cluster
from pulse.plan import Plan, load_plan
from pulse.tune.measured import MeasuredProfiler
from pulse.tune.tuner import TuneRequest, tune
from pulse.zoo import get_spec

MODEL, CLUSTER = "tiny-unet", "cpu-local"
SLOW = 10.0  # the one layer the "measured" table makes this much slower


def analytic_table(microbatch_size: int = 1):
    spec = get_spec(MODEL).with_act_bytes(2)  # as `pulse tune --precision fp16` (its default) loads it
    return spec, AnalyticProfiler(load_cluster(CLUSTER).hardware).profile(spec, microbatch_size)


def slowed(table, layer: int):
    times = lambda column: tuple(t * SLOW if i == layer else t for i, t in enumerate(column))  # noqa: E731
    return replace(table, fwd=times(table.fwd), bwd=times(table.bwd), source="measured (test)")


def tuned_plan(tmp_path, table, name: str, *extra: str) -> Plan:
    costs, out = tmp_path / f"{name}.yaml", tmp_path / f"{name}-plan.yaml"
    table.save(costs)
    code = pulse_main(["tune", "--model", MODEL, "--cluster", CLUSTER, "--global-batch", "8", "--costs", str(costs),
                       "--folds", "1", "--out", str(out), *extra])
    assert code == 0
    return load_plan(out)[0]


def tuned_at(spec, table, pp: int):
    """The fastest configuration the tuner priced at ``pp`` pipeline devices with ``table``."""
    request = TuneRequest(spec, load_cluster(CLUSTER), 8, 20 * 2**30, microbatch_sizes=(1,), folds=(1,), max_pp=pp)
    result = tune(request, MeasuredProfiler(table), workers=1, exhaustive=True)
    return min((e for e in result.ranked if e.candidate.pp == pp), key=lambda e: e.iteration_time)


def others_on_its_device(placement, table, layer: int) -> float:
    """The compute of the other layers on the device that holds ``layer`` (analytic seconds), as a share
    of one device's mean: how much work the partition left beside the slow layer."""
    chunks = placement.chunks
    device = next(c.device for c in chunks if c.start <= layer < c.end)
    beside = sum(table.total(i, i + 1) for c in chunks if c.device == device
                 for i in range(c.start, c.end) if i != layer)
    everything = sum(table.total(i, i + 1) for i in range(len(table.fwd)) if i != layer)
    return beside / (everything / placement.num_devices)


def test_a_layer_made_ten_times_slower_moves_the_tuners_partition_away_from_it():
    spec, table = analytic_table()
    layer = max(range(spec.num_layers), key=lambda i: table.total(i, i + 1))  # the heaviest layer
    analytic = tuned_at(spec, table, 4)
    measured = tuned_at(spec, slowed(table, layer), 4)
    beside_slow = others_on_its_device(measured.placement, table, layer)
    assert beside_slow < others_on_its_device(analytic.placement, table, layer)


def test_tune_says_it_searches_the_measured_size(tmp_path, capsys):
    _, table = analytic_table()
    plan = tuned_plan(tmp_path, slowed(table, 3), "measured")
    assert "measured at microbatch size 1: the search keeps to that size" in capsys.readouterr().out
    assert plan.microbatch_size == 1


def test_the_search_keeps_to_the_measured_size_and_refuses_another(tmp_path, capsys):
    _, table = analytic_table(2)
    plan = tuned_plan(tmp_path, table, "mb2")
    assert plan.microbatch_size == 2
    capsys.readouterr()
    costs = tmp_path / "mb2.yaml"
    code = pulse_main(["tune", "--model", MODEL, "--cluster", CLUSTER, "--global-batch", "8", "--costs", str(costs),
                       "--microbatch-sizes", "1,2", "--out", str(tmp_path / "never.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "measured at microbatch size 2, but --microbatch-sizes asks for 1" in err[0]
    assert not (tmp_path / "never.yaml").exists()


@pytest.mark.parametrize("model", ["tiny-uvit"])
def test_a_table_of_another_model_is_refused(tmp_path, capsys, model):
    _, table = analytic_table()
    table.save(tmp_path / "unet.yaml")
    code = pulse_main(["tune", "--model", model, "--cluster", CLUSTER, "--costs", str(tmp_path / "unet.yaml"),
                       "--out", str(tmp_path / "never.yaml")])
    assert code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
