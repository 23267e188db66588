"""A CPU rank's measured memory, two ways: the bytes its allocations held, and its resident peak.

::

    probe = ResidentPeak.start()     before the rank builds its stage: the kernel's high-water mark
                                     reset to the resident size now (/proc/self/clear_refs "5"),
                                     that size and malloc's bytes in use kept as the baselines
    probe.sample()                   after every action of the step and at its end: malloc's
                                     bytes in use now, the most kept
    probe.held_above_baseline()      the most malloc had handed out at a sample, above its
                                     baseline: what the stage, its optimizer, its activations and
                                     messages held at once; the CPU's twin of an accelerator
                                     allocator's ``max_memory_allocated`` and of the simulator's
                                     per-device peak
    probe.peak_above_baseline()      VmHWM - baseline: the same as the host sees it, with the free
                                     memory glibc's heap keeps for reuse (``pulse.host_heap``)

On a CPU no allocator counts a rank's tensors, so glibc does (``mallinfo2``: bytes in
allocated chunks plus mmapped blocks, over every arena). The resident peak is what the
ranks share and what the out-of-memory killer judges, but it also holds freed blocks
the heap kept: tiny-unet at pp 2 x dp 2 (README command 1) held 54 MiB at most on device 0
against 50 MiB predicted, and read 71 MiB resident, with 59 MiB of its heap free at rest
(a step frees its activations into holes later blocks do not fit). Both are logged; the held figure is
the one held against the prediction. Sampling at action boundaries does not see a
transient inside one action (an accelerator's allocator would).

Where the high-water mark cannot be reset (an old kernel, a read-only /proc), the
resident peak is the process's whole-life VmHWM above the baseline: an over-estimate
only if something before the baseline held more than the stage does, which
``resettable`` records. Off glibc (no ``mallinfo2``), and for a framework that takes
its memory from a pool of its own (MindSpore), nothing is sampled and the resident
peak is the only figure.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

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


class _MallInfo2(ctypes.Structure):  # malloc.h, glibc >= 2.33
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@lru_cache(maxsize=1)
def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        call = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return None
    call.argtypes, call.restype = [], _MallInfo2
    return call


def malloc_in_use() -> int | None:
    """Bytes malloc has handed out and not had back, in every arena: allocated heap chunks plus mmapped
    blocks (about 2 us a call); None off glibc."""
    call = _mallinfo2()
    if call is None:
        return None
    info = call()
    return int(info.uordblks + info.hblkhd)


@dataclass
class ResidentPeak:
    baseline: int  # bytes resident when the probe started
    resettable: bool  # the high-water mark was reset at the baseline
    held_baseline: int | None = None  # malloc's bytes in use when the probe started (None: not glibc)
    held_peak: int = 0  # the most malloc had in use at a sample

    @classmethod
    def start(cls, tensors_from_malloc: bool = True) -> "ResidentPeak | None":
        """Start measuring now; None where /proc has no resident figures (not Linux).
        ``tensors_from_malloc``: the framework allocates each tensor from malloc (PyTorch's CPU allocator), so
        malloc's bytes in use are its tensors'; False for one that reserves a pool from it up front
        (MindSpore's CPU runtime: 1.18 GiB in use against 418 MiB resident on tiny-unet), which leaves
        the resident peak alone."""
        resettable = reset_high_water_mark()
        baseline = status_bytes("VmRSS")
        held = malloc_in_use() if tensors_from_malloc else None
        return None if baseline is None else cls(baseline, resettable, held, held or 0)

    def sample(self) -> None:
        """Note malloc's bytes in use now (after an action, at the step's end)."""
        if self.held_baseline is not None:
            self.held_peak = max(self.held_peak, malloc_in_use() or 0)

    def held_above_baseline(self) -> int | None:
        """The most the rank's allocations held at a sample above the baseline; None off glibc."""
        if self.held_baseline is None:
            return None
        self.sample()
        return max(0, self.held_peak - self.held_baseline)

    def peak_above_baseline(self) -> int | None:
        # the resident size now too: the kernel folds it into VmHWM lazily (its counters are per CPU)
        seen = [v for v in (status_bytes("VmHWM"), status_bytes("VmRSS")) if v is not None]
        return max(0, max(seen) - self.baseline) if seen else None
