"""Validation errors: a one-line headline, then the Step x Device grid with the culprit marked."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
from test_schedule_helpers import cluster, sequential, unet, uniform_costs, wave

from pulse.errors import PlanError
from pulse.schedule.generators import gpipe, greedy_v_1f1b, one_f_one_b, zero_bubble_v
from pulse.schedule.ir import Action, Schedule
from pulse.schedule.passes import add_send_recv
from pulse.schedule.validate import (MARK, _check_comm_pairs, _check_comm_positions, _comm_fine, _ready_fn,
                                     check_progress, fail, validate)
from pulse.sim import simulate


def rows(text: dict[int, str], m: int = 1, name: str = "hand") -> Schedule:
    return Schedule(name, m, {d: tuple(Action.parse(t, d) for t in row.split()) for d, row in text.items()})


def error_of(schedule, placement, **kw) -> str:
    with pytest.raises(PlanError) as err:
        validate(schedule, placement, schedule.num_microbatches, **kw)
    return str(err.value)


CYCLIC = {0: "0F0 0B0 0F1 0B1", 1: "1F1 1B1 1F0 1B0"}  # 0B0 needs 1B0, behind 1F1, which needs 0F1


def test_cyclic_schedule_is_marked():
    message = error_of(rows(CYCLIC, m=2), sequential(2))
    first, *grid = message.splitlines()
    assert first.startswith("schedule deadlocks") and "ERROR HERE" in message
    assert grid[0].startswith("Step | Dev 0")
    assert grid[1].split("|")[2].strip() == "1F1 <-- ERROR HERE"  # step 0 of device 1
    assert grid[2].split("|")[1].strip() == "0B0 <-- ERROR HERE"  # step 1 of device 0
    assert sum(MARK in line for line in grid) == 2


def test_backward_before_forward_on_a_device():
    message = error_of(rows({0: "0B0 0F0", 1: "1F0 1B0"}), sequential(2))
    assert message.splitlines()[0] == "0B0 comes before 0F0 on device 0"
    assert "0F0 <-- ERROR HERE (its F)" in message


def test_simulator_reports_deadlock_instead_of_hanging():
    spec, placement = unet(2), sequential(2)
    with pytest.raises(PlanError) as err:
        simulate(spec, placement, rows(CYCLIC, m=2), uniform_costs(spec), cluster())
    assert str(err.value).startswith("schedule deadlocks") and "ERROR HERE" in str(err.value)


def test_schedule_file_missing_a_microbatch_fails(tmp_path):
    placement = sequential(3)
    path = tmp_path / "s.yaml"
    one_f_one_b(placement, 4).save(path)
    text = path.read_text().replace(" 2B3", "")
    path.write_text(text)
    message = error_of(Schedule.load(path), placement)
    assert message.splitlines()[0] == "schedule lacks 2B3 (chunk 2, microbatch 3) on device 2"
    assert "ERROR HERE (missing 2B3)" in message


@pytest.mark.parametrize("text,m,headline", [
    ({0: "0F0 0B0 0F0", 1: "1F0 1B0"}, 1, "appears twice"),
    ({0: "0F0 0B0 1F0", 1: "1B0"}, 1, "lives on device 1"),
    ({0: "0F0 0B0 0F7", 1: "1F0 1B0"}, 1, "names microbatch 7"),
    ({0: "0F0 0B0 5F0", 1: "1F0 1B0"}, 1, "names chunk 5"),
    ({0: "0F0 0B0 0W0", 1: "1F0 1B0"}, 1, "lacks 1W0"),
    ({0: "0F0 0W0 0B0", 1: "1F0 1B0 1W0"}, 1, "0W0 comes before 0B0"),
])
def test_malformed_schedules(text, m, headline):
    message = error_of(rows(text, m), sequential(2))
    assert headline in message.splitlines()[0] and MARK in message


def test_wrong_microbatch_count_and_device():
    with pytest.raises(PlanError, match="for 4 microbatches, expected 3"):
        validate(gpipe(sequential(2), 4), sequential(2), 3)
    with pytest.raises(PlanError, match="device 2"):
        validate(gpipe(sequential(3), 2), sequential(2), 2)


@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
def test_send_recv_schedules_validate_with_comm(make):
    spec, placement = unet(4), sequential(4)
    full = add_send_recv(make(placement, 4), spec, placement)
    validate(full, placement, 4, with_comm=True)
    validate(full, placement, 4)  # compute checks ignore the messages


@pytest.mark.parametrize("make", [greedy_v_1f1b, zero_bubble_v])
def test_v_send_recv_validates_with_comm(make):
    spec, placement = unet(8), wave(4)
    validate(add_send_recv(make(placement, 6), spec, placement), placement, 6, with_comm=True)


def test_missing_receive_and_misplaced_messages():
    spec, placement = unet(2), sequential(2)
    full = add_send_recv(gpipe(placement, 2), spec, placement)
    dropped = Schedule("x", 2, {0: full.actions[0], 1: tuple(a for a in full.actions[1] if a.text != "1RF1:0")})
    assert "1 matching receive" not in (msg := error_of(dropped, placement, with_comm=True))
    assert msg.splitlines()[0].startswith("send 0SF1:1 has 0 matching receive")
    row = list(full.actions[1])
    i = row.index(Action.parse("1RF0:0", 1))
    row[i], row[i + 1] = row[i + 1], row[i]  # receive after its consumer
    late = Schedule("x", 2, {0: full.actions[0], 1: tuple(row)})
    assert "comes after the compute that needs it" in error_of(late, placement, with_comm=True)


def test_receive_waiting_on_a_later_send_deadlocks():
    spec, placement = unet(2), sequential(2)
    full = add_send_recv(one_f_one_b(placement, 2), spec, placement)
    send, recv = Action.parse("0SF1:1", 0), Action.parse("1RF1:0", 1)
    zero, one = list(full.actions[0]), list(full.actions[1])
    zero.remove(send)
    zero.insert(zero.index(Action.parse("0B0", 0)) + 1, send)  # mb 1 leaves only after 0B0 ...
    one.remove(recv)
    one.insert(0, recv)  # ... but device 1 waits for it before computing mb 0
    message = error_of(Schedule("x", 2, {0: tuple(zero), 1: tuple(one)}), placement, with_comm=True)
    assert message.startswith("schedule deadlocks") and "1RF1:0 <-- ERROR HERE" in message


def test_quick_message_check_agrees_with_the_marking_one():
    """``check_comm`` answers in one pass and marks the culprit only on a failure: on programs with a
    message dropped, doubled, moved or pointed at a missing chunk, the two always agree."""
    spec, placement = unet(8), wave(4)
    full = add_send_recv(zero_bubble_v(placement, 4), spec, placement)
    rng = random.Random(3)
    verdicts = set()
    for _ in range(300):
        rows = {d: list(row) for d, row in full.actions.items()}
        for _ in range(rng.randrange(1, 3)):
            d = rng.choice(list(rows))
            row = rows[d]
            i = rng.randrange(len(row))
            change = rng.choice(["drop", "double", "move", "peer"])
            if change == "drop":
                del row[i]
            elif change == "double":
                row.insert(rng.randrange(len(row) + 1), row[i])
            elif change == "move":
                row.insert(rng.randrange(len(row) + 1), row.pop(i))
            elif row[i].peer is not None:
                row[i] = replace(row[i], peer=rng.choice([row[i].peer + 1, 99]))
        program = Schedule("x", 4, rows)
        try:
            _check_comm_pairs(program, placement)
            _check_comm_positions(program)
            marked = True
        except PlanError:
            marked = False
        assert _comm_fine(program, placement) == marked
        verdicts.add(marked)
    assert verdicts == {True, False}


def _stuck_by_replay(program, num_chunks):
    """The zero-cost run by its definition: sweep the rows, an action runs once its chain
    predecessors ran (compute) or once as many equal sends ran as equal receives before it."""
    from collections import Counter

    from pulse.schedule.deps import chain_edges
    preds = {}
    split = any(a.kind == "W" for a in program.all_actions())
    for pred, succ in chain_edges(num_chunks, program.num_microbatches, split):
        preds.setdefault(succ, []).append(pred)
    pos, done, ran, sends = {d: 0 for d in program.actions}, Counter(), set(), Counter()

    def ready(a):
        if a.is_compute:
            return all(p in ran for p in preds.get(a.task, ()))
        if a.kind[0] == "S":
            return True
        return sends[(a.kind[1], a.peer, a.chunk, a.microbatch)] > done[a]

    moved = True
    while moved:
        moved = False
        for d, row in program.actions.items():
            while pos[d] < len(row) and ready(row[pos[d]]):
                a = row[pos[d]]
                if a.is_compute:
                    ran.add(a.task)
                elif a.kind[0] == "S":
                    sends[(a.kind[1], a.chunk, a.peer, a.microbatch)] += 1
                done[a] += 1
                pos[d] += 1
                moved = True
    return {(d, pos[d]) for d, row in program.actions.items() if pos[d] < len(row)}


def test_zero_cost_run_stops_where_replaying_it_stops():
    """Programs with actions moved around their rows stop (or finish) where the definition does."""
    spec, placement = unet(8), wave(4)
    full = add_send_recv(greedy_v_1f1b(placement, 4), spec, placement)
    rng = random.Random(5)
    outcomes = set()
    for _ in range(200):
        rows = {d: list(row) for d, row in full.actions.items()}
        for _ in range(rng.randrange(1, 4)):
            row = rows[rng.choice(list(rows))]
            row.insert(rng.randrange(len(row) + 1), row.pop(rng.randrange(len(row))))
        program = Schedule("x", 4, rows)
        stuck = _stuck_by_replay(program, len(placement.chunks))
        ready = _ready_fn(program, len(placement.chunks), 4, True)
        if stuck:
            with pytest.raises(PlanError) as err:
                check_progress(program, ready, "stuck")
            assert str(err.value) == str(fail(program, "stuck", {s: "" for s in stuck}))
        else:
            check_progress(program, ready, "stuck")
        outcomes.add(bool(stuck))
    assert outcomes == {True, False}
