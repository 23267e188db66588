"""Data-parallel gradient all-reduce overlapped with the backward pass, one bucket per chunk.

Like DDP's buckets, a chunk's gradients are all-reduced as soon as they are
final: right after the last action of the step that accumulates into them (its
last ``B``, or its last ``W`` when the backward is split). The all-reduce runs
in the communicator's background while the rank goes on with its action list;
``finish`` waits for every bucket and writes the averages back::

    rank:  ... 3B7  0B6  3W7 ─┬─ 0B7  0W7 ─┬─ (end of actions) finish()
                              │             │
    comm:                     └ all-reduce chunk 3 ─┐ └ all-reduce chunk 0 ─┐
                                                    ▼                       ▼
                                            averaged, written back at finish

``pulse.sim.step`` prices exactly this: one bucket per chunk, launched at the
end of that action, buckets of one rank one after another.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from pulse.errors import PlanError
from pulse.schedule.ir import Action


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


def final_gradient_positions(actions: Sequence[Action]) -> dict[int, int]:
    """Chunk -> position of the last action that accumulates its parameter gradients.

    With a split backward (a ``W`` exists for that chunk and microbatch) the
    weight gradients come from ``W``; otherwise from ``B``.
    """
    split = {(a.chunk, a.microbatch) for a in actions if a.kind == "W"}
    last: dict[int, int] = {}
    for pos, a in enumerate(actions):
        accumulates = a.kind == "W" or (a.kind == "B" and (a.chunk, a.microbatch) not in split)
        if accumulates:
            last[a.chunk] = pos
    return last


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
    actions: tuple[Action, ...]
    timeout: float | None = None
    launch_at: dict[int, list[int]] = field(init=False)
    _pending: list[tuple[int, list[str], list[Any], AsyncWork]] = field(init=False, default_factory=list)
    _written: set[int] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self.launch_at = {}
        for chunk, pos in final_gradient_positions(self.actions).items():
            if chunk in self.chunks:
                self.launch_at.setdefault(pos, []).append(chunk)

    @property
    def active(self) -> bool:
        return len(self.group) > 1

    def after_action(self, position: int) -> None:
        """Launch the buckets whose gradients became final at ``position``."""
        if not self.active:
            return
        for chunk in self.launch_at.get(position, ()):
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
        if missing:  # a chunk whose gradients never became final: the schedule and plan disagree
            raise PlanError(f"gradient buckets of chunks {missing} were never launched")
        while self._pending:
            chunk, names, like, work = self._pending[0]
            total = self.backend.scale(work.wait(), 1.0 / len(self.group))
            self._pending.pop(0)
            self._written.add(chunk)
            pieces = self.backend.split_like(total, like)
            self.backend.set_gradients(self.chunks[chunk], dict(zip(names, pieces)))
        self._written = set()
