"""Device memory (issue 30, item 6): every rank's measured peak in log.json beside the simulator's
peak for its pipeline device, and the run's closing line saying both. No device here: the
allocator queries are monkeypatched."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from pulse.cli.main import main  # noqa: E402
from pulse.layout import Layout  # noqa: E402
from pulse.placement import from_cuts  # noqa: E402
from pulse.plan import Plan, load_plan  # noqa: E402
from pulse.cli.common import load_model  # noqa: E402
from pulse.train import loop# noqa: E402
from pulse.runtime.executor import StepStats  # noqa: E402
from pulse.train.loop import StepSettings, TrainingJob, peak_memory_slots  # noqa: E402
from pulse.train.run_outputs import StepLog, finish_log  # noqa: E402
from pulse.schedule.ir import Action, Schedule  # noqa: E402
from pulse_torch.backend import TorchBackend  # noqa: E402
from pulse_torch.memory import AllocatorQueries, InProcessShares, peak_bytes  # noqa: E402

GiB = 2**30
PREDICTED = [3 * GiB, 2 * GiB]  # the simulator's peak of pipeline devices 0 and 1


def toy_plan() -> Plan:
    placement = from_cuts("v", [0, 1, 2, 3, 4], [0, 1, 1, 0], 2, "direct", "pulse")
    schedule = Schedule("toy", 1, {
        0: [Action(0, 0, 0, "F"), Action(0, 3, 0, "F"), Action(0, 3, 0, "B"), Action(0, 0, 0, "B")],
        1: [Action(1, 1, 0, "F"), Action(1, 2, 0, "F"), Action(1, 2, 0, "B"), Action(1, 1, 0, "B")]})
    return Plan("m4", "cpu-local", 2, 2, 1, 1, "pulse", placement, schedule,
                predicted={"peak_memory_bytes": max(PREDICTED), "peak_memory_bytes_per_device": PREDICTED})


class _World:
    """The step's one sum over the world: every rank's list added up (each rank's own slot set)."""

    def __init__(self, jobs: list[TrainingJob]) -> None:
        self.jobs = jobs

    def comm(self) -> SimpleNamespace:
        def sum_values(values, timeout=None):
            others = [[0.0] * 4 + peak_memory_slots(j) for j in self.jobs[1:]]
            return [sum(v) for v in zip(values, *others)]
        return SimpleNamespace(bytes_sent={}, allreduce_bytes=0, wait_sends=lambda timeout=None: None,
                               sum_values=sum_values, set_shapes=lambda key: None)


def rank_job(plan: Plan, rank: int, peak: int | None, comm=None) -> TrainingJob:
    backend = TorchBackend()
    backend.peak_memory_bytes = lambda: peak  # type: ignore[method-assign]  # what the device would say
    stats = StepStats(rank, Layout(2, 2, rank).stage, losses={0: 0.5})
    executor = SimpleNamespace(chunks={}, run_step=lambda: stats, timeline=None)
    return TrainingJob(plan, None, Layout(2, 2, rank), backend, comm, executor,  # type: ignore[arg-type]
                       SimpleNamespace(step=0, shapes_key=lambda: None), StepSettings(clip=0.0, total_steps=2), None)


def test_log_json_holds_every_ranks_peak_beside_its_devices_prediction(tmp_path: Path, capsys) -> None:
    plan = toy_plan()
    peaks = {0: 3_100 * 2**20, 1: 1_900 * 2**20, 2: 3_300 * 2**20, 3: 1_800 * 2**20}  # rank 2: device 0, replica 1
    world = _World([])
    jobs = [rank_job(plan, r, peaks[r]) for r in range(4)]
    world.jobs = jobs
    jobs[0].comm = world.comm()
    log = StepLog(tmp_path / "log.json", {"pp": 2, "dp": 2, "global_batch": plan.global_batch, "schedule": "toy",
                                          "placement": "v", "predicted": dict(plan.predicted)})
    records = loop.run_steps(jobs[0], 2, hooks=loop.LoopHooks(after_step=log))
    finish_log(log, records, "toy")
    data = json.loads((tmp_path / "log.json").read_text())
    assert [s["peak_memory_bytes"] for s in data["steps"]] == [[peaks[r] for r in range(4)]] * 2
    assert data["summary"]["memory"] == [
        {"rank": 0, "device": 0, "peak_bytes": peaks[0], "predicted_peak_bytes": PREDICTED[0]},
        {"rank": 1, "device": 1, "peak_bytes": peaks[1], "predicted_peak_bytes": PREDICTED[1]},
        {"rank": 2, "device": 0, "peak_bytes": peaks[2], "predicted_peak_bytes": PREDICTED[0]},
        {"rank": 3, "device": 1, "peak_bytes": peaks[3], "predicted_peak_bytes": PREDICTED[1]}]
    line = [t for t in capsys.readouterr().out.splitlines() if t.startswith("peak memory")]
    # per device the most of its replicas: device 0 is rank 2's 3300 MiB
    assert line == ["peak memory: device 0 3.22 GiB (predicted 3.00 GiB), device 1 1.86 GiB (predicted 2.00 GiB)"]


def test_a_cpu_run_measures_nothing_and_says_nothing(tmp_path: Path, capsys) -> None:
    plan = toy_plan()
    jobs = [rank_job(plan, r, None) for r in range(4)]
    world = _World(jobs)
    jobs[0].comm = world.comm()
    assert peak_memory_slots(jobs[0]) == []  # no extra numbers in the step's sum
    log = StepLog(tmp_path / "log.json", {"pp": 2, "dp": 2, "global_batch": 4, "schedule": "toy",
                                          "placement": "v", "predicted": {}})
    finish_log(log, loop.run_steps(jobs[0], 1, hooks=loop.LoopHooks(after_step=log)), "toy")
    data = json.loads((tmp_path / "log.json").read_text())
    assert data["steps"][0]["peak_memory_bytes"] is None and data["summary"]["memory"] is None
    assert "peak memory" not in capsys.readouterr().out


def test_a_cpu_rank_logs_what_its_allocations_held_beside_its_resident_peak(tmp_path: Path, capsys,
                                                                            monkeypatch) -> None:
    """No allocator on a CPU: each rank's figure is malloc's bytes in use at its busiest sample above its
    baseline, held against the prediction; its resident peak (with the free memory its heap kept) rides
    in a second world-long list and is logged and printed beside it."""
    from pulse.train import resident as resident_module
    from pulse.train.resident import ResidentPeak

    MiB = 2**20
    held = {0: 52 * MiB, 1: 26 * MiB, 2: 55 * MiB, 3: 24 * MiB}  # above a held baseline of 100 MiB
    kept = 20 * MiB  # free heap the host still sees
    monkeypatch.setattr(resident_module, "malloc_in_use", lambda: 0)  # only the peaks set below count
    monkeypatch.setattr(resident_module, "status_bytes", lambda field, status=None: 400 * MiB)
    plan = toy_plan()
    jobs = []
    for rank in range(4):
        job = rank_job(plan, rank, None)
        job.resident = ResidentPeak(baseline=400 * MiB - held[rank] - kept, resettable=True,
                                    held_baseline=100 * MiB, held_peak=100 * MiB + held[rank])
        jobs.append(job)
    assert peak_memory_slots(jobs[1]) == [0.0, held[1], 0.0, 0.0, 0.0, held[1] + kept, 0.0, 0.0]
    world = _World(jobs)
    jobs[0].comm = world.comm()
    log = StepLog(tmp_path / "log.json", {"pp": 2, "dp": 2, "global_batch": plan.global_batch, "schedule": "toy",
                                          "placement": "v", "predicted": {"peak_memory_bytes_per_device":
                                                                          [51 * MiB, 27 * MiB]}})
    finish_log(log, loop.run_steps(jobs[0], 1, hooks=loop.LoopHooks(after_step=log)), "toy")
    data = json.loads((tmp_path / "log.json").read_text())
    assert data["steps"][0]["peak_memory_bytes"] == [held[r] for r in range(4)]
    assert data["steps"][0]["resident_memory_bytes"] == [held[r] + kept for r in range(4)]
    assert data["summary"]["memory"][2] == {"rank": 2, "device": 0, "peak_bytes": held[2],
                                            "predicted_peak_bytes": 51 * MiB, "resident_peak_bytes": held[2] + kept}
    line = [t for t in capsys.readouterr().out.splitlines() if t.startswith("peak memory")]
    assert line == ["peak memory: device 0 55 MiB (predicted 51 MiB; 75 MiB resident), "
                    "device 1 26 MiB (predicted 27 MiB; 46 MiB resident)"]


def test_a_cpu_rank_whose_allocations_cannot_be_counted_logs_its_resident_set_and_says_so(
        tmp_path: Path, capsys, monkeypatch) -> None:
    """MindSpore's CPU runtime takes its tensors from a pool (``tensors_from_malloc=False``): the rank's figure is
    its resident peak alone, which holds the pool's free pages too. The log marks it, and the closing line calls
    it resident and says why it stands above the tensors' prediction; a run not on a CPU is not marked."""
    from pulse.train import resident as resident_module
    from pulse.train.resident import ResidentPeak

    MiB = 2**20
    resident = {0: 94 * MiB, 1: 92 * MiB}
    monkeypatch.setattr(resident_module, "status_bytes", lambda field, status=None: 500 * MiB)
    plan = toy_plan()
    jobs = []
    for rank in range(4):
        job = rank_job(plan, rank, None)
        job.resident = ResidentPeak(baseline=500 * MiB - resident[rank % 2], resettable=True)
        jobs.append(job)
    assert peak_memory_slots(jobs[1]) == [0.0, resident[1], 0.0, 0.0]  # one list: no held figure
    world = _World(jobs)
    jobs[0].comm = world.comm()
    run = {"pp": 2, "dp": 2, "global_batch": plan.global_batch, "schedule": "toy", "placement": "v",
           "device": "CPU", "predicted": {"peak_memory_bytes_per_device": [13 * MiB, 19 * MiB]}}
    log = StepLog(tmp_path / "log.json", run)
    finish_log(log, loop.run_steps(jobs[0], 1, hooks=loop.LoopHooks(after_step=log)), "toy")
    data = json.loads((tmp_path / "log.json").read_text())
    assert data["summary"]["memory"][1] == {"rank": 1, "device": 1, "peak_bytes": resident[1],
                                            "predicted_peak_bytes": 19 * MiB, "peak_is_resident": True}
    line = [t for t in capsys.readouterr().out.splitlines() if t.startswith("peak memory")]
    assert line == ["peak memory: device 0 94 MiB resident (predicted 13 MiB), device 1 92 MiB resident "
                    "(predicted 19 MiB); resident: this runtime counts no tensor bytes on a CPU, and its resident "
                    "set holds the pages its memory pool keeps free (benchmarks/mindspore_pool_pages.py)"]
    from pulse.train.runlog import device_memory

    accelerator = device_memory({**run, "device": "Ascend"}, data["steps"])
    assert "peak_is_resident" not in accelerator[0]


def test_the_torch_backend_asks_its_own_devices_allocator(monkeypatch) -> None:
    asked = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: asked.append(device) or 5 * GiB)
    assert TorchBackend(device="cuda:1").peak_memory_bytes() == 5 * GiB
    assert asked == [torch.device("cuda:1")]
    assert TorchBackend().peak_memory_bytes() is None and peak_bytes("cpu") is None


def test_a_simulated_plan_carries_a_peak_per_device(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    assert main(["simulate", "--model", "tiny-unet", "--pp", "2", "--schedule", "greedy_v_1f1b",
                 "--out", str(out)]) == 0
    plan, _ = load_plan(out, load_model)
    per_device = plan.predicted["peak_memory_bytes_per_device"]
    assert len(per_device) == 2 and max(per_device) == plan.predicted["peak_memory_bytes"]


class _Allocator:
    """A stand-in caching allocator: the test says what each call allocates and frees."""

    def __init__(self) -> None:
        self.now = self.top = 0

    def take(self, n: int) -> None:
        self.now += n
        self.top = max(self.top, self.now)

    def queries(self) -> AllocatorQueries:
        return AllocatorQueries(lambda: self.now, lambda: self.top, lambda: setattr(self, "top", self.now))


def test_in_process_shares_charge_each_call_to_its_device_and_a_message_to_its_receiver() -> None:
    mem = _Allocator()
    sent = []

    def executor(rank: int, work):
        comm = SimpleNamespace(send_group=lambda ts, peer, tags, timeout=None: sent.append((rank, peer)))
        ex = SimpleNamespace(rank=rank, device=rank, chunks={0: "c"}, comm=comm, begin_step=lambda z=True: None,
                             optimizer_step=lambda: mem.take(8), backend=SimpleNamespace(parameters=lambda h: {"w": 4}))
        ex.run_next = lambda: work(ex)
        return ex

    def sender(ex):  # an F: 100 held, 50 transient, then a 10-byte message to rank 1 (its wire copy)
        mem.take(150)
        mem.take(-50)
        mem.take(10)
        ex.comm.send_group([10], 1, ["tag"])

    def receiver(ex):  # frees the message it took, allocates 30
        mem.take(-10)
        mem.take(30)

    exs = [executor(0, sender), executor(1, receiver)]
    shares = InProcessShares(mem.queries()).watch(exs, nbytes=lambda t: t)
    assert shares.live == {0: 4, 1: 4}  # the parameters
    exs[0].run_next()
    exs[1].run_next()
    exs[0].optimizer_step()
    assert sent == [(0, 1)]
    assert shares.live == {0: 4 + 100 + 8, 1: 4 + 10 - 10 + 30}  # the message left device 0's share
    # device 0: 150 at once in its F; device 1: the message, then 30 more once it was freed
    assert shares.peak == {0: 4 + 150, 1: 4 + 30}


def test_mindspore_asks_its_runtime_off_a_cpu_and_nothing_on_one(monkeypatch) -> None:
    ms = pytest.importorskip("mindspore")
    from pulse_mindspore.backend import MindSporeBackend

    assert MindSporeBackend.peak_memory_bytes(None) is None  # this host: device_target CPU
    monkeypatch.setattr(ms, "get_context", lambda key: "Ascend")
    monkeypatch.setattr(ms.runtime, "max_memory_allocated", lambda: 7 * GiB)
    assert MindSporeBackend.peak_memory_bytes(None) == 7 * GiB
