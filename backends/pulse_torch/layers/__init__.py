"""PyTorch modules for every layer kind of the zoo, behind one per-layer interface.

``build_layer(layer)`` returns a ``PulseLayer``: ``module(h, shared, skips) ->
(h_out, made_shared)`` (see ``common.py``).
"""
from pulse_torch.layers.common import PulseLayer
from pulse_torch.layers.inputs import latent_shape, make_inputs
from pulse_torch.layers.registry import LAYER_TYPES, build_layer, reference_key, seeded_init

__all__ = ["LAYER_TYPES", "PulseLayer", "build_layer", "latent_shape", "make_inputs", "reference_key",
           "seeded_init"]
