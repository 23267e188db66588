"""A run alternating aspect-ratio buckets on the PyTorch communicator under NCCL's rules (every rank a
thread over tests/fake_nccl.py): each step's receives are sized for its bucket without a message
(a header per message class the first time a bucket crosses, none after), every message received as
the one its sender meant, and training bit-equal to the same ranks on gloo's tag-matched mailboxes."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

import test_device_messages as rig  # noqa: E402  (tests/: its threaded ranks over the fake NCCL)
from pulse.data.bucketed_latents import synthetic_buckets  # noqa: E402

LATENTS = [(16, 32), (24, 8)]  # two buckets' latent (height, width): 128x256 and 192x64 pixels
STEPS = 4  # buckets 0, 1, 0, 1 (the feed's seeded order over these 16 samples, checked below)


def run(monkeypatch, plan, mailbox: bool):
    source = synthetic_buckets(rig.SPEC, LATENTS, num_samples=16, seed=0)
    monkeypatch.setattr(rig, "load_source", lambda *args: source)
    headers: dict[int, list[int]] = {}
    buckets: dict[int, list[int]] = {}

    def record(job, step: int) -> None:
        headers.setdefault(job.layout.rank, []).append(sum(job.comm.header_bytes.values()))
        buckets.setdefault(job.layout.rank, []).append(job.batches.shapes_key())
    ranks = rig.run_ranks(monkeypatch, plan, steps=STEPS, mailbox=mailbox, between_steps=record)
    return ranks, headers, buckets


def test_alternating_buckets_under_nccl_rules_train_as_the_mailbox_network(monkeypatch):
    plan = rig.tiny_plan(2, "greedy_v_1f1b", 2)
    with monkeypatch.context() as m:
        nccl, headers, buckets = run(m, plan, mailbox=False)
    assert nccl.errors == [None, None], nccl.errors
    assert buckets[0] == buckets[1] and len(set(buckets[0])) == 2  # both buckets, every rank agreeing
    first_of_bucket = [buckets[0].index(b) == s for s, b in enumerate(buckets[0])]
    for rank, totals in headers.items():  # headers only on a bucket's first step
        grew = [b > a for a, b in zip([0] + totals, totals)]
        assert grew == first_of_bucket, (rank, totals, buckets[0])
    with monkeypatch.context() as m:
        mailbox, _, _ = run(m, plan, mailbox=True)
    rig.assert_same_training(nccl, mailbox)
