"""The emulated links' board: senders book a receiver's inbound link when they send, across processes."""
from __future__ import annotations

import multiprocessing
import random

import pytest

torch = pytest.importorskip("torch")

from pulse.link_slots import take_slot  # noqa: E402
from pulse_torch.backend import TorchBackend  # noqa: E402
from pulse.link_slots import InboundLinks  # noqa: E402
from pulse_torch.emulation.link_board import SharedLinks  # noqa: E402
from pulse_torch.emulation.throttle import ThrottledCommunicator  # noqa: E402
from virtual_clock import VirtualClock  # noqa: E402


def synthetic_present() -> int:
    """The tests' stamps count from 0: their present, so that no stretch has ended yet."""
    return 0


def _book_many(directory: str, seed: int, count: int, out) -> None:
    links, rng = SharedLinks(directory, clock=synthetic_present), random.Random(seed)
    out.put([(start, start + hold) for ready, hold in ((rng.randrange(0, 5000), rng.randrange(1, 20))
                                                       for _ in range(count))
             for start in [links.book(0, ready, hold)]])
    links.close()


def test_stretches_booked_by_two_processes_at_once_never_overlap(tmp_path) -> None:
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    workers = [context.Process(target=_book_many, args=(str(tmp_path), seed, 300, out)) for seed in (1, 2)]
    for worker in workers:
        worker.start()
    booked = sorted(out.get(timeout=60) + out.get(timeout=60))
    for worker in workers:
        worker.join(timeout=60)
    assert len(booked) == 600
    assert all(a[1] <= b[0] for a, b in zip(booked, booked[1:])), "two messages on one inbound link at once"


def test_the_shared_board_books_as_one_process_does(tmp_path) -> None:
    shared, local, rng = SharedLinks(tmp_path, clock=synthetic_present), InboundLinks(), random.Random(0)
    for _ in range(200):
        receiver, ready, hold = rng.randrange(3), rng.randrange(0, 3000), rng.randrange(1, 30)
        assert shared.book(receiver, ready, hold) == local.book(receiver, ready, hold)
    assert shared.book(7, 0, 5) == 0  # a rank nobody sent to: a free link
    assert SharedLinks(tmp_path, clock=synthetic_present).book(0, 0, 1) == local.book(0, 0, 1)  # another process's view: the same
    shared.close()


class _Switch:
    """Inner communicators of several ranks on one process: every message waits, with its stamp,
    until its receiver asks for its tag (the runtime posts receives ahead, in its own order)."""

    def __init__(self) -> None:
        self.queues: dict[int, list[tuple[int, list, int]]] = {}

    def rank_end(self, rank: int):
        switch = self

        class End:
            bytes_sent: dict[int, int] = {}
            last_stamp = 0

            def send_group(self, tensors, peer_rank, tags, timeout=None, stamp=0):
                switch.queues.setdefault(peer_rank, []).append((tags[0], list(tensors), stamp))

            def recv_group(self, peer_rank, tags, timeout=None):
                queue = switch.queues[rank]
                i = next(i for i, (tag, _, _) in enumerate(queue) if tag == tags[0])
                _, tensors, self.last_stamp = queue.pop(i)
                return tensors

        End.rank = rank
        return End()


def test_a_receiver_fed_by_two_senders_takes_their_messages_in_the_order_they_were_sent(monkeypatch) -> None:
    """Rank 1 sends four messages (40 ms each on the link) to rank 2, then rank 3 sends one. Rank 3's
    message finds rank 2's inbound link booked until 160 ms and lands at 200 ms, even though rank 2
    asks for it first; rank 1's four are there by then."""
    clock = VirtualClock().drive_throttle(monkeypatch)
    backend, switch, links = TorchBackend(), _Switch(), InboundLinks()
    ranks = {r: ThrottledCommunicator(switch.rank_end(r), 1e5, backend.nbytes, links=links) for r in (1, 2, 3)}
    sent = clock.us
    for k in range(4):
        ranks[1].send(torch.zeros(1000), 2, ("F", k))
    ranks[3].send(torch.zeros(1000), 2, ("B", 0))
    assert clock.sleeps == [], "a send must not block the sender"
    assert [stamp - sent for _, _, stamp in switch.queues[2]] == [40_000, 80_000, 120_000, 160_000, 200_000]
    ranks[2].recv(3, ("B", 0))
    assert clock.us - sent == 200_000
    for k in range(4):
        ranks[2].recv(1, ("F", k))
    assert clock.us - sent == 200_000 and len(clock.sleeps) == 1  # landed while rank 3's was on the link




def test_with_one_sender_booking_at_the_receiver_in_any_order_lands_every_message_alike() -> None:
    """Why the P = 2 rows of benchmarks/validate.py, measured while the receiver booked its inbound
    link when it took a message, stand: with one sender per receiver its outbound link spaces the
    messages a hold apart, so whichever order they are booked in, each lands at its own stretch."""
    rng = random.Random(3)
    for _ in range(50):
        sends, free = [], 0
        for _ in range(12):
            start = max(rng.randrange(0, 400), free)
            hold = rng.randrange(1, 40)
            sends.append((start, hold))
            free = start + hold
        links = InboundLinks()
        at_send = [links.book(1, start, hold) + hold for start, hold in sends]
        slots: list[tuple[int, int]] = []
        order = list(range(len(sends)))
        rng.shuffle(order)
        at_receive = {i: take_slot(slots, sends[i][0], sends[i][1]) + sends[i][1] for i in order}
        assert at_send == [at_receive[i] for i in range(len(sends))]


def test_a_stretch_that_ended_after_a_late_senders_stamp_still_blocks_it(tmp_path) -> None:
    """A sender stamps its ready time, then waits for the board's lock (a loaded host hands it over late):
    a stretch that ended between its stamp and the lock must still push it back, or the receiver's link
    would carry two messages at once (seen in a full suite run: rank 1's inbound link)."""
    present = {"us": 100}
    links = SharedLinks(tmp_path, clock=lambda: present["us"])
    assert links.book(0, ready=100, hold=50) == 100  # the link is busy 100..150
    present["us"] = 200  # the next sender stamped 120, but got the lock only now
    assert links.book(0, ready=120, hold=10) == 150  # after the first stretch, not overlapping it
    present["us"] = 1000
    assert links.book(0, ready=1000, hold=5) == 1000  # stretches ended before the stamp block nothing
    links.close()
