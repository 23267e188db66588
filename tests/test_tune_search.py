"""The pruned tuner: its bounds never exceed a simulated step, and it answers as the exhaustive search."""
import json

import pytest

from pulse.cli.main import main
from pulse.costs import AnalyticProfiler
from pulse.hardware import load_cluster
from pulse.sim.step import StepTerms
from pulse.tune.bounds import placement_bound
from pulse.tune.incumbents import Incumbents
from pulse.tune.space import Candidate
from pulse.tune.tuner import TuneRequest, tune
from pulse.zoo import get_spec

GiB = 2**30


def _request(model: str, cluster: str, batch: int, **kw) -> TuneRequest:
    net = load_cluster(cluster)
    if "bandwidth" in kw:  # a communication-bound variant: every link slowed
        net = net.with_link_bandwidth(kw.pop("bandwidth"))
    return TuneRequest(get_spec(model), net, batch, 30 * GiB, microbatch_sizes=(1, 2), **kw)


# small enough for an exhaustive search in seconds, large enough that the bounds skip most candidates
CASES = [("uvit", "ascend-910a-1x8", 16, {}), ("sd2-unet", "v100-pcie-1x8", 8, {"bandwidth": 2e9})]


@pytest.fixture(scope="module", params=CASES, ids=[c[1] for c in CASES])
def exhaustive(request):
    model, net, batch, kw = request.param
    req = _request(model, net, batch, **kw)
    return req, tune(req, exhaustive=True, workers=1)


def _answer(result, top):
    return ([(e.candidate, e.iteration_time) for e in result.ranked[:top]],
            {s: (e.candidate, e.iteration_time) for s, e in result.best_by_strategy.items()})


@pytest.mark.parametrize("top", [1, 10])
def test_pruned_search_answers_as_the_exhaustive_one(exhaustive, top):
    req, full = exhaustive
    pruned = tune(req, top=top, workers=1)
    assert pruned.skipped > 0  # the bounds did skip work
    assert len(pruned.ranked) + pruned.skipped <= len(full.ranked) + len(full.rejected) + full.skipped
    assert pruned.winner.candidate == full.winner.candidate
    assert _answer(pruned, top) == _answer(full, top)


def test_bound_never_exceeds_the_simulated_step(exhaustive):
    req, full = exhaustive
    tables = {}
    for e in full.ranked + full.rejected:
        c = e.candidate
        costs = tables.setdefault(c.microbatch_size, AnalyticProfiler(req.cluster.hardware).profile(req.spec,
                                                                                                  c.microbatch_size))
        bound = placement_bound(req.spec, e.placement, costs, req.cluster, c,
                                StepTerms(dp=c.dp, grad_bytes=req.memory.grad_bytes))
        assert bound <= e.iteration_time * (1 + 1e-9), c.label


def test_two_workers_price_the_same_candidates_in_the_same_order():
    req = _request("uvit", "ascend-910a-1x8", 8, folds=(1,))
    one, two = tune(req, workers=1), tune(req, workers=2)
    assert [(e.candidate, e.iteration_time) for e in one.ranked] == [(e.candidate, e.iteration_time)
                                                                      for e in two.ranked]
    assert one.skipped == two.skipped and one.unbuildable == two.unbuildable


def test_incumbents_skip_only_what_cannot_change_the_answer():
    def cand(strategy):
        return Candidate(strategy, 2, 1, 1, 4, 0, strategy, "1f1b")

    class Priced:  # the two fields Incumbents reads
        def __init__(self, strategy, seconds):
            self.candidate, self.iteration_time, self.fits = cand(strategy), seconds, True

    inc = Incumbents(top=2)
    assert inc.matters(1e9, cand("sequential"))  # nothing known: everything matters
    for strategy, seconds in (("sequential", 1.0), ("sequential", 2.0), ("diffusionpipe", 5.0)):
        inc.add(Priced(strategy, seconds))
    assert inc.threshold(cand("sequential")) == 2.0  # the second fastest overall
    assert inc.threshold(cand("diffusionpipe")) == 5.0  # its strategy's best so far
    assert inc.threshold(cand("pulse")) == float("inf")  # no pulse priced yet
    assert inc.matters(2.0, cand("sequential")) and not inc.matters(2.1, cand("sequential"))


def test_cli_tune_json_carries_each_best_steps_breakdown(tmp_path, capsys):
    assert main(["tune", "--model", "uvit", "--cluster", "ascend-910a-1x8", "--global-batch", "16",
                 "--microbatch-sizes", "1", "--folds", "1", "--top", "3", "--format", "json",
                 "--out", str(tmp_path / "p.yaml")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["counts"]["skipped_by_bound"] >= 0 and len(report["ranked"]) == 3
    for best in report["best_by_strategy"].values():
        parts = best["step_breakdown_seconds"]
        assert set(parts) == {"compute", "bubble", "imbalance", "exposed_p2p", "exposed_allreduce"}
        assert sum(parts.values()) == pytest.approx(best["step_seconds"], rel=1e-12)
    assert report["winner"]["step_breakdown_seconds"] == report["ranked"][0]["step_breakdown_seconds"]


def test_cli_simulate_prints_and_carries_the_breakdown(capsys):
    common = ["simulate", "--model", "tiny-unet", "--pp", "2", "--schedule", "greedy_v_1f1b", "--cluster", "cpu-local"]
    assert main(common) == 0
    out = capsys.readouterr().out
    assert "step goes (pulse.sim.breakdown): step" in out and "no schedule of this placement beats" in out
    assert main([*common, "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    chosen = next(r for r in report["schedules"] if r["schedule"] == report["chosen"])
    assert sum(report["step_breakdown_seconds"].values()) == pytest.approx(chosen["step_seconds"], rel=1e-12)
    # the placement's bound holds every schedule simulated on it, split backward or not
    assert 0 < report["placement_bound_seconds"] <= min(r["step_seconds"] for r in report["schedules"])


def test_a_searched_v_is_priced_as_the_same_candidate_alone():
    """The search shares one placement between candidates; a V's must stay the V the planner
    makes (skips direct), not take a baseline's relayed transport: Hunyuan-DiT gives up
    crossing skips, so relaying them priced its V at pp=8 four times slower."""
    from pulse.tune.evaluate import evaluate
    req = _request("hunyuan-dit", "v100-pcie-10gbe-8x1", 8, folds=(1,))
    req = TuneRequest(req.spec, req.cluster, 8, req.memory_budget, microbatch_sizes=(1,), folds=(1,))
    result = tune(req, exhaustive=True, workers=1)
    vs = [e for e in result.ranked + result.rejected if e.candidate.folds == 1 and e.candidate.pp == 8]
    assert vs
    for e in vs:
        alone = evaluate(req.spec, AnalyticProfiler(req.cluster.hardware).profile(req.spec, 1), req.cluster,
                         e.candidate, req.memory_budget)
        assert e.placement.skip_transport == "direct"
        assert e.p2p_bytes_per_iteration == alone.p2p_bytes_per_iteration
        assert e.iteration_time == pytest.approx(alone.iteration_time, rel=1e-12)


def test_the_bound_holds_each_chunks_bucket_all_reduces_and_each_ranks_outbound_link():
    """Two terms a step cannot beat, each tight where it rules (pulse.tune.bounds):
    - a chunk's buckets run one after another from no earlier than its last backward's start, which follows
      all its microbatches' work: SD v2 pp 2 x dp 4 on 10 GbE all-reduces ~1.9 s of the decoder chunk's
      gradients after it (the last bucket alone bounded the step at 0.53 s of its 2.43);
    - a rank's messages share its one outbound link, each transfer's from when its first microbatch's is made,
      and the last one's receiver still runs after it: a sequential pp 2 at 200 MB/s sends 0.47 s a step from
      each rank (the compute and fill bounded it at 0.40 s of its 0.78, all sends from the first output at
      0.55, the sends as a ramp at 0.59);
    - a rank's buckets share its link too, each chunk's from the start of its last backward, which the last
      microbatch reaches only after every microbatch went through the busiest task before it: SD v2 pp 4 x
      dp 4 as a two-fold wave on 910A 2x8 (M 8) all-reduces 909 MB from device 3 after its pipeline (each
      chunk's buckets alone, from its own work, bounded it at 64.7 ms of its 130.1)."""
    from pulse.tune.evaluate import evaluate

    spec = get_spec("sd2-unet")
    slow_nics = load_cluster("v100-pcie-10gbe-8x1")
    slow_link = load_cluster("v100-pcie-1x8").with_link_bandwidth(2e8)
    for cluster, cand, dp, least in ((slow_nics, Candidate("pulse", 2, 4, 1, 16, 1, "pulse", "zero_bubble_v",
                                                           skip_transport="direct"), 4, 0.7),
                                     (slow_link, Candidate("sequential", 2, 1, 1, 8, 0, "sequential", "1f1b"), 1, 0.75),
                                     (load_cluster("ascend-910a-2x8"), Candidate("pulse", 4, 4, 1, 8, 2, "pulse",
                                      "zero_bubble_v", skip_transport="direct"), 4, 0.7)):
        costs = AnalyticProfiler(cluster.hardware).profile(spec, 1)
        e = evaluate(spec, costs, cluster, cand, 30 * GiB)
        bound = placement_bound(spec, e.placement, costs, cluster, cand, StepTerms(dp=dp, grad_bytes=2))
        assert least * e.iteration_time <= bound <= e.iteration_time, cand.label


def test_the_bound_holds_a_v_devices_late_chunk_as_a_ramp():
    """A V's outer devices hold the model's first layers and its last: their decoder chunk cannot start
    before the first microbatch has come down the whole forward. SD v2 at pp 16 on 910A 2x8 (batch 32), on
    the headline's fitted layers: device 1 holds one light encoder layer and 60 ms of decoder work that
    starts after 9 ms of forward; the earliest head alone bounded the step at 65.7 ms of its 75.6
    (pulse.sim.bounds.ramp)."""
    from pulse.tune.evaluate import evaluate

    fitted = {"split_resnets": "down0_res1,down1_res0,down2_res0,down3_res1,mid_res0,up1_res0,up1_res2,up2_res0,"
                               "up2_res2,up3_res2", "split_transformers": "down0_attn0,up2_attn2,up3_attn0"}
    spec, cluster = get_spec("sd2-unet", **fitted), load_cluster("ascend-910a-2x8")
    costs = AnalyticProfiler(cluster.hardware).profile(spec, 1)
    cand = Candidate("pulse", 16, 1, 1, 32, 1, "pulse", "zero_bubble_v", skip_transport="direct")
    e = evaluate(spec, costs, cluster, cand, 30 * GiB)
    bound = placement_bound(spec, e.placement, costs, cluster, cand, StepTerms(dp=1, grad_bytes=2))
    forward_before = [0.0]
    for f in costs.fwd:
        forward_before.append(forward_before[-1] + f)
    late = max(forward_before[chunk.start] + cand.num_microbatches * sum(costs.span(chunk.start, chunk.end))
               for chunk in (e.placement.chunks[max(e.placement.chunks_of(d))] for d in range(16)))
    assert late <= bound <= e.iteration_time
