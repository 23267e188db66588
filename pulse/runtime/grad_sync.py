"""Data-parallel gradient all-reduce overlapped with the backward pass, layer group by layer group.

Like DDP's buckets (``pulse.grad_buckets``: whole layers, ``cap`` bytes each, cut from a
chunk's last layer), a bucket is all-reduced as soon as its gradients are final. Where that
is, the lowered program says: a chunk's ``AR`` action follows the last action that
accumulates into its gradients (``pulse.schedule.lower``). The executor ``arm``s the chunk
before that action; a backend that reports each gradient as it is accumulated
(``watch_gradients``: PyTorch's post-accumulate hooks, its split W) has the buckets launched
inside it, one after another as the walk from the last layer passes them. The ``AR`` handler
calls ``launch``, which launches what is left (all of it, on a backend that reports nothing).
The all-reduces run in the communicator's background while the rank goes on with its action
list; ``finish`` waits for every bucket and writes the averages back::

    rank:  ... 3B7  0B6  3W7 ──────────── 3AR7  0B7  0W7 ─────────── 0AR7  (end of actions) finish()
                         │ l5 l4 │ l3 .. l0        │ l2 │ l1 l0
    comm:                └ b0 ─┐ └ b1 ──┐          └ b0 ┐└ b1 ──┐
                               ▼        ▼               ▼       ▼  averaged, written back at finish

``pulse.sim.step`` prices exactly this: each bucket launched where the walk has passed its
layers (at the AR where the backend reports nothing), a rank's buckets one after another.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from pulse.errors import PlanError
from pulse.grad_buckets import BUCKET_CAP_BYTES, bucket_layers


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
class _Pending:
    chunk: int
    names: list[str]
    like: list[Any]
    work: AsyncWork


@dataclass
class BucketedGradientSync:
    """Averages one rank's chunk gradients over its data-parallel ``group`` while it computes.

    ``backend`` supplies ``parameters``/``gradients``/``set_gradients``/``scale``/``nbytes`` and
    ``flatten``/``split_like``; where it can say which layer of a chunk holds each parameter
    (``parameter_layers``) a chunk's gradients go in ``pulse.grad_buckets`` buckets of ``cap``
    bytes, else in one; where it can report each gradient as it becomes final
    (``watch_gradients``) they launch during the chunk's last backward, else all at its AR.
    ``comm`` supplies ``all_reduce_async(tensor, group, timeout)`` returning an object with ``wait()``.
    """

    backend: Any
    comm: Any
    group: list[int]
    chunks: dict[int, Any]
    timeout: float | None = None
    cap: int = BUCKET_CAP_BYTES
    _buckets: dict[int, list[list[str]]] = field(init=False, default_factory=dict)
    _launched: dict[int, int] = field(init=False, default_factory=dict)  # chunk -> buckets launched this step
    _final: dict[int, dict[str, Any]] = field(init=False, default_factory=dict)  # armed chunk -> gradients final
    _unwatch: dict[int, Callable[[], None]] = field(init=False, default_factory=dict)
    _closed: set[int] = field(init=False, default_factory=set)  # chunks whose AR ran this step
    _pending: list[_Pending] = field(init=False, default_factory=list)
    _averaged: dict[int, dict[str, Any]] = field(init=False, default_factory=dict)

    @property
    def active(self) -> bool:
        return len(self.group) > 1

    def buckets(self, chunk: int) -> list[list[str]]:
        """``chunk``'s buckets in launch order, each its parameters' names (sorted): the same on
        every replica, so their all-reduces meet in the same order."""
        if chunk not in self._buckets:
            params = self.backend.parameters(self.chunks[chunk])
            layers_of = getattr(self.backend, "parameter_layers", None)
            if layers_of is None or not params:
                self._buckets[chunk] = [sorted(params)]
            else:
                layer = layers_of(self.chunks[chunk])
                count = max(layer.values()) + 1
                sizes = [0] * count
                for name, p in params.items():
                    sizes[layer[name]] += self.backend.nbytes(p)
                self._buckets[chunk] = [sorted(n for n in params if start <= layer[n] < end)
                                        for start, end in bucket_layers(sizes, self.cap)]
        return self._buckets[chunk]

    def arm(self, chunk: int) -> None:
        """``chunk``'s last backward comes next: launch each bucket as soon as the backend reports
        its gradients final (and every bucket before it is launched)."""
        watch = getattr(self.backend, "watch_gradients", None)
        if not self.active or watch is None or chunk in self._final or chunk in self._closed:
            return
        self._check_held(chunk)
        self._final[chunk] = {}
        self._unwatch[chunk] = watch(self.chunks[chunk], lambda name, grad: self._gradient_final(chunk, name, grad))

    def _gradient_final(self, chunk: int, name: str, grad: Any) -> None:
        final = self._final[chunk]
        final[name] = grad
        buckets = self.buckets(chunk)
        while self._launched.get(chunk, 0) < len(buckets) and \
                all(n in final for n in buckets[self._launched.get(chunk, 0)]):
            self._launch_next(chunk, final)

    def launch(self, chunk: int) -> None:
        """``chunk``'s AR: its gradients are all final; launch every bucket not launched yet."""
        if not self.active:
            return
        self._check_held(chunk)
        if chunk in self._closed:
            raise PlanError(f"the buckets of chunk {chunk} are launched twice in one step")
        self._closed.add(chunk)
        if chunk in self._unwatch:
            self._unwatch.pop(chunk)()
        self._final.pop(chunk, None)
        left = len(self.buckets(chunk)) - self._launched.get(chunk, 0)
        grads = self.backend.gradients(self.chunks[chunk]) if left else {}
        for _ in range(left):
            self._launch_next(chunk, grads)

    def _launch_next(self, chunk: int, grads: dict[str, Any]) -> None:
        index = self._launched.get(chunk, 0)
        names = self.buckets(chunk)[index]
        tensors = [grads[n] for n in names]
        work = self.comm.all_reduce_async(self.backend.flatten(tensors), self.group, self.timeout)
        self._pending.append(_Pending(chunk, names, tensors, work))
        self._launched[chunk] = index + 1

    def _check_held(self, chunk: int) -> None:
        if chunk not in self.chunks:
            raise PlanError(f"all-reduce of chunk {chunk}, which this rank does not hold "
                            f"(it holds {sorted(self.chunks)})")

    def finish(self) -> None:
        """Wait for every bucket of the step; write the averaged gradients back, chunk by chunk."""
        while not self.finish_next():
            pass

    def finish_next(self) -> bool:
        """Wait for the next bucket (the oldest launched); True once every bucket of the step is
        averaged and written back.

        One bucket a call, each retryable: a communicator that signals would-block (the
        in-process fake network) leaves the bucket in place for the retry, and its cooperative
        runner sees the progress of every bucket that was done.
        """
        missing = sorted(set(self.chunks) - self._closed) if self.active else []
        if missing:  # a chunk without an AR: the program was not lowered by pulse.schedule.lower
            raise PlanError(f"gradient buckets of chunks {missing} were never launched (no AR action)")
        if self._pending:
            bucket = self._pending[0]
            total = self.backend.scale(bucket.work.wait(), 1.0 / len(self.group))
            self._pending.pop(0)
            averaged = self._averaged.setdefault(bucket.chunk, {})
            averaged.update(zip(bucket.names, self.backend.split_like(total, bucket.like)))
            if len(averaged) == sum(len(b) for b in self.buckets(bucket.chunk)):
                self.backend.set_gradients(self.chunks[bucket.chunk], self._averaged.pop(bucket.chunk))
        if self._pending:
            return False
        self._closed, self._launched = set(), {}
        return True
