"""The closing line's words for a rank the kernel killed for memory: its last measured peak beside its predicted one.

::

    pulse train: the launch failed (rank 1: signal 9); out of memory: the kernel's out-of-memory killer
        ended rank 1 (1 kill in this job's memory cgroups); rank 1: last recorded peak 2.10 GiB at step 4,
        predicted 1.80 GiB (pipeline device 1)

The measured peak is log.json's latest ``peak_memory_bytes`` row (per rank; on a CPU what its
allocations held, ``pulse.train.resident``), the predicted one the plan's
``peak_memory_bytes_per_device`` for the rank's pipeline device (rank = replica * pp + device).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from pulse.plan import Plan
from pulse.train.out_of_memory import predicted_peak

GIB = 2**30


@dataclass(frozen=True)
class RunMemory:
    """What `pulse train` knows of its ranks' memory: where their peaks are logged and what was predicted."""

    log_path: Path
    pp: int
    dp: int
    predicted: Mapping[str, object]  # the plan's predicted figures

    @classmethod
    def of(cls, plan: Plan, out_dir: Path) -> "RunMemory":
        return cls(out_dir / "log.json", plan.pp, plan.dp, dict(plan.predicted))

    def predicted_peak(self, rank: int) -> tuple[int | None, int]:
        """The predicted peak of ``rank``'s pipeline device, and that device (``out_of_memory.predicted_peak``)."""
        return predicted_peak(self.predicted, self.pp, self.dp, rank)

    def last_peak(self, rank: int) -> tuple[int, int] | None:
        """(bytes, step) of ``rank``'s latest logged peak; None before its first logged step."""
        try:
            steps = json.loads(self.log_path.read_text())["steps"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        for row in reversed(steps if isinstance(steps, list) else []):
            peaks = row.get("peak_memory_bytes") if isinstance(row, dict) else None
            if isinstance(peaks, list) and rank < len(peaks) and isinstance(peaks[rank], (int, float)):
                return int(peaks[rank]), int(row.get("step", -1))
        return None

    def describe(self, rank: int) -> str:
        """``rank N: last recorded peak X GiB at step S, predicted Y GiB (pipeline device D)``."""
        seen = self.last_peak(rank)
        measured = "no step recorded" if seen is None else \
            f"last recorded peak {seen[0] / GIB:.2f} GiB at step {seen[1]}"
        predicted, device = self.predicted_peak(rank)
        guess = "not predicted" if predicted is None else f"predicted {predicted / GIB:.2f} GiB"
        return f"rank {rank}: {measured}, {guess} (pipeline device {device})"


def oom_note(kills: int, killed_ranks: Sequence[int], memory: RunMemory | None) -> str:
    """The words added to the closing line when the kill counters rose during the run (``kills`` > 0):
    which ranks died by SIGKILL, and each one's recorded and predicted peak."""
    counted = f"{kills} kill{'s' if kills > 1 else ''} in this job's memory cgroups"
    if not killed_ranks:
        return f"out of memory: the kernel's out-of-memory killer ended a process of this job ({counted})"
    names = ", ".join(f"rank {r}" for r in killed_ranks)
    note = f"out of memory: the kernel's out-of-memory killer ended {names} ({counted})"
    if memory is not None:
        note += "; " + "; ".join(memory.describe(r) for r in killed_ranks)
    return note
