"""A rank whose allocator failed: one line and exit code 2, beside what the plan predicted for its device.

::

    python -m pulse_mindspore.train: rank 1: error: out of memory on pipeline device 1 (MindSpore: Memory isn't
        enough and alloc failed, kernel name: 967_Default/Mul-op613, alloc size: 58982400B); the plan predicted
        11.60 GiB for it; fit it with more pipeline stages (--pp), a smaller --microbatch-size, --recompute, or a
        plan from `pulse tune --memory-budget`

A failed allocation (CUDA's or an NPU's ``out of memory``, the CPU allocator's ``can't allocate memory``,
MindSpore's memory pool) is a plan that does not fit memory: what the rule for bad input asks of it is one
line saying so and how to fix it, not every rank's traceback. Each backend names its allocator's words
(``BackendTraits.out_of_memory_markers``); anything else is still a traceback. The rank leaves at once, as a
rank whose peer died does (``run_outputs.guarded``): its peers are blocked on it, and log.json already holds
every finished step.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence

from pulse.layout import Layout

GIB = 2**30
LONGEST = 240  # characters of the allocator's own words kept in the line


class AllocatorWords(Protocol):
    """What a backend's traits (``pulse.backend_traits.BackendTraits``) say here: its name, its allocators' words."""

    label: str
    out_of_memory_markers: tuple[str, ...]


def predicted_peak(predicted: Mapping[str, object], pp: int, dp: int, rank: int) -> tuple[int | None, int]:
    """The plan's predicted peak for ``rank``'s pipeline device (a plan without the per-device list: its
    worst device's), and that device."""
    device = Layout(pp, dp, rank).stage
    per_device = predicted.get("peak_memory_bytes_per_device")
    if isinstance(per_device, Sequence) and device < len(per_device):
        return int(per_device[device]), device
    worst = predicted.get("peak_memory_bytes")
    return (int(worst) if isinstance(worst, (int, float)) else None), device


def allocator_failure(exc: BaseException, markers: Sequence[str]) -> str | None:
    """The line of ``exc``'s message that names a failed allocation, or None: the first line holding the first
    of ``markers`` (any case) that one does, so that a backend lists its most telling words first."""
    lines = [" ".join(line.split()) for line in str(exc).splitlines()]
    for marker in markers:
        for line in lines:
            at = line.lower().find(marker.lower())
            if at >= 0:  # from the sentence holding the words: the CPU allocator prefixes its source line
                starts = [line.rfind(end, 0, at) for end in (". ", "] ")]
                text = line[max((i + 2 for i in starts if i >= 0), default=0):]
                return text if len(text) <= LONGEST else text[:LONGEST - 3] + "..."
    return None


def out_of_memory_line(failure: str, label: str, rank: int | None, predicted: Mapping[str, object] | None = None,
                       pp: int = 1, dp: int = 1) -> str:
    """The line (module docstring); without the plan's figures it names the rank alone."""
    where, guess = f"rank {'?' if rank is None else rank}", "the plan's figures could not be read"
    if predicted is not None and rank is not None:
        peak, device = predicted_peak(predicted, pp, dp, rank)
        where = f"pipeline device {device}"
        guess = "the plan has no memory prediction" if peak is None else \
            f"the plan predicted {peak / GIB:.2f} GiB for it"
    return (f"out of memory on {where} ({label}: {failure}); {guess}; fit it with more pipeline stages (--pp), "
            "a smaller --microbatch-size, --recompute, or a plan from `pulse tune --memory-budget`")


def reporter(traits: AllocatorWords, plan_path: str | Path, rank: str) -> Callable[[BaseException], str | None]:
    """What ``run_outputs.guarded`` asks of an exception a rank's body raised: the one line, if it is a failed
    allocation in ``traits``' words. ``rank`` as the launcher's environment gives it (not a number: unknown).
    The plan is read only then (its predicted figures)."""
    number = int(rank) if rank.isdigit() else None

    def line(exc: BaseException) -> str | None:
        failure = allocator_failure(exc, traits.out_of_memory_markers)
        if failure is None:
            return None
        from pulse.plan import load_plan

        try:
            plan, _ = load_plan(plan_path)
        except Exception:  # noqa: BLE001 - the failure is what must be said; the plan's figures are extra
            return out_of_memory_line(failure, traits.label, number)
        return out_of_memory_line(failure, traits.label, number, dict(plan.predicted), plan.pp, plan.dp)
    return line
