"""The inbound link's first-gap rule, shared by the simulator and the link emulation."""
from __future__ import annotations

import pytest

from pulse.link_slots import KEEP_SLOTS, take_slot


@pytest.mark.parametrize("given, ready, hold, start", [
    ([], 5.0, 2.0, 5.0),  # a free link: at once
    ([(10.0, 14.0)], 0.0, 5.0, 0.0),  # before a later message's stretch, when it fits
    ([(0.0, 4.0), (10.0, 14.0)], 1.0, 3.0, 4.0),  # into the gap after the busy stretch
    ([(0.0, 4.0), (6.0, 10.0)], 1.0, 3.0, 10.0),  # the gap is too short: after the next stretch
    ([(0.0, 4.0), (4.0, 8.0), (9.0, 12.0)], 5.0, 1.0, 8.0),  # the first gap long enough, from ready on
    ([(0.0, 2.0)], 3.0, 1.0, 3.0),  # stretches that ended before ready are no obstacle
])
def test_takes_the_first_gap_long_enough_from_ready_on(given, ready, hold, start) -> None:
    slots = list(given)
    assert take_slot(slots, ready, hold) == start
    assert (start, start + hold) in slots and slots == sorted(slots)
    assert all(a[1] <= b[0] for a, b in zip(slots, slots[1:]))  # stretches never overlap


def test_remembers_the_newest_slots_only() -> None:
    slots: list[tuple[float, float]] = []
    for k in range(KEEP_SLOTS + 10):
        take_slot(slots, float(k), 1.0)
    assert len(slots) == KEEP_SLOTS and slots[-1] == (KEEP_SLOTS + 9.0, KEEP_SLOTS + 10.0)
