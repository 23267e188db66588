"""The send/recv pass and the text / CSV / YAML / JSON round trips of generated schedules."""
from __future__ import annotations

import pytest
from test_schedule_helpers import cluster, interleaved, sequential, unet, uniform_costs, wave

from pulse.placement import from_cuts
from pulse.schedule.generators import BASELINES, applicable_baselines, one_f_one_b, zero_bubble_v
from pulse.schedule.ir import Action, Schedule
from pulse.schedule.passes import add_send_recv
from pulse.schedule.validate import validate
from pulse.sim import simulate
from pulse.spec import Layer, ModelSpec, SkipEdge
from pulse.traffic import skips_leaving_device, transfers


def neighbours(row, i):
    """The compute actions just before and after position i."""
    before = next((a for a in reversed(row[:i]) if a.is_compute), None)
    after = next((a for a in row[i + 1:] if a.is_compute), None)
    return before, after


def test_messages_sit_next_to_their_compute():
    spec, placement = unet(4, shared=True), sequential(4, "direct")
    full = add_send_recv(one_f_one_b(placement, 3), spec, placement)
    for row in full.actions.values():
        for i, a in enumerate(row):
            before, after = neighbours(row, i)
            want = {"SF": ("F", before), "SB": ("B", before), "RF": ("F", after), "RB": ("B", after)}.get(a.kind)
            if want:
                kind, compute = want
                assert (compute.kind, compute.chunk, compute.microbatch) == (kind, a.chunk, a.microbatch)


def test_one_pair_per_transfer_per_microbatch():
    spec, placement, m = unet(4), sequential(4, "direct"), 5
    full = add_send_recv(one_f_one_b(placement, m), spec, placement)
    sends = sorted((a.chunk, a.peer) for a in full.all_actions() if a.kind == "SF")
    assert sends == sorted((t.src_chunk, t.dst_chunk) for t in transfers(spec, placement) for _ in range(m))
    for kind in ("RF", "SB", "RB"):
        assert sum(a.kind == kind for a in full.all_actions()) == len(sends)
    assert any(a.peer != a.chunk + 1 for a in full.all_actions() if a.kind == "SF")  # direct skip
    assert add_send_recv(full, spec, placement) == full


def test_v_placement_moves_no_skip():
    spec, placement = unet(8), wave(4)
    assert skips_leaving_device(spec, placement) == []
    assert all(not t.skips for t in transfers(spec, placement))
    schedule = add_send_recv(zero_bubble_v(placement, 4), spec, placement)
    validate(schedule, placement, 4, with_comm=True)
    result = simulate(spec, placement, schedule, uniform_costs(spec), cluster())
    assert result.messages and all(msg.skips == () for msg in result.messages)
    # skips l0->l7, l1->l6, l2->l5 wait on devices 0, 1, 2; device 3 holds the middle only
    assert [peak > 0 for peak in result.peak_skip_cache] == [True, True, True, False]


def test_adjacent_direct_skip_repeats_the_pair():
    layers = [Layer(f"l{i}", "x", 1, 1.0, 10, 0) for i in range(3)]
    spec = ModelSpec("adj", layers, [SkipEdge("l0", "l2", 5)])
    placement = from_cuts("sequential", [0, 1, 3], [0, 1], 2, "direct", "test")  # l0 | l1 l2
    full = add_send_recv(one_f_one_b(placement, 2), spec, placement)
    assert [a.text for a in full.actions[0]][:3] == ["0F0", "0SF0:1", "0SF0:1"]
    validate(full, placement, 2, with_comm=True)
    result = simulate(spec, placement, full, uniform_costs(spec), cluster())
    assert result.link_bytes == {(0, 1): 2 * 15, (1, 0): 2 * 15}


@pytest.mark.parametrize("placement", [sequential(4), interleaved(2, 2), wave(2), wave(2, 2)],
                         ids=["seq", "interleaved", "v", "wave"])
def test_generated_schedules_round_trip(placement, tmp_path):
    spec = unet(placement.num_layers)
    for name in applicable_baselines(placement, 4):
        compute = BASELINES[name](placement, 4, None)
        for schedule in (compute, add_send_recv(compute, spec, placement)):
            for a in schedule.all_actions():
                assert Action.parse(a.text, a.device) == a
            assert Schedule.from_csv(schedule.to_csv(), schedule.name, 4) == schedule
            assert Schedule.from_dict(schedule.to_dict()) == schedule
            for suffix in (".yaml", ".json", ".csv"):
                schedule.save(tmp_path / f"s{suffix}")
                assert Schedule.load(tmp_path / f"s{suffix}", name=schedule.name) == schedule
