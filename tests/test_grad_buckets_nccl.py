"""Data-parallel buckets layer by layer (pulse.grad_buckets) under NCCL's rules: every rank a
thread over the fake torch.distributed (``tests/fake_nccl.py``), where all-reduces are matched
by their order alone. Launched from the backward's gradient hooks, one per layer, they train bit
for bit as one bucket per chunk launched at the AR; issued in different orders, they are caught."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fake_nccl import MessageMisuse  # noqa: E402
from test_device_messages import assert_same_training, run_ranks, tiny_plan  # noqa: E402
import pulse_torch.job as torch_job  # noqa: E402

DP_GROUP = (0, 2)  # stage 0's replicas at pp 2, dp 2 (rank = replica * pp + stage)


def with_bucket_cap(cap: int, reorder: bool = False):
    """``executor_for_rank`` whose data-parallel buckets hold ``cap`` bytes; ``reorder``: rank 2
    launches its buckets in reverse order (a runtime whose replicas disagree)."""
    real = torch_job.executor_for_rank

    def make(*args, **kwargs):
        executor = real(*args, **kwargs)
        executor.grad_sync.cap = cap
        if reorder and executor.rank == 2:
            buckets = executor.grad_sync.buckets
            executor.grad_sync.buckets = lambda chunk: list(reversed(buckets(chunk)))
        return executor
    return make


@pytest.mark.parametrize("schedule", ["greedy_v_1f1b", "zero_bubble_v"])
def test_a_bucket_per_layer_trains_as_a_bucket_per_chunk(monkeypatch, schedule) -> None:
    plan = tiny_plan(2, schedule, 4, "v", dp=2)
    with monkeypatch.context() as m:
        m.setattr(torch_job, "executor_for_rank", with_bucket_cap(1))
        layered = run_ranks(m, plan)
    with monkeypatch.context() as m:
        whole = run_ranks(m, plan, mailbox=True)  # the default cap: a tiny model's chunk is one bucket
    assert_same_training(layered, whole)
    # the same gradients in many more all-reduces (two steps)
    assert layered.fake.seq[(DP_GROUP, 0)] > 4 * whole.fake.seq[(DP_GROUP, 0)] > 0


def test_replicas_that_launch_their_buckets_in_different_orders_are_caught(monkeypatch) -> None:
    plan = tiny_plan(2, "greedy_v_1f1b", 4, "v", dp=2)
    monkeypatch.setattr(torch_job, "executor_for_rank", with_bucket_cap(1, reorder=True))
    errors = run_ranks(monkeypatch, plan, steps=1).errors
    assert any(isinstance(e, MessageMisuse) and "different orders" in str(e) for e in errors), errors
