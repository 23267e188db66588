"""PULSE's PyTorch backend (gloo on CPU, NCCL on CUDA, HCCL via torch_npu on Ascend)."""
import logging

# bitsandbytes (the optimizers extra: --optimizer adamw8bit) warns at import, on CPUs with AVX-512 bf16, that an
# optional 4-bit matmul kernel (no part of its optimizers) is missing; peft and transformers import it in every
# LoRA or diffusers rank, which would each print that line
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def __getattr__(name: str):
    # Lazy: importing pulse_torch must not pull in diffusers for users who do not have it.
    if name == "from_diffusers":
        from pulse_torch.diffusers_adapter import from_diffusers

        return from_diffusers
    raise AttributeError(f"module 'pulse_torch' has no attribute {name!r}")
