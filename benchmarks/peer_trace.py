"""Each TP rank's actions in one step, in ``pulse_torch.train --trace``'s span format, so the two
runtimes can be read side by side (``pulse.views.trace.measured_trace_events`` renders both).

``ActionTracer(stages)`` wraps each ``PipelineStage``'s three compute calls on the instance::

    forward_one_chunk(m)           -> "{stage}F{m}"   kind F
    backward_one_chunk(m)          -> "{stage}B{m}"   kind B (a full backward when the schedule
                                                      runs no split: kind B, label "{stage}BW{m}")
    backward_weight_one_chunk(m)   -> "{stage}W{m}"   kind W

with wall seconds from the step's start and the thread's processor time in each (what
``pulse_torch.train`` records for PULSE's own actions). ``traced(tracer, name)`` times any other
part of the step (clipping, the optimizer). ``restart()`` at each step keeps only the last one.
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Iterator


class ActionTracer:
    def __init__(self, stages: list) -> None:
        self.events: list[dict] = []
        self._origin = time.perf_counter()
        for stage in stages:
            self._wrap(stage, "forward_one_chunk", "F")
            self._wrap(stage, "backward_one_chunk", "B")
            self._wrap(stage, "backward_weight_one_chunk", "W")

    def restart(self) -> None:
        self.events, self._origin = [], time.perf_counter()

    @contextlib.contextmanager
    def span(self, label: str, kind: str) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.events.append({"label": label, "kind": kind, "start": wall - self._origin,
                                "end": time.perf_counter() - self._origin, "cpu": time.thread_time() - cpu})

    def _wrap(self, stage, method: str, kind: str) -> None:
        inner = getattr(stage, method)

        @functools.wraps(inner)
        def timed(chunk_id, *args, **kwargs):
            full = kind == "B" and kwargs.get("full_backward", True)
            label = f"{stage.stage_index}{'BW' if full else kind}{chunk_id}"
            with self.span(label, kind):
                return inner(chunk_id, *args, **kwargs)

        setattr(stage, method, timed)


@contextlib.contextmanager
def traced(tracer: ActionTracer | None, label: str) -> Iterator[None]:
    """A span named ``label`` (kind ``step``) when tracing; nothing otherwise."""
    if tracer is None:
        yield
        return
    with tracer.span(label, "step"):
        yield
