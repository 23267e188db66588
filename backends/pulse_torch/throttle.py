"""Emulate a slow link on one host: messages arrive when a link of that bandwidth would deliver them.

A real link is asynchronous: the sender hands the message to the NIC and goes
on computing; the bytes leave one after another on the sender's outbound link
and come in one after another on the receiver's inbound link. Emulated::

    sender   send(t) ─▶ out link: [ max(now, out_free) ── + n/B ]   stamp = when it started
                        inner.send(t, stamp)  (returns at once, as before)
    receiver recv() ─▶ inner.recv ─▶ in link: the first free slot of n/B from the stamp on,
                        + latency; sleep until then (the message "arrives")

A link delivers whether or not the receiver has asked yet: a message received
after a later-sent one (the receiver's list takes them in another order) still
had its slot on the inbound link at its stamp. So the inbound link keeps the
slots it gave and a message takes the first gap after its stamp, not the end of
the last one received (``pulse.link_slots.take_slot``, which ``pulse.sim.program``
times with too).

Stamps are ``time.monotonic_ns`` microseconds: CLOCK_MONOTONIC is one clock for
every process of a host, which is where this emulation runs (torchrun on one
machine). ``pulse.sim.program`` models the same mechanism: one outbound and one
inbound link per rank, ``bytes / bandwidth`` each, then ``latency``, with one
difference: it gives a message its inbound stretch when it is sent, and this
emulation when the receiver takes it. A receive posted ahead cannot tell that
its message is here before it is waited on (gloo's ``Work.is_completed`` stays
false until then), so messages still unread cannot claim the link first: a
receiver fed by two senders may let a later message in ahead of earlier ones.
Receives, all-reduces and barriers of the data-parallel group are not throttled:
the emulation is about pipeline traffic, the part placement changes.

Used by ``python -m pulse_torch.train --emulate-bandwidth BYTES_PER_S``.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from pulse.errors import PulseError
from pulse.link_slots import take_slot
from pulse.runtime.protocols import Communicator, Tensor


def _now_us() -> int:
    return time.monotonic_ns() // 1000


class ThrottledCommunicator:
    """``inner`` behind an emulated link of ``bandwidth`` bytes/s and ``latency`` s each way per rank."""

    def __init__(self, inner: Communicator, bandwidth: float, nbytes: Callable[[Tensor], int],
                 latency: float = 0.0) -> None:
        if not (bandwidth > 0 and latency >= 0):
            raise PulseError(f"emulated link needs bandwidth > 0 and latency >= 0, got {bandwidth} and {latency}")
        self.inner = inner
        self.bandwidth = float(bandwidth)
        self.latency = float(latency)
        self._nbytes = nbytes
        self.out_free_us = 0  # when this rank's outbound link is free
        self.in_slots: list[tuple[int, int]] = []  # (start, end) its inbound link gave, by start; the newest kept
        self.throttled_seconds = 0.0  # total time this rank waited for emulated arrivals

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def bytes_sent(self) -> dict[int, int]:
        return self.inner.bytes_sent

    @property
    def allreduce_bytes(self) -> int:
        return self.inner.allreduce_bytes

    def _hold_us(self, tensors: Sequence[Tensor]) -> int:
        return int(round(sum(self._nbytes(t) for t in tensors) / self.bandwidth * 1e6))

    def send(self, tensor: Tensor, peer_rank: int, tag: Any, timeout: float | None = None) -> None:
        self.send_group([tensor], peer_rank, [tag], timeout)

    def recv(self, peer_rank: int, tag: Any, timeout: float | None = None) -> Tensor:
        return self.recv_group(peer_rank, [tag], timeout)[0]

    def send_group(self, tensors: Sequence[Tensor], peer_rank: int, tags: Sequence[Any],
                   timeout: float | None = None) -> None:
        start = max(_now_us(), self.out_free_us)
        self.out_free_us = start + self._hold_us(tensors)
        self.inner.send_group(tensors, peer_rank, tags, timeout, stamp=start)  # type: ignore[attr-defined]

    def recv_group(self, peer_rank: int, tags: Sequence[Any], timeout: float | None = None) -> list[Tensor]:
        tensors = self.inner.recv_group(peer_rank, tags, timeout)  # type: ignore[attr-defined]
        sent = int(getattr(self.inner, "last_stamp", 0))
        hold = self._hold_us(tensors)
        landed = take_slot(self.in_slots, sent, hold) + hold
        wait = (landed - _now_us()) / 1e6 + self.latency  # until it lands, latency included
        if wait > 0:
            time.sleep(wait)
            self.throttled_seconds += wait
        return tensors

    def all_reduce(self, tensor: Tensor, group: Sequence[int], timeout: float | None = None) -> Tensor:
        return self.inner.all_reduce(tensor, group, timeout)

    def barrier(self, timeout: float | None = None) -> None:
        self.inner.barrier(timeout)

    def __getattr__(self, name: str) -> Any:
        # Anything else the inner communicator offers (close(), groups, ...) stays reachable.
        if name == "inner":  # not set yet (mid-construction, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
