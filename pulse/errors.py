"""User-facing errors: one clear line, exit code 2, no traceback (see pulse.cli)."""


class PulseError(Exception):
    """Bad input the user can fix. The message says what is wrong and how to fix it."""


class SpecError(PulseError):
    """A model spec that is malformed or inconsistent."""


class PlanError(PulseError):
    """A plan, placement or schedule that cannot be built or does not fit."""
