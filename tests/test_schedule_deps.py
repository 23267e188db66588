"""The task graph: tasks, durations, chain edges and message delays."""
from __future__ import annotations

import pytest
from test_schedule_helpers import cluster, sequential, unet, uniform_costs, wave

from pulse.errors import PlanError
from pulse.costs import BACKWARD_INPUT_FRACTION
from pulse.schedule.deps import build_dependencies
from pulse.traffic import transfers


def graph(placement, m=3, split=False, net=None, mbs=1):
    spec = unet(placement.num_layers, shared=True)
    net = net or cluster(bandwidth=1000.0, latency=0.5)
    return spec, build_dependencies(spec, placement, m, uniform_costs(spec, mbs=mbs), net, split_backward=split)


def test_tasks_and_durations():
    _, g = graph(sequential(4), m=3)
    assert len(g.tasks) == 4 * 3 * 2
    assert g.tasks[("F", 2, 1)].device == 2 and g.tasks[("F", 2, 1)].duration == 1.0
    assert g.tasks[("B", 2, 1)].duration == 2.0
    _, split = graph(sequential(4), m=3, split=True)
    assert len(split.tasks) == 4 * 3 * 3
    # one-layer chunks: B is the input half, W the weight half; the first chunk has no input to
    # differentiate, so its B is empty and W walks its whole backward (CostTable.split_backward)
    assert split.tasks[("B", 1, 0)].duration == pytest.approx(2.0 * BACKWARD_INPUT_FRACTION)
    assert split.tasks[("B", 1, 0)].duration + split.tasks[("W", 1, 0)].duration == pytest.approx(2.0)
    assert split.tasks[("B", 0, 0)].duration == 0.0
    assert split.tasks[("W", 0, 0)].duration == pytest.approx(2.0 * (1 - BACKWARD_INPUT_FRACTION))
    assert split.preds[("W", 1, 2)] == [(("B", 1, 2), 0.0)]


def test_chain_edges_carry_transfer_time():
    spec, g = graph(sequential(3), mbs=1)
    net = cluster(bandwidth=1000.0, latency=0.5)
    main = [t for t in transfers(spec, sequential(3)) if t.src_chunk == 0][0]
    delay = net.transfer_time(0, 1, main.total_bytes)
    assert (("F", 0, 1), delay) in g.preds[("F", 1, 1)]
    assert (("B", 1, 1), delay) in g.preds[("B", 0, 1)]
    assert (("F", 1, 1), 0.0) in g.preds[("B", 1, 1)]
    assert g.preds[("F", 0, 0)] == []
    _, double = graph(sequential(3), mbs=2)
    assert dict(double.preds[("F", 1, 1)])[("F", 0, 1)] == pytest.approx(0.5 + 2 * main.total_bytes / 1000.0)


def test_direct_skips_add_their_own_edges():
    spec, g = graph(sequential(4, "direct"))
    direct = [t for t in transfers(spec, sequential(4, "direct")) if t.dst_chunk != t.src_chunk + 1]
    assert direct
    for t in direct:
        assert ("F", t.src_chunk, 0) in dict(g.preds[("F", t.dst_chunk, 0)])
        assert ("B", t.dst_chunk, 0) in dict(g.preds[("B", t.src_chunk, 0)])


def test_v_graph_same_device_edges_are_free_and_acyclic():
    _, g = graph(wave(3))
    # chunk 2 and 3 share device 2: the turn of the V costs nothing
    assert dict(g.preds[("F", 3, 0)])[("F", 2, 0)] == 0.0
    assert len(g.topological_order()) == len(g.tasks)
    assert g.devices() == [0, 1, 2]


def test_bad_microbatch_count():
    with pytest.raises(PlanError, match="at least one microbatch"):
        graph(sequential(2), m=0)
