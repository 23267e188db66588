from dataclasses import replace

import pytest

from pulse.costs import AnalyticProfiler, CostTable
from pulse.errors import PulseError
from pulse.hardware import Cluster, Hardware, available, load_cluster, load_hardware
from pulse.spec import Layer, ModelSpec

HW = Hardware("toy", peak_flops=1e12, efficiency=0.5, memory_bytes=10**9, hbm_bandwidth=1e11,
              intra_node_bandwidth=1e9, intra_node_latency=1e-5, inter_node_bandwidth=1e8,
              inter_node_latency=1e-4, devices_per_node=4, kernel_overhead=0.0)


def test_roofline_compute_and_memory_bound_layers():
    spec = ModelSpec("m", [Layer("gemm", "x", 0, 1e9, 100, 100), Layer("norm", "x", 0, 1.0, 10**7, 10**7)])
    table = AnalyticProfiler(HW).profile(spec, 2)
    # compute bound: 2 samples * 1e9 FLOPs / (0.5 * 1e12 FLOP/s)
    assert table.fwd[0] == pytest.approx(4e-3)
    assert table.bwd[0] == pytest.approx(8e-3)
    # memory bound: 2 * 2e7 bytes / 1e11 B/s
    assert table.fwd[1] == pytest.approx(4e-4)
    assert table.act_mem == (200, 2 * 10**7)
    assert table.span(0, 2) == pytest.approx((4.4e-3, 8.8e-3))


def test_cost_table_round_trip_and_mismatch(tmp_path):
    spec = ModelSpec("m", [Layer("a", "x", 1, 1e6, 1, 1), Layer("b", "x", 1, 2e6, 1, 1)])
    table = AnalyticProfiler(HW).profile(spec, 1)
    for name in ("t.yaml", "t.json"):
        table.save(tmp_path / name)
        assert CostTable.load(tmp_path / name) == table
    other = ModelSpec("n", [Layer("a", "x", 1, 1e6, 1, 1)])
    with pytest.raises(PulseError, match="does not match"):
        table.check_matches(other)
    with pytest.raises(PulseError, match="microbatch size"):
        AnalyticProfiler(HW).profile(spec, 0)


def test_links_inside_and_across_nodes():
    cluster = Cluster("c", HW, nodes=2)
    assert cluster.num_devices == 8
    assert cluster.transfer_time(0, 3, 1e9) == pytest.approx(1e-5 + 1.0)
    assert cluster.transfer_time(3, 4, 1e8) == pytest.approx(1e-4 + 1.0)
    assert cluster.transfer_time(2, 2, 1e9) == 0.0


def test_shipped_hardware_carries_sources_for_every_figure():
    assert {"ascend-910a", "v100-sxm2", "v100-pcie", "cpu-local"} <= set(available("hardware"))
    for name in available("hardware"):
        hw = load_hardware(name)
        assert hw.sources, name
        assert "peak_flops" in hw.sources and "intra_node_bandwidth" in hw.sources
    ascend = load_hardware("ascend-910a")
    assert ascend.memory_bytes == 32 * 2**30 and ascend.peak_flops == 256e12
    assert ascend.intra_node_bandwidth == 30e9 and ascend.devices_per_node == 8
    assert load_cluster("ascend-910a-2x8").num_devices == 16


def test_bad_hardware_names_and_files(tmp_path):
    with pytest.raises(PulseError, match="unknown hardware 'tpu9'.*known: ascend-910a"):
        load_hardware("tpu9")
    bad = tmp_path / "hw.yaml"
    bad.write_text("name: x\npeak_flops: 1\n")
    with pytest.raises(PulseError, match="hw.yaml: missing key"):
        load_hardware(str(bad))


def test_measured_halves_and_optimizer_round_trip_and_are_checked(tmp_path) -> None:
    import pytest as _pytest

    from pulse.costs import BACKWARD_INPUT_FRACTION, CostTable
    from pulse.errors import PulseError

    table = CostTable("m", 2, ("a", "b", "c"), (1.0, 2.0, 3.0), (2.0, 4.0, 6.0), (1, 2, 3), "measured:x",
                      bwd_input=(0.5, 1.0, 4.0), optimizer=(0.1, 0.2, 0.3))
    assert table.input_backward(0, 3) == _pytest.approx(5.5)
    assert table.weight_backward(0, 3) == _pytest.approx(12.0 - 5.5)
    assert table.optimizer_seconds(1, 3) == _pytest.approx(0.5)
    for suffix in (".yaml", ".json"):
        table.save(tmp_path / f"t{suffix}")
        assert CostTable.load(tmp_path / f"t{suffix}") == table
    plain = CostTable("m", 2, ("a",), (1.0,), (2.0,), (1,))
    assert plain.input_backward(0, 1) == BACKWARD_INPUT_FRACTION * 2.0 and plain.optimizer_seconds(0, 1) == 0
    assert "bwd_input" not in plain.to_dict()  # tables without measured halves stay as they were
    with _pytest.raises(PulseError, match="'bwd_input' exceeds 'bwd'"):
        CostTable("m", 2, ("a",), (1.0,), (2.0,), (1,), bwd_input=(3.0,))
    with _pytest.raises(PulseError, match="'optimizer' has 2 entries for 1 layers"):
        CostTable("m", 2, ("a",), (1.0,), (2.0,), (1,), optimizer=(1.0, 1.0))
    bad = {**table.to_dict(), "optimizer": [0.1, "x", 0.3]}
    with _pytest.raises(PulseError, match=r"optimizer\[1\]"):
        CostTable.from_dict(bad)
    assert "whole_backward_in_b" not in table.to_dict()  # PyTorch's tables stay as they were
    mindspore = replace(table, whole_backward_in_b=True)
    assert CostTable.from_dict(mindspore.to_dict()) == mindspore
    with _pytest.raises(PulseError, match="'whole_backward_in_b' must be true or false"):
        CostTable.from_dict({**table.to_dict(), "whole_backward_in_b": "yes"})


def test_split_backward_prices_the_walk_where_autograd_repeats_it() -> None:
    from pulse.costs import CostTable

    t = CostTable("m", 1, ("a", "b", "c"), (1.0,) * 3, (4.0, 6.0, 8.0), (0,) * 3, bwd_input=(1.0, 2.0, 3.0))
    # B: every input half, keeping the gradients W starts from; W: every weight half (3 + 4 + 5)
    assert t.split_backward(0, 3) == (6.0, 12.0)
    # the first chunk: B has nothing to do, so W walks from the outputs, the input halves after
    # the first layer (2 + 3) again
    assert t.split_backward(0, 3, input_grads=False) == (0.0, 17.0)
    assert t.split_backward(1, 2) == (2.0, 4.0)  # one layer: nothing is walked twice
    # MindSpore's vjp: B computes both halves whatever the chunk (bwd_input measured that), W adds up
    ms = replace(t, bwd_weight=(0.1, 0.1, 0.1), whole_backward_in_b=True)
    assert ms.split_backward(0, 3) == ms.split_backward(0, 3, input_grads=False) == (6.0, pytest.approx(0.3))
    # and its whole backward runs that B then that W: their sum, not the separately timed column
    assert ms.span(0, 3) == (3.0, pytest.approx(6.3)) and t.span(0, 3) == (3.0, 18.0)


def test_measured_weight_halves_count_the_inner_walk(tmp_path) -> None:
    from pulse.costs import CostTable

    # a one-layer W measured above bwd - bwd_input: autograd walked the layer's inside twice
    t = CostTable("m", 1, ("a", "b"), (1.0, 1.0), (4.0, 6.0), (0, 0), bwd_input=(1.0, 2.0), bwd_weight=(3.5, 5.0))
    assert t.weight_backward(0, 2) == 8.5
    assert t.split_backward(0, 2) == (3.0, 8.5)
    assert t.split_backward(0, 2, input_grads=False) == (0.0, 8.5 + 2.0)
    t.save(tmp_path / "t.yaml")
    assert CostTable.load(tmp_path / "t.yaml") == t


def test_per_action_seconds_are_counted_once_per_chunk(tmp_path) -> None:
    """One-layer figures each hold an action's fixed cost once; a chunk of n layers holds it once too."""
    names = ("a", "b", "c", "d")
    table = CostTable("m", 1, names, (1.0, 2.0, 3.0, 4.0), (2.0, 2.0, 2.0, 2.0), (0, 0, 0, 0),
                      bwd_input=(1.0, 1.0, 1.0, 1.0), bwd_weight=(1.5, 1.5, 1.5, 1.5),
                      per_action=(("F", 0.5), ("B", 0.25), ("Bi", 0.1), ("W", -0.2)))
    assert table.span(0, 1) == (1.0, 2.0)  # one layer: as measured
    assert table.span(1, 4) == pytest.approx((9.0 - 2 * 0.5, 6.0 - 2 * 0.25))
    # the fitted W holds the walk again through the chunk's activations: no separate term
    assert table.split_backward(1, 4) == pytest.approx((3.0 - 2 * 0.1, 4.5 + 2 * 0.2))
    assert table.split_backward(0, 4, input_grads=False)[0] == 0.0
    path = tmp_path / "costs.yaml"
    table.save(path)
    assert CostTable.load(path) == table
    with pytest.raises(PulseError, match="unknown kinds"):
        CostTable("m", 1, names, table.fwd, table.bwd, table.act_mem, per_action=(("X", 1.0),))
    # the optimizer steps a chunk in one call: its fixed cost (O) counted once per chunk
    stepped = CostTable("m", 1, names, table.fwd, table.bwd, table.act_mem, optimizer=(0.5, 0.5, 0.5, 0.5),
                        per_action=(("O", 0.2),))
    assert stepped.optimizer_seconds(0, 1) == 0.5
    assert stepped.optimizer_seconds(0, 4) == pytest.approx(4 * 0.5 - 3 * 0.2)
    stepped.save(path)
    assert CostTable.load(path) == stepped
    assert CostTable("m", 1, names, table.fwd, table.bwd, table.act_mem).optimizer_seconds(0, 4) == 0.0
    # without a fit, nothing changes: sums, and only the first chunk's W adds the input halves it walks again
    plain = CostTable("m", 1, names, table.fwd, table.bwd, table.act_mem, bwd_input=table.bwd_input,
                      bwd_weight=table.bwd_weight)
    assert plain.span(1, 4) == (9.0, 6.0)
    assert plain.split_backward(1, 4) == pytest.approx((3.0, 4.5))
    assert plain.split_backward(1, 4, input_grads=False) == pytest.approx((0.0, 4.5 + 2.0))


def test_cold_start_seconds_round_trip_and_are_checked(tmp_path) -> None:
    names = ("a", "b")
    table = CostTable("m", 1, names, (1.0, 1.0), (2.0, 2.0), (0, 0), cold_start=(("F", 1e-4), ("Bi", 2e-4)))
    assert table.cold_start_seconds("F") == 1e-4 and table.cold_start_seconds("W") == 0.0
    path = tmp_path / "costs.yaml"
    table.save(path)
    assert CostTable.load(path) == table
    assert "cold_start" not in CostTable("m", 1, names, (1.0, 1.0), (2.0, 2.0), (0, 0)).to_dict()
    with pytest.raises(PulseError, match="'cold_start' has unknown kinds"):
        CostTable("m", 1, names, table.fwd, table.bwd, table.act_mem, cold_start=(("O", 1.0),))
    path.write_text(path.read_text().replace("0.0001", "-0.0001"))
    with pytest.raises(PulseError, match="cold_start"):
        CostTable.load(path)


def test_every_device_but_layer_zeros_makes_its_own_batch_in_its_first_chunk() -> None:
    """D (a device's own copy of a microbatch's batch) lands on the first chunk of every device
    except the one holding layer 0, whose one-layer figure holds it already; once per device."""
    from pulse.placement import from_cuts
    from pulse.schedule.deps import task_durations

    names = tuple("abcdef")
    table = CostTable("m", 1, names, (1.0,) * 6, (2.0,) * 6, (0,) * 6, per_action=(("D", 0.25),))
    assert table.batch_seconds() == 0.25
    v = from_cuts("v", [0, 1, 3, 5, 6], [0, 1, 1, 0], 2, "direct", "test")  # a V over two devices
    durations = task_durations(v, table, split_backward=False)
    assert [durations[("F", c)] for c in range(4)] == [1.0, 2.25, 2.0, 1.0]
    assert [durations[("B", c)] for c in range(4)] == [2.0, 4.0, 4.0, 2.0]
    over_three = from_cuts("v", [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 2, 1, 0], 3, "direct", "test")
    durations = task_durations(over_three, table, split_backward=False)
    assert [durations[("F", c)] for c in range(6)] == [1.0, 1.25, 1.25, 1.0, 1.0, 1.0]
    plain = CostTable("m", 1, names, table.fwd, table.bwd, table.act_mem)  # not measured: nothing added
    assert task_durations(v, plain, split_backward=False)[("F", 1)] == 2.0
