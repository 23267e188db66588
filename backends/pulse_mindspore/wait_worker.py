"""Blocking waits bounded by a timeout, run on one long-lived helper thread.

MindSpore's ``CommHandle.wait()`` takes no timeout and cannot be polled, so a
bounded wait must block somewhere other than the caller. A thread per wait
would start hundreds of threads a step (two messages per tensor, a bucket per
chunk); one worker serves them all::

    caller                                   worker (daemon, lives with the communicator)
    run(fn, 30 s) ── job ──▶ queue ──▶ fn()   (op.wait(), then the host read it needs)
        waits on the job's event ◀─── done ──┘
        30 s pass first: TimeoutError; the worker is abandoned (still inside fn,
        which cannot be cancelled) and the next run() starts a fresh one

So threads are made once, and once more after each timeout (after which the
job ends anyway: ``CommTimeout``).
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class _Job:
    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
            self.error = exc
        finally:
            self.done.set()


def _serve(jobs: "queue.SimpleQueue[_Job | None]") -> None:
    while (job := jobs.get()) is not None:
        job.run()


class WaitWorker:
    """Runs ``fn`` on its helper thread and waits at most ``seconds`` for it (None: inline)."""

    def __init__(self, name: str = "pulse-wait") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job | None] | None = None
        self.started = 0  # helper threads made so far (one, plus one after each timeout)

    def run(self, fn: Callable[[], Any], seconds: float | None) -> Any:
        """``fn()``'s result or exception; ``TimeoutError`` when ``seconds`` pass first."""
        if seconds is None:
            return fn()
        job = _Job(fn)
        self._queue().put(job)
        if not job.done.wait(seconds):
            self._abandon()
            raise TimeoutError(f"not done after {seconds:g} s")
        if job.error is not None:
            raise job.error
        return job.result

    def _queue(self) -> "queue.SimpleQueue[_Job | None]":
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), name=f"{self.name}-{self.started}",
                             daemon=True).start()
            self.started += 1
        return self._jobs

    def _abandon(self) -> None:
        """The worker is stuck in a job: let it end when (if) that job returns; the next run starts another."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None
