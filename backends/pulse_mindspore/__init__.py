"""PULSE's MindSpore backend: layer cells, the single-device model, weight exchange, the runtime ``Backend``.

Everything runs in MindSpore's PyNative mode (its default): dict inputs and
Python control flow in ``construct``::

    pulse_mindspore.layers         one cell per zoo layer kind, torch's parameter names
    pulse_mindspore.model          build_model(spec, seed), forward_reference
    pulse_mindspore.weights        parameters to / from .npz by reference checkpoint name
    pulse_mindspore.diffusion      noised batches and the epsilon loss (numpy data, closed-form gradient)
    pulse_mindspore.backend        MindSporeBackend: pulse.runtime.protocols.Backend
    pulse_mindspore.parity_export  (run with torch) the fixtures of the torch-parity test

This file imports nothing, so ``parity_export`` runs where only torch is installed.
"""
