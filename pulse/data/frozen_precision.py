"""The precision a pipeline's frozen parts are held in while its backbone trains: diffusers' ``weight_dtype``.

::

    --precision fp32         every part fp32
    --precision bf16 | fp16  the text encoder(s) and the VAE in that dtype, as train_text_to_image.py casts
                             them (``vae.to(dtype=weight_dtype)``, ``text_encoder.to(dtype=weight_dtype)``);
                             except an SDXL VAE under fp16, which stays fp32 (below)

The rank that runs an encoder loads it so (``pulse_torch.pipeline.encode``) and the plan prices its
weights so (``Encoder.bytes_per_param``, ``pulse.cli.encoders_args``): one rule for both.
"""
from __future__ import annotations

from pulse.data.pipeline_folder import PipelineFolder, part_config
from pulse.data.pipeline_text import SDXL_RECIPE, recipe_for
from pulse.sim.memory import PRECISION_BYTES

PARTS = ("text", "vae")  # the frozen parts, named as pulse.data.pipeline_text.pipeline_encoders names their tasks


def frozen_precision(folder: PipelineFolder, part: str, precision: str) -> str:
    """The precision ``part`` ("text" or "vae") of ``folder`` is held in when the backbone trains in ``precision``.

    SDXL's VAE overflows in fp16 (its activations pass 65504: NaN latents, then a NaN loss):
    train_text_to_image_sdxl.py keeps it fp32 and diffusers' SDXL pipelines upcast it, unless its
    config says ``force_upcast: false`` (a VAE fine-tuned for fp16, such as sdxl-vae-fp16-fix).
    bf16 has fp32's exponent range, so no VAE needs that there."""
    if part not in PARTS:
        raise ValueError(f"unknown frozen part '{part}' (known: {', '.join(PARTS)})")
    if part == "vae" and precision == "fp16" and recipe_for(folder) is SDXL_RECIPE \
            and part_config(folder.vae).get("force_upcast", True) is not False:
        return "fp32"
    return precision


def frozen_bytes(folder: PipelineFolder, precision: str) -> dict[str, int]:
    """Bytes per weight of each frozen part under ``precision`` (``EncoderSet.held_at``'s argument)."""
    return {part: PRECISION_BYTES[frozen_precision(folder, part, precision)] for part in PARTS}
