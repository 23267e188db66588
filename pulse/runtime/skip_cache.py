"""The per-rank skip cache: skip tensors and their pending gradients, by (microbatch, skip key).

Life of a skip whose producer and consumer share the device (V / wave)::

    producer F ── put_value ──▶ [value] ── consumer F reads it
    consumer B ── add_grad ──▶ [grad] ── producer B take_grad ──▶ gone
    consumer B (or its W) ── drop_value ──▶ value gone

A relayed or directly sent skip also passes through: a receive puts it, the
send that forwards it drops it, and the same for its gradient going back.

Two peaks are kept. ``peak_local_bytes``: values of skips that never leave
this device, the simulator's ``peak_skip_cache`` (held from the producer's F
to the consumer's B, or W). ``peak_bytes``: everything the cache held at
once, transit values and pending gradients included.

The executor keeps its copies of layer-made shared inputs (temb, a text
context) in a second instance, keyed by (microbatch, "name@origin chunk"):
same life, gradients summed over every chunk that read the copy.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from pulse.errors import PlanError

Key = tuple[int, str]  # (microbatch, skip key "src->dst")


class SkipCache:
    def __init__(self, nbytes: Callable[[Any], int], add: Callable[[Any, Any], Any],
                 local_keys: Iterable[str] = (), label: str = "skip") -> None:
        self.label = label  # what the keys name, for messages
        self._nbytes = nbytes
        self._add = add
        self._local = frozenset(local_keys)
        self._values: dict[Key, Any] = {}
        self._grads: dict[Key, Any] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.local_bytes = 0
        self.peak_local_bytes = 0

    # -- forward values ----------------------------------------------------
    def put_value(self, microbatch: int, skip: str, tensor: Any) -> None:
        key = (microbatch, skip)
        if key in self._values:
            raise PlanError(f"{self.label} '{skip}' of microbatch {microbatch} arrives twice on this rank")
        self._values[key] = tensor
        self._count(skip, self._nbytes(tensor), value=True)

    def has_value(self, microbatch: int, skip: str) -> bool:
        return (microbatch, skip) in self._values

    def value(self, microbatch: int, skip: str) -> Any:
        return self._values[(microbatch, skip)]

    def drop_value(self, microbatch: int, skip: str) -> None:
        self._count(skip, -self._nbytes(self._values.pop((microbatch, skip))), value=True)

    # -- gradients going back to the producer --------------------------------
    def add_grad(self, microbatch: int, skip: str, grad: Any) -> None:
        key = (microbatch, skip)
        old = self._grads.get(key)
        if old is None:
            self._grads[key] = grad
            self._count(skip, self._nbytes(grad), value=False)
        else:  # a second contribution to the same skip: sum in place of the first
            self._grads[key] = self._add(old, grad)

    def has_grad(self, microbatch: int, skip: str) -> bool:
        return (microbatch, skip) in self._grads

    def take_grad(self, microbatch: int, skip: str) -> Any:
        grad = self._grads.pop((microbatch, skip))
        self._count(skip, -self._nbytes(grad), value=False)
        return grad

    # -- bookkeeping ---------------------------------------------------------
    def _count(self, skip: str, delta: int, value: bool) -> None:
        self.live_bytes += delta
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if value and skip in self._local:
            self.local_bytes += delta
            self.peak_local_bytes = max(self.peak_local_bytes, self.local_bytes)

    def leftovers(self) -> list[str]:
        """What is still held (empty after a complete step)."""
        what = "" if self.label == "skip" else f"{self.label} "
        return ([f"{what}value of {k} mb{m}" for m, k in sorted(self._values)]
                + [f"{what}gradient of {k} mb{m}" for m, k in sorted(self._grads)])

    def reset_peaks(self) -> None:
        self.peak_bytes = self.live_bytes
        self.peak_local_bytes = self.local_bytes
