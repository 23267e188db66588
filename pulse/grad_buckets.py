"""A chunk's data-parallel gradient buckets: which layers' gradients are all-reduced together.

As DDP's ``bucket_cap_mb``: a backward makes a chunk's gradients final from its last
layer to its first, so the buckets are cut in that order, whole layers each, a bucket
closing once it holds ``cap`` bytes::

    chunk layers   l0  l1  l2  l3  l4  l5        (backward walks l5 -> l0)
    buckets                 └─ 1 ─┘ └── 0 ──┘     bucket 0 final first, launched first
                   └─ 2 ─┘

A bucket is launched as soon as its layers' gradients are final, and only after every
bucket before it, so all data-parallel replicas issue the same all-reduces in the same
order (NCCL's and HCCL's rule for collectives). The one rule: the runtime cuts the buckets
it launches (``pulse.runtime.grad_sync``) from its gradients' bytes, the simulator the
ones it prices (``pulse.sim.step``) from the spec's, both here.
"""
from __future__ import annotations

from typing import Sequence

# DDP's default ``bucket_cap_mb`` (25): large enough that a bucket's all-reduce is bandwidth-bound,
# small enough that the first buckets start while the backward still has most of its layers to go
BUCKET_CAP_BYTES = 25 * 2 ** 20


def bucket_layers(layer_bytes: Sequence[int], cap: int = BUCKET_CAP_BYTES) -> list[tuple[int, int]]:
    """The buckets of a chunk whose layers hold ``layer_bytes`` of gradients (chunk order), as
    ``(start, end)`` layer offsets in the chunk, in the order they become final: the last layers
    first. A layer is never split; one over ``cap`` is a bucket of its own. A chunk with no
    gradients at all is one empty bucket (its replicas still meet in its all-reduce)."""
    if cap <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap}")
    n = len(layer_bytes)
    if n == 0:
        return []
    out: list[tuple[int, int]] = []
    end, held = n, 0
    for layer in range(n - 1, -1, -1):
        held += layer_bytes[layer]
        if held >= cap and layer > 0:
            out.append((layer, end))
            end, held = layer, 0
    out.append((0, end))
    return out
