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
the last one received: from one sender (whose outbound link already spaced the
stamps) this is exactly ``pulse.sim.program``'s inbound FIFO.

Stamps are ``time.monotonic_ns`` microseconds: CLOCK_MONOTONIC is one clock for
every process of a host, which is where this emulation runs (torchrun on one
machine). ``pulse.sim.program`` models the same mechanism: one outbound and one
inbound link per rank, FIFO, ``bytes / bandwidth`` each, then ``latency``.
Receives, all-reduces and barriers of the data-parallel group are not throttled:
the emulation is about pipeline traffic, the part placement changes.

Used by ``python -m pulse_torch.train --emulate-bandwidth BYTES_PER_S``.
"""
from __future__ import annotations

import bisect
import time
from typing import Any, Callable, Sequence

from pulse.errors import PulseError
from pulse.runtime.protocols import Communicator, Tensor


MAX_SLOTS = 1024  # inbound slots remembered: a message is received long before a thousand later ones


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
        landed = self._take_inbound_slot(sent, self._hold_us(tensors))
        wait = (landed - _now_us()) / 1e6 + self.latency  # until it lands, latency included
        if wait > 0:
            time.sleep(wait)
            self.throttled_seconds += wait
        return tensors

    def _take_inbound_slot(self, stamp: int, hold: int) -> int:
        """The first gap of ``hold`` us on the inbound link from ``stamp`` on; its end."""
        start = stamp
        for begin, end in self.in_slots:
            if end <= start:
                continue
            if begin >= start + hold:
                break
            start = end
        bisect.insort(self.in_slots, (start, start + hold))
        del self.in_slots[:-MAX_SLOTS]
        return start + hold

    def all_reduce(self, tensor: Tensor, group: Sequence[int], timeout: float | None = None) -> Tensor:
        return self.inner.all_reduce(tensor, group, timeout)

    def barrier(self, timeout: float | None = None) -> None:
        self.inner.barrier(timeout)

    def __getattr__(self, name: str) -> Any:
        # Anything else the inner communicator offers (close(), groups, ...) stays reachable.
        if name == "inner":  # not set yet (mid-construction, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
