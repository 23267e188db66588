"""Bucketed data order: one bucket per step, every sample each epoch, a pure function of (seed, step)."""
import numpy as np
import pytest

from pulse.errors import PulseError
from pulse.train.bucket_sampler import BucketSampler

BUCKETS = np.array([0, 1, 1, 2, 0, 2, 2, 1, 0, 0, 2, 1, 1, 1, 0, 2, 2, 2, 0, 1, 3])  # bucket 3: one sample
B, M, DP = 2, 2, 2  # a global batch of 8


def _epoch(sampler, epoch):
    steps = range(epoch * sampler.batches_per_epoch, (epoch + 1) * sampler.batches_per_epoch)
    return [(s, sampler.bucket(s), np.concatenate([sampler.indices(s, r, m) for r in range(DP) for m in range(M)]))
            for s in steps]


def test_every_step_reads_one_bucket_and_every_sample_each_epoch():
    sampler = BucketSampler(BUCKETS, B, M, DP, seed=3)
    counts = np.bincount(BUCKETS)
    assert sampler.batches_per_epoch == sum(-(-c // (B * M * DP)) for c in counts)
    for epoch in range(3):
        seen = []
        for _, bucket, batch in _epoch(sampler, epoch):
            assert len(batch) == B * M * DP
            assert set(BUCKETS[batch]) == {bucket}  # every replica and microbatch: the step's one bucket
            seen.append(batch)
        seen = np.concatenate(seen)
        assert set(seen) == set(range(len(BUCKETS)))  # nobody left out
        for k, count in enumerate(counts):  # a bucket's padding repeats its own samples as evenly as can be
            per_sample = np.bincount(seen[BUCKETS[seen] == k], minlength=len(BUCKETS))[BUCKETS == k]
            assert per_sample.max() - per_sample.min() <= -(-(B * M * DP) // count)


def test_order_is_a_function_of_seed_and_step_alone():
    whole = BucketSampler(BUCKETS, B, M, DP, seed=5)
    run = [(s, r, m, whole.indices(s, r, m)) for s in range(20) for r in range(DP) for m in range(M)]
    for start in (7, 13):  # a fresh sampler on another rank, or a run resumed at ``start`` (a later epoch)
        fresh = BucketSampler(BUCKETS, B, M, DP, seed=5)
        for s, r, m, got in run:
            if s >= start:
                np.testing.assert_array_equal(fresh.indices(s, r, m), got)
    other = BucketSampler(BUCKETS, B, M, DP, seed=6)
    assert any(not np.array_equal(other.indices(s, 0, 0), whole.indices(s, 0, 0)) for s in range(10))


def test_epochs_are_reshuffled_and_buckets_mixed():
    sampler = BucketSampler(BUCKETS, B, M, DP, seed=1)
    first, second = _epoch(sampler, 0), _epoch(sampler, 1)
    assert [b for _, b, _ in first] != [b for _, b, _ in second] or \
        any(not np.array_equal(x, y) for (_, _, x), (_, _, y) in zip(first, second))
    assert len({b for _, b, _ in first}) == 4


def test_bucket_shares_weigh_steps():
    sampler = BucketSampler(BUCKETS, B, M, DP, seed=0)
    steps = [sampler.bucket(s) for s in range(sampler.batches_per_epoch)]
    np.testing.assert_allclose(sampler.bucket_shares(), np.bincount(steps) / len(steps))


def test_bad_buckets_are_refused():
    with pytest.raises(PulseError, match="one bucket number"):
        BucketSampler(np.array([], np.int64), 1, 1, 1, 0)
