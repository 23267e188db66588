"""Emulate a slow link on one host: messages arrive when a link of that bandwidth would deliver them.

A real link is asynchronous: the sender hands the message to the NIC and goes
on computing; the bytes leave one after another on the sender's outbound link
and come in one after another on the receiver's inbound link. Emulated::

    sender   send(t) ─▶ out link: [ max(now, out_free) ── + n/B ]   from its start on,
                        the receiver's in link: the first free stretch of n/B   (the link board)
                        inner.send(t, stamp = when that stretch ends)  (returns at once, as before)
    receiver recv() ─▶ inner.recv ─▶ sleep until stamp + latency (the message "arrives")

The sender books the receiver's inbound stretch when it sends, on a board every
rank of the host shares (``pulse_torch.emulation.link_board``): a link carries bytes when
they are sent, whichever message the receiver asks for first, and a receiver fed
by two senders takes their messages in the order they were sent. The stretch is
the first gap from the send on (``pulse.link_slots.take_slot``), so a message
waiting for a busy receiver does not hold its sender's next one.
``pulse.sim.program`` times messages with the same two links and the same
function: one outbound and one inbound link per rank, ``bytes / bandwidth``
each, then ``latency``.

Stamps are ``time.monotonic_ns`` microseconds: CLOCK_MONOTONIC is one clock for
every process of a host, which is where this emulation runs (torchrun on one
machine). Receives, all-reduces and barriers of the data-parallel group are not
throttled: the emulation is about pipeline traffic, the part placement changes.

Used by ``python -m pulse_torch.train --emulate-bandwidth BYTES_PER_S``.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from pulse.errors import PulseError
from pulse.runtime.protocols import Communicator, CommunicatorWrapper, Tensor
from pulse.link_slots import InboundLinks
from pulse_torch.emulation.link_board import SharedLinks, now_us


class ThrottledCommunicator(CommunicatorWrapper):
    """``inner`` behind an emulated link of ``bandwidth`` bytes/s and ``latency`` s each way per rank;
    ``links``: the board its messages book receivers' inbound links on (one process's own by default);
    ``bookings``: where to note every send's (peer, start, hold, landed) in µs (checks; None: nowhere)."""

    def __init__(self, inner: Communicator, bandwidth: float, nbytes: Callable[[Tensor], int],
                 latency: float = 0.0, links: InboundLinks | SharedLinks | None = None,
                 bookings: list[tuple[int, int, int, int]] | None = None) -> None:
        if not (bandwidth > 0 and latency >= 0):
            raise PulseError(f"emulated link needs bandwidth > 0 and latency >= 0, got {bandwidth} and {latency}")
        super().__init__(inner)
        self.bandwidth = float(bandwidth)
        self.latency = float(latency)
        self._nbytes = nbytes
        self.out_free_us = 0  # when this rank's outbound link is free
        self.links = InboundLinks() if links is None else links
        self.throttled_seconds = 0.0  # total time this rank waited for emulated arrivals
        self.bookings = bookings

    def _hold_us(self, tensors: Sequence[Tensor]) -> int:
        return int(round(sum(self._nbytes(t) for t in tensors) / self.bandwidth * 1e6))

    def send(self, tensor: Tensor, peer_rank: int, tag: Any, timeout: float | None = None) -> None:
        self.send_group([tensor], peer_rank, [tag], timeout)

    def recv(self, peer_rank: int, tag: Any, timeout: float | None = None) -> Tensor:
        return self.recv_group(peer_rank, [tag], timeout)[0]

    def send_group(self, tensors: Sequence[Tensor], peer_rank: int, tags: Sequence[Any],
                   timeout: float | None = None) -> None:
        hold = self._hold_us(tensors)
        start = max(now_us(), self.out_free_us)
        self.out_free_us = start + hold
        landed = self.links.book(peer_rank, start, hold) + hold
        if self.bookings is not None:
            self.bookings.append((peer_rank, start, hold, landed))
        self.inner.send_group(tensors, peer_rank, tags, timeout, stamp=landed)  # type: ignore[attr-defined]

    def recv_group(self, peer_rank: int, tags: Sequence[Any], timeout: float | None = None) -> list[Tensor]:
        tensors = self.inner.recv_group(peer_rank, tags, timeout)  # type: ignore[attr-defined]
        landed = int(getattr(self.inner, "last_stamp", 0))
        wait = (landed - now_us()) / 1e6 + self.latency  # until it lands, latency included
        if wait > 0:
            time.sleep(wait)
            self.throttled_seconds += wait
        return tensors
