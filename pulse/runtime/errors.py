"""Runtime errors: each names the rank, the action and what it waited for."""
from pulse.errors import PlanError, PulseError


class ScheduleOrderError(PlanError):
    """An action needs something no earlier action of its rank provided."""


class DeadlockError(PulseError):
    """Every unfinished rank waits for a message or collective that never comes."""


class CommTimeout(PulseError):
    """A real communicator gave up waiting (the fake one reports deadlocks instead)."""
