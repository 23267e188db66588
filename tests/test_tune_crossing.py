"""The tuner's V candidates include V cuts that send a skip across (``partition.crossing``) where they
price faster, so the plan `pulse plan` / `train` pick on a fast link is within the tuner's reach.

The toy is ``test_partition_crossing``'s: three heavy layers tied by a skip, so every skip-local V
over two devices is unbalanced and the V that sends the skip directly is not.
"""
from __future__ import annotations

import pytest

from pulse.hardware import load_cluster
from pulse.partition import plan_symmetric
from pulse.partition.priced import DEFAULT_CANDIDATES, PRICED_SCHEDULES
from pulse.traffic import skips_leaving_device
from pulse.tune.evaluate import evaluate
from pulse.tune.measured import MeasuredProfiler
from pulse.tune.space import Candidate
from pulse.tune.tuner import TuneRequest, tune

from test_partition_crossing import costs_of, heavy_ends_spec

GiB = 2**30
PP, DP, MICROBATCHES = 2, 2, 4


def tuned(cluster):
    spec = heavy_ends_spec()
    request = TuneRequest(spec, cluster, DP * MICROBATCHES, 20 * GiB, microbatch_sizes=(1,), folds=(1,), max_pp=PP)
    return spec, request, tune(request, MeasuredProfiler(costs_of(spec)), workers=1, exhaustive=True)


def planned_step(spec, request, cluster) -> tuple[float, object]:
    """The V `pulse plan` / `train` choose (their cut-set pricing) at the tuner's pp, dp and M, priced as
    the tuner prices a candidate, with its faster V schedule."""
    costs = costs_of(spec)
    plan = plan_symmetric(spec, costs, PP, strict=False, cluster=cluster, num_microbatches=MICROBATCHES,
                          candidates=DEFAULT_CANDIDATES)
    steps = [evaluate(spec, costs, cluster, Candidate("pulse", PP, DP, 1, MICROBATCHES, 1, "pulse", name,
                                                      skip_transport="direct"),
                      request.memory_budget, request.memory, placement=plan.placement).iteration_time
             for name in PRICED_SCHEDULES]
    return min(steps), plan.placement


def test_on_a_fast_link_the_tuner_reaches_the_planners_crossing_v():
    cluster = load_cluster("cpu-local")
    spec, request, result = tuned(cluster)
    plan_step, plan_placement = planned_step(spec, request, cluster)
    assert skips_leaving_device(spec, plan_placement)  # the planner's own choice is a crossing V
    same_shape = [e for e in result.ranked if (e.candidate.pp, e.candidate.dp, e.candidate.microbatch_size)
                  == (PP, DP, 1)]
    best = min(same_shape, key=lambda e: e.iteration_time)
    assert best.iteration_time <= plan_step * (1 + 1e-9)
    v_shapes = [e for e in same_shape if e.candidate.folds == 1]
    assert all(skips_leaving_device(spec, e.placement) for e in v_shapes)  # the tuner's V sends the skip too


def test_on_a_slow_link_the_tuners_v_keeps_its_skips():
    cluster = load_cluster("cpu-local").with_link_bandwidth(50e6)  # the 4 MiB skip costs more than the imbalance
    spec, _, result = tuned(cluster)
    v_shapes = [e for e in result.ranked if e.candidate.folds == 1 and e.candidate.pp == PP]
    assert v_shapes and not any(skips_leaving_device(spec, e.placement) for e in v_shapes)


def test_a_size_the_table_was_not_measured_at_is_refused():
    spec = heavy_ends_spec()
    with pytest.raises(Exception, match="measured at microbatch size 1, not 2"):
        MeasuredProfiler(costs_of(spec), "costs.yaml").profile(spec, 2)
