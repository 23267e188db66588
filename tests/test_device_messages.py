"""The PyTorch communicator under NCCL's rules, every rank a thread over a fake torch.distributed
(``tests/fake_nccl.py``): pipeline messages that cannot deadlock, and a host that waits for the
device a constant number of times per step, not once per message."""
from __future__ import annotations

import threading
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from fake_nccl import FakeNccl  # noqa: E402
from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.data.sources import load_source  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.plan import Plan  # noqa: E402
from pulse.runtime.errors import DeadlockError  # noqa: E402
from pulse.train.loop import train_step  # noqa: E402
from pulse.train.run_config import RunConfig  # noqa: E402
from pulse.schedule.generators import make_schedule  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
import pulse_torch.job as torch_job  # noqa: E402
from pulse_torch import dist as torch_dist  # noqa: E402

SPEC = get_spec("tiny-unet")


def tiny_plan(pp: int, schedule: str, microbatches: int, kind: str = "v") -> Plan:
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(SPEC, 2)
    partitioner = "pulse" if kind == "v" else "sequential"
    placement = partition(partitioner, SPEC, costs, pp, folds=1)
    return Plan("tiny-unet", "cpu-local", pp, 1, 2, microbatches, partitioner, placement,
                make_schedule(schedule, placement, microbatches))


def run_ranks(monkeypatch, plan: Plan, steps: int = 2, per_direction: bool = True,
              eager_bytes: int = 0) -> tuple[FakeNccl, list[Counter], list[BaseException | None]]:
    """Every rank of ``plan`` in a thread; per rank and step, the host reads and host-side waits."""
    fake = FakeNccl(plan.world_size, eager_bytes).install(monkeypatch)
    fake.count_host_reads(monkeypatch)

    def join(pp: int, dp: int, timeout_s: float = 300.0):
        ctx = torch_dist.build_context(pp, dp, "nccl", "cpu")
        return ctx if per_direction else type(ctx)(ctx.layout, ctx.backend, ctx.device, ctx.dp_group, ctx.pp_group)
    monkeypatch.setattr(torch_job, "init_distributed", join)
    config = RunConfig(steps=steps, timeout=60.0)
    per_step: list[Counter] = [Counter() for _ in range(steps)]
    errors: list[BaseException | None] = [None] * plan.world_size
    lock = threading.Lock()

    def rank_main(rank: int) -> None:
        fake.join(rank)
        try:
            torch.set_num_threads(1)
            job, _ = torch_job.build_job(config, plan, SPEC, load_source(None, SPEC, 0, plan.model))
            for step in range(steps):
                reads0, waits0 = snapshot(fake, rank)
                train_step(job, step)
                reads1, waits1 = snapshot(fake, rank)
                with lock:
                    per_step[step][(rank, "host reads")] += reads1 - reads0
                    per_step[step][(rank, "host waits")] += waits1 - waits0
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors[rank] = exc
        finally:
            fake.leave()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(plan.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a rank thread never finished"
    return fake, per_step, errors


def snapshot(fake: FakeNccl, rank: int) -> tuple[int, int]:
    return sum(n for (r, _), n in fake.host_reads.items() if r == rank), fake.host_waits[rank]


@pytest.mark.parametrize("pp,schedule", [(2, "greedy_v_1f1b"), (4, "greedy_v_1f1b"), (2, "zero_bubble_v")])
def test_one_process_group_per_pair_deadlocks_a_v_and_one_per_direction_trains_it(monkeypatch, pp, schedule):
    """What ProcessGroupNCCL does with one group: both directions between two ranks on one stream,
    and a message larger than NCCL's buffer blocks the stream until its receive runs."""
    plan = tiny_plan(pp, schedule, 2 * pp)
    _, _, errors = run_ranks(monkeypatch, plan, steps=1, per_direction=False)
    assert any(isinstance(e, DeadlockError) for e in errors), errors
    with monkeypatch.context() as again:
        _, _, errors = run_ranks(again, plan, steps=1, per_direction=True)
    assert errors == [None] * pp


def test_host_waits_for_the_device_a_constant_number_of_times_per_step(monkeypatch) -> None:
    """Twice the microbatches, twice the messages: the same host reads per step once every message
    class has had its one header (the first step), and no wait polls from the host."""
    counts = {}
    for microbatches in (4, 8):
        with monkeypatch.context() as m:
            _, per_step, errors = run_ranks(m, tiny_plan(2, "greedy_v_1f1b", microbatches), steps=2)
        assert errors == [None, None]
        counts[microbatches] = per_step
    for rank in range(2):
        steady = [counts[m][1][(rank, "host reads")] for m in (4, 8)]
        assert steady[0] == steady[1], f"rank {rank}: host reads per step grow with the messages: {steady}"
        assert steady[0] <= 8, f"rank {rank}: {steady[0]} host reads in a step"
        for m in (4, 8):
            assert counts[m][0][(rank, "host waits")] == counts[m][1][(rank, "host waits")] == 0
        # the first step reads each message class's header once: more than later steps, never per microbatch
        first = [counts[m][0][(rank, "host reads")] for m in (4, 8)]
        assert first[0] == first[1] > steady[0]
