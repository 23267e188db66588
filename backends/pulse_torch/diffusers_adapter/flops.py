"""FLOPs per layer as PyTorch counts them on the real modules: the check on the spec's analytic figures.

::

    for each spec layer, in order:  FlopCounterMode ⟨ layer(h, shared, skips) ⟩ ─▶ measured[layer]

On a meta-device model nothing is allocated or computed (shapes only), so
the full-size SD2 UNet is measured in a second. ``FlopCounterMode`` counts
matrix products (convolutions, linears, attention's two batched products),
the spec's convention (docs/ZOO.md). Attention runs on the math kernel
while counting: FlopCounterMode has no formula for the CPU flash kernel
(torch 2.13), which would leave attention's products out on CPU tensors.
"""
from __future__ import annotations

from typing import Mapping

from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pulse.spec import ModelSpec
from pulse_torch.layers.common import PulseLayer


def measured_flops(spec: ModelSpec, layers: Mapping[str, PulseLayer], h: Tensor,
                   shared: Mapping[str, Tensor]) -> dict[str, float]:
    """Forward FLOPs of every layer for the batch (h, shared), divided by the batch size."""
    shared = dict(shared)
    consumers = {layer.name: [e.src for e in spec.skips if e.dst == layer.name] for layer in spec.layers}
    kept: dict[str, Tensor] = {}
    out = {}
    for layer in spec.layers:
        counter = FlopCounterMode(display=False)
        with counter, sdpa_kernel(SDPBackend.MATH):
            h, made = layers[layer.name](h, shared, [kept[src] for src in consumers[layer.name]])
        out[layer.name] = counter.get_total_flops() / h.shape[0]
        shared.update(made)
        kept[layer.name] = h
    return out
