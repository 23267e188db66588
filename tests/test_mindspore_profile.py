"""`pulse profile --backend mindspore` on real msrun workers: a cost table and a measured cluster
taken by MindSpore's own cells, executor and communicator, that every command accepts.

Two CPU workers (mccl all-reduce, gloo send/recv as a MindSpore pipeline
uses here) profile tiny-uvit cut to 8 layers (MindSpore's PyNative CPU kernels
take ~0.5 s per microbatch of it), one repeat per figure, no warm-up, as two
data-parallel replicas (two microbatches in flight instead of a pipeline's four:
the suite's time budget; links and pairs are measured all the same). Every figure the simulator
reads must be there and make sense: per layer forward, whole and split
backward, optimizer; what an action costs once; the cold start after a
message; both links and the all-reduce curve; the host's cores shared
unpinned (msrun does not pin workers). Then `pulse simulate` must price a plan
with them. The refusals cost nothing to launch and are checked first.
Skipped without MindSpore, torch or msrun.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("mindspore")
pytest.importorskip("torch")

from pulse.cli.main import main  # noqa: E402
from pulse.cores import pins_cores  # noqa: E402
from pulse.costs import CostTable  # noqa: E402
from pulse.hardware import load_cluster  # noqa: E402
from pulse.launch_env import finished_mark, finished_marks  # noqa: E402

MSRUN = Path(sys.executable).parent / "msrun"
MODEL = ["--model", "tiny-uvit", "--model-option", "depth=3"]  # 8 layers: enough for the per-action fit


def test_mindspore_profile_refuses_what_it_cannot_measure_in_one_line(tmp_path: Path, capsys) -> None:
    images = tmp_path / "images"
    images.mkdir()
    out = ["--out-costs", str(tmp_path / "c" / "costs.yaml")]
    assert main(["profile", "--backend", "mindspore", *MODEL, "--images", str(images), *out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--images times a pipeline's frozen encoders" in err[0]
    assert not (tmp_path / "c").exists()  # nothing made before the refusal
    assert main(["profile", "--backend", "mindspore", *MODEL, "--device-timing", "synchronize", *out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device-timing synchronize" in err[0] and "--backend torch" in err[0]
    assert not (tmp_path / "c").exists()


def test_an_ascend_worker_times_its_layers_on_the_devices_events(monkeypatch) -> None:
    """Off a CPU a MindSpore worker's profile backend carries the device's clock: timing events recorded on
    the stream, their elapsed milliseconds read once the later one is reached. A CPU worker's has none."""
    import mindspore as ms
    from pulse_mindspore.profile_job import DeviceEvents, profiled_backend

    made = []

    class FakeEvent:
        def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
            self.enable_timing, self.recorded, self.synced, self.at = enable_timing, False, False, 3.0 * len(made)
            made.append(self)

        def record(self, stream=None) -> None:
            self.recorded = True

        def synchronize(self) -> None:
            self.synced = True

        def elapsed_time(self, end: "FakeEvent") -> float:
            assert end.synced
            return end.at - self.at
    monkeypatch.setattr(ms.runtime, "Event", FakeEvent)
    assert not hasattr(profiled_backend("CPU"), "device_clock")
    clock = profiled_backend("Ascend").device_clock
    assert isinstance(clock, DeviceEvents)
    start, end = clock.mark(), clock.mark()
    assert all(e.enable_timing and e.recorded for e in made)
    assert clock.seconds(start, end) == pytest.approx(3e-3)


@pytest.mark.skipif(not MSRUN.exists(), reason=f"no msrun next to {sys.executable}")
def test_profile_on_msrun_workers_writes_costs_and_links_that_simulate_accepts(tmp_path: Path, capsys) -> None:
    costs_path, cluster_path = tmp_path / "costs.yaml", tmp_path / "cluster.yaml"
    logs = tmp_path / "msrun_logs"
    logs.mkdir()
    finished_mark(logs, 1).touch()  # an earlier profile's: must not vouch for this one's workers
    # two data-parallel workers: the pairs' links and cold start as for pp 2, two microbatches in flight, not four
    assert main(["profile", "--backend", "mindspore", *MODEL, "--pp", "1", "--dp", "2", "--microbatch-size", "1",
                 "--repeats", "1", "--warmup", "0", "--out-costs", str(costs_path),
                 "--out-cluster", str(cluster_path)]) == 0
    # each worker marked its outputs written, so a crash in MindSpore's teardown fails no profile
    # (tests/test_msrun_teardown.py); the stale mark went before the launch
    marks = finished_marks(logs)
    assert 1 not in marks and len(marks) == len(list(logs.glob("worker_*.log"))) == 2
    costs = CostTable.load(costs_path)
    assert costs.source == "measured:mindspore-cpu, 2 ranks" and costs.microbatch_size == 1
    n = len(costs.layer_names)
    assert n == 8 and len(costs.bwd_input) == len(costs.bwd_weight) == len(costs.optimizer) == n
    assert all(f > 0 and b > 0 and o > 0 for f, b, o in zip(costs.fwd, costs.bwd, costs.optimizer))
    assert all(0 < i <= b for i, b in zip(costs.bwd_input, costs.bwd))  # the input half of the backward
    assert costs.whole_backward_in_b  # MindSpore's split B computes both halves, on the first chunk too
    assert {k for k, _ in costs.per_action} >= {"F", "B", "Bi", "W", "O", "D"}
    assert {k for k, _ in costs.cold_start} == {"F", "B", "Bi", "W"} and all(t >= 0 for _, t in costs.cold_start)
    cluster = load_cluster(str(cluster_path))
    assert set(cluster.links) == {(0, 1), (1, 0)}
    for link in cluster.links.values():  # through MindSporeCommunicator: header + payload, gloo beneath
        assert link.bandwidth > 0 and link.message_overhead >= 0 and link.send_overhead > 0
    assert cluster.allreduce_seconds(1 << 20, 2) > 0  # mccl
    # the workers pinned themselves to cores as training's do (pulse_mindspore.train.join_cluster)
    assert cluster.shared_cores == os.cpu_count() and cluster.pinned_cores is pins_cores()
    # its buckets are summed after the actions, and each tensor is a message: priced so
    assert cluster.deferred_buckets and cluster.tensor_messages
    capsys.readouterr()
    assert main(["simulate", *MODEL, "--pp", "2", "--microbatch-size", "1", "--costs", str(costs_path),
                 "--cluster", str(cluster_path), "--time-limit", "5"]) == 0
    assert "tiny-uvit" in capsys.readouterr().out
