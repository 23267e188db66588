"""A rank's inbound link as the simulator and the link emulation both time it.

A message leaves on its sender's outbound link (FIFO, ``bytes / bandwidth``) and
takes the first free stretch of the receiver's inbound link from the moment it
started sending: a switched network buffers it while another sender holds the
receiver's link, and the sender's link goes on with its next message meanwhile.
Used by ``pulse.sim.program`` (what the planner prices) and, through
``pulse_torch.emulation.link_board``, by ``pulse_torch.emulation.throttle`` (what
``--emulate-bandwidth`` runs), so the two cannot differ in how contended links
are shared.
"""
from __future__ import annotations

import bisect

KEEP_SLOTS = 1024  # slots remembered: a message lands long before a thousand later ones


def take_slot(slots: list[tuple[float, float]], ready: float, hold: float) -> float:
    """The first gap of length ``hold`` on a link from ``ready`` on (``slots``: the (start, end)
    stretches already given, by start); recorded in ``slots``; its start."""
    start = ready
    i = max(bisect.bisect_left(slots, (ready,)) - 1, 0)  # stretches ending before ready are no obstacle
    while i < len(slots):
        begin, end = slots[i]
        i += 1
        if end <= start:
            continue
        if begin >= start + hold:
            break
        start = end
    bisect.insort(slots, (start, start + hold))
    del slots[:-KEEP_SLOTS]
    return start


class InboundLinks:
    """Every receiver's inbound link, booked by the senders of one process (the simulator, or one
    rank's emulation: ``pulse_torch.emulation.link_board.SharedLinks`` is the same across a host's ranks)."""

    def __init__(self) -> None:
        self.slots: dict[int, list[tuple[float, float]]] = {}

    def book(self, receiver: int, ready: float, hold: float) -> float:
        """The start of the first stretch of ``hold`` on ``receiver``'s inbound link from ``ready`` on."""
        return take_slot(self.slots.setdefault(receiver, []), ready, hold)
