"""`pulse profile --backend torch` profiles the device the job trains on (issue 30, item 3): the job's
own process group (NCCL here), the rank's device for tensors, models and the communicator, the
training precision's autocast, and every timed call closed by a device synchronize (or, with
--device-timing events, every action timed between device events). No GPU here:
the accelerator's availability and its calls are monkeypatched."""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from pulse.cli.main import main  # noqa: E402
from pulse.profiling.layers import one_chunk_per_layer  # noqa: E402
from pulse.profiling.layers import time_optimizer  # noqa: E402
from pulse.profiling.timing import time_actions  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse_torch import dist as pulse_dist, profile_job  # noqa: E402
from pulse_torch.backend import TorchBackend  # noqa: E402
from pulse_torch.diffusion import eps_loss  # noqa: E402
from pulse_torch.profiler import SYNCED_CALLS, DeviceEvents, device_timed, synchronized  # noqa: E402

JOB = ["--model", "tiny-unet", "--pp", "1", "--microbatch-size", "1", "--out-costs", "c.yaml",
       "--out-cluster", "k.yaml"]


@pytest.fixture
def cuda_job(monkeypatch, tmp_path: Path):
    """torch.distributed as a CUDA node would set it up: NCCL asked for, device 0 bound. The group that
    really forms is a one-rank gloo group (no NCCL without a GPU); what was asked for is recorded."""
    asked: dict[str, list] = {"backend": [], "device": [], "sync": []}
    real_init = dist.init_process_group

    def init(backend, **kwargs):
        asked["backend"].append(backend)
        real_init("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)

    monkeypatch.setattr(pulse_dist, "accelerator_backend", lambda: ("nccl", "cuda"))
    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setattr(torch.cuda, "set_device", asked["device"].append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: asked["sync"].append("cuda"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    yield asked
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_the_profile_joins_the_jobs_nccl_group_and_measures_on_the_ranks_cuda_device(cuda_job) -> None:
    args = profile_job.build_parser().parse_args([*JOB, "--precision", "bf16"])
    ctx = profile_job.join(args)
    assert cuda_job["backend"] == ["nccl"] and cuda_job["device"] == [0]
    assert ctx.backend == "nccl" and ctx.device == "cuda:0"
    rig = profile_job.rig_of(args, ctx)
    assert rig.ranks.comm.device == torch.device("cuda:0")  # links and all-reduce curves: device tensors
    assert rig.ranks.tensors.device == torch.device("cuda:0")
    assert rig.framework == "torch-cuda bf16" and rig.cores is None and rig.pinned is False
    fresh = rig.backend_of()
    assert fresh.device == torch.device("cuda:0")  # the layers' modules and inputs go there
    autocast = fresh.forward_context()
    assert autocast.device == "cuda" and autocast.fast_dtype == torch.bfloat16
    assert not hasattr(fresh, "device_clock")  # the default: every call waits for the device
    out = torch.zeros(1, 4, 2, 2)
    rig.loss({"h": out}, {"target": torch.ones(1, 4, 2, 2)})  # the last chunk's loss: waited for on the device
    assert cuda_job["sync"] == ["cuda"]
    evented = profile_job.rig_of(profile_job.build_parser().parse_args([*JOB, "--device-timing", "events"]), ctx)
    assert isinstance(evented.backend_of().device_clock, DeviceEvents)  # each action between device events
    assert evented.loss is eps_loss  # inside its F action's events: nothing waits for the device


class CountingClock:
    """A device clock whose every action lasts exactly 1 ms per mark between its two marks."""

    def __init__(self) -> None:
        self.marks = 0

    def mark(self) -> int:
        self.marks += 1
        return self.marks

    def seconds(self, start: int, end: int) -> float:
        return (end - start) * 1e-3


def test_a_backend_with_a_device_clock_is_timed_on_it_not_on_the_hosts_clock() -> None:
    """Each action's figure and each optimizer step's are read between marks on the device clock (the
    host clock would give every action a different, never exactly 1 ms, figure)."""
    backend = TorchBackend(seed=0)
    backend.device_clock = clock = CountingClock()
    spec = get_spec("tiny-unet")
    run = one_chunk_per_layer(spec, backend, eps_loss, 1, split=True, seed=0)
    timed = time_actions(run, steps=2, warmup=1)
    assert timed and set(timed.values()) == {1e-3}
    actions = len(run.executors[0].actions)
    assert clock.marks == 3 * 2 * actions
    assert time_optimizer(run, backend, repeats=2, chunks=[0]) == [1e-3]
    plain = one_chunk_per_layer(spec, TorchBackend(seed=0), eps_loss, 1, split=True, seed=0)
    assert len(set(time_actions(plain, steps=1, warmup=0).values())) > 1


def test_device_events_read_the_accelerators_own_events(monkeypatch) -> None:
    """On CUDA (and torch.npu alike) a mark is a timing event recorded on the current stream; the seconds
    between two wait for the later one and convert elapsed_time's milliseconds."""
    made = []

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            self.enable_timing, self.recorded, self.synced, self.at = enable_timing, False, False, len(made) * 7.0
            made.append(self)

        def record(self) -> None:
            self.recorded = True

        def synchronize(self) -> None:
            self.synced = True

        def elapsed_time(self, end: "FakeEvent") -> float:
            assert end.synced, "read before the device took the end mark"
            return end.at - self.at
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    clock = DeviceEvents(torch.device("cuda:0"))
    start, end = clock.mark(), clock.mark()
    assert all(e.enable_timing and e.recorded for e in made)
    assert clock.seconds(start, end) == pytest.approx(7e-3)
    cpu = TorchBackend(seed=0)
    assert device_timed(cpu, torch.device("cpu"), "events") is cpu and not hasattr(cpu, "device_clock")


def test_a_cpu_profile_keeps_gloo_the_hosts_cores_and_no_synchronize(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(pulse_dist, "accelerator_backend", lambda: ("gloo", "cpu"))
    monkeypatch.setattr(pulse_dist, "pin_to_cores", lambda *a: None)
    monkeypatch.setenv("WORLD_SIZE", "1")
    real_init = dist.init_process_group
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: real_init(
        backend, store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1))
    try:
        args = profile_job.build_parser().parse_args(JOB)
        rig = profile_job.rig_of(args, profile_job.join(args))
        assert dist.get_backend() == "gloo" and rig.framework == "torch-cpu" and rig.cores is not None
        assert rig.loss is eps_loss and rig.backend_of().device == torch.device("cpu")
    finally:
        dist.destroy_process_group()


def test_every_timed_call_returns_after_the_devices_work() -> None:
    """The executor's action span (the figure) ends after the call: each call that queues device work
    is followed at once by a synchronize, before anything else runs."""
    events: list[str] = []
    backend = TorchBackend(seed=0)
    for name in SYNCED_CALLS:
        inner = getattr(backend, name)
        setattr(backend, name, lambda *a, _inner=inner, _name=name, **k: (events.append(_name), _inner(*a, **k))[1])
    synchronized(backend, lambda: events.append("sync"))
    spec = get_spec("tiny-unet")
    run = one_chunk_per_layer(spec, backend, eps_loss, 1, split=True, seed=0)
    timed = time_actions(run, steps=1, warmup=0)
    calls = [i for i, e in enumerate(events) if e != "sync"]
    assert calls and all(events[i + 1] == "sync" for i in calls)
    assert events.count("forward") == len([k for k in timed if k[0] == "F"]) == spec.num_layers
    assert events.count("backward_input") == events.count("backward_weight") == spec.num_layers


def test_precision_reaches_the_job_and_mindspore_refuses_it(capsys) -> None:
    assert main(["profile", "--backend", "mindspore", "--precision", "bf16", "--pp", "1"]) == 2
    assert "--precision bf16" in capsys.readouterr().err
    args = profile_job.build_parser().parse_args(JOB)
    assert args.precision == "fp32"
