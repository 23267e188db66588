"""What the PyTorch backend does that planning prices or refuses (``pulse.backend_traits``). Framework-free.

Its communicator sends a transfer as one message and launches each data-parallel bucket at its
AR, its split backward computes the input half in B and the weight half in W, it recomputes only
the chunks a plan names, and it runs every ``RunConfig`` setting: the defaults, nothing declared.
"""
from __future__ import annotations

from pulse.backend_traits import BackendTraits
from pulse import launch_env
from pulse.errors import PulseError
from pulse.optimizers import check_installed
from pulse.train.run_config import RunConfig

# its allocators' words for a failed allocation: torch.OutOfMemoryError's "CUDA out of memory. Tried to allocate",
# torch_npu's "NPU out of memory. Tried to allocate", the CPU allocator's "DefaultCPUAllocator: can't allocate memory"
OUT_OF_MEMORY = ("out of memory", "can't allocate memory")
TRAITS = BackendTraits(name="torch", label="PyTorch", out_of_memory_markers=OUT_OF_MEMORY)


def traits() -> BackendTraits:
    return TRAITS


def check_options(config: RunConfig) -> None:
    """Every setting runs here (bf16 on a device without it is the launcher's probe to refuse), LoRA on a
    UNet backbone only: diffusers gives a Hunyuan-DiT no peft adapters, said before launch."""
    TRAITS.check_supported(config)
    check_installed(config.optimizer)
    if config.optimizer == "adamw8bit" and launch_env.ascend_available():  # bitsandbytes: CUDA, XPU, CPU
        raise PulseError("--optimizer adamw8bit: bitsandbytes has no kernels for Ascend NPUs; use --optimizer "
                         "adafactor (about as little state) or adamw")
    if config.lora_rank is not None and config.pipeline is not None:
        from pulse.data.pipeline_folder import part_config, read_pipeline
        from pulse.zoo.diffusers_config import UNET

        folder = read_pipeline(config.pipeline)
        cls = str(part_config(folder.backbone).get("_class_name", "?"))
        if cls != UNET:
            raise PulseError(f"--lora-rank {config.lora_rank}: {folder.backbone} is a {cls}; LoRA trains a "
                             f"{UNET} backbone (diffusers gives {cls} no peft adapters)")


def check_model(model: str) -> None:
    """Every model PULSE plans trains here."""
