"""What the executor records of each action it runs, when asked for a timeline
(``StageExecutor.timeline``): ``pulse train --trace``'s measured spans and ``pulse profile``'s figures."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ActionSpan:
    """When one action ran on this rank (``time.perf_counter`` seconds): the measured
    twin of the simulator's ``ComputeSpan`` / message events. ``cpu``: the processor time the
    rank's thread spent in it (``time.thread_time``): wall time minus waiting and being preempted."""

    label: str  # the action's text form, "0F3", "1SB2:0", ...
    kind: str
    chunk: int | None  # None for E and SE: they run an encoder
    microbatch: int
    start: float
    end: float
    cpu: float = 0.0
    encoder: int | None = None  # E, SE, RE
    marks: tuple[Any, Any] | None = None  # its start and end on the backend's device_clock, where it has one

    def seconds(self, clock: Any = None) -> float:
        """How long it ran: on ``clock`` (a ``DeviceClock``) between its marks, else the host's span."""
        return self.end - self.start if self.marks is None or clock is None else clock.seconds(*self.marks)
