"""Users' own diffusers models on PULSE: a spec from the config, chunks over the model's own modules.

::

    from pulse_torch.diffusers_adapter import from_diffusers, load_diffusers

    adapter = from_diffusers(unet)              # or load_diffusers("path/to/unet"): local folder only
    adapter.spec                                # ModelSpec: plan it like any zoo model
    backend = adapter.backend(lr=1e-5)          # TorchBackend whose chunks run unet's own modules
    run = local_run(adapter.spec, placement, schedule, backend, batches, eps_loss)
    run.step(optimize=True); unet.save_pretrained("out")

Supported: ``UNet2DConditionModel`` (CrossAttn/Down/Up block types, the
cross-attention mid block, default attention) and ``HunyuanDiT2DModel``.
Anything else raises ``UnsupportedDiffusersModel`` (a ``pulse.errors.SpecError``)
naming the block. See docs/DIFFUSERS.md.
"""
from pulse.zoo.diffusers_config import UnsupportedDiffusersModel
from pulse_torch.diffusers_adapter.adapter import DiffusersAdapter, from_diffusers
from pulse_torch.diffusers_adapter.backend import DiffusersBackend
from pulse_torch.diffusers_adapter.flops import measured_flops
from pulse_torch.diffusers_adapter.loading import load_diffusers, load_model

__all__ = ["DiffusersAdapter", "DiffusersBackend", "UnsupportedDiffusersModel", "from_diffusers",
           "load_diffusers", "load_model", "measured_flops"]
