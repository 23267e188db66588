"""The fake ProcessGroupNCCL (``tests/fake_nccl.py``) is as strict as a device: each of its checks
raises on a deliberately broken input, and lets the same input through done right.

One thread can play both ranks (``join`` switches); what blocks runs in threads."""
from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from fake_nccl import FakeNccl, MessageMisuse, PeerFailed  # noqa: E402
from pulse.errors import PlanError  # noqa: E402
from pulse.runtime.errors import DeadlockError  # noqa: E402

EAGER = 1 << 20  # every message here fits NCCL's buffer: a send completes at once


def fake(monkeypatch, world: int = 2, eager_bytes: int = 0, mailbox: bool = False) -> FakeNccl:
    return FakeNccl(world, eager_bytes, mailbox).install(monkeypatch)


def send(f: FakeNccl, rank: int, tensor: torch.Tensor, dst: int, label=None, tag: int = 0):
    f.join(rank)
    if label is None:
        return dist.isend(tensor, dst, tag=tag)
    with f.labelled(label):
        return dist.isend(tensor, dst, tag=tag)


def recv(f: FakeNccl, rank: int, tensor: torch.Tensor, src: int, label=None, tag: int = 0):
    f.join(rank)
    if label is None:
        return dist.irecv(tensor, src, tag=tag)
    with f.labelled(label):
        return dist.irecv(tensor, src, tag=tag)


# -- a receive gets the message its sender meant for it ------------------------------------------
def test_two_same_sized_messages_received_in_swapped_order_raise(monkeypatch) -> None:
    f = fake(monkeypatch)
    a, b = torch.full((4,), 1.0), torch.full((4,), 2.0)
    send(f, 0, a, 1, "a")
    send(f, 0, b, 1, "b")
    with pytest.raises(MessageMisuse, match=r"posted a receive for 'b' from rank 0, and NCCL's order gave it "
                                            r"rank 0's send #0 to rank 1 \('a' part 1/1\)"):
        recv(f, 1, torch.empty(4), 0, "b")


def test_receives_in_the_senders_order_get_its_bytes(monkeypatch) -> None:
    f = fake(monkeypatch)
    a, b = torch.full((4,), 1.0), torch.full((4,), 2.0)
    works = [send(f, 0, a, 1, "a"), send(f, 0, b, 1, "b")]
    got = [torch.empty(4), torch.empty(4)]
    works += [recv(f, 1, got[0], 0, "a"), recv(f, 1, got[1], 0, "b")]
    for w in works[2:]:
        w.wait()
    f.join(0)
    for w in works[:2]:
        w.wait()
    assert got[0].tolist() == [1.0] * 4 and got[1].tolist() == [2.0] * 4 and f.unreleased == []


def test_a_consumer_that_takes_a_buffer_as_another_message_raises(monkeypatch) -> None:
    """Unlabelled receives (as ``pulse_torch.comm`` posts them): the check is where the bytes are used."""
    f = fake(monkeypatch, eager_bytes=EAGER)
    a, b = torch.full((4,), 1.0), torch.full((4,), 2.0)
    send(f, 0, a, 1, "a")
    send(f, 0, b, 1, "b")
    first, second = torch.empty(4), torch.empty(4)
    for buf in (first, second):
        recv(f, 1, buf, 0).wait()
    with pytest.raises(MessageMisuse, match=r"took 'a' from rank 0, but its bytes are rank 0's send #1"):
        f.check_received([second], 0, "a")
    f.failed = None  # the misuse above ended the fake's run; go on to show what passes
    f.check_received([first[:2], first[2:]], 0, "a")  # views of one buffer: one message
    with pytest.raises(MessageMisuse, match="nobody took yet"):
        f.check_received([first], 0, "a")  # taken already


def test_a_header_taken_as_its_payload_raises(monkeypatch) -> None:
    """Two sends under one label are its parts (header, payload): only the last is the message."""
    f = fake(monkeypatch, eager_bytes=EAGER)
    header, payload = torch.full((4,), 7.0), torch.full((4,), 8.0)
    f.join(0)
    with f.labelled("m"):
        dist.isend(header, 1)
        dist.isend(payload, 1)
    bufs = [torch.empty(4), torch.empty(4)]
    for buf in bufs:
        recv(f, 1, buf, 0).wait()
    with pytest.raises(MessageMisuse, match=r"'m' part 1/2"):
        f.check_received([bufs[0]], 0, "m")
    f.failed = None
    f.check_received([bufs[1]], 0, "m")


def test_sizes_still_must_match_on_nccl(monkeypatch) -> None:
    f = fake(monkeypatch)
    keep = torch.ones(4)
    send(f, 0, keep, 1)
    with pytest.raises(PlanError, match="sender's order"):
        recv(f, 1, torch.empty(5), 0)


# -- a send buffer is NCCL's until its send completed ----------------------------------------------
def test_a_send_buffer_written_before_its_send_completed_raises(monkeypatch) -> None:
    f = fake(monkeypatch)
    t = torch.ones(4)
    send(f, 0, t, 1)
    t.add_(1)  # the receive is not posted yet: NCCL has not read the buffer
    with pytest.raises(MessageMisuse, match=r"written \(version 0 -> 1\) before its send completed"):
        recv(f, 1, torch.empty(4), 0)


def test_a_write_the_version_counter_misses_is_caught_by_the_snapshot(monkeypatch) -> None:
    f = fake(monkeypatch)
    t = torch.ones(4)
    send(f, 0, t, 1)
    t.data.mul_(3)  # .data shares the storage, not the version counter
    with pytest.raises(MessageMisuse, match="written"):
        recv(f, 1, torch.empty(4), 0)


def test_a_send_buffer_written_after_completion_but_before_wait_raises(monkeypatch) -> None:
    """Completed in NCCL's buffer, but the host has not learnt it: on a device the write may run first."""
    f = fake(monkeypatch, eager_bytes=EAGER)
    t = torch.ones(4)
    work = send(f, 0, t, 1)
    got = torch.empty(4)
    recv(f, 1, got, 0).wait()
    t.zero_()
    f.join(0)
    with pytest.raises(MessageMisuse, match="before its work's wait()"):
        work.wait()
    assert got.tolist() == [1.0] * 4  # the receiver got the bytes as the completion read them


@pytest.mark.parametrize("learn", ["wait", "is_completed"])
def test_a_send_buffer_reused_once_the_sender_learnt_its_send_completed_is_fine(monkeypatch, learn) -> None:
    f = fake(monkeypatch, eager_bytes=EAGER)
    t = torch.ones(4)
    work = send(f, 0, t, 1)
    assert work.wait() if learn == "wait" else work.is_completed()
    t.zero_()
    got = torch.empty(4)
    recv(f, 1, got, 0).wait()
    assert got.tolist() == [1.0] * 4 and f.unreleased == []


def test_a_send_buffer_freed_before_its_send_completed_raises(monkeypatch) -> None:
    f = fake(monkeypatch)
    work = send(f, 0, torch.ones(4), 1)  # nobody keeps the tensor: its memory may go to the next allocation
    with pytest.raises(MessageMisuse, match="was freed before its send completed"):
        recv(f, 1, torch.empty(4), 0)
    assert work is not None


def test_a_send_buffer_whose_storage_is_released_raises(monkeypatch) -> None:
    f = fake(monkeypatch)
    t = torch.ones(4)
    send(f, 0, t, 1)
    t.untyped_storage().resize_(0)  # as FSDP frees a flat parameter's storage
    with pytest.raises(MessageMisuse, match="storage .* was released"):
        recv(f, 1, torch.empty(4), 0)


def test_sends_never_waited_for_stay_unreleased(monkeypatch) -> None:
    f = fake(monkeypatch, eager_bytes=EAGER)
    t = torch.ones(4)
    send(f, 0, t, 1)
    recv(f, 1, torch.empty(4), 0).wait()
    assert [s.sender for s in f.unreleased] == [0]


def test_an_all_reduce_buffer_written_before_its_wait_raises(monkeypatch) -> None:
    f = fake(monkeypatch, world=1)
    f.join(0)
    t = torch.ones(3)
    work = dist.all_reduce(t, async_op=True)
    t.add_(1)
    with pytest.raises(MessageMisuse, match="before its wait"):
        work.wait()
    ok = torch.ones(3)
    f.failed = None
    dist.all_reduce(ok, async_op=True).wait()
    assert ok.tolist() == [1.0] * 3


# -- the mailbox network the NCCL runs are compared with ---------------------------------------
def test_mailbox_mode_matches_by_tag_and_takes_a_message_into_a_larger_buffer(monkeypatch) -> None:
    f = fake(monkeypatch, mailbox=True)
    a, b = torch.full((4,), 1.0), torch.full((2,), 2.0)
    send(f, 0, a, 1, tag=1)
    send(f, 0, b, 1, tag=2)
    got_b, got_a = torch.zeros(3), torch.zeros(4)
    recv(f, 1, got_b, 0, tag=2).wait()
    recv(f, 1, got_a, 0, tag=1).wait()
    assert got_a.tolist() == [1.0] * 4 and got_b.tolist() == [2.0, 2.0, 0.0]
    assert dist.get_backend() == "gloo"


# -- a deadlock is every rank waiting; a crash is not a deadlock ----------------------------------
def run_threads(f: FakeNccl, bodies) -> list[BaseException | None]:
    errors: list[BaseException | None] = [None] * len(bodies)

    def main(rank: int) -> None:
        f.join(rank)
        try:
            bodies[rank]()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors[rank] = exc
        finally:
            f.leave(errors[rank])
    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return errors


def test_two_ranks_receiving_first_deadlock_each_with_deadlock_error(monkeypatch) -> None:
    f = fake(monkeypatch)
    errors = run_threads(f, [lambda: dist.irecv(torch.empty(1), 1).wait(),
                             lambda: dist.irecv(torch.empty(1), 0).wait()])
    assert all(isinstance(e, DeadlockError) for e in errors), errors
    assert "rank 0 waits for recv #0 from rank 1" in str(errors[0])


def test_a_rank_that_crashed_leaves_its_peers_a_peer_failure_not_a_deadlock(monkeypatch) -> None:
    f = fake(monkeypatch)

    def crash() -> None:
        raise RuntimeError("out of memory")
    errors = run_threads(f, [lambda: dist.irecv(torch.empty(1), 1).wait(), crash])
    assert isinstance(errors[0], PeerFailed) and not isinstance(errors[0], DeadlockError), errors
    assert "rank 1 left with RuntimeError: out of memory" in str(errors[0])
