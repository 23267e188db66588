"""Views: a Gantt PNG and a Chrome trace of a simulated iteration."""
from __future__ import annotations

import json

from test_schedule_helpers import cluster, unet, uniform_costs, wave

from pulse.schedule.generators import zero_bubble_v
from pulse.sim import simulate
from pulse.views.timeline import draw_timeline
from pulse.views.trace import write_trace


def result_and_placement():
    spec, placement = unet(8), wave(4)
    net = cluster(bandwidth=1e4, latency=0.01)
    return simulate(spec, placement, zero_bubble_v(placement, 4), uniform_costs(spec), net), placement


def test_trace_has_compute_and_message_events(tmp_path):
    result, _ = result_and_placement()
    doc = json.loads(write_trace(result, tmp_path / "t.json").read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(result.compute) + len(result.messages)
    compute = [e for e in spans if e["tid"] == 0]
    assert {e["pid"] for e in compute} == {0, 1, 2, 3} and {e["cat"] for e in compute} == {"F", "B", "W"}
    first = min(compute, key=lambda e: e["ts"])
    assert first["name"] == "0F0" and first["dur"] == 1e6
    assert all(e["tid"] > 0 for e in spans if e["cat"] == "message")
    launches = [e for e in doc["traceEvents"] if e["ph"] == "i"]  # one AR per chunk; FREE is not drawn
    assert sorted(e["name"] for e in launches) == [f"{c}AR3" for c in range(8)]
    assert not any("FREE" in e["name"] for e in doc["traceEvents"] if "name" in e)
    last_w = {c: result.span("W", c, 3).end for c in range(8)}
    assert all(e["ts"] == last_w[int(e["name"][0])] * 1e6 and e["tid"] == 0 for e in launches)


def test_timeline_png(tmp_path):
    result, placement = result_and_placement()
    path = draw_timeline(result, placement, tmp_path / "g.png", "zb-v")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000
