"""A measured cost table as the tuner's profiler (`pulse tune --costs`).

A table from `pulse profile` holds one microbatch size's times. The tuner searches that
size alone: scaling the measured times to other sizes by the analytic ratio would put a
roofline guess (which mispriced real size by 44%, issue #43) back under every figure the
user profiled to get rid of, so a size that was not measured is refused, not estimated.
"""
from __future__ import annotations

from dataclasses import dataclass

from pulse.costs import CostTable
from pulse.errors import PulseError
from pulse.spec import ModelSpec


@dataclass(frozen=True)
class MeasuredProfiler:
    """``Profiler``: the measured ``table`` for its own microbatch size, and nothing else."""

    table: CostTable
    path: str = "the cost table"  # how errors name it (the --costs file)

    def profile(self, spec: ModelSpec, microbatch_size: int) -> CostTable:
        if microbatch_size != self.table.microbatch_size:
            raise PulseError(f"{self.path} was measured at microbatch size {self.table.microbatch_size}, not "
                             f"{microbatch_size}: search --microbatch-sizes {self.table.microbatch_size}, or "
                             f"profile at {microbatch_size} (`pulse profile --microbatch-size {microbatch_size}`)")
        self.table.check_matches(spec)
        return self.table

    @property
    def microbatch_sizes(self) -> tuple[int, ...]:
        """The sizes the tuner may search with this table."""
        return (self.table.microbatch_size,)
