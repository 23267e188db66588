"""The bytes autograd keeps for a backward: what a layer's forward costs in activation memory.

::

    forward under saved_tensors_hooks ─ pack(t) for every tensor autograd saves
        t's storage is a parameter's                    not counted (the weights: static memory)
        t made from a parameter alone (a cast, a view:  not counted (autocast's weight copies: the
          autocast's bf16 copy of a weight, its .t())     memory model's ``compute_copy_bytes``)
        else                                            its storage's bytes, once per storage

Storages, not tensors: two views of one buffer (a saved input and its reshape) hold
its bytes once, and a view of a larger buffer keeps all of it alive. The figures are
what ``pulse profile`` writes as a cost table's ``act_mem`` (``counting_chunks``) and
what ``pulse_torch.profiler`` reports per layer (``counting``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor

# How far back through one-input autograd nodes (casts, views, transposes) a saved tensor is traced
# to a parameter: autocast's copy of a linear weight is ToCopy then T, two steps.
_WEIGHT_TRACE = 8


def storage_key(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def weight_storages(parameters: Iterable[Tensor]) -> set[int]:
    return {storage_key(p) for p in parameters}


def made_from_a_weight(t: Tensor, weights: set[int]) -> bool:
    """``t`` is a parameter, a view of one, or computed from one parameter alone (autocast's cast)."""
    if storage_key(t) in weights:
        return True
    node = t.grad_fn
    for _ in range(_WEIGHT_TRACE):
        if node is None:
            return False
        if type(node).__name__ == "AccumulateGrad":  # a leaf: a parameter, or an input
            return storage_key(node.variable) in weights
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return False


@dataclass
class SavedCount:
    """Storages autograd saved while counting, and their bytes."""

    weights: set[int]
    storages: dict[int, int] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def pack(self, t: Tensor) -> Tensor:
        if t.device.type != "meta" and not made_from_a_weight(t, self.weights):
            storage = t.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t


@contextlib.contextmanager
def counting(parameters: Iterable[Tensor]) -> Iterator[SavedCount]:
    """While open, every tensor autograd saves is counted (``parameters``' and copies of them excluded)."""
    count = SavedCount(weight_storages(parameters))
    with torch.autograd.graph.saved_tensors_hooks(count.pack, lambda t: t):
        yield count


@contextlib.contextmanager
def counting_chunks(backend: Any) -> Iterator[dict[tuple[int, int], int]]:
    """While open, each forward of ``backend`` counts what it saved for its backward: the bytes by the
    chunk's layers (start, end), the largest of its forwards (``ProfileRig.count_saved``)."""
    counts: dict[tuple[int, int], int] = {}
    own = vars(backend).get("forward")  # a wrapper already set on the instance (``synchronized``), else None
    plain = backend.forward

    def forward(chunk: Any, inputs: Any, grad_names: frozenset[str]) -> Any:
        with counting(chunk.parameters()) as count:
            out = plain(chunk, inputs, grad_names)
        key = (chunk.io.start, chunk.io.end)
        counts[key] = max(counts.get(key, 0), count.bytes)
        return out

    backend.forward = forward
    try:
        yield counts
    finally:
        if own is None:
            del backend.forward
        else:
            backend.forward = own
