"""MindSpore cells for every layer kind of the zoo, behind one per-layer interface.

``build_layer(layer)`` returns a ``PulseCell``: ``cell(h, shared, skips) ->
(h_out, made_shared)`` (see ``common.py``), with the parameter names of
``pulse_torch.layers`` so weights exchange by name.
"""
from pulse_mindspore.layers.common import PulseCell
from pulse_mindspore.layers.inputs import latent_shape, make_inputs
from pulse_mindspore.layers.registry import LAYER_TYPES, build_layer, layer_params, reference_key

__all__ = ["LAYER_TYPES", "PulseCell", "build_layer", "latent_shape", "layer_params", "make_inputs",
           "reference_key"]
