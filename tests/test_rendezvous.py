"""The fake network's rendezvous mode: messages moved as NCCL and HCCL move them.

``pulse.runtime.rendezvous`` holds NCCL's rules (order matching, one stream per rank pair and
process group, a send larger than the buffer completes only with its receive). Under them, what
one process group per pair does (both directions on one stream, receives posted when reached)
hangs every 1F1B-like schedule; a process group per direction with receives posted in the
sender's order (what ``pulse_torch.comm`` and the fake's ``RendezvousCommunicator`` do) runs
every schedule the planners make, and the gradients are those of the mailbox network.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

import pulse.runtime.executor as executor_module
from pulse.errors import PlanError
from pulse.hardware import load_cluster
from pulse.runtime.errors import DeadlockError
from pulse.runtime.wiring import MessageTag
from pulse.testing.fake_comm import FakeNetwork
from pulse.testing.fake_rendezvous import RendezvousRules
from pulse.testing.local import local_run
from pulse.testing.numpy_backend import NumpyBackend
from pulse.runtime.rendezvous import RendezvousStreams
from pulse.testing.toy import mse_loss, toy_batches, toy_placement, toy_unet_spec
from pulse.schedule.generators import applicable_baselines, make_schedule
from pulse.schedule.lower import lower
from pulse.synth.synthesize import ILP_NAME, tiled_route, to_schedule
from test_runtime_equivalence import B, CASES, M, SPEC, placement_for, schedule_for, unit_costs

DIRECTION = RendezvousRules()  # every message waits for its receive; a process group per direction
OLD_LAYOUT = RendezvousRules(channels="pair")  # one process group: both directions on one stream


def run(spec, placement, program, rendezvous, microbatch_size=B):
    r = local_run(spec, placement, program, NumpyBackend(), toy_batches(spec, microbatch_size), mse_loss,
                  rendezvous=rendezvous)
    r.step()
    return r


def assert_same_gradients(got, want) -> None:
    a, b = got.gradients(), want.gradients()
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


# -- the rules themselves ---------------------------------------------------------------
def test_a_large_send_completes_only_with_its_receive_and_a_small_one_at_once() -> None:
    net = RendezvousStreams(eager_bytes=100)
    small = net.send(0, 1, "g", 100, "a")
    large = net.send(0, 1, "g", 101, "b")
    net.progress()
    assert small.done and not large.done  # the large one waits at the head of rank 0's stream
    first, second = net.recv(1, 0, "g", 100), net.recv(1, 0, "g", 101)
    net.progress()
    assert (first.payload, second.payload) == ("a", "b") and large.done


def test_one_stream_for_both_directions_blocks_two_ranks_that_send_first() -> None:
    for shared in (True, False):
        net = RendezvousStreams()
        up, down = ("g", "g") if shared else ("up", "down")
        net.send(0, 1, up, 8, "to 1")
        net.send(1, 0, down, 8, "to 0")
        got = [net.recv(0, 1, down, 8), net.recv(1, 0, up, 8)]
        net.progress()
        assert all(not op.done for op in got) == shared, net.heads()


def test_receives_posted_out_of_the_senders_order_are_an_error() -> None:
    net = RendezvousStreams()
    net.send(0, 1, "g", 8, "first", key=1)
    net.recv(1, 0, "g", None, key=2)  # NCCL would write message 1 into message 2's buffer
    with pytest.raises(PlanError, match="sender's order"):
        net.progress()


# -- the communicator: a message's identity rides beside it, a send's tensors are read at completion --
def pair(rules: RendezvousRules = DIRECTION, order=((0, 0), (0, 1))):
    """Ranks 0 and 1 on a rendezvous network; rank 1 expects ``order``'s (transfer, microbatch)
    activations from rank 0 in that order."""
    net = FakeNetwork(2, NumpyBackend(), rules)
    tags = {(t, mb): MessageTag("F", t, mb, 0, "h") for t, mb in order}
    net.communicator(1).expect_inbound({0: [(tags[k].as_int(),) for k in order]})
    return net.communicator(0), net.communicator(1), tags


def test_two_same_sized_messages_expected_in_swapped_order_are_an_error() -> None:
    sender, receiver, tags = pair(order=((0, 1), (0, 0)))  # rank 1 expects mb1 first; rank 0 sends mb0 first
    sender.send_group([np.zeros(4)], 1, [tags[(0, 0)]])
    sender.send_group([np.ones(4)], 1, [tags[(0, 1)]])
    with pytest.raises(PlanError, match="sender's order"):
        receiver.recv_group(0, [tags[(0, 1)]])


def test_a_tensor_written_before_its_send_completed_is_an_error() -> None:
    sender, receiver, tags = pair()
    h = np.ones(4)
    sender.send_group([h], 1, [tags[(0, 0)]])
    h += 1  # nobody received it yet: on NCCL the send has not read it
    with pytest.raises(PlanError, match="written before the send completed"):
        receiver.recv_group(0, [tags[(0, 0)]])


def test_a_tensor_written_before_wait_sends_learnt_its_send_completed_is_an_error() -> None:
    sender, receiver, tags = pair(RendezvousRules(eager_bytes=1 << 20))
    h = np.ones(4)
    sender.send_group([h], 1, [tags[(0, 0)]])  # fits NCCL's buffer: complete at once, read then
    h *= 3
    np.testing.assert_array_equal(receiver.recv_group(0, [tags[(0, 0)]])[0], np.ones(4))
    with pytest.raises(PlanError, match="written before wait_sends learnt it completed"):
        sender.wait_sends()


def test_a_tensor_reused_after_wait_sends_is_fine() -> None:
    sender, receiver, tags = pair(RendezvousRules(eager_bytes=1 << 20))
    h = np.ones(4)
    sender.send_group([h], 1, [tags[(0, 0)]])
    sender.wait_sends()
    h *= 3
    got = receiver.recv_group(0, [tags[(0, 0)]])[0]
    np.testing.assert_array_equal(got, np.ones(4))
    got += 1  # the receiver's copy is its own
    np.testing.assert_array_equal(h, 3 * np.ones(4))


# -- the hangs a single process group gives, and the fix ---------------------------------------
@pytest.mark.parametrize("case,P", [("v-greedy", 2), ("v-greedy", 4), ("v-zbv", 2), ("seq-1f1b", 4),
                                    ("interleaved", 2)])
def test_one_stream_per_pair_hangs_what_nccl_hangs(monkeypatch, case: str, P: int) -> None:
    """Today's message order replayed under NCCL's rules (``shared/repro/nccl_order_sim.py``):
    receives posted when reached, both directions on one stream. Only GPipe survives."""
    monkeypatch.setattr(executor_module, "RECV_LOOKAHEAD", 0)
    placement = placement_for(case, P)
    program = schedule_for(case, placement)
    with pytest.raises(DeadlockError, match="stream heads"):
        run(SPEC, placement, program, OLD_LAYOUT)
    run(SPEC, placement, program, RendezvousRules(channels="pair", eager_bytes=1 << 30))  # small messages pass
    assert_same_gradients(run(SPEC, placement, program, DIRECTION), run(SPEC, placement, program, None))


def test_gpipe_survives_one_stream_per_pair(monkeypatch) -> None:
    monkeypatch.setattr(executor_module, "RECV_LOOKAHEAD", 0)
    placement = placement_for("seq-gpipe", 4)
    run(SPEC, placement, schedule_for("seq-gpipe", placement), OLD_LAYOUT)


# -- every schedule the planners make runs under rendezvous ------------------------------------
@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_every_generator_trains_under_rendezvous(case: str, P: int) -> None:
    placement = placement_for(case, P)
    program = schedule_for(case, placement)
    assert_same_gradients(run(SPEC, placement, program, DIRECTION), run(SPEC, placement, program, None))


@pytest.mark.parametrize("kind,P", [("v", 2), ("v", 4), ("wave", 2)])
def test_the_ilp_schedule_trains_under_rendezvous(kind: str, P: int) -> None:
    placement = toy_placement(SPEC, kind, P, folds=2 if kind == "wave" else 1)
    orders, _, _ = tiled_route(SPEC, placement, unit_costs(SPEC), load_cluster("ascend-910a"), 2 * P, None, 10.0,
                               None, lambda _: None)
    assert orders is not None
    program = lower(to_schedule(ILP_NAME, 2 * P, orders), SPEC, placement)
    assert_same_gradients(run(SPEC, placement, program, DIRECTION), run(SPEC, placement, program, None))


def random_plans(count: int, seed: int = 7):
    """Random toy models, placements, schedules and microbatch counts (as the fuzz pass draws them)."""
    rng = random.Random(seed)
    for _ in range(count):
        spec = toy_unet_spec(depth=rng.randint(3, 7), width=rng.randint(2, 5))
        P = rng.choice([2, 3, 4])
        kind = rng.choice(["sequential", "interleaved", "v", "wave"])
        folds = 2 if kind in ("interleaved", "wave") else 1
        if spec.num_layers < P * folds * (2 if kind in ("v", "wave") else 1):
            continue
        placement = toy_placement(spec, kind, P, folds=folds,
                                  transport=rng.choice(["relay", "direct"]) if kind != "v" else None)
        mb = rng.choice([P, 2 * P, 2 * P + 1])
        names = applicable_baselines(placement, mb)
        yield spec, placement, lower(make_schedule(rng.choice(names), placement, mb), spec, placement)


def test_random_plans_train_under_rendezvous() -> None:
    ran = 0
    for spec, placement, program in random_plans(30):
        got = run(spec, placement, program, DIRECTION, microbatch_size=1)
        assert_same_gradients(got, run(spec, placement, program, None, microbatch_size=1))
        ran += 1
    assert ran >= 15
