"""What a pipeline device owns: its chunks' layers, and so their parameters' bytes.

::

    stage_layers(spec, placement, device)   the spec layers of every chunk on ``device`` (spec order)
    device_params(spec, placement)          parameters per device
    trained_params(spec, adapters, a, b)    parameters layers a..b-1 train: theirs, or with LoRA their
                                            adapters' (what their gradients and buckets hold)

The one rule every reader asks: a backend materializes exactly these layers on a
rank (``pulse_torch.diffusers_adapter.stage_loading``, the zoo backends' chunk
builders), the memory model counts exactly their bytes (``pulse.sim.memory``),
and the tests hold what a rank really holds against it. The rank of a device is
``pulse.layout``'s. A block specced as several layers (a transformer block's halves,
``split_blocks``; a ResnetBlock2D's, ``split_resnets``) is owned half by half: each
half's parameters belong to the half's layer, so a cut between halves splits the block's
parameters between two devices.
"""
from __future__ import annotations

from pulse.placement import Placement
from pulse.spec import ModelSpec


def stage_layers(spec: ModelSpec, placement: Placement, device: int) -> tuple[str, ...]:
    """The names of the layers ``device``'s chunks run, in spec order."""
    if not 0 <= device < placement.num_devices:
        raise ValueError(f"device {device} is outside the placement's {placement.num_devices} devices")
    starts = sorted((c.start, c.end) for c in placement.chunks if c.device == device)
    return tuple(layer.name for start, end in starts for layer in spec.layers[start:end])


def device_params(spec: ModelSpec, placement: Placement) -> list[int]:
    """Parameters each device's layers hold (the base's, without adapters)."""
    out = [0] * placement.num_devices
    for chunk in placement.chunks:
        out[chunk.device] += sum(layer.params for layer in spec.layers[chunk.start:chunk.end])
    return out


def trained_params(spec: ModelSpec, adapters: tuple[int, ...] | None, start: int, end: int) -> int:
    """Parameters layers ``start``..``end - 1`` train: their own for a full fine-tune, their adapters' with
    LoRA (``adapters``: per spec layer, ``pulse.zoo.lora.adapter_params``)."""
    if adapters is None:
        return sum(layer.params for layer in spec.layers[start:end])
    return sum(adapters[start:end])
