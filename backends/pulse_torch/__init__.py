"""PULSE's PyTorch backend (gloo on CPU, NCCL on CUDA, HCCL via torch_npu on Ascend)."""
