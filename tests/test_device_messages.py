"""The PyTorch communicator under NCCL's rules, every rank a thread over a fake torch.distributed
(``tests/fake_nccl.py``): pipeline messages that cannot deadlock, training bit-equal to the same
ranks on gloo's tag-matched mailboxes, every message received as the one its sender meant and no
send buffer touched before its send completed, and a host that waits for the device a constant
number of times per step, not once per message."""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

from fake_nccl import FakeNccl, MessageMisuse  # noqa: E402
from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.data.sources import load_source  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.plan import Plan  # noqa: E402
from pulse.runtime.errors import CommTimeout, DeadlockError  # noqa: E402
from pulse.runtime.message_order import CLASS_SPAN  # noqa: E402
from pulse.runtime.rendezvous import NCCL_BUFFER_BYTES  # noqa: E402
from pulse.train.loop import train_step  # noqa: E402
from pulse.train.run_config import RunConfig  # noqa: E402
from pulse.train.runlog import StepRecord  # noqa: E402
from pulse.schedule.generators import make_schedule  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
import pulse_torch.comm as torch_comm  # noqa: E402
import pulse_torch.job as torch_job  # noqa: E402
from pulse_torch import dist as torch_dist  # noqa: E402
from pulse_torch.wire import pack  # noqa: E402

SPEC = get_spec("tiny-unet")


def tiny_plan(pp: int, schedule: str, microbatches: int, kind: str = "v", dp: int = 1) -> Plan:
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(SPEC, 2)
    partitioner = "pulse" if kind == "v" else "sequential"
    placement = partition(partitioner, SPEC, costs, pp, folds=1)
    return Plan("tiny-unet", "cpu-local", pp, dp, 2, microbatches, partitioner, placement,
                make_schedule(schedule, placement, microbatches))


@dataclass
class Ranks:
    """What a threaded run left: the fake, per step the host's reads and waits, each rank's error
    (None: it finished), step records and, once trained, parameters and gradients by name."""

    fake: FakeNccl
    per_step: list[Counter]
    errors: list[BaseException | None]
    records: list[list[StepRecord]]
    state: list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]]


def run_ranks(monkeypatch, plan: Plan, steps: int = 2, per_direction: bool = True, eager_bytes: int = 0,
              mailbox: bool = False, between_steps: Callable[[Any, int], None] | None = None) -> Ranks:
    """Every rank of ``plan`` in a thread over the fake (``mailbox``: gloo's rules), every message
    named by its tag (``FakeNccl.label_messages``); ``between_steps(job, step)`` runs on each rank
    after each step."""
    fake = FakeNccl(plan.world_size, eager_bytes, mailbox).install(monkeypatch)
    fake.count_host_reads(monkeypatch)
    fake.label_messages(monkeypatch)

    def join(pp: int, dp: int, timeout_s: float = 300.0):
        ctx = torch_dist.build_context(pp, dp, "gloo" if mailbox else "nccl", "cpu")
        return ctx if per_direction else type(ctx)(ctx.layout, ctx.backend, ctx.device, ctx.dp_group, ctx.pp_group)
    monkeypatch.setattr(torch_job, "init_distributed", join)
    config = RunConfig(steps=steps, timeout=60.0)
    out = Ranks(fake, [Counter() for _ in range(steps)], [None] * plan.world_size,
                [[] for _ in range(plan.world_size)], [{} for _ in range(plan.world_size)])
    lock, building = threading.Lock(), threading.Lock()

    def rank_main(rank: int) -> None:
        fake.join(rank)
        try:
            torch.set_num_threads(1)
            with building:  # layers are initialised from torch's one global RNG, seeded per layer
                job, _ = torch_job.build_job(config, plan, SPEC, load_source(None, SPEC, 0, plan.model))
            for step in range(steps):
                reads0, waits0 = snapshot(fake, rank)
                out.records[rank].append(train_step(job, step))
                reads1, waits1 = snapshot(fake, rank)
                with lock:
                    out.per_step[step][(rank, "host reads")] += reads1 - reads0
                    out.per_step[step][(rank, "host waits")] += waits1 - waits0
                if between_steps is not None:
                    between_steps(job, step)
            out.state[rank] = trained_state(job)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.errors[rank] = exc
        finally:
            fake.leave(out.errors[rank])

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(plan.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a rank thread never finished"
    if out.errors == [None] * plan.world_size:
        assert fake.unreleased == [], f"sends never waited for nor seen completed: {fake.unreleased[:3]}"
    return out


def trained_state(job: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Every local parameter and its gradient, by name, as the last step left them."""
    backend, chunks = job.executor.backend, job.executor.chunks.values()
    grads = {n: g for h in chunks for n, g in backend.gradients(h).items()}
    return {n: (p.detach().clone(), None if grads.get(n) is None else grads[n].detach().clone())
            for h in chunks for n, p in backend.parameters(h).items()}


def assert_same_training(got: Ranks, want: Ranks) -> None:
    """Bit for bit: every step's loss, gradient norm and bytes, every parameter and gradient."""
    assert got.errors == want.errors == [None] * len(got.errors), (got.errors, want.errors)
    for rank, (a, b) in enumerate(zip(got.records, want.records)):
        assert [(r.loss, r.grad_norm, r.pipeline_bytes, r.allreduce_bytes) for r in a] == \
               [(r.loss, r.grad_norm, r.pipeline_bytes, r.allreduce_bytes) for r in b], f"rank {rank}"
    for rank, (a, b) in enumerate(zip(got.state, want.state)):
        assert a.keys() == b.keys() and a, f"rank {rank}"
        for name, ((p, g), (q, h)) in ((n, (a[n], b[n])) for n in a):
            assert torch.equal(p, q), f"rank {rank}: parameter {name}"
            assert (g is None) == (h is None) and (g is None or torch.equal(g, h)), f"rank {rank}: gradient {name}"


def snapshot(fake: FakeNccl, rank: int) -> tuple[int, int]:
    return sum(n for (r, _), n in fake.host_reads.items() if r == rank), fake.host_waits[rank]


@pytest.mark.parametrize("pp,schedule", [(2, "greedy_v_1f1b"), (4, "greedy_v_1f1b"), (2, "zero_bubble_v")])
def test_one_process_group_per_pair_deadlocks_a_v_and_one_per_direction_trains_it(monkeypatch, pp, schedule):
    """What ProcessGroupNCCL does with one group: both directions between two ranks on one stream,
    and a message larger than NCCL's buffer blocks the stream until its receive runs. Every rank
    waits then, and each says so (a crash of one rank reads otherwise: see the crash test below)."""
    plan = tiny_plan(pp, schedule, 2 * pp)
    with monkeypatch.context() as m:
        errors = run_ranks(m, plan, steps=1, per_direction=False).errors
    assert all(isinstance(e, DeadlockError) for e in errors), errors
    with monkeypatch.context() as m:
        nccl = run_ranks(m, plan, steps=1, per_direction=True)
    with monkeypatch.context() as m:
        assert_same_training(nccl, run_ranks(m, plan, steps=1, mailbox=True))


@pytest.mark.parametrize("pp,dp,schedule,kind,eager_bytes", [
    (2, 1, "greedy_v_1f1b", "v", 0), (2, 1, "zero_bubble_v", "v", NCCL_BUFFER_BYTES), (4, 1, "greedy_v_1f1b", "v", 0),
    (3, 1, "1f1b", "sequential", 0), (2, 2, "zero_bubble_v", "v", 0)])
def test_training_under_nccl_rules_is_the_mailbox_networks(monkeypatch, pp, dp, schedule, kind, eager_bytes) -> None:
    """Two steps under NCCL's rules (every message named and checked, every send buffer and
    all-reduce bucket watched) against the same ranks on gloo's tag-matched mailboxes: the same
    losses, norms, parameters and gradients, bit for bit."""
    plan = tiny_plan(pp, schedule, 2 * pp, kind, dp)
    with monkeypatch.context() as m:
        nccl = run_ranks(m, plan, eager_bytes=eager_bytes)
    with monkeypatch.context() as m:
        assert_same_training(nccl, run_ranks(m, plan, mailbox=True))


def same_class_pair(keys: list[int]) -> tuple[int, int]:
    """Two positions in one peer's send order holding messages of one class (same shapes)."""
    for i, a in enumerate(keys):
        for j in range(i + 1, len(keys)):
            if a % CLASS_SPAN == keys[j] % CLASS_SPAN:
                return i, j
    raise AssertionError(f"no two messages of one class in {keys}")


def test_two_same_sized_messages_received_in_swapped_order_are_caught(monkeypatch) -> None:
    """From the second step on (no header left to tell them apart), rank 1 posts its receives
    from rank 0 with two same-shaped messages swapped: on NCCL each would silently land in the
    other's buffer; the fake names the swap."""
    plan = tiny_plan(2, "greedy_v_1f1b", 4)

    def swap(job, step: int) -> None:
        comm = job.comm
        if job.layout.rank != 1 or step != 0:
            return
        order = {peer: list(keys) for peer, keys in comm.ordered.cursor.order.items()}
        i, j = same_class_pair(order[0])
        order[0][i], order[0][j] = order[0][j], order[0][i]
        comm.ordered.cursor.expect(order)  # the layouts learnt stay: no header will say it
    errors = run_ranks(monkeypatch, plan, steps=2, between_steps=swap).errors
    assert isinstance(errors[1], MessageMisuse) and "another order" in str(errors[1]), errors
    assert all(isinstance(e, (MessageMisuse, CommTimeout)) for e in errors), errors


def test_a_communicator_that_reuses_its_send_buffer_is_caught(monkeypatch) -> None:
    """A communicator that packs every message of one size into one staging buffer overwrites a
    payload before the sender learnt its send completed: the fake names the write."""
    staging: dict[int, torch.Tensor] = {}

    def pack_into_staging(tensors, device):
        packed = pack(tensors, device)
        buf = staging.setdefault(packed.numel(), torch.empty_like(packed))
        return buf.copy_(packed)
    monkeypatch.setattr(torch_comm, "pack", pack_into_staging)
    errors = run_ranks(monkeypatch, tiny_plan(2, "greedy_v_1f1b", 4), steps=1).errors
    # Which check sees the write first depends on the threads' timing: the completion's read of
    # the buffer, or the sender's is_completed() that releases it. Either names the same write.
    assert any(isinstance(e, MessageMisuse) and "was written (version" in str(e) for e in errors), errors


def test_a_communicator_that_forgets_its_sends_is_caught(monkeypatch) -> None:
    """Dropping a send's buffer and work before it completed: NCCL would read freed memory."""
    monkeypatch.setattr(torch_comm.TorchCommunicator, "_reap", lambda comm: comm._pending.clear())
    errors = run_ranks(monkeypatch, tiny_plan(2, "greedy_v_1f1b", 4), steps=1).errors
    assert any(isinstance(e, MessageMisuse) and "freed before its send completed" in str(e) for e in errors), errors


def test_a_crash_of_one_rank_is_not_reported_as_a_deadlock(monkeypatch) -> None:
    """The survivors of a rank that failed wait forever too; the fake tells them why, as a
    RuntimeError the way ProcessGroupNCCL does, which the communicator reports as a failure."""
    def crash(job, step: int) -> None:
        if job.layout.rank == 0:
            raise RuntimeError("rank 0 fails after its first step")
    errors = run_ranks(monkeypatch, tiny_plan(2, "greedy_v_1f1b", 4), steps=2, between_steps=crash).errors
    assert isinstance(errors[0], RuntimeError) and isinstance(errors[1], CommTimeout), errors
    assert "rank 0 left with RuntimeError" in str(errors[1]) and "deadlock" not in str(errors[1])


def test_host_waits_for_the_device_a_constant_number_of_times_per_step(monkeypatch) -> None:
    """Twice the microbatches, twice the messages: the same host reads per step once every message
    class has had its one header (the first step), and no wait polls from the host."""
    counts = {}
    for microbatches in (4, 8):
        with monkeypatch.context() as m:
            ranks = run_ranks(m, tiny_plan(2, "greedy_v_1f1b", microbatches), steps=2)
        assert ranks.errors == [None, None]
        counts[microbatches] = ranks.per_step
    for rank in range(2):
        steady = [counts[m][1][(rank, "host reads")] for m in (4, 8)]
        assert steady[0] == steady[1], f"rank {rank}: host reads per step grow with the messages: {steady}"
        assert steady[0] <= 8, f"rank {rank}: {steady[0]} host reads in a step"
        for m in (4, 8):
            assert counts[m][0][(rank, "host waits")] == counts[m][1][(rank, "host waits")] == 0
        # the first step reads each message class's header once: more than later steps, never per microbatch
        first = [counts[m][0][(rank, "host reads")] for m in (4, 8)]
        assert first[0] == first[1] > steady[0]
