"""The one lowering step: messages, frees and all-reduces, checked, round-tripping as text."""
from __future__ import annotations

import pytest
from test_schedule_helpers import cluster, interleaved, sequential, unet, uniform_costs, wave

from pulse.errors import PlanError, PulseError
from pulse.schedule.generators import BASELINES, applicable_baselines, gpipe, one_f_one_b, zero_bubble_v
from pulse.schedule.ir import Action, Schedule
from pulse.schedule.lower import lower
from pulse.schedule.passes import add_send_recv
from pulse.schedule.validate import check_marks, validate
from pulse.sim import simulate

PLACEMENTS = [sequential(4), interleaved(2, 2), wave(2), wave(2, 2)]


def rows(schedule: Schedule) -> dict[int, str]:
    return {d: " ".join(a.text for a in row) for d, row in schedule.actions.items()}


def parse(text: dict[int, str], num_mb: int) -> Schedule:
    return Schedule("hand", num_mb, {d: tuple(Action.parse(t, d) for t in r.split()) for d, r in text.items()})


def test_text_forms_of_free_and_all_reduce_round_trip():
    for text in ("5FREE0", "12AR7", "0FREE13"):
        action = Action.parse(text, device=1)
        assert action.text == text and not action.is_compute and not action.is_comm and action.is_mark
    assert Action.parse("3FREE2", 0) == Action(0, 3, 2, "FREE")
    for bad in ("3FREE2:1", "3AR", "AR3", "3FRE2"):
        with pytest.raises(PulseError):
            Action.parse(bad, 0)


def test_two_stage_1f1b_lowered_by_hand():
    spec, placement = unet(2, skip_bytes=0), sequential(2)
    program = lower(one_f_one_b(placement, 2), spec, placement)
    assert rows(program) == {
        0: "0F0 0SF0:1 0F1 0SF1:1 0RB0:1 0B0 0FREE0 0RB1:1 0B1 0AR1 0FREE1",
        1: "1RF0:0 1F0 1B0 1FREE0 1SB0:0 1RF1:0 1F1 1B1 1AR1 1FREE1 1SB1:0"}


@pytest.mark.parametrize("placement", PLACEMENTS, ids=["seq", "interleaved", "v", "wave"])
def test_every_baseline_lowers_to_a_checked_program_that_round_trips(placement, tmp_path):
    spec = unet(placement.num_layers)
    for name in applicable_baselines(placement, 4):
        compute = BASELINES[name](placement, 4, None)
        program = lower(compute, spec, placement)
        validate(program, placement, 4, with_comm=True)
        assert program.compute_only() == compute.compute_only()
        assert lower(program, spec, placement) == program  # idempotent: every pass replaces what it adds
        marks = [a for a in program.all_actions() if a.is_mark]
        assert sum(a.kind == "FREE" for a in marks) == len(placement.chunks) * 4
        assert sorted(a.chunk for a in marks if a.kind == "AR") == list(range(len(placement.chunks)))
        assert Schedule.from_dict(program.to_dict()) == program
        assert Schedule.from_csv(program.to_csv(), program.name, 4) == program
        program.save(tmp_path / "p.yaml")
        assert Schedule.load(tmp_path / "p.yaml") == program


def test_a_free_and_an_all_reduce_follow_the_compute_that_ends_their_need():
    spec, placement = unet(8), wave(4)
    program = lower(zero_bubble_v(placement, 4), spec, placement)  # split backward: W ends it
    for row in program.actions.values():
        for i, a in enumerate(row):
            if a.kind == "FREE":
                assert row[i - 1].kind in ("W", "AR") and row[i - 1 - (row[i - 1].kind == "AR")] == \
                    Action(a.device, a.chunk, a.microbatch, "W")
            if a.kind == "AR":
                later = [b for b in row[i + 1:] if b.chunk == a.chunk and b.is_compute]
                assert row[i - 1] == Action(a.device, a.chunk, a.microbatch, "W") and later == []


def test_a_deadlocking_compute_order_is_refused_before_any_message_is_added():
    spec, placement = unet(2, skip_bytes=0), sequential(2)
    broken = parse({0: "0F0 0B0", 1: "1B0 1F0"}, 1)
    with pytest.raises(PlanError, match=r"1B0 comes before 1F0") as err:
        lower(broken, spec, placement)
    assert "<-- ERROR HERE" in str(err.value)


def test_misplaced_or_missing_marks_are_named_with_the_grid():
    spec, placement = unet(2, skip_bytes=0), sequential(2)
    full = add_send_recv(gpipe(placement, 1), spec, placement)
    good = {0: "0F0 0SF0:1 0RB0:1 0B0 0AR0 0FREE0", 1: "1RF0:0 1F0 1B0 1AR0 1FREE0 1SB0:0"}
    check_marks(parse(good, 1), placement)
    cases = {
        "0FREE0 comes before the compute that last needs what it frees":
            {0: "0F0 0SF0:1 0FREE0 0RB0:1 0B0 0AR0", 1: good[1]},
        "0AR0 comes before the last compute that accumulates its gradients":
            {0: "0F0 0SF0:1 0AR0 0RB0:1 0B0 0FREE0", 1: good[1]},
        "device 1 lacks 1AR0": {0: good[0], 1: "1RF0:0 1F0 1B0 1FREE0 1SB0:0"},
        "action 0FREE0 appears twice": {0: good[0] + " 0FREE0", 1: good[1]},
    }
    for headline, text in cases.items():
        with pytest.raises(PlanError, match=headline) as err:
            validate(parse(text, 1), placement, 1, with_comm=True)
        assert "<-- ERROR HERE" in str(err.value)
    validate(full, placement, 1, with_comm=True)  # messages without marks: still a valid communication check


def test_an_all_reduce_must_name_the_microbatch_that_completes_the_gradients():
    placement = sequential(2)
    text = {0: "0F0 0F1 0B0 0FREE0 0B1 0AR0 0FREE1", 1: "1F0 1F1 1B0 1FREE0 1B1 1AR1 1FREE1"}
    with pytest.raises(PlanError, match=r"0AR0 names microbatch 0, but chunk 0's gradients become final with 0B1"):
        check_marks(parse(text, 2), placement)


def test_the_simulator_times_the_lowered_program_marks_included():
    spec, placement = unet(4), sequential(4)
    result = simulate(spec, placement, one_f_one_b(placement, 3), uniform_costs(spec), cluster())
    frees = {(m.chunk, m.microbatch): m.time for m in result.marks if m.kind == "FREE"}
    assert frees == {(c, m): result.span("B", c, m).end for c in range(4) for m in range(3)}
    launches = {m.chunk: m.time for m in result.marks if m.kind == "AR"}
    assert launches == {c: result.span("B", c, 2).end for c in range(4)}
