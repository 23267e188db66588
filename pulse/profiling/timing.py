"""Each action's seconds as the executor's timeline records them: what the profile's figures are
read from (``pulse.profiling.layers``, ``pulse.profiling.cold_start``). On an accelerator whose
backend has a ``device_clock`` (``pulse.runtime.protocols.DeviceClock``), on the device's clock."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

# How an accelerator's layers are timed (`pulse profile --device-timing`): with a device synchronize after
# every compute call (PyTorch's default), or between device events while the host queues ahead as in
# training (MindSpore's on Ascend). A CPU's calls return when their work is done: the host's clock either way.
DEVICE_TIMINGS = ("synchronize", "events")
TORCH_DEVICE_TIMING = "synchronize"  # on an H200 its figures sum closer to a real step's than events' (RESULTS.md)

# (kind, chunk) -> seconds of each of its actions; (kind, encoder) for E and SE, which run no chunk
Samples = dict[tuple[str, int], list[float]]


def record_step(run: Any, samples: Samples) -> None:
    """Run one step of ``run`` (an in-process ``local_run``) and add every action's seconds to ``samples``."""
    for ex in run.executors:
        ex.timeline = []
    run.step()
    for ex in run.executors:
        clock = getattr(ex.backend, "device_clock", None)
        for a in ex.timeline:
            samples.setdefault((a.kind, a.encoder if a.chunk is None else a.chunk), []).append(a.seconds(clock))
        ex.timeline = None


def timed_call(backend: Any, work: Callable[[], Any]) -> float:
    """Seconds ``work`` (calls into ``backend``) takes: on its ``device_clock`` where it has one, from
    when the device reaches the work's first kernel to its last; else the host's clock around it."""
    clock = getattr(backend, "device_clock", None)
    if clock is None:
        start = time.perf_counter()
        work()
        return time.perf_counter() - start
    start = clock.mark()
    work()
    return clock.seconds(start, clock.mark())


def time_actions(run: Any, steps: int, warmup: int) -> dict[tuple[str, int], float]:
    """Median seconds per (kind, chunk) over ``steps`` steps after ``warmup``: a layer is timed a
    few times, and one stall of tens of ms among them would otherwise set its figure."""
    return time_alternating([run], steps, warmup)[0]


def time_alternating(runs: list[Any], steps: int, warmup: int) -> list[dict[tuple[str, int], float]]:
    """``time_actions`` of every run in ``runs``, their steps alternated (one step of each in turn):
    whatever the host does meanwhile (a drift, the phase another rank is in) falls on all of them
    alike, so a figure fitted on their difference is not its."""
    samples: list[Samples] = [{} for _ in runs]
    for step in range(warmup + steps):
        for run, mine in zip(runs, samples):
            record_step(run, mine if step >= warmup else {})
    return [{k: statistics.median(v) for k, v in mine.items()} for mine in samples]
