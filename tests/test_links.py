"""Measured clusters: link costs and all-reduce curves in a YAML every command reads."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from pulse.errors import PulseError
from pulse.hardware import load_cluster, save_measured_cluster
from pulse.links import AllReduceCurve, LinkCost


def test_allreduce_curve_interpolates_between_and_extrapolates_beyond() -> None:
    curve = AllReduceCurve(2, (1000, 3000, 7000), (1.0, 2.0, 4.0))
    assert curve.time(10) == 1.0  # below the smallest size: its time (latency-bound)
    assert curve.time(2000) == pytest.approx(1.5)
    assert curve.time(5000) == pytest.approx(3.0)
    assert curve.time(9000) == pytest.approx(5.0)  # the last slope, 0.5 s per 1000 B
    with pytest.raises(PulseError, match="sizes must increase"):
        AllReduceCurve(2, (3000, 1000), (1.0, 2.0))


def test_measured_cluster_round_trips_and_falls_back_to_the_hardware(tmp_path) -> None:
    base = load_cluster("cpu-local")
    measured = type(base)(name="here", hardware=base.hardware, nodes=1, source="measured: test",
                          links={(0, 1): LinkCost(2e9, 1e-5, 3e-4, 1e-4)},
                          allreduce=(AllReduceCurve(2, (8, 1 << 20), (2e-4, 1e-3)),))
    path = tmp_path / "cluster.yaml"
    save_measured_cluster(measured, "cpu-local", path)
    back = load_cluster(str(path))
    assert back.link_cost(0, 1) == LinkCost(2e9, 1e-5, 3e-4, 1e-4)
    assert back.link(0, 1) == (2e9, 1e-5)
    assert back.pinned_cores and back.shared_cores == base.shared_cores
    save_measured_cluster(replace(measured, hardware=replace(base.hardware, pinned_cores=False)), "cpu-local", path)
    assert not load_cluster(str(path)).pinned_cores  # measured with PULSE_PIN_CORES=0: one pool of cores
    save_measured_cluster(replace(measured, hardware=replace(base.hardware, core_sharing=0.9)), "cpu-local", path)
    assert load_cluster(str(path)).hardware.core_sharing == 0.9
    assert not back.deferred_buckets and "deferred_buckets" not in path.read_text()
    save_measured_cluster(replace(measured, deferred_buckets=True, tensor_messages=True), "cpu-local", path)
    again = load_cluster(str(path))  # MindSpore's communicator
    assert again.deferred_buckets and again.tensor_messages and again.with_link_bandwidth(1e6).tensor_messages
    hw = base.hardware
    assert back.link_cost(1, 0).bandwidth == hw.intra_node_bandwidth  # not measured: the hardware's figure
    assert back.allreduce_seconds(8, 2) == pytest.approx(2e-4) and back.allreduce_seconds(8, 4) is None
    slow = back.with_link_bandwidth(1e6)
    assert slow.link_cost(0, 1) == LinkCost(1e6, 1e-5, 3e-4, 1e-4) and slow.link_cost(2, 3).bandwidth == 1e6


@pytest.mark.parametrize("bad, message", [
    ("links: [{src: 0, dst: 0, bandwidth: 1, latency: 0}]", "self-link"),
    ("links: [{src: 0, dst: 9, bandwidth: 1, latency: 0}]", r"ranks \[9\]"),
    ("links: [{src: 0, dst: 1, bandwidth: -1, latency: 0}]", "bandwidth"),
    ("links: [{src: 0, dst: 1, bandwidth: 1, latency: 0, speed: 3}]", "speed"),
    ("allreduce: [{ranks: 2, bytes: [1, 2], seconds: [1.0]}]", "as many sizes as times"),
    ("allreduce: {ranks: 2}", "must be a list"),
    ("shared_cores: 0", "shared_cores"),
    ("pinned_cores: 2", "pinned_cores' must be true or false"),
    ("core_sharing: 1.5", "at most 1"),
    ("core_sharing: 0", "core_sharing"),
    ("deferred_buckets: 1", "deferred_buckets' must be true or false"),
    ("tensor_messages: yes please", "tensor_messages' must be true or false"),
])
def test_bad_measured_cluster_is_one_line(tmp_path, bad: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"name: x\nhardware: cpu-local\nnodes: 1\n{bad}\n")
    with pytest.raises(PulseError, match=message) as info:
        load_cluster(str(path))
    assert "\n" not in str(info.value)


def test_a_mindspore_job_is_priced_as_its_communicator_and_backward_work() -> None:
    """What `pulse train --backend mindspore` prices: its communicator sums the data-parallel buckets
    after each rank's actions and sends a message per tensor (pulse_mindspore.comm), and its split
    backward does everything in B, whatever cluster and table the plan names."""
    from pulse.costs import CostTable
    from pulse_mindspore.traits import traits as mindspore_traits
    from pulse_torch.traits import traits as torch_traits

    costs = CostTable("m", 1, ("a", "b"), (1.0, 1.0), (2.0, 4.0), (0, 0), "analytic", (1.0, 2.0), (1.0, 2.0))
    cluster = load_cluster("cpu-local")
    ms_costs, ms_cluster = mindspore_traits(ascend=False).runs(costs, cluster)
    assert ms_cluster.deferred_buckets and ms_cluster.tensor_messages and ms_costs.whole_backward_in_b
    assert not mindspore_traits(ascend=True).runs(costs, cluster)[1].deferred_buckets  # HCCL: launched at AR
    # PyTorch's halves: MindSpore's B does the whole backward, on the first chunk too; its W adds up
    assert ms_costs.split_backward(0, 2, input_grads=False) == (6.0, 0.0)
    assert costs.split_backward(0, 2, input_grads=False) == (0.0, 3.0 + 2.0)  # weights, then layer 1 walked again
    torch_costs, torch_cluster = torch_traits().runs(costs, cluster)
    assert torch_costs is costs and torch_cluster is cluster
    measured = replace(costs, whole_backward_in_b=True)  # a MindSpore profile's: kept as measured
    assert mindspore_traits(ascend=False).runs(measured, cluster)[0] is measured
    assert measured.split_backward(0, 2, input_grads=False) == (3.0, 3.0)
    assert ms_costs.span(0, 2) == costs.span(0, 2) == (2.0, 6.0)  # converted: the whole backward unchanged


class _ClockRanks:
    """One rank whose all-reduce takes a scripted time on a fake clock (pulse.profiling.links' view)."""

    def __init__(self, seconds_of: dict[int, list[float]]) -> None:
        self.rank, self.world, self.now = 0, 1, 0.0
        self.seconds_of = {n: iter(v) for n, v in seconds_of.items()}
        self.calls: dict[int, int] = {}
        self.tensors = SimpleNamespace(from_numpy=lambda array: array)
        self.comm = SimpleNamespace(all_reduce=self._all_reduce)

    def _all_reduce(self, buf, group) -> None:
        nbytes = buf.size * 4
        self.calls[nbytes] = self.calls.get(nbytes, 0) + 1
        self.now += next(self.seconds_of[nbytes])

    def barrier(self) -> None:
        pass

    def max(self, values):
        return list(values)


def test_allreduce_curve_samples_each_size_until_its_samples_span_the_budget(monkeypatch) -> None:
    from pulse.profiling import links as probe

    # 1 KB: 0.5 ms each but a 10 ms stall as the 5th; every larger size 0.1 s each
    small = [0.0005] * 4 + [0.010] + [0.0005] * 2000
    script = {n: (small if n == 1024 else [0.1] * 100) for n in probe.SIZES}
    ranks = _ClockRanks(script)
    monkeypatch.setattr(probe.time, "perf_counter", lambda: ranks.now)
    curve = probe.allreduce_curve(ranks, [0], repeats=4)
    # 1 KB: a warm-up and 4 samples (3 x 0.5 ms and the stall: mean 2.875 ms), then on to
    # ceil(0.25 s / 2.875 ms) = 87 samples, the stall one of them
    assert probe.CURVE_SECONDS == 0.25 and ranks.calls[1024] == 1 + 87
    assert curve.seconds[0] == pytest.approx((0.010 + 86 * 0.0005) / 87)
    # 0.1 s each: the budget asks for 3 samples, fewer than the 4 repeats: no more
    assert ranks.calls[1 << 23] == 5 and curve.seconds[-1] == pytest.approx(0.1)


@pytest.mark.parametrize("pp, dp, sizes", [(2, 2, [2, 4]), (2, 1, [2]), (1, 4, [4]), (4, 2, [2, 4, 8]), (3, 3, [3, 9])])
def test_a_profile_measures_one_group_per_size_and_the_gradients_group_where_sizes_tie(tmp_path, pp, dp, sizes) -> None:
    """The curves are looked up by group size, and a cluster file listing a size twice is refused: `pulse
    profile --pp 2 --dp 2` wrote the pipeline's and the data-parallel group's 2-rank curves, and its own
    cluster.yaml could not be loaded (benchmarks/validate_dp.py found it)."""
    from pulse.layout import Layout
    from pulse.profiling.links import groups

    measured = groups(pp, dp)
    assert [len(g) for g in measured] == sizes
    assert Layout(pp, dp).stage_ranks(0) in measured or dp == 1  # the gradients' group, whatever the pipeline's size
    base = load_cluster("cpu-local")
    curves = tuple(AllReduceCurve(len(g), (8, 1 << 20), (2e-4, 1e-3)) for g in measured)
    save_measured_cluster(type(base)(name="here", hardware=base.hardware, nodes=1, source="measured: test",
                                     links={}, allreduce=curves), "cpu-local", tmp_path / "cluster.yaml")
    assert [c.ranks for c in load_cluster(str(tmp_path / "cluster.yaml")).allreduce] == sizes
