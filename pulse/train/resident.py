"""A CPU rank's measured memory: the process's resident peak above what it held before building its stage.

::

    probe = ResidentPeak.start()     before the rank builds its stage: the kernel's high-water mark
                                     reset to the resident size now (/proc/self/clear_refs "5"),
                                     that size kept as the baseline
    probe.peak_above_baseline()      VmHWM - baseline: the most the stage, its optimizer, its
                                     activations and messages held at once, as the host sees it

On a CPU nothing else counts a rank's tensors (no allocator statistics), and the
host's memory is what the ranks share and what the out-of-memory killer judges, so
this is the twin of the simulator's per-device peak there. Where the high-water
mark cannot be reset (an old kernel, a read-only /proc), the peak is the process's
whole-life VmHWM above the baseline: an over-estimate only if something before the
baseline held more than the stage does, which ``resettable`` records.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def status_bytes(field: str, status: Path = STATUS) -> int | None:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM, RssAnon) in bytes; None where there is none."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def reset_high_water_mark(clear_refs: Path = CLEAR_REFS) -> bool:
    """Set VmHWM to the resident size now (Linux >= 4.0); False where the kernel does not let us."""
    try:
        clear_refs.write_text("5")
        return True
    except OSError:
        return False


@dataclass
class ResidentPeak:
    baseline: int  # bytes resident when the probe started
    resettable: bool  # the high-water mark was reset at the baseline

    @classmethod
    def start(cls) -> "ResidentPeak | None":
        """Start measuring now; None where /proc has no resident figures (not Linux)."""
        resettable = reset_high_water_mark()
        baseline = status_bytes("VmRSS")
        return None if baseline is None else cls(baseline, resettable)

    def peak_above_baseline(self) -> int | None:
        # the resident size now too: the kernel folds it into VmHWM lazily (its counters are per CPU)
        seen = [v for v in (status_bytes("VmHWM"), status_bytes("VmRSS")) if v is not None]
        return max(0, max(seen) - self.baseline) if seen else None
