"""The discrete-event engine: traffic totals, link serialization, latency, determinism."""
from __future__ import annotations

import pytest
from test_schedule_helpers import cluster, sequential, unet, uniform_costs, wave

from pulse.errors import PlanError
from pulse.schedule.generators import OnLinks, gpipe, greedy_v_1f1b, one_f_one_b, zero_bubble_v
from pulse.schedule.passes import add_send_recv
from pulse.sim import simulate
from pulse.sim.memory import MemoryModel
from pulse.traffic import summarize, transfers


def test_sequential_relays_skips_and_link_bytes_match_traffic():
    spec, placement, m, mbs = unet(6, shared=True), sequential(6), 4, 2
    costs = uniform_costs(spec, mbs=mbs)
    result = simulate(spec, placement, one_f_one_b(placement, m), costs, cluster())
    for t in transfers(spec, placement):
        assert result.link_bytes[(t.src_device, t.dst_device)] == t.total_bytes * m * mbs
        assert result.link_bytes[(t.dst_device, t.src_device)] == t.total_bytes * m * mbs
    assert result.total_link_bytes == summarize(spec, placement).total_bytes * m * mbs
    assert any(msg.skips for msg in result.messages)  # relayed, riding the main message
    assert result.peak_skip_cache == (0,) * 6


def test_ideal_network_compute_and_full_schedule_time_the_same():
    spec, placement = unet(8), wave(4)
    schedule = greedy_v_1f1b(placement, 6)
    plain = simulate(spec, placement, schedule, uniform_costs(spec), cluster())
    full = simulate(spec, placement, add_send_recv(schedule, spec, placement), uniform_costs(spec), cluster())
    assert plain == full


def test_messages_serialize_on_a_link():
    # zero-cost compute, one 100-byte message per microbatch at 100 B/s: 1 s each
    spec, placement, m = unet(2, out_bytes=100, skip_bytes=0), sequential(2), 5
    costs = uniform_costs(spec, f=0.0, b=0.0)
    result = simulate(spec, placement, gpipe(placement, m), costs, cluster(bandwidth=100.0))
    forward = sorted(msg.end for msg in result.messages if msg.direction == "F")
    assert forward == pytest.approx([1.0, 2.0, 3.0, 4.0, 5.0])
    assert result.makespan == pytest.approx(2 * m)  # m activations out, then m gradients back


def test_latency_delays_the_consumer():
    spec, placement = unet(2, out_bytes=100, skip_bytes=0), sequential(2)
    net = cluster(bandwidth=100.0, latency=0.25)
    result = simulate(spec, placement, gpipe(placement, 1), uniform_costs(spec), net)
    assert result.span("F", 1, 0).start == pytest.approx(1.0 + 1.25)
    assert result.span("B", 0, 0).start == pytest.approx(result.span("B", 1, 0).end + 1.25)
    assert result.makespan == pytest.approx(3.0 + 3.0 + 2 * 1.25)


def test_busy_idle_and_bubble():
    spec, placement, m = unet(4), sequential(4), 8
    result = simulate(spec, placement, one_f_one_b(placement, m), uniform_costs(spec), cluster())
    assert result.busy == (m * 3.0,) * 4
    assert all(b + i == pytest.approx(result.makespan) for b, i in zip(result.busy, result.idle))
    assert result.bubble_ratio == pytest.approx(3 / 11)
    assert len(result.compute) == 2 * 4 * m
    assert "makespan" in result.summary()


def test_incomplete_or_oversized_input_fails_clearly():
    spec, placement = unet(4), sequential(4)
    with pytest.raises(PlanError, match="has 2"):
        simulate(spec, placement, gpipe(placement, 2), uniform_costs(spec), cluster(devices=2))
    partial = gpipe(placement, 2)
    partial = type(partial)("p", 2, {d: row[1:] if d == 3 else row for d, row in partial.actions.items()})
    with pytest.raises(PlanError, match="lacks 3F0"):
        simulate(spec, placement, partial, uniform_costs(spec), cluster())


def test_simulation_is_deterministic():
    spec, placement = unet(8), wave(4)
    schedule = greedy_v_1f1b(placement, 8)
    net = cluster(bandwidth=5e3, latency=0.01)
    assert simulate(spec, placement, schedule, uniform_costs(spec), net) == \
        simulate(spec, placement, schedule, uniform_costs(spec), net)


def test_a_lent_task_graph_times_as_a_built_one():
    """``links`` lends the graph its list schedules were ordered on; a recomputing variant builds its own."""
    spec, placement = unet(8), wave(4)
    net = cluster(bandwidth=5e3, latency=0.01)
    costs, links = uniform_costs(spec), OnLinks(spec, net)
    for schedule in (greedy_v_1f1b(placement, 8, costs, links=links),
                     zero_bubble_v(placement, 8, costs, links=links), gpipe(placement, 8)):
        for memory in (MemoryModel(), MemoryModel(recompute=frozenset({1, 6}))):
            assert simulate(spec, placement, schedule, costs, net, memory=memory, links=links) == \
                simulate(spec, placement, schedule, costs, net, memory=memory)
