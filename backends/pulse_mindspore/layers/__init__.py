"""MindSpore cells for every layer kind of the zoo, behind one per-layer interface.

``build_layer(layer)`` returns a ``PulseCell``: ``cell(h, shared, skips) ->
(h_out, made_shared)`` (see ``common.py``), with the parameter names of
``pulse_torch.layers`` so weights exchange by name. On a CPU, importing it makes the process's ops
run where they are launched (``pulse_mindspore.cpu_mode``), before any cell can run.
"""
from pulse_mindspore.cpu_mode import launch_blocking_on_cpu
from pulse_mindspore.layers.common import PulseCell
from pulse_mindspore.layers.inputs import latent_shape, make_inputs
from pulse_mindspore.layers.registry import LAYER_TYPES, build_layer, layer_params, reference_key

launch_blocking_on_cpu()

__all__ = ["LAYER_TYPES", "PulseCell", "build_layer", "latent_shape", "layer_params", "make_inputs",
           "reference_key"]
