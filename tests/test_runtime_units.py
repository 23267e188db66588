"""The runtime's small parts: wiring, message tags, the skip cache, the fake network."""
from __future__ import annotations

import numpy as np
import pytest

from pulse.errors import PlanError
from pulse.runtime import Backend, Communicator, MessageTag, SkipCache, Wiring
from pulse.testing import FakeNetwork, WouldBlock
from pulse.plan import Plan, plan_from_dict
from pulse.testing.fake_comm import run_all_ranks
from pulse.runtime.from_plan import executor_for_rank
from pulse.testing.local import local_run
from pulse.testing.numpy_backend import NumpyBackend
from pulse.testing.toy import mse_loss, toy_batches, toy_placement, toy_unet_spec
from pulse.schedule.generators import gpipe, greedy_v_1f1b
from pulse.schedule.lower import lower
from pulse.traffic import transfers

SPEC = toy_unet_spec(depth=3)  # temb stem enc0 enc1 enc2 mid dec2 dec1 dec0 head


def test_protocols_are_met_by_the_reference_implementations() -> None:
    network = FakeNetwork(2, NumpyBackend())
    assert isinstance(NumpyBackend(), Backend)
    assert isinstance(network.communicator(0), Communicator)


def test_chunk_io_of_a_v() -> None:
    placement = toy_placement(SPEC, "v", 2)  # chunks [temb stem enc0] [enc1 enc2] [mid dec2 dec1] [dec0 head]
    ios = Wiring(SPEC, placement).ios
    assert [(io.start, io.end, io.device) for io in ios] == [(0, 3, 0), (3, 5, 1), (5, 8, 1), (8, 10, 0)]
    assert ios[0].produces == ("enc0->dec0", "stem->head") and ios[0].shared_made == ("temb",)
    assert ios[0].grad_names == frozenset()  # data in, nothing to send back
    assert ios[1].produces == ("enc1->dec1", "enc2->dec2") and ios[1].shared_in == ("temb",)
    assert ios[2].consumes == ("enc1->dec1", "enc2->dec2")
    assert ios[3].consumes == ("enc0->dec0", "stem->head") and ios[3].last
    assert ios[3].grad_names == {"h", "temb", "enc0->dec0", "stem->head"}
    assert ios[2].data_inputs == ("t",)


def test_payloads_follow_transfers_in_order() -> None:
    placement = toy_placement(SPEC, "sequential", 2, transport="relay")
    wiring = Wiring(SPEC, placement)
    (tr,) = transfers(SPEC, placement)
    assert wiring.payload(0) == ("h", *tr.shared, *tr.skips)
    tags = wiring.tags("B", 0, 3)
    assert [t.slot for t in tags] == list(range(len(tags))) and tags[0].name == "h"


def test_repeated_chunk_pairs_match_transfers_in_order() -> None:
    """Sequential + direct skips: chunk 1 -> 2 carries the main path and four direct skips."""
    spec = toy_unet_spec(depth=7)
    placement = toy_placement(spec, "sequential", 4, transport="direct")
    wiring = Wiring(spec, placement)
    schedule = lower(gpipe(placement, 1), spec, placement)
    matched = wiring.match_transfers(schedule.actions[1])
    sends = [wiring.transfers[t] for pos, t in matched.items() if schedule.actions[1][pos].kind == "SF"]
    assert [(t.src_chunk, t.dst_chunk, t.main_bytes > 0, t.skips) for t in sends][:3] == [
        (1, 2, True, ()), (1, 2, False, ("enc3->dec3",)), (1, 2, False, ("enc4->dec4",))]
    assert len({t for t in matched.values()}) == len(matched) // 2  # each transfer: one send, one receive


def test_message_tags_are_unique_integers() -> None:
    ints = {MessageTag(d, t, m, s, "x").as_int()
            for d in "FB" for t in range(5) for m in range(7) for s in range(3)}
    assert len(ints) == 2 * 5 * 7 * 3 and max(ints) < 2**31
    with pytest.raises(PlanError, match="integer tag"):
        MessageTag("F", 0, 20000, 0, "h").as_int()


def test_skip_cache_counts_bytes_and_local_values() -> None:
    cache = SkipCache(lambda t: t.nbytes, lambda a, b: a + b, local_keys=["a->b"])
    x = np.ones(4)
    cache.put_value(0, "a->b", x)
    cache.put_value(0, "c->d", x)
    assert cache.live_bytes == 64 and cache.local_bytes == 32
    cache.add_grad(0, "a->b", x)
    cache.add_grad(0, "a->b", x)  # a second contribution sums, does not grow
    assert cache.live_bytes == 96
    cache.drop_value(0, "a->b")
    cache.drop_value(0, "c->d")
    assert np.all(cache.take_grad(0, "a->b") == 2.0)
    assert cache.live_bytes == 0 and cache.peak_bytes == 96 and cache.peak_local_bytes == 32
    assert cache.leftovers() == []
    cache.put_value(1, "a->b", x)
    with pytest.raises(PlanError, match="arrives twice"):
        cache.put_value(1, "a->b", x)
    assert cache.leftovers() == ["value of a->b mb1"]


def test_fake_network_copies_counts_and_blocks() -> None:
    net = FakeNetwork(3, NumpyBackend())
    a, b, c = (net.communicator(r) for r in range(3))
    tag = MessageTag("F", 0, 0, 0, "h")
    with pytest.raises(WouldBlock, match="from rank 0"):
        b.recv(0, tag)
    x = np.arange(3.0)
    a.send(x, 1, tag)
    x[0] = 99.0  # the wire holds a copy
    assert list(b.recv(0, tag)) == [0.0, 1.0, 2.0]
    assert a.bytes_sent == {1: 24} and net.log[0].tag.name == "h"
    with pytest.raises(WouldBlock, match=r"ranks \[2\] have not reached it"):
        a.all_reduce(np.ones(2), [0, 2])
    assert list(c.all_reduce(np.full(2, 2.0), [0, 2])) == [3.0, 3.0]
    assert list(a.all_reduce(np.ones(2), [0, 2])) == [3.0, 3.0]  # the retry completes
    assert a.allreduce_bytes == 16 and not net.collectives


def test_steps_repeat_and_leave_nothing_behind() -> None:
    placement = toy_placement(SPEC, "v", 2)
    run = local_run(SPEC, placement, lower(greedy_v_1f1b(placement, 3), SPEC, placement),
                    NumpyBackend(), toy_batches(SPEC, 2), mse_loss)
    first = {k: v.copy() for k, v in (run.step(), run.gradients())[1].items()}
    second = (run.step(), run.gradients())[1]
    assert all(np.array_equal(first[k], second[k]) for k in first)
    for ex in run.executors:
        assert ex.done and ex.cache.live_bytes == 0 and not ex._ctx


def test_executors_from_a_plan_match_local_run() -> None:
    placement = toy_placement(SPEC, "v", 2)
    plan = Plan("toy-unet", "none", pp=2, dp=2, microbatch_size=2, num_microbatches=3, partitioner="toy",
                placement=placement, schedule=greedy_v_1f1b(placement, 3))
    plan = plan_from_dict(plan.to_dict(SPEC))  # what a launcher reads back
    backend, data = NumpyBackend(), [toy_batches(SPEC, 2, seed=r) for r in range(2)]
    net = FakeNetwork(plan.world_size, backend)
    executors = [executor_for_rank(plan, SPEC, r, backend, net.communicator(r), data[r // 2], mse_loss)
                 for r in range(plan.world_size)]
    run_all_ranks(executors)
    local = local_run(SPEC, placement, lower(plan.schedule, SPEC, placement), backend, data,
                      mse_loss, dp=2)
    local.step()
    expected = local.gradients()
    got = {n: g for ex in executors[:2] for n, g in ex.gradients().items()}
    assert all(np.array_equal(got[k], expected[k]) for k in expected)
    with pytest.raises(PlanError, match="outside the plan"):
        executor_for_rank(plan, SPEC, 4, backend, net.communicator(0), data[0], mse_loss)
