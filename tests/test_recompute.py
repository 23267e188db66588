"""Activation recomputation (``Plan.recompute``): the plan file, the price, the tuner's choice, the CLI.

The PyTorch gradients with and without recomputation are in ``test_torch_recompute.py``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_schedule_helpers import cluster, uniform_costs, unet, wave

from pulse.cli.common import load_model
from pulse.cli.main import main
from pulse.costs import AnalyticProfiler, CostTable
from pulse.errors import PulseError
from pulse.hardware import load_cluster, load_hardware
from pulse.partition import partition
from pulse.placement import from_cuts
from pulse.plan import Plan, load_plan, plan_from_dict
from pulse.schedule.generators import gpipe, greedy_v_1f1b, zero_bubble_v
from pulse.sim import simulate
from pulse.sim.memory import MemoryModel
from pulse.synth.caps import inflight_caps
from pulse.tune.tuner import TuneRequest, tune
from pulse.yamlio import load_mapping
from pulse.zoo import get_spec

GiB = 2**30


def _hand_case() -> tuple:
    """Two chunks of two layers on two devices, every cost different so a mix-up shows."""
    spec = unet(4, out_bytes=100, skip_bytes=0, params=0)
    costs = CostTable("u", 1, ("l0", "l1", "l2", "l3"), fwd=(1.0, 2.0, 3.0, 4.0), bwd=(5.0, 6.0, 7.0, 8.0),
                      act_mem=(1000, 2000, 3000, 4000), source="test")
    placement = from_cuts("sequential", [0, 2, 4], [0, 1], 2, "relay", "test")
    return spec, costs, placement


def test_recompute_adds_each_chunks_forward_to_its_backward_by_hand() -> None:
    spec, costs, placement = _hand_case()
    schedule = gpipe(placement, 1)
    plain = simulate(spec, placement, schedule, costs, cluster())
    again = simulate(spec, placement, schedule, costs, cluster(), memory=MemoryModel(recompute={0, 1}))
    # one microbatch on an ideal network: F0 F1 B1 B0 in a row; B_c grows by chunk c's forward
    assert plain.makespan == pytest.approx((1 + 2) + (3 + 4) + (7 + 8) + (5 + 6))
    assert again.makespan == pytest.approx(plain.makespan + (1 + 2) + (3 + 4))
    assert again.span("B", 1, 0).end - again.span("B", 1, 0).start == pytest.approx(3 + 4 + 7 + 8)


def test_recompute_holds_inputs_only_and_one_rebuilt_graph_by_hand() -> None:
    spec, costs, placement = _hand_case()
    m = 3
    plain = simulate(spec, placement, gpipe(placement, m), costs, cluster())
    again = simulate(spec, placement, gpipe(placement, m), costs, cluster(), memory=MemoryModel(recompute={1}))
    # gpipe: all three forwards before any backward. Device 1 (layers l2, l3) held 3 x (3000 + 4000);
    # recomputing, it holds 3 inputs (l1's output, 100 B) and, from its first B on, one rebuilt graph
    assert plain.memory[1].activations == m * (3000 + 4000)
    assert again.memory[1].activations == m * 100 + (3000 + 4000)
    assert again.memory[0].activations == plain.memory[0].activations == m * (1000 + 2000)  # not recomputed
    assert again.busy[1] == pytest.approx(plain.busy[1] + m * (3 + 4)) and again.busy[0] == plain.busy[0]


def test_split_backward_keeps_the_rebuilt_graph_until_w() -> None:
    spec = unet(4, out_bytes=10, skip_bytes=0, params=0)
    placement = wave(2)
    costs = uniform_costs(spec, act=1000)
    result = simulate(spec, placement, zero_bubble_v(placement, 4), costs, cluster(),
                      memory=MemoryModel(recompute=frozenset(range(4))))
    for (kind, c, m) in [("B", 1, 0), ("W", 1, 0)]:
        assert result.span(kind, c, m)  # both halves ran
    free = next(mk.time for mk in result.marks if (mk.kind, mk.chunk, mk.microbatch) == ("FREE", 1, 0))
    assert free >= result.span("W", 1, 0).end  # the FREE (and the rebuilt graph) waits for W


def test_caps_count_inputs_per_microbatch_plus_one_rebuilt_graph() -> None:
    spec, costs, placement = _hand_case()
    plain = inflight_caps(spec, placement, costs, 20_000, MemoryModel())
    again = inflight_caps(spec, placement, costs, 20_000, MemoryModel(recompute={1}))
    messages = 100  # device 1's receive buffer for l1's output, per microbatch
    assert plain[1] == 20_000 // (7000 + messages)
    assert again[1] == (20_000 - 7000) // (100 + messages)


def test_plan_yaml_round_trip_and_old_files(tmp_path: Path) -> None:
    spec = get_spec("tiny-unet")
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, 1)
    placement = partition("pulse", spec, costs, 2)
    plan = Plan("tiny-unet", "cpu-local", 2, 1, 1, 4, "pulse", placement, greedy_v_1f1b(placement, 4),
                recompute=(3, 0))
    plan.save(tmp_path / "p.yaml", spec)
    loaded, _ = load_plan(tmp_path / "p.yaml", load_model)
    assert loaded == plan and loaded.recompute == (0, 3)
    data = load_mapping(tmp_path / "p.yaml")
    assert data["recompute"] == [0, 3]
    del data["recompute"]  # what a plan written before recomputation looks like
    assert plan_from_dict(data).recompute == ()
    Plan(**{**plan.__dict__, "recompute": ()}).save(tmp_path / "off.yaml", spec)
    assert "recompute" not in (tmp_path / "off.yaml").read_text()
    for bad, message in (([0, 0], "lists a chunk twice"), ([4], "names chunk 4"), (["a"], "must be a number"),
                         ("all", "must be a list")):
        with pytest.raises(PulseError, match=message):
            plan_from_dict({**data, "recompute": bad})


def _sd2_request(budget: int, recompute: bool = True) -> TuneRequest:
    return TuneRequest(get_spec("sd2-unet"), load_cluster("ascend-910a-1x8"), 32, budget,
                       microbatch_sizes=(8,), folds=(1,), recompute=recompute)


def test_tuner_recomputes_only_when_nothing_fits_without() -> None:
    roomy = tune(_sd2_request(1000 * GiB, recompute=False), exhaustive=True)  # every shape's memory
    least = min(e.peak_memory for e in roomy.ranked)
    roomy_winner = roomy.winner.candidate
    assert tune(_sd2_request(30 * GiB)).winner.candidate == roomy_winner  # it fits: recomputing is only slower
    edge = tune(_sd2_request(least))  # one shape fits as is; a faster one may fit recomputing: by step time
    plain = [e for e in edge.ranked if not e.candidate.recompute]
    assert plain and edge.winner.samples_per_s >= plain[0].samples_per_s
    tight = _sd2_request(least - 1)  # SD 2 at microbatch 8 just over a 910A-like budget
    result = tune(tight)
    assert all(e.candidate.recompute for e in result.ranked)  # nothing fits without
    winner = result.winner
    assert winner.candidate.recompute and winner.fits and winner.peak_memory < least
    # priced as the simulator prices the plan it writes
    costs = AnalyticProfiler(tight.cluster.hardware).profile(tight.spec, 8)
    again = simulate(tight.spec, winner.placement, winner.schedule, costs, tight.cluster,
                     memory=MemoryModel(recompute=frozenset(winner.candidate.recompute)))
    assert max(again.peak_memory) == winner.peak_memory
    plain = simulate(tight.spec, winner.placement, winner.schedule, costs, tight.cluster)
    assert again.makespan > plain.makespan and max(plain.peak_memory) > tight.memory_budget


def test_cli_simulate_and_train_plan_only_carry_recompute(tmp_path: Path, capsys) -> None:
    common = ["--model", "tiny-unet", "--pp", "2", "--schedule", "greedy_v_1f1b", "--cluster", "cpu-local"]
    assert main(["simulate", *common, "--format", "json"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert main(["simulate", *common, "--format", "json", "--recompute", "--out", str(tmp_path / "s.yaml")]) == 0
    on = json.loads(capsys.readouterr().out)
    assert on["recompute"] == [0, 1, 2, 3] and off["recompute"] == []
    row = {name: next(r for r in d["schedules"] if r["schedule"] == "greedy_v_1f1b") for name, d in
           (("off", off), ("on", on))}
    assert row["on"]["peak_memory_bytes"] < row["off"]["peak_memory_bytes"]
    assert row["on"]["pipeline_seconds"] > row["off"]["pipeline_seconds"]
    assert load_plan(tmp_path / "s.yaml")[0].recompute == (0, 1, 2, 3)
    assert main(["train", *common, "--recompute", "0,3", "--plan-only", "--out-dir", str(tmp_path / "t")]) == 0
    plan, _ = load_plan(tmp_path / "t" / "plan.yaml")
    assert plan.recompute == (0, 3) and "recomputing chunks 0, 3" in capsys.readouterr().out
    assert main(["train", *common, "--backend", "mindspore", "--plan-only", "--out-dir", str(tmp_path / "m")]) == 0
    assert load_plan(tmp_path / "m" / "plan.yaml")[0].recompute == (0, 1, 2, 3)  # what MindSpore runs
    assert main(["simulate", *common, "--recompute", "7"]) == 2
    assert "--recompute names chunk 7" in capsys.readouterr().err
