"""What the MindSpore backend does that planning prices or refuses (``pulse.backend_traits``). Framework-free:
`pulse train` reads it before msrun starts, and every worker again before joining the job.

::

    communicator (pulse_mindspore.comm)   every tensor of a transfer a wire message of its own (header,
                                          then payload); data-parallel buckets launched at their AR on
                                          Ascend (HCCL, asynchronous), summed after the actions on CPU
                                          (mccl's all-reduce blocks where ops launch blocking: no overlap)
    backward (pulse_mindspore.backend)    B rebuilds the tape: it re-runs the forward (every chunk
                                          recomputes) and computes both halves; W adds them up
"""
from __future__ import annotations

from pathlib import Path

from pulse import device_check, launch_env
from pulse.backend_traits import BackendTraits, Unsupported
from pulse.data.backbone_weights import backbone_weights
from pulse.errors import PulseError
from pulse.train.run_config import RunConfig
from pulse.zoo.diffusers_config import PREFIX as DIFFUSERS_PREFIX
from pulse.zoo.diffusers_config import UNET as DIFFUSERS_UNET
from pulse.zoo.diffusers_config import read_config

SDXL_ZOO = "sdxl-unet"  # zoo entries MindSpore refuses (their time_embed reads SDXL's added inputs)

# Settings whose MindSpore counterpart does not exist (yet).
UNSUPPORTED = (
    Unsupported("images", None, "on-the-fly encoding is PyTorch only: cache first with `pulse cache-latents`, "
                                "then --data CACHE"),
    Unsupported("sample_every", 0, "sample images are drawn by the PyTorch pipeline from a checkpoint"),
    Unsupported("emulate_bandwidth", None, "link emulation wraps the PyTorch communicator"),
    Unsupported("lora_rank", None, "LoRA adapters are peft modules of the PyTorch backend"),
    Unsupported("deterministic", False, "it sets PyTorch's deterministic kernels; MindSpore's own switch is not "
                                        "wired yet"),
)


# its memory pool's words for a failed allocation, on CPU and Ascend (RuntimeError: "Memory not enough: Memory
# isn't enough and alloc failed, ..."; "Allocate memory failed"; Ascend's "Out of Memory" / "device memory not enough")
OUT_OF_MEMORY = ("Memory isn't enough", "Memory not enough", "Allocate memory failed", "out of memory")


def traits(ascend: bool | None = None) -> BackendTraits:
    """Its traits on Ascend (``ascend``) or CPU; None: whether this host shows Ascend NPUs."""
    ascend = launch_env.ascend_available() if ascend is None else ascend
    return BackendTraits(name="mindspore", label="MindSpore", deferred_buckets=not ascend, tensor_messages=True,
                         buckets_at_chunk_end=True,
                         whole_backward_in_b=True, always_recomputes=True, posts_receives_ahead_on_cpu=False,
                         unsupported=UNSUPPORTED, out_of_memory_markers=OUT_OF_MEMORY)


def check_options(config: RunConfig) -> None:
    """Refuse, in one line, the settings a MindSpore job cannot run: bf16 without an Ascend that has it,
    and the ``UNSUPPORTED`` ones."""
    if config.precision == "bf16" and not launch_env.ascend_available():
        raise PulseError("--precision bf16 with --backend mindspore needs Ascend NPUs (MindSpore's CPU kernels have "
                         "no bfloat16 convolution or matmul): use --precision fp16 or fp32 here, or --backend torch")
    if config.precision == "bf16":  # Ascend, but a first-generation 910 (910A) has no bf16 either
        device_check.check_precision(config.precision, "pulse_mindspore.device_support")
    traits(ascend=True).check_supported(config)  # the same settings on every device


def check_model(model: str) -> None:
    """A diffusers plan MindSpore can train: a UNet whose weights are safetensors (or none: config only).

    The workers check the rest before joining (every layer kind has a cell; the file's names and shapes
    equal the cells', ``pulse_mindspore.diffusers_weights``); this says the common refusals before msrun starts.
    """
    if model.startswith(SDXL_ZOO):
        raise PulseError(f"--backend mindspore does not train SDXL ('{model}': its added text/time embedding "
                         "has no MindSpore cell): use --backend torch")
    if not model.startswith(DIFFUSERS_PREFIX):
        return
    folder = Path(model[len(DIFFUSERS_PREFIX):])
    config = read_config(folder)
    cls = config.get("_class_name")
    if cls != DIFFUSERS_UNET:
        raise PulseError(f"--backend mindspore trains diffusers {DIFFUSERS_UNET} backbones only, not {cls} "
                         "(its diffusers module names differ from the MindSpore cells'): use --backend torch")
    if config.get("addition_embed_type") == "text_time":
        raise PulseError(f"--backend mindspore does not train SDXL UNets ({folder}: addition_embed_type "
                         "'text_time' has no MindSpore cell): use --backend torch")
    entries = backbone_weights(folder)
    stored = sorted({e.dtype for e in (entries or {}).values()} - {"F16", "F32", "F64"})
    if stored:
        raise PulseError(f"{folder}: weights stored as {stored[0]}, which numpy (the MindSpore loader) cannot "
                         "read: save the UNet in float32 or float16, or use --backend torch")
