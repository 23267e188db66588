"""PULSE's PyTorch backend (gloo on CPU, NCCL on CUDA, HCCL via torch_npu on Ascend)."""


def __getattr__(name: str):
    # Lazy: importing pulse_torch must not pull in diffusers for users who do not have it.
    if name == "from_diffusers":
        from pulse_torch.diffusers_adapter import from_diffusers

        return from_diffusers
    raise AttributeError(f"module 'pulse_torch' has no attribute {name!r}")
