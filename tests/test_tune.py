"""The hybrid tuner: all-reduce pricing, memory rejection, consistency with the simulator, bad input."""
import subprocess
import sys

import pytest

from pulse.costs import AnalyticProfiler
from pulse.errors import PulseError
from pulse.hardware import Cluster, load_cluster
from pulse.sim.engine import simulate
from pulse.tune.allreduce import replica_devices, ring_allreduce_time
from pulse.schedule.generators import applicable_baselines
from pulse.tune.evaluate import place
from pulse.tune.report import format_result
from pulse.tune.request import default_microbatch_sizes
from pulse.tune.space import enumerate_candidates
from pulse.tune.tuner import TuneRequest, tune
from pulse.zoo import get_spec

GiB = 2**30


@pytest.fixture(scope="module")
def uvit_result():
    cluster = load_cluster("ascend-910a-1x8")
    request = TuneRequest(get_spec("uvit"), cluster, 32, 30 * GiB, microbatch_sizes=(1, 2), folds=(1,))
    return request, tune(request, exhaustive=True)  # every candidate priced: these tests read the whole ranking


def test_ring_allreduce_closed_forms():
    cluster = load_cluster("ascend-910a-2x8")
    hw = cluster.hardware
    n = 1e9
    inside = ring_allreduce_time(n, [0, 1, 2, 3], cluster)
    assert inside == pytest.approx(6 * hw.intra_node_latency + 1.5 * n / hw.intra_node_bandwidth)
    # two nodes of 8: intra ring over 8, then the 1/8 shard across 2 nodes
    both = ring_allreduce_time(n, list(range(16)), cluster)
    expected = (14 * hw.intra_node_latency + 14 / 8 * n / hw.intra_node_bandwidth
                + 2 * hw.inter_node_latency + (n / 8) / hw.inter_node_bandwidth)
    assert both == pytest.approx(expected)
    assert ring_allreduce_time(n, [5], cluster) == 0.0
    assert replica_devices(stage=1, pp=4, dp=4) == [1, 5, 9, 13]


def test_search_space_splits_the_batch_exactly():
    for c in enumerate_candidates(8, 32, (1, 2, 4), (1, 2), 8):
        assert c.pp * c.dp == 8
        assert c.dp * c.microbatch_size * c.num_microbatches == 32
    strategies = {c.strategy for c in enumerate_candidates(8, 32, (1,), (1,), 8)}
    assert strategies == {"pulse", "data-parallel", "sequential", "diffusionpipe"}


def test_pulse_searches_every_baseline_shape_plain_data_parallelism_included():
    """PULSE's search holds each baseline's shapes (its skips sent direct), PP = 1 too: where data
    parallelism alone is fastest, PULSE's best is that, never below it."""
    candidates = enumerate_candidates(8, 64, (1, 8), (1,), 8)
    whole = {(c.pp, c.dp, c.microbatch_size, c.schedule) for c in candidates if c.strategy == "data-parallel"}
    pulse_whole = {(c.pp, c.dp, c.microbatch_size, c.schedule) for c in candidates
                   if c.strategy == "pulse" and c.pp == 1}
    assert whole and pulse_whole == whole


def test_default_microbatch_sizes_reach_a_devices_share_of_the_batch():
    """Powers of two to a device's share, at least to 8: data parallelism can then run its share as
    one microbatch, whose whole backward hides the all-reduce."""
    assert default_microbatch_sizes(256, 16) == (1, 2, 4, 8, 16)
    assert default_microbatch_sizes(256, 8) == (1, 2, 4, 8, 16, 32)
    assert default_microbatch_sizes(32, 16) == (1, 2, 4, 8)
    assert default_microbatch_sizes(100, 4) == (1, 2, 4, 8, 16)  # 25 a device: the powers of two below it
    request = TuneRequest(get_spec("uvit"), load_cluster("ascend-910a-2x8"), 256, 30 * GiB)
    assert request.sizes == (1, 2, 4, 8, 16)
    assert TuneRequest(get_spec("uvit"), load_cluster("ascend-910a-2x8"), 256, 30 * GiB, (2,)).sizes == (2,)


def test_every_strategy_is_offered_every_schedule_its_placement_runs():
    """For each baseline shape the offered schedules are exactly the generators' applicable ones
    (``applicable_baselines`` on the placement the tuner builds), interleaved 1F1B included."""
    spec, cluster = get_spec("uvit"), load_cluster("ascend-910a-1x8")
    costs = AnalyticProfiler(cluster.hardware).profile(spec, 1)
    offered: dict[tuple, set[str]] = {}
    for c in enumerate_candidates(8, 64, (1,), (1,), 8):
        if c.strategy != "pulse":
            offered.setdefault((c.strategy, c.pp, c.num_microbatches, c.virtual), set()).add(c.schedule)
    assert {virtual for *_, virtual in offered} == {1, 2}
    for (strategy, pp, m, virtual), names in offered.items():
        cand = next(c for c in enumerate_candidates(8, 64, (1,), (1,), 8)
                    if (c.strategy, c.pp, c.virtual) == (strategy, pp, virtual))
        placement = place(spec, costs, cluster, cand)
        assert placement.chunks_per_device == virtual
        assert names == set(applicable_baselines(placement, m)), (strategy, pp, virtual)
    assert "interleaved_1f1b" in offered[("sequential", 4, 32, 2)]


def test_each_strategy_best_and_the_strongest_baseline_follow_the_ranking(uvit_result):
    _, result = uvit_result
    for strategy in ("pulse", "data-parallel", "sequential", "diffusionpipe"):
        mine = [e.samples_per_s for e in result.ranked if e.candidate.strategy == strategy]
        assert result.best_by_strategy[strategy].samples_per_s == max(mine)
    rivals = [e for e in result.ranked if e.candidate.strategy != "pulse"]
    assert result.strongest_baseline.samples_per_s == max(e.samples_per_s for e in rivals)
    assert result.speedup_over_strongest() == pytest.approx(
        result.best_by_strategy["pulse"].samples_per_s / max(e.samples_per_s for e in rivals))
    schedules = {e.candidate.schedule for e in rivals if e.candidate.strategy == "sequential"}
    assert {"1f1b", "gpipe", "zero_bubble_v", "interleaved_1f1b"} <= schedules
    report = format_result(result)
    assert f"{result.speedup_over_strongest():.2f}x" in report and result.strongest_baseline.candidate.label in report


def test_ranking_is_by_simulated_throughput_and_fits(uvit_result):
    request, result = uvit_result
    rates = [e.samples_per_s for e in result.ranked]
    assert rates == sorted(rates, reverse=True)
    assert all(e.peak_memory <= request.memory_budget for e in result.ranked)
    for e in result.ranked[:5]:
        assert e.samples_per_s == pytest.approx(32 / e.iteration_time)
        assert e.iteration_time >= e.pipeline_time
    assert set(result.best_by_strategy) == {"pulse", "data-parallel", "sequential", "diffusionpipe"}


def test_predicted_peak_memory_matches_the_simulator(uvit_result):
    request, result = uvit_result
    winner = result.winner
    costs = AnalyticProfiler(request.cluster.hardware).profile(request.spec, winner.candidate.microbatch_size)
    again = simulate(request.spec, winner.placement, winner.schedule, costs, request.cluster)
    assert max(again.peak_memory) == winner.peak_memory
    assert again.makespan == pytest.approx(winner.pipeline_time)


def test_a_budget_just_below_the_winner_picks_another(uvit_result):
    request, result = uvit_result
    tight = TuneRequest(request.spec, request.cluster, 32, result.winner.peak_memory - 1,
                        microbatch_sizes=(1, 2), folds=(1,))
    second = tune(tight)
    assert second.winner.candidate != result.winner.candidate
    assert second.winner.peak_memory < result.winner.peak_memory
    assert any(e.candidate == result.winner.candidate for e in second.rejected)
    assert "budget" in next(e.reason for e in second.rejected if e.candidate == result.winner.candidate)


def test_nothing_fits_names_the_smallest_memory_that_would():
    request = TuneRequest(get_spec("uvit"), load_cluster("ascend-910a-1x8"), 16, 1 * GiB,
                          microbatch_sizes=(1,), folds=(1,))
    with pytest.raises(PulseError, match=r"smallest need is \d+\.\d+ GiB.*raise --memory-budget to at least"):
        tune(request)


def test_indivisible_global_batch_is_refused():
    request = TuneRequest(get_spec("uvit"), load_cluster("ascend-910a-1x8"), 3, 30 * GiB,
                          microbatch_sizes=(2, 4), folds=(1,))
    with pytest.raises(PulseError, match="global batch 3 cannot be split.*use a multiple of 2"):
        tune(request)


def _pulse(*args):
    return subprocess.run([sys.executable, "-m", "pulse.cli.main", *args], capture_output=True, text=True)


def test_cli_bad_inputs_exit_2_with_one_line(tmp_path):
    bad_cluster = tmp_path / "c.yaml"
    bad_cluster.write_text("name: c\nhardware: ascend-910a\n")
    cases = [
        (["tune", "--model", "uvit", "--cluster", str(bad_cluster)], "missing key 'nodes'"),
        (["tune", "--model", "uvit", "--cluster", "ascend-910a-1x8", "--global-batch", "16",
          "--memory-budget", "0.5", "--microbatch-sizes", "1", "--folds", "1", "--out", str(tmp_path / "p.yaml")],
         "nothing fits"),  # one microbatch size and fold count: the refusal is the same, the search 4x shorter
        (["tune", "--model", "uvit", "--cluster", "ascend-910a-1x8", "--global-batch", "3",
          "--microbatch-sizes", "2"], "cannot be split"),
    ]
    for args, message in cases:
        out = _pulse(*args)
        assert out.returncode == 2, out.stderr
        assert message in out.stderr
        assert "Traceback" not in out.stderr
    assert not (tmp_path / "p.yaml").exists()


def test_cli_writes_a_loadable_winning_plan(tmp_path):
    out = _pulse("tune", "--model", "uvit", "--cluster", "ascend-910a-1x8", "--global-batch", "16",
                 "--microbatch-sizes", "1", "--folds", "1", "--out", str(tmp_path / "plan.yaml"))
    assert out.returncode == 0, out.stderr
    assert "winner:" in out.stdout and "pulse speedup" in out.stdout
    from pulse.cli.common import load_model
    from pulse.plan import load_plan

    plan, spec = load_plan(tmp_path / "plan.yaml", load_model)
    assert plan.pp * plan.dp == 8 and plan.schedule is not None
