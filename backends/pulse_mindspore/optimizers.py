"""The optimizer a MindSpore worker steps (``--optimizer``, ``pulse.optimizers``): AdamW only.

MindSpore 2.10 has ``mindspore.experimental.optim.AdamW`` (torch's interface: a chunk's parameters,
stepped with their gradients) and, among the others, only ``mindspore.nn.AdaFactor``, an ``nn.Optimizer``
cell whose state (and ``pulse_mindspore.checkpoint``'s ``.npz`` layout: weights, AdamW moments, step)
is not wired here. Every other ``--optimizer`` is refused before launch (``BackendTraits.check_supported``
reads ``pulse.optimizers``' backends) and again here.
"""
from __future__ import annotations

from typing import Any, Sequence

from pulse.optimizers import check_backend


def build_optimizer(name: str, params: Sequence[Any], lr: float, betas: tuple[float, float], eps: float,
                    weight_decay: float) -> Any:
    """``name``'s optimizer over ``params`` (their order is its moments' order)."""
    check_backend(name, "mindspore")
    from mindspore.experimental.optim import AdamW

    return AdamW(list(params), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
