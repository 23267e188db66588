"""Data-parallel gradient all-reduce overlapped with the backward pass, one bucket per chunk.

Like DDP's buckets, a chunk's gradients are all-reduced as soon as they are
final. Where that is, the lowered program says: its ``AR`` action follows the
last action that accumulates into them (``pulse.schedule.lower``), and the
executor's ``AR`` handler calls ``launch``. The all-reduce runs in the
communicator's background while the rank goes on with its action list;
``finish`` waits for every bucket and writes the averages back::

    rank:  ... 3B7  0B6  3W7  3AR7 ─┬─ 0B7  0W7  0AR7 ─┬─ (end of actions) finish()
                                    │                   │
    comm:                           └ all-reduce chunk 3 ─┐ └ all-reduce chunk 0 ─┐
                                                          ▼                       ▼
                                                  averaged, written back at finish

``pulse.sim.step`` prices exactly this: one bucket per chunk, launched at its
AR, buckets of one rank one after another.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from pulse.errors import PlanError


class AsyncWork(Protocol):
    def wait(self) -> Any:
        """Block until the collective is done; return the reduced tensor."""
        ...


@dataclass
class DeferredAllReduce:
    """A bucket whose sum runs at ``wait()``: for communicators with no asynchronous all-reduce
    (the in-process fake network, MindSpore's CPU mccl). Same sums, in the same order on every rank."""

    comm: Any
    tensor: Any
    group: list[int]
    timeout: float | None

    def wait(self) -> Any:
        return self.comm.all_reduce(self.tensor, self.group, self.timeout)


@dataclass
class BucketedGradientSync:
    """Averages one rank's chunk gradients over its data-parallel ``group`` while it computes.

    ``backend`` supplies ``gradients``/``set_gradients``/``scale`` and
    ``flatten``/``split_like``; ``comm`` supplies ``all_reduce_async(tensor,
    group, timeout)`` returning an object with ``wait()``.
    """

    backend: Any
    comm: Any
    group: list[int]
    chunks: dict[int, Any]
    timeout: float | None = None
    _pending: list[tuple[int, list[str], list[Any], AsyncWork]] = field(init=False, default_factory=list)
    _written: set[int] = field(init=False, default_factory=set)

    @property
    def active(self) -> bool:
        return len(self.group) > 1

    def launch(self, chunk: int) -> None:
        """Start the all-reduce of ``chunk``'s bucket (its gradients are final)."""
        if not self.active:
            return
        if chunk not in self.chunks:
            raise PlanError(f"all-reduce of chunk {chunk}, which this rank does not hold "
                            f"(it holds {sorted(self.chunks)})")
        if any(c == chunk for c, *_ in self._pending):
            raise PlanError(f"the bucket of chunk {chunk} is launched twice in one step")
        grads = self.backend.gradients(self.chunks[chunk])
        names = sorted(grads)
        tensors = [grads[n] for n in names]
        flat = self.backend.flatten(tensors)
        work = self.comm.all_reduce_async(flat, self.group, self.timeout)
        self._pending.append((chunk, names, tensors, work))

    def finish(self) -> None:
        """Wait for every bucket of the step; write the averaged gradients back.

        Resumable: a communicator that signals would-block (the in-process fake
        network) leaves the buckets not yet waited for in place for the retry.
        """
        launched = {chunk for chunk, *_ in self._pending}
        missing = sorted(set(self.chunks) - launched - self._written) if self.active else []
        if missing:  # a chunk without an AR: the program was not lowered by pulse.schedule.lower
            raise PlanError(f"gradient buckets of chunks {missing} were never launched (no AR action)")
        while self._pending:
            chunk, names, like, work = self._pending[0]
            total = self.backend.scale(work.wait(), 1.0 / len(self.group))
            self._pending.pop(0)
            self._written.add(chunk)
            pieces = self.backend.split_like(total, like)
            self.backend.set_gradients(self.chunks[chunk], dict(zip(names, pieces)))
        self._written = set()
