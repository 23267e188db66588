"""PULSE's MindSpore backend: layer cells, the single-device model, weight exchange, the runtime ``Backend``.

Everything runs in MindSpore's PyNative mode (its default): dict inputs and
Python control flow in ``construct``::

    pulse_mindspore.layers         one cell per zoo layer kind, torch's parameter names
    pulse_mindspore.model          build_model(spec, seed), forward_reference
    pulse_mindspore.weights        parameters to / from .npz by reference checkpoint name
    pulse_mindspore.diffusion      the epsilon loss (closed-form gradient; batches: pulse.data.feed)
    pulse_mindspore.backend        MindSporeBackend: pulse.runtime.protocols.Backend

This file imports nothing (importing a submodule loads only what that one needs).
"""
