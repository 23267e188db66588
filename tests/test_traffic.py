"""Bytes crossing devices, checked against hand counts on a 6-layer U."""
from pulse.placement import Chunk, Placement, from_cuts, interleaved_devices, wave_devices
from pulse.spec import Layer, ModelSpec, SharedInput, SkipEdge
from pulse.traffic import skips_leaving_device, summarize, transfers

#   l0 -> l1 -> l2 -> l3 -> l4 -> l5 ; skips l0->l5 (50 B), l1->l4 (40 B); temb made by l0 (3 B)
SPEC = ModelSpec(
    "u6",
    [Layer(f"l{i}", "x", 1, 1.0, 10 + i, 0) for i in range(6)],
    [SkipEdge("l0", "l5", 50), SkipEdge("l1", "l4", 40)],
    [SharedInput("temb", 3, "l0"), SharedInput("context", 7)],
)


def test_sequential_relays_every_skip_across_every_boundary_it_spans():
    placement = from_cuts("sequential", [0, 2, 4, 6], [0, 1, 2], 3, "relay", "test")
    msgs = transfers(SPEC, placement)
    assert [(m.src_device, m.dst_device) for m in msgs] == [(0, 1), (1, 2)]
    # boundary before l2: main = l1 out (11), skips l0->l5 and l1->l4 (90), temb (3); context never moves
    assert (msgs[0].main_bytes, msgs[0].skip_bytes, msgs[0].shared_bytes) == (11, 90, 3)
    assert (msgs[1].main_bytes, msgs[1].skip_bytes, msgs[1].shared_bytes) == (13, 90, 3)
    report = summarize(SPEC, placement)
    assert report.forward_bytes == 11 + 90 + 3 + 13 + 90 + 3
    assert report.total_bytes == 2 * report.forward_bytes
    assert skips_leaving_device(SPEC, placement) == ["l0->l5", "l1->l4"]


def test_v_placement_keeps_nested_skips_local():
    # chunks [l0] [l1] [l2 l3] [l4] [l5] on devices 0 1 | 1 ... a P=2 V: 0,1,1,0
    placement = from_cuts("v", [0, 2, 3, 4, 6], [0, 1, 1, 0], 2, "direct", "test")
    msgs = transfers(SPEC, placement)
    assert [(m.src_chunk, m.dst_chunk) for m in msgs] == [(0, 1), (2, 3)]
    assert [m.skip_bytes for m in msgs] == [0, 0]
    assert [m.main_bytes for m in msgs] == [11, 13]
    assert [m.shared_bytes for m in msgs] == [3, 0]  # device 0 made temb: the decoder side resends nothing
    assert skips_leaving_device(SPEC, placement) == []


def test_direct_transport_sends_a_broken_skip_once():
    # l1->l4 breaks: l1 on device 1, l4 on device 0
    placement = from_cuts("v", [0, 1, 3, 4, 6], [0, 1, 1, 0], 2, "direct", "test")
    msgs = transfers(SPEC, placement)
    direct = [m for m in msgs if m.main_bytes == 0]
    assert [(m.src_chunk, m.dst_chunk, m.skip_bytes, m.skips) for m in direct] == [(1, 3, 40, ("l1->l4",))]
    assert skips_leaving_device(SPEC, placement) == ["l1->l4"]


def test_consecutive_chunks_on_one_device_send_nothing():
    placement = Placement("wave", 1, (Chunk(0, 3, 0), Chunk(3, 6, 0)), "direct")
    assert transfers(SPEC, placement) == []


def test_device_patterns():
    assert wave_devices(4, 1) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert wave_devices(2, 2) == [0, 1, 1, 0, 0, 1, 1, 0]
    assert interleaved_devices(2, 2) == [0, 1, 0, 1]


#   l0 .. l9, no skips; temb made by l0 (3 B), cond made by l3 (5 B), main path out l_i = 10 + i
SPEC10 = ModelSpec(
    "u10",
    [Layer(f"l{i}", "x", 1, 1.0, 10 + i, 0) for i in range(10)],
    [],
    [SharedInput("temb", 3, "l0"), SharedInput("cond", 5, "l3"), SharedInput("context", 7)],
)


def _shared(placement):
    return [(m.src_chunk, m.dst_chunk, m.main_bytes, m.shared_bytes, m.shared)
            for m in transfers(SPEC10, placement)]


def test_v_sends_a_produced_shared_input_once_per_device():
    # chunks [l0 l1] [l2 l3] [l4] [l5] [l6 l7] [l8 l9] on devices 0 1 2 2 1 0; cond made on device 1
    placement = from_cuts("v", [0, 2, 4, 5, 6, 8, 10], wave_devices(3, 1), 3, "direct", "test")
    assert _shared(placement) == [
        (0, 1, 11, 3, ("temb",)),           # device 1 gets temb for the first time
        (1, 2, 13, 8, ("temb", "cond")),    # device 2: both, first time
        (3, 4, 15, 0, ()),                  # device 1 holds temb and made cond
        (4, 5, 17, 5, ("cond",)),           # device 0 holds temb; cond arrives first on its decoder side
    ]
    assert summarize(SPEC10, placement).shared_bytes == 16  # relayed it would be 3 + 8 + 8 + 8 = 27
    relay = from_cuts("v", [0, 2, 4, 5, 6, 8, 10], wave_devices(3, 1), 3, "relay", "test")
    assert [m.shared_bytes for m in transfers(SPEC10, relay)] == [3, 8, 8, 8]


def test_wave_sends_a_produced_shared_input_once_per_device():
    # chunks [l0] [l1] [l2] [l3 l4] [l5] [l6] [l7] [l8 l9] on devices 0 1 1 0 0 1 1 0; cond made on device 0
    placement = from_cuts("wave", [0, 1, 2, 3, 5, 6, 7, 8, 10], wave_devices(2, 2), 2, "direct", "test")
    assert _shared(placement) == [
        (0, 1, 10, 3, ("temb",)),  # device 1 gets temb, once for all its four chunks
        (2, 3, 12, 0, ()),         # device 0 made temb; cond is not made yet
        (4, 5, 15, 5, ("cond",)),  # device 1 held only temb
        (6, 7, 17, 0, ()),         # device 0 made both
    ]
    report = summarize(SPEC10, placement)
    assert (report.main_bytes, report.shared_bytes, report.messages) == (54, 8, 4)
    relay = from_cuts("wave", [0, 1, 2, 3, 5, 6, 7, 8, 10], wave_devices(2, 2), 2, "relay", "test")
    assert [m.shared_bytes for m in transfers(SPEC10, relay)] == [3, 3, 8, 8]
